// int8's chunk in two vector passes (AVX-512 or AVX2), bitwise the portable ``chunk8``; ``MQ_PASS1`` /
// ``MQ_PASS2`` name the build's.
#pragma once

#include "int8.h"
#include "vectors.h"

namespace {

#if defined(__AVX512F__)
constexpr Padded16<16, 16> V8_OCT16(V8_OCTAVE, 0.0f);
inline __m512 v8_shifted16(__m512 octave, __m512i c) {
  const __m512i bits = _mm512_castps_si512(_mm512_permutexvar_ps(c, octave));  // octave[c & 15]
  return _mm512_castsi512_ps(_mm512_sub_epi32(bits, _mm512_slli_epi32(_mm512_srli_epi32(c, 4), 23)));
}
// How many values (``THRESHOLDS``: thresholds) lie above y: 16 per octave wholly above y's, plus those of
// y's octave above its mantissa; clamped to [0, 255].
template <bool THRESHOLDS>
inline __m512i v8_above16(__m512 y) {
  const __m512i b = _mm512_castps_si512(y);
  const int32_t* above = THRESHOLDS ? V8_SLICES.thresholds_above : V8_SLICES.values_above;
  // the slice: the low 5 bits of b >> 18, the mantissa's top 5
  __m512i count = _mm512_permutex2var_epi32(_mm512_load_si512(above), _mm512_srli_epi32(b, 18),
                                            _mm512_load_si512(above + 16));
  const __m512i next = THRESHOLDS ? _mm512_permutex2var_epi32(_mm512_load_si512(V8_SLICES.threshold_after), count,
                                                              _mm512_load_si512(V8_SLICES.threshold_after + 16))
                                  : _mm512_permutexvar_epi32(count, _mm512_load_si512(V8_SLICES.value_after));
  const __m512i mant = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffff));
  count = _mm512_mask_add_epi32(count, _mm512_cmplt_epi32_mask(mant, next), count, _mm512_set1_epi32(1));
  count = _mm512_sub_epi32(count, _mm512_and_si512(_mm512_srli_epi32(b, 19), _mm512_set1_epi32(0xff0)));  // 16 e
  return _mm512_min_epi32(_mm512_max_epi32(count, _mm512_setzero_si512()), _mm512_set1_epi32(V8_LAST));
}
inline __m512i v8_code16(__m512 y, bool sr, int64_t index, uint32_t key) {
  if (!sr) return v8_above16<true>(y);
  const __m512i k = v8_above16<false>(y), last = _mm512_set1_epi32(V8_LAST), one = _mm512_set1_epi32(1);
  const __m512 octave = _mm512_load_ps(V8_OCT16.t);
  const __m512i nx = _mm512_min_epi32(_mm512_add_epi32(k, one), last);
  const __m512 upper = v8_shifted16(octave, k), lower = v8_shifted16(octave, nx);
  const __mmask16 up = _mm512_cmp_ps_mask(
      _mm512_sub_ps(y, lower), _mm512_mul_ps(uniform16(index, key), _mm512_sub_ps(upper, lower)), _CMP_GT_OQ);
  return _mm512_mask_blend_epi32(up, nx, k);
}

// e4m3_code of 16 non-negative z (round half to even)
inline __m512i e4m3_code16(__m512 z) {
  const __m512i zb = _mm512_castps_si512(z);
  const __m512i normal = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(zb, _mm512_set1_epi32(0x7FFFF - (896 << 20))),
                       _mm512_and_si512(_mm512_srli_epi32(zb, 20), _mm512_set1_epi32(1))),
      20);
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(z, _mm512_set1_ps(64.0f))),
                                       _mm512_set1_epi32((int)fbits(64.0f)));
  const __mmask16 is_sub = _mm512_cmp_ps_mask(z, _mm512_set1_ps(M8_MIN_NORMAL), _CMP_LT_OQ);
  return _mm512_min_epi32(_mm512_mask_blend_epi32(is_sub, normal, sub), _mm512_set1_epi32(127));
}
// e4m3_code_sr of 16 non-negative z with random bits ``r`` (a subnormal lane's overflowing conversion is
// not taken)
inline __m512i e4m3_code_sr16(__m512 z, __m512i r) {
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(z), r), 20),
                                          _mm512_set1_epi32(896));
  const __m512i sub = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(_mm512_mul_ps(z, _mm512_set1_ps(0x1p37f))), r), 20);
  const __mmask16 is_sub = _mm512_cmp_ps_mask(z, _mm512_set1_ps(M8_MIN_NORMAL), _CMP_LT_OQ);
  return _mm512_min_epi32(_mm512_mask_blend_epi32(is_sub, normal, sub), _mm512_set1_epi32(127));
}

// The chunk with AVX-512 intrinsics, in two passes (below), operation for operation on the values (bit-identical
// results). Needs MXCSR with round-to-nearest-even and without DAZ/FTZ (set by ``run``): the int8
// first moment is decoded by reading its E4M3 bits as an fp32 (sub)normal and scaling by 2^112.
// Pass 1: decode, update (fp32), write the parameter, clean and stage the new moments.
template <bool MAXIMIZE, bool L2, bool TAIL>
inline void pass1_avx512(float* __restrict p, const float* __restrict g, uint8_t* __restrict mc,
                         float* __restrict ms, uint8_t* __restrict vc, float* __restrict vs,
                         const Hyper& h, int valid, int64_t base, Staged& st) {
  float* __restrict mn = st.mn;
  float* __restrict vn = st.vn;
  const __m512 decay = _mm512_set1_ps(h.decay), wd = _mm512_set1_ps(h.wd);
  const __m512 b1 = _mm512_set1_ps(h.b1), omb1 = _mm512_set1_ps(h.omb1);
  const __m512 b2 = _mm512_set1_ps(h.b2), omb2 = _mm512_set1_ps(h.omb2);
  const __m512 ibc2 = _mm512_set1_ps(h.ibc2), eps = _mm512_set1_ps(h.eps);
  const __m512 nstep = _mm512_set1_ps(h.nstep);
  const __m512i sign_mask = _mm512_set1_epi32((int)0x80000000u);
  const __m512 v_octave = _mm512_load_ps(V8_OCT16.t);

  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512i amaxi = _mm512_setzero_si512();  // |m| maximum, bits
  __m512i vmaxi[2] = {_mm512_set1_epi32((int)fbits(V_FLOOR)), _mm512_set1_epi32((int)fbits(V_FLOOR))};

  for (int half = 0; half < 2; ++half) {
    const __m512 msc = _mm512_set1_ps(ms[0]);
    const __m512 vsc = _mm512_set1_ps(vs[half]);
    for (int k = half * HALF; k < (half + 1) * HALF; k += 16) {
      __m512i cm = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(mc + k)));  // sign-extended
      __m512i cv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(vc + k)));
      __m512 gi = _mm512_loadu_ps(g + k);
      if (MAXIMIZE) gi = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gi), sign_mask));
      __m512 pi = _mm512_loadu_ps(p + k);
      if (L2) gi = _mm512_add_ps(gi, _mm512_mul_ps(pi, wd));
      pi = _mm512_mul_ps(pi, decay);
      // sign-extended code << 20: magnitude in bits 20..26, sign in 27..31
      __m512i bits = _mm512_and_si512(_mm512_slli_epi32(cm, 20), _mm512_set1_epi32((int)0x87F00000u));
      __m512 m = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p112f));
      m = _mm512_mul_ps(m, msc);
      __m512 v = _mm512_mul_ps(v8_shifted16(v_octave, cv), vsc);
      m = _mm512_add_ps(_mm512_mul_ps(m, b1), _mm512_mul_ps(gi, omb1));
      v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(gi, gi), omb2));
      __m512 den = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), ibc2), eps);
      pi = _mm512_add_ps(pi, _mm512_mul_ps(nstep, _mm512_div_ps(m, den)));
      _mm512_storeu_ps(p + k, pi);

      if (TAIL) {
        __mmask16 live = k >= valid ? 0 : (k + 16 <= valid ? 0xFFFF : (__mmask16)((1u << (valid - k)) - 1u));
        m = _mm512_maskz_mov_ps(live, m);
        v = _mm512_maskz_mov_ps(live, v);
      }
      // stage the raw moments; the maxima are taken on the bits (|m| and v as unsigned integers order
      // like the floats, with Inf and NaN above every finite value), so a chunk holding NaN, Inf or
      // huge values is recognized afterwards and cleaned then (``clean_staged``)
      _mm512_store_ps(mn + k, m);
      amaxi = _mm512_max_epu32(amaxi, _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
      _mm512_store_ps(vn + k, v);
      vmaxi[half] = _mm512_max_epu32(vmaxi[half], _mm512_castps_si512(v));
    }
  }

  st.A = bfloat(_mm512_reduce_max_epu32(amaxi));
  for (int i = 0; i < 2; ++i) st.VA[i] = bfloat(_mm512_reduce_max_epu32(vmaxi[i]));
  if (!st.clean()) clean_staged(st);
  st.base = base;
  st.mc = mc;
  st.ms = ms;
  st.vc = vc;
  st.vs = vs;
}

// Pass 2: block scales and codes of a staged chunk.
inline void pass2_avx512(Staged& st, const Hyper& h) {
  const float* __restrict mn = st.mn;
  const float* __restrict vn = st.vn;
  uint8_t* __restrict mc = st.mc;
  uint8_t* __restrict vc = st.vc;
  const __m512i sign_mask = _mm512_set1_epi32((int)0x80000000u);
  // first moment: encode
  const float A = st.A;
  const float pre = prescale(A);
  const float inv_s = A == 0.0f ? 0.0f : M8_TOP / (A * pre);
  st.ms[0] = A / M8_TOP;
  const __m512 vpre = _mm512_set1_ps(pre), inv = _mm512_set1_ps(inv_s);
  for (int k = 0; k < CHUNK; k += 16) {
    __m512 x = _mm512_load_ps(mn + k);
    __m512 z = _mm512_mul_ps(_mm512_mul_ps(_mm512_abs_ps(x), vpre), inv);
    __m512i code = h.sr_m ? e4m3_code_sr16(z, _mm512_srli_epi32(hash16(st.base + k, h.key_m), 12)) : e4m3_code16(z);
    __mmask16 setsign = _mm512_mask_test_epi32_mask(_mm512_test_epi32_mask(code, code),
                                                    _mm512_castps_si512(x), sign_mask);
    code = _mm512_mask_or_epi32(code, setsign, code, _mm512_set1_epi32(128));
    _mm_storeu_si128((__m128i*)(mc + k), _mm512_cvtepi32_epi8(code));
  }

  // second moment: encode
  for (int half = 0; half < 2; ++half) {
    const float VA = st.VA[half];
    const __m512 vinv = _mm512_set1_ps(1.0f / VA);
    st.vs[half] = VA;
    for (int k = half * HALF; k < (half + 1) * HALF; k += 16) {
      const __m512i code = v8_code16(_mm512_mul_ps(_mm512_load_ps(vn + k), vinv), h.sr_v, st.base + k, h.key_v);
      _mm_storeu_si128((__m128i*)(vc + k), _mm512_cvtepi32_epi8(code));
    }
  }
}
#endif  // __AVX512F__

#if defined(__AVX2__) && !defined(__AVX512F__)

// The same two passes with AVX2 (8 lanes), for CPUs without AVX-512; bit-identical results.
// int8's v map, 8 lanes (as v8_shifted, v8_values_above, v8_code).
inline __m256 v8_shifted8(const float* octave, __m256i c) {
  const __m256i bits = _mm256_castps_si256(lookup16(octave, c));
  return _mm256_castsi256_ps(_mm256_sub_epi32(bits, _mm256_slli_epi32(_mm256_srli_epi32(c, 4), 23)));
}
// table[i & 31] of 32 integers: four 8-lane permutes, blended by bits 3 and 4 of i
inline __m256i lookup32i(const int32_t* table, __m256i i) {
  const auto part = [&](int at) {
    return _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(_mm256_load_si256((const __m256i*)(table + at)), i));
  };
  const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)), bit4 = _mm256_castsi256_ps(_mm256_slli_epi32(i, 27));
  const __m256 lo = _mm256_blendv_ps(part(0), part(8), bit3), hi = _mm256_blendv_ps(part(16), part(24), bit3);
  return _mm256_castps_si256(_mm256_blendv_ps(lo, hi, bit4));
}
// v8_above16 with 8 lanes: the mantissa's slice, then one compare (mantissas are below 2^23: signed compares)
template <bool THRESHOLDS>
inline __m256i v8_above8(__m256 y) {
  const __m256i b = _mm256_castps_si256(y);
  __m256i count = lookup32i(THRESHOLDS ? V8_SLICES.thresholds_above : V8_SLICES.values_above, _mm256_srli_epi32(b, 18));
  const __m256i next = THRESHOLDS ? lookup32i(V8_SLICES.threshold_after, count)
                                  : _mm256_castps_si256(lookup16((const float*)V8_SLICES.value_after, count));
  const __m256i mant = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffff));
  count = _mm256_sub_epi32(count, _mm256_cmpgt_epi32(next, mant));  // a true compare is -1
  count = _mm256_sub_epi32(count, _mm256_and_si256(_mm256_srli_epi32(b, 19), _mm256_set1_epi32(0xff0)));  // 16 e
  return _mm256_min_epi32(_mm256_max_epi32(count, _mm256_setzero_si256()), _mm256_set1_epi32(V8_LAST));
}
// V8_OCTAVE[j + 1] (j < 15) and, for j = 15, the next octave's first value (1/2): the value after code c
// is V8_NEXT[c & 15] shifted as c's own
constexpr Padded16<15, 16> V8_NEXT(V8_OCTAVE + 1, 0.5f);
inline __m256i v8_code8(__m256 y, bool sr, int64_t index, uint32_t key) {
  if (!sr) return v8_above8<true>(y);
  // y between code k's value and code k + 1's (the same lane permute index and exponent shift: the compiler
  // computes them once); at the last code both neighbours are k (v8_code), and here k + 1 clamps back to it
  const __m256i k = v8_above8<false>(y);
  const __m256 upper = v8_shifted8(V8_OCTAVE, k), lower = v8_shifted8(V8_NEXT.t, k);
  const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(y, lower), _mm256_mul_ps(uniform8(index, key), _mm256_sub_ps(upper, lower)),
                                  _CMP_GT_OQ);
  const __m256i nx = _mm256_add_epi32(k, _mm256_set1_epi32(1));
  return _mm256_min_epi32(_mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(nx), _mm256_castsi256_ps(k), up)),
                          _mm256_set1_epi32(V8_LAST));
}

// e4m3_code16 with 8 lanes
inline __m256i e4m3_code8(__m256 z) {
  const __m256i zb = _mm256_castps_si256(z);
  const __m256i normal = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(zb, _mm256_set1_epi32(0x7FFFF - (896 << 20))),
                       _mm256_and_si256(_mm256_srli_epi32(zb, 20), _mm256_set1_epi32(1))),
      20);
  const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(z, _mm256_set1_ps(64.0f))),
                                       _mm256_set1_epi32((int)fbits(64.0f)));
  const __m256 is_sub = _mm256_cmp_ps(z, _mm256_set1_ps(M8_MIN_NORMAL), _CMP_LT_OQ);
  const __m256i code = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub), is_sub));
  return _mm256_min_epi32(code, _mm256_set1_epi32(127));
}
// e4m3_code_sr16 with 8 lanes
inline __m256i e4m3_code_sr8(__m256 z, __m256i r) {
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(z), r), 20),
                                          _mm256_set1_epi32(896));
  const __m256i sub = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_mul_ps(z, _mm256_set1_ps(0x1p37f))), r), 20);
  const __m256 is_sub = _mm256_cmp_ps(z, _mm256_set1_ps(M8_MIN_NORMAL), _CMP_LT_OQ);
  const __m256i code = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub), is_sub));
  return _mm256_min_epi32(code, _mm256_set1_epi32(127));
}

template <bool MAXIMIZE, bool L2, bool TAIL>
inline void pass1_avx2(float* __restrict p, const float* __restrict g, uint8_t* __restrict mc,
                       float* __restrict ms, uint8_t* __restrict vc, float* __restrict vs, const Hyper& h,
                       int valid, int64_t base, Staged& st) {
  float* __restrict mn = st.mn;
  float* __restrict vn = st.vn;
  const __m256 decay = _mm256_set1_ps(h.decay), wd = _mm256_set1_ps(h.wd);
  const __m256 b1 = _mm256_set1_ps(h.b1), omb1 = _mm256_set1_ps(h.omb1);
  const __m256 b2 = _mm256_set1_ps(h.b2), omb2 = _mm256_set1_ps(h.omb2);
  const __m256 ibc2 = _mm256_set1_ps(h.ibc2), eps = _mm256_set1_ps(h.eps);
  const __m256 nstep = _mm256_set1_ps(h.nstep);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);

  __m256i amaxi = _mm256_setzero_si256();
  __m256i vmaxi[2] = {_mm256_set1_epi32((int)fbits(V_FLOOR)), _mm256_set1_epi32((int)fbits(V_FLOOR))};
  for (int half = 0; half < 2; ++half) {
    const __m256 msc = _mm256_set1_ps(ms[0]);
    const __m256 vsc = _mm256_set1_ps(vs[half]);
    for (int k = half * HALF; k < (half + 1) * HALF; k += 8) {
      __m256i cm = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(mc + k)));  // sign-extended
      __m256i cv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(vc + k)));
      __m256 gi = _mm256_loadu_ps(g + k);
      if (MAXIMIZE) gi = _mm256_xor_ps(gi, sign);
      __m256 pi = _mm256_loadu_ps(p + k);
      if (L2) gi = _mm256_add_ps(gi, _mm256_mul_ps(pi, wd));
      pi = _mm256_mul_ps(pi, decay);
      __m256i bits = _mm256_and_si256(_mm256_slli_epi32(cm, 20), _mm256_set1_epi32((int)0x87F00000u));
      __m256 m = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p112f));
      m = _mm256_mul_ps(m, msc);
      __m256 v = _mm256_mul_ps(v8_shifted8(V8_OCTAVE, cv), vsc);
      m = _mm256_add_ps(_mm256_mul_ps(m, b1), _mm256_mul_ps(gi, omb1));
      v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(gi, gi), omb2));
      __m256 den = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), ibc2), eps);
      pi = _mm256_add_ps(pi, _mm256_mul_ps(nstep, _mm256_div_ps(m, den)));
      _mm256_storeu_ps(p + k, pi);
      if (TAIL) {
        __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - k), iota));
        m = _mm256_and_ps(m, live);
        v = _mm256_and_ps(v, live);
      }
      _mm256_store_ps(mn + k, m);  // raw, checked and cleaned afterwards as in pass1_avx512
      amaxi = _mm256_max_epu32(amaxi, _mm256_castps_si256(_mm256_andnot_ps(sign, m)));
      _mm256_store_ps(vn + k, v);
      vmaxi[half] = _mm256_max_epu32(vmaxi[half], _mm256_castps_si256(v));
    }
  }
  st.A = bfloat(hmaxu8(amaxi));
  for (int i = 0; i < 2; ++i) st.VA[i] = bfloat(hmaxu8(vmaxi[i]));
  if (!st.clean()) clean_staged(st);
  st.base = base;
  st.mc = mc;
  st.ms = ms;
  st.vc = vc;
  st.vs = vs;
}

inline void pass2_avx2(Staged& st, const Hyper& h) {
  const float* __restrict mn = st.mn;
  const float* __restrict vn = st.vn;
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
  const __m256i zeroi = _mm256_setzero_si256();
  const float A = st.A;
  const float pre = prescale(A);
  const float inv_s = A == 0.0f ? 0.0f : M8_TOP / (A * pre);
  st.ms[0] = A / M8_TOP;
  const __m256 vpre = _mm256_set1_ps(pre), inv = _mm256_set1_ps(inv_s);
  const auto m_code = [&](int k) {
    __m256 x = _mm256_load_ps(mn + k);
    __m256 z = _mm256_mul_ps(_mm256_mul_ps(_mm256_andnot_ps(sign, x), vpre), inv);
    const __m256i code = h.sr_m ? e4m3_code_sr8(z, _mm256_srli_epi32(hash8(st.base + k, h.key_m), 12)) : e4m3_code8(z);
    __m256i setsign = _mm256_and_si256(_mm256_srai_epi32(_mm256_castps_si256(x), 31),
                                       _mm256_cmpgt_epi32(code, zeroi));
    return _mm256_or_si256(code, _mm256_and_si256(setsign, _mm256_set1_epi32(128)));
  };
  for (int k = 0; k < CHUNK; k += 32) store_bytes32(st.mc + k, m_code(k), m_code(k + 8), m_code(k + 16), m_code(k + 24));
  for (int half = 0; half < 2; ++half) {
    const float VA = st.VA[half];
    const __m256 vinv = _mm256_set1_ps(1.0f / VA);
    st.vs[half] = VA;
    const auto v_code = [&](int k) {
      return v8_code8(_mm256_mul_ps(_mm256_load_ps(vn + k), vinv), h.sr_v, st.base + k, h.key_v);
    };
    for (int k = half * HALF; k < (half + 1) * HALF; k += 32)
      store_bytes32(st.vc + k, v_code(k), v_code(k + 8), v_code(k + 16), v_code(k + 24));
  }
}
#endif  // __AVX2__ && !__AVX512F__

// The vector path this build uses for int8: AVX-512, AVX2 or none (the scalar ``chunk8``).
#if defined(__AVX512F__)
#define MQ_PASS1 pass1_avx512
#define MQ_PASS2 pass2_avx512
#elif defined(__AVX2__)
#define MQ_PASS1 pass1_avx2
#define MQ_PASS2 pass2_avx2
#endif

}  // namespace
