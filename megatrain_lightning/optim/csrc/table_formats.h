// One chunk of a table format (int4, int3, int2): decode, update and stage in registers, then encode.
#pragma once

#include "table_codes.h"

namespace {

// A table-format chunk's new moments after its update, as bits: m's and v's, and per block the maxima its
// scales come from: m's largest magnitude and largest positive value, v's largest value (at least
// V_FLOOR). The vector passes stage them as computed; ``clean_staged`` makes them finite (NaN -> 0,
// magnitudes at most CLAMP, v's negatives -> 0) where a block's maximum shows a value to clean.
struct TStaged {
  alignas(64) uint32_t m[CHUNK];
  alignas(64) uint32_t v[CHUNK];
  uint32_t m_abs[CHUNK / 16], m_pos[CHUNK / 16], v_max[CHUNK / 16];  // per block (blocks of >= 16)
};

// Whether any staged value needs cleaning: NaN, Inf, beyond CLAMP or (v) negative ones raise their block's
// maximum above CLAMP (as unsigned integers, v's sign bit too).
template <int MB, int VB>
inline bool staged_unclean(const TStaged& st) {
  uint32_t worst = 0;
  for (int b = 0; b < CHUNK / MB; ++b) worst = std::max(worst, st.m_abs[b]);
  for (int b = 0; b < CHUNK / VB; ++b) worst = std::max(worst, st.v_max[b]);
  return worst > CLAMP_BITS;
}

// The staged moments cleaned and their block maxima taken again: the vector passes' rare path (NaN, Inf,
// overflowing or negative moments), the portable pass's only one.
template <int MB, int VB>
inline void clean_staged(TStaged& st) {
  for (int o = 0; o < CHUNK; o += MB) {
    uint32_t amax = 0, pmax = 0;
    for (int i = o; i < o + MB; ++i) {
      const uint32_t u = st.m[i], a = clean_magnitude(u);
      st.m[i] = a | (u & 0x80000000u);
      amax = a > amax ? a : amax;
      const uint32_t pos = (u >> 31) ? 0u : a;
      pmax = pos > pmax ? pos : pmax;
    }
    st.m_abs[o / MB] = amax;
    st.m_pos[o / MB] = pmax;
  }
  for (int o = 0; o < CHUNK; o += VB) {
    uint32_t vmax = fbits(V_FLOOR);
    for (int i = o; i < o + VB; ++i) {
      const uint32_t u = clean_v(st.v[i]);
      st.v[i] = u;
      vmax = u > vmax ? u : vmax;
    }
    st.v_max[o / VB] = vmax;
  }
}

#if defined(__AVX512F__)
// Pass 1 of a table-format chunk, 16 elements at a time in registers: decode (in-register table lookups),
// update (fp32), write the parameter, stage the new moments and take their block maxima.
template <int MW, int MB, int VW, int VB, bool MAXIMIZE, bool L2>
inline void tstage(float* __restrict p, const float* __restrict g, const uint8_t* __restrict mcu,
                   const float* __restrict ms, const uint8_t* __restrict vcu, const float* __restrict vs,
                   const Hyper& h, int valid, TStaged& st) {
  static_assert(MB % 16 == 0 && VB % 16 == 0, "blocks of whole vectors");
  const __m512 mt = m_decode16<MW>(), vt = v_decode16<VW>();
  const __m512 decay = _mm512_set1_ps(h.decay), wd = _mm512_set1_ps(h.wd);
  const __m512 b1 = _mm512_set1_ps(h.b1), omb1 = _mm512_set1_ps(h.omb1);
  const __m512 b2 = _mm512_set1_ps(h.b2), omb2 = _mm512_set1_ps(h.omb2);
  const __m512 ibc2 = _mm512_set1_ps(h.ibc2), eps = _mm512_set1_ps(h.eps), nstep = _mm512_set1_ps(h.nstep);
  const __m512i zero = _mm512_setzero_si512(), abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i v_floor = _mm512_set1_epi32((int)fbits(V_FLOOR));
  __m512i am = zero, pm = zero, vm = v_floor;
  for (int i = 0; i < CHUNK; i += 16) {
    const __m512i cm = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(mcu + i)));
    const __m512i cv = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(vcu + i)));
    __m512 gi = _mm512_loadu_ps(g + i);
    if (MAXIMIZE) gi = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gi), _mm512_set1_epi32((int)0x80000000u)));
    __m512 pi = _mm512_loadu_ps(p + i);
    if (L2) gi = _mm512_add_ps(gi, _mm512_mul_ps(pi, wd));
    pi = _mm512_mul_ps(pi, decay);
    __m512 m = _mm512_mul_ps(_mm512_permutexvar_ps(cm, mt), _mm512_set1_ps(ms[i / MB]));
    __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(cv, vt), _mm512_set1_ps(vs[i / VB]));
    m = _mm512_add_ps(_mm512_mul_ps(m, b1), _mm512_mul_ps(gi, omb1));
    v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(gi, gi), omb2));
    const __m512 den = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), ibc2), eps);
    pi = _mm512_add_ps(pi, _mm512_mul_ps(nstep, _mm512_div_ps(m, den)));
    _mm512_storeu_ps(p + i, pi);
    if (valid < CHUNK) {  // a zero-padded tail: its padding's moments are zeros
      const __mmask16 live = i >= valid ? 0 : (i + 16 <= valid ? 0xFFFF : (__mmask16)((1u << (valid - i)) - 1u));
      m = _mm512_maskz_mov_ps(live, m);
      v = _mm512_maskz_mov_ps(live, v);
    }
    const __m512i u = _mm512_castps_si512(m), w = _mm512_castps_si512(v);
    _mm512_store_si512(st.m + i, u);
    _mm512_store_si512(st.v + i, w);
    am = _mm512_max_epu32(am, _mm512_and_si512(u, abs_mask));
    pm = _mm512_max_epi32(pm, u);  // negatives are negative integers: 0
    vm = _mm512_max_epu32(vm, w);
    if ((i + 16) % MB == 0) {
      st.m_abs[i / MB] = _mm512_reduce_max_epu32(am);
      st.m_pos[i / MB] = _mm512_reduce_max_epu32(pm);
      am = pm = zero;
    }
    if ((i + 16) % VB == 0) {
      st.v_max[i / VB] = _mm512_reduce_max_epu32(vm);
      vm = v_floor;
    }
  }
}
#elif defined(__AVX2__)
// Pass 1 with AVX2, 8 elements at a time: as the AVX-512 pass (lookups by lane permutes, maxima as unsigned
// integers).
template <int MW, int MB, int VW, int VB, bool MAXIMIZE, bool L2>
inline void tstage(float* __restrict p, const float* __restrict g, const uint8_t* __restrict mcu,
                   const float* __restrict ms, const uint8_t* __restrict vcu, const float* __restrict vs,
                   const Hyper& h, int valid, TStaged& st) {
  static_assert(MB % 8 == 0 && VB % 8 == 0, "blocks of whole vectors");
  const __m256 decay = _mm256_set1_ps(h.decay), wd = _mm256_set1_ps(h.wd);
  const __m256 b1 = _mm256_set1_ps(h.b1), omb1 = _mm256_set1_ps(h.omb1);
  const __m256 b2 = _mm256_set1_ps(h.b2), omb2 = _mm256_set1_ps(h.omb2);
  const __m256 ibc2 = _mm256_set1_ps(h.ibc2), eps = _mm256_set1_ps(h.eps), nstep = _mm256_set1_ps(h.nstep);
  const __m256i zero = _mm256_setzero_si256(), abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i v_floor = _mm256_set1_epi32((int)fbits(V_FLOOR)), iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i am = zero, pm = zero, vm = v_floor;
  for (int i = 0; i < CHUNK; i += 8) {
    const __m256i cm = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(mcu + i)));
    const __m256i cv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(vcu + i)));
    __m256 gi = _mm256_loadu_ps(g + i);
    if (MAXIMIZE) gi = _mm256_xor_ps(gi, _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u)));
    __m256 pi = _mm256_loadu_ps(p + i);
    if (L2) gi = _mm256_add_ps(gi, _mm256_mul_ps(pi, wd));
    pi = _mm256_mul_ps(pi, decay);
    __m256 m = _mm256_mul_ps(lookup<MMap<MW>::L>(m_decode_table<MW>(), cm), _mm256_set1_ps(ms[i / MB]));
    __m256 v = _mm256_mul_ps(lookup<VMap<VW>::L>(v_decode_table<VW>(), cv), _mm256_set1_ps(vs[i / VB]));
    m = _mm256_add_ps(_mm256_mul_ps(m, b1), _mm256_mul_ps(gi, omb1));
    v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(gi, gi), omb2));
    const __m256 den = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), ibc2), eps);
    pi = _mm256_add_ps(pi, _mm256_mul_ps(nstep, _mm256_div_ps(m, den)));
    _mm256_storeu_ps(p + i, pi);
    if (valid < CHUNK) {  // a zero-padded tail: its padding's moments are zeros
      const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - i), iota));
      m = _mm256_and_ps(m, live);
      v = _mm256_and_ps(v, live);
    }
    const __m256i u = _mm256_castps_si256(m), w = _mm256_castps_si256(v);
    _mm256_store_si256((__m256i*)(st.m + i), u);
    _mm256_store_si256((__m256i*)(st.v + i), w);
    am = _mm256_max_epu32(am, _mm256_and_si256(u, abs_mask));
    pm = _mm256_max_epi32(pm, u);  // negatives are negative integers: 0
    vm = _mm256_max_epu32(vm, w);
    if ((i + 8) % MB == 0) {
      st.m_abs[i / MB] = hmaxu8(am);
      st.m_pos[i / MB] = hmaxu8(pm);
      am = pm = zero;
    }
    if ((i + 8) % VB == 0) {
      st.v_max[i / VB] = hmaxu8(vm);
      vm = v_floor;
    }
  }
}
#else
// Pass 1 without AVX2: the same in loops over fixed-size arrays that the compiler vectorizes (decoding
// by selects over codes: no gathers, slow on CPUs with the gather-data-sampling mitigation), cleaned.
template <int MW, int MB, int VW, int VB, bool MAXIMIZE, bool L2>
inline void tstage(float* __restrict p, const float* __restrict g, const uint8_t* __restrict mcu,
                   const float* __restrict ms, const uint8_t* __restrict vcu, const float* __restrict vs,
                   const Hyper& h, int valid, TStaged& st) {
  constexpr int SUB = MB < VB ? MB : VB;  // elements sharing both scales
  constexpr auto& MT = mtables<MW>();
  alignas(64) float mn[CHUNK];
  alignas(64) float vn[CHUNK];
  for (int i = 0; i < CHUNK; ++i) mn[i] = vn[i] = 0.0f;
  for (int c = 0; c < MMap<MW>::L; ++c) {
    const float t = MT.decode[c];
    for (int i = 0; i < CHUNK; ++i) mn[i] = mcu[i] == c ? t : mn[i];
  }
  for (int c = 0; c < VMap<VW>::L; ++c) {
    const float t = VMap<VW>::DECODE[c];
    for (int i = 0; i < CHUNK; ++i) vn[i] = vcu[i] == c ? t : vn[i];
  }
  for (int o = 0; o < CHUNK; o += SUB) {
    const float msc = ms[o / MB];
    const float vsc = vs[o / VB];
    for (int i = o; i < o + SUB; ++i) {
      float gi = g[i];
      if (MAXIMIZE) gi = -gi;
      float pi = p[i];
      if (L2) gi = gi + pi * h.wd;
      pi = pi * h.decay;
      float m = mn[i] * msc;
      float v = vn[i] * vsc;
      m = m * h.b1 + gi * h.omb1;
      v = v * h.b2 + (gi * gi) * h.omb2;
      float den = std::sqrt(v) * h.ibc2 + h.eps;
      pi = pi + h.nstep * (m / den);
      p[i] = pi;
      mn[i] = m;
      vn[i] = v;
    }
  }
  for (int i = valid; i < CHUNK; ++i) mn[i] = vn[i] = 0.0f;
  std::memcpy(st.m, mn, sizeof mn);
  std::memcpy(st.v, vn, sizeof vn);
  clean_staged<MB, VB>(st);
}
#endif

// One chunk of a table format (m: MW-bit codes, blocks of MB; v: VW-bit log codes, blocks of VB): pass 1
// (``tstage``), then each block's scale from its maxima and its codes. (Pipelining the two passes over
// neighbouring chunks, as int8's, measured no faster here.)
template <int MW, int MB, int VW, int VB, bool MAXIMIZE, bool L2>
inline void tchunk(float* __restrict p, const float* __restrict g, uint8_t* __restrict mc,
                   float* __restrict ms, uint8_t* __restrict vc, float* __restrict vs, const Hyper& h,
                   int valid, int64_t base) {
  [[maybe_unused]] constexpr auto& MT = mtables<MW>();
  TStaged st;
  alignas(64) uint8_t mcu[CHUNK];
  alignas(64) uint8_t vcu[CHUNK];
#if !defined(__AVX2__)
  alignas(64) float y[CHUNK];      // normalized values to encode
  alignas(64) int32_t idx[CHUNK];  // their codes
#endif
  unpack_codes<MW>(mc, mcu);
  unpack_codes<VW>(vc, vcu);
  tstage<MW, MB, VW, VB, MAXIMIZE, L2>(p, g, mcu, ms, vcu, vs, h, valid, st);
  if (staged_unclean<MB, VB>(st)) clean_staged<MB, VB>(st);

  // first moment: the signed block max, encode
  for (int o = 0; o < CHUNK; o += MB) {
    const uint32_t amax = st.m_abs[o / MB], pmax = st.m_pos[o / MB];
    const float A = bfloat(amax);
    const float S = pmax >= amax ? A : -A;
    const float pre = prescale(A);
    const float inv = A == 0.0f ? 0.0f : 1.0f / (S * pre);
    ms[o / MB] = S;
    if (h.sr_m) {
      sr_encode_m<MW>(st.m + o, MB, pre, inv, base + o, h.key_m, mcu + o);
      continue;
    }
#if defined(__AVX512F__)
    {
      const __m512 th = m_mid16<MW>(), vpre = _mm512_set1_ps(pre), vinv = _mm512_set1_ps(inv);
      const __m512i off = _mm512_set1_epi32(MMap<MW>::L - MMap<MW>::ZERO), mask = _mm512_set1_epi32(MMap<MW>::L - 1);
      for (int i = o; i < o + MB; i += 16) {
        __m512 yv = _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_load_si512(st.m + i)), vpre), vinv);
        __m512i code = _mm512_and_si512(_mm512_add_epi32(count_prefix<MMap<MW>::L, _CMP_GT_OQ>(yv, th), off), mask);
        _mm_store_si128((__m128i*)(mcu + i), _mm512_cvtepi32_epi8(code));
      }
    }
#elif defined(__AVX2__)
    {
      const __m256 vpre = _mm256_set1_ps(pre), vinv = _mm256_set1_ps(inv);
      const __m256i off = _mm256_set1_epi32(MMap<MW>::L - MMap<MW>::ZERO), mask = _mm256_set1_epi32(MMap<MW>::L - 1);
      for (int i = o; i < o + MB; i += 8) {
        const __m256 yv = _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_load_si256((const __m256i*)(st.m + i))), vpre), vinv);
        const __m256i code = _mm256_and_si256(_mm256_add_epi32(count_holding<MMap<MW>::L, _CMP_GT_OQ>(yv, MT.mid), off), mask);
        _mm_storel_epi64((__m128i*)(mcu + i), bytes8(code));
      }
    }
#else
    for (int i = o; i < o + MB; ++i) {
      y[i] = (bfloat(st.m[i]) * pre) * inv;
      idx[i] = MMap<MW>::L - MMap<MW>::ZERO;
    }
    for (int k = 0; k < MMap<MW>::L - 1; ++k) {  // thresholds outside: the element loop vectorizes
      const float t = MT.mid[k];
      for (int i = o; i < o + MB; ++i) idx[i] += y[i] > t;
    }
    for (int i = o; i < o + MB; ++i) mcu[i] = (uint8_t)(idx[i] & (MMap<MW>::L - 1));
#endif
  }

  // second moment: the block max, log map
  for (int o = 0; o < CHUNK; o += VB) {
    const float A = bfloat(st.v_max[o / VB]);
    const float inv = 1.0f / A;
    vs[o / VB] = A;
    if (h.sr_v) {
      sr_encode_v<VW>(st.v + o, VB, inv, base + o, h.key_v, vcu + o);
      continue;
    }
#if defined(__AVX512F__)
    {
      const __m512 vinv = _mm512_set1_ps(inv);
      for (int i = o; i < o + VB; i += 16) {
        __m512 yv = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_load_si512(st.v + i)), vinv);
        __m512i code = v_nearest_code<VW>(yv);  // thresholds above y
        _mm_store_si128((__m128i*)(vcu + i), _mm512_cvtepi32_epi8(code));
      }
    }
#elif defined(__AVX2__)
    {
      const __m256 vinv = _mm256_set1_ps(inv);
      for (int i = o; i < o + VB; i += 8) {
        const __m256 yv = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_load_si256((const __m256i*)(st.v + i))), vinv);
        _mm_storel_epi64((__m128i*)(vcu + i), bytes8(v_nearest_code<VW>(yv)));  // thresholds above y
      }
    }
#else
    for (int i = o; i < o + VB; ++i) {
      y[i] = bfloat(st.v[i]) * inv;
      idx[i] = 0;
    }
    for (int k = 0; k < VMap<VW>::L - 1; ++k) {
      const float t = VMap<VW>::TH[k];
      for (int i = o; i < o + VB; ++i) idx[i] += y[i] < t;
    }
    for (int i = o; i < o + VB; ++i) vcu[i] = (uint8_t)idx[i];
#endif
  }
  pack_codes<MW>(mcu, mc);
  pack_codes<VW>(vcu, vc);
}

}  // namespace
