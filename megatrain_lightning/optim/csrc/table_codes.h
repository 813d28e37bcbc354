// The table formats' (int4, int3, int2) codes: the v map by exponent, stochastic rounding of either
// moment, and packing 2 or 4 codes per byte.
#pragma once

#include "vectors.h"

namespace {

#if defined(__AVX2__)
// The vectors of this build's table-format passes: 16 lanes with AVX-512, else 8.
#if defined(__AVX512F__)
using VecF = __m512;
using VecI = __m512i;
#else
using VecF = __m256;
using VecI = __m256i;
#endif
// The nearest v code: thresholds above y (4 bits: 0x1.ae89fa and 0x1.306fe0 times 2^-k from k = 1; 2 bits:
// 2^-1, 2^-3, 2^-5).
template <int W>
inline VecI v_nearest_code(VecF y) {
  if constexpr (W == 4) return count_above_log<16, true>(y, 1, {mantissa(V4_TH[0]), mantissa(V4_TH[1])});
  else return count_above_log<4, false>(y, 0, {});
}
// Stochastic rounding's lower neighbour: the map's values below its largest that lie above y (4 bits:
// 0x1.6a09e6 and 1 times 2^-k from k = 1; 2 bits: 2^-2, 2^-4, 2^-6).
template <int W>
inline VecI v_values_above(VecF y) {
  if constexpr (W == 4) return count_above_log<16, true>(y, 1, {mantissa(V4_DECODE[1])});
  else return count_above_log<4, false>(y, 1, {});
}
#endif

// Stochastic rounding of nb normalized values between their two neighbouring map values (rounding.
// round_to_neighbour): the farther with probability distance / gap (v maps with ROOT_SR: of y^(1/4)); beyond
// the map's ends, the end.
// m: y = (value * pre) * inv against the ascending map; v: y = value * inv against the descending one.
// ``index``: the stream's index of the first value, whose uniform numbers (``key``) decide.
template <int W>
inline void sr_encode_m(const uint32_t* __restrict bits, int nb, float pre, float inv, int64_t index, uint32_t key,
                        uint8_t* __restrict out) {
  constexpr int L = MMap<W>::L;
#if defined(__AVX512F__)
  const __m512 lower = _mm512_load_ps(m_sr<W>().lower), gap = _mm512_load_ps(m_sr<W>().gap);
  const __m512 vpre = _mm512_set1_ps(pre), vinv = _mm512_set1_ps(inv);
  const __m512i last = _mm512_set1_epi32(L - 1), one = _mm512_set1_epi32(1);
  const __m512i off = _mm512_set1_epi32(L - MMap<W>::ZERO);
  for (int i = 0; i < nb; i += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_loadu_si512(bits + i)), vpre), vinv);
    const __m512i j = m_count_at_most<W>(y);  // values above the lowest that are <= y
    const __m512 lo = _mm512_permutexvar_ps(j, lower);
    const __m512 draw = _mm512_mul_ps(uniform_units16(index + i, key), _mm512_permutexvar_ps(j, gap));
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(y, lo), draw, _CMP_GT_OQ);  // never past the top
    const __m512i idx = _mm512_add_epi32(j, off);
    const __m512i code = _mm512_and_si512(_mm512_mask_add_epi32(idx, up, idx, one), last);
    _mm_storeu_si128((__m128i*)(out + i), _mm512_cvtepi32_epi8(code));
  }
  return;
#elif defined(__AVX2__)
  const __m256 vpre = _mm256_set1_ps(pre), vinv = _mm256_set1_ps(inv);
  const __m256i last = _mm256_set1_epi32(L - 1), off = _mm256_set1_epi32(L - MMap<W>::ZERO);
  for (int i = 0; i < nb; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_loadu_si256((const __m256i*)(bits + i))), vpre), vinv);
    __m256i j;  // values above the lowest that are <= y
    if constexpr (W == 4) j = m4_count_at_most(y);
    else j = count_holding<L, _CMP_GE_OQ>(y, MMap<W>::SORTED + 1);
    const __m256 lo = lookup<L>(m_sr<W>().lower, j);
    const __m256 draw = _mm256_mul_ps(uniform_units8(index + i, key), lookup<L>(m_sr<W>().gap, j));
    const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(y, lo), draw, _CMP_GT_OQ);  // never past the top
    const __m256i idx = _mm256_sub_epi32(_mm256_add_epi32(j, off), _mm256_castps_si256(up));  // up: -1
    _mm_storel_epi64((__m128i*)(out + i), bytes8(_mm256_and_si256(idx, last)));
  }
  return;
#endif
  const float* T = MMap<W>::SORTED;
  for (int i = 0; i < nb; ++i) {
    const float y = (bfloat(bits[i]) * pre) * inv;
    int j = 0;
    for (int k = 1; k < L; ++k) j += y >= T[k];
    const int nx = j + 1 < L ? j + 1 : L - 1;
    const float lo = T[j], hi = T[nx];
    const int idx = (y - lo) > uniform(index + i, key) * (hi - lo) ? nx : j;
    out[i] = (uint8_t)((idx + L - MMap<W>::ZERO) & (L - 1));
  }
}
template <int W>
inline void sr_encode_v(const uint32_t* __restrict bits, int nb, float inv, int64_t index, uint32_t key,
                        uint8_t* __restrict out) {
  constexpr int L = VMap<W>::L;
  const float* D = VMap<W>::DECODE;
  if constexpr (VMap<W>::ROOT_SR) {  // AVX2 below; AVX-512 and portable builds: a loop the compiler vectorizes
    static_assert(VMap<W>::OCTAVES == 2.0f, "code c's value is 4^-c: its bits, no lookup (gather)");
#if defined(__AVX2__) && !defined(__AVX512F__)
    const __m256 vinv = _mm256_set1_ps(inv), step = _mm256_set1_ps(QUARTER_ROOT_STEP), one_f = _mm256_set1_ps(1.0f);
    const __m256i last = _mm256_set1_epi32(L - 1), one = _mm256_set1_epi32(1);
    for (int i = 0; i < nb; i += 8) {
      const __m256 y = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_loadu_si256((const __m256i*)(bits + i))), vinv);
      const __m256i k = count_holding<L, _CMP_LT_OQ>(y, D + 1);
      const __m256i nx = _mm256_min_epi32(_mm256_add_epi32(k, one), last);
      const __m256 lower = _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_set1_epi32((int)fbits_c(1.0f)), _mm256_slli_epi32(nx, 24)));
      __m256 w = _mm256_add_ps(_mm256_mul_ps(uniform8(index + i, key), step), one_f);  // quarter_power_threshold
      w = _mm256_mul_ps(w, w);
      w = _mm256_mul_ps(w, w);
      const __m256 up = _mm256_cmp_ps(y, _mm256_mul_ps(lower, w), _CMP_GT_OQ);
      const __m256i code = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(nx), _mm256_castsi256_ps(k), up));
      _mm_storel_epi64((__m128i*)(out + i), bytes8(code));
    }
    return;
#endif
    for (int i = 0; i < nb; ++i) {
      const float y = bfloat(bits[i]) * inv;
      int k = 0;
      for (int c = 1; c < L; ++c) k += y < D[c];
      const int nx = k + 1 < L ? k + 1 : L - 1;
      const float lower = bfloat(fbits_c(1.0f) - ((uint32_t)nx << 24));  // D[nx]
      // y^(1/4) - lower^(1/4) > u * (upper^(1/4) - lower^(1/4)), upper = 4 lower
      out[i] = (uint8_t)(y > lower * quarter_power_threshold(uniform(index + i, key)) ? k : nx);
    }
    return;
  }
#if defined(__AVX512F__)
  const __m512 lowers = _mm512_load_ps(v_sr<W>().lower), gap = _mm512_load_ps(v_sr<W>().gap);
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i last = _mm512_set1_epi32(L - 1), one = _mm512_set1_epi32(1);
  for (int i = 0; i < nb; i += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_loadu_si512(bits + i)), vinv);
    const __m512i k = v_values_above<W>(y);  // values below the largest that are > y
    const __m512 lower = _mm512_permutexvar_ps(k, lowers);
    const __m512 draw = _mm512_mul_ps(uniform_units16(index + i, key), _mm512_permutexvar_ps(k, gap));
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(y, lower), draw, _CMP_GT_OQ);
    const __m512i code = _mm512_min_epi32(_mm512_mask_add_epi32(k, _knot_mask16(up), k, one), last);  // else k + 1
    _mm_storeu_si128((__m128i*)(out + i), _mm512_cvtepi32_epi8(code));
  }
  return;
#elif defined(__AVX2__)
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i last = _mm256_set1_epi32(L - 1), one = _mm256_set1_epi32(1);
  for (int i = 0; i < nb; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_loadu_si256((const __m256i*)(bits + i))), vinv);
    const __m256i k = v_values_above<W>(y);  // values below the largest that are > y
    const __m256 lower = lookup<L>(v_sr<W>().lower, k);
    const __m256 draw = _mm256_mul_ps(uniform_units8(index + i, key), lookup<L>(v_sr<W>().gap, k));
    const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(y, lower), draw, _CMP_GT_OQ);
    const __m256i down = _mm256_andnot_si256(_mm256_castps_si256(up), one);
    const __m256i code = _mm256_min_epi32(_mm256_add_epi32(k, down), last);
    _mm_storel_epi64((__m128i*)(out + i), bytes8(code));
  }
  return;
#endif
  for (int i = 0; i < nb; ++i) {
    const float y = bfloat(bits[i]) * inv;
    int k = 0;
    for (int c = 1; c < L; ++c) k += y < D[c];
    const int nx = k + 1 < L ? k + 1 : L - 1;
    const float upper = D[k], lower = D[nx];
    out[i] = (uint8_t)((y - lower) > uniform(index + i, key) * (upper - lower) ? k : nx);
  }
}

// Codes of width W (8 / W per byte, element k of a byte in bits [k W, (k + 1) W)) <-> one byte each.
template <int W>
inline void unpack_codes(const uint8_t* __restrict in, uint8_t* __restrict out) {
  constexpr int PER = 8 / W;
  constexpr uint8_t MASK = (1u << W) - 1u;
#if defined(__SSE2__)
  // interleave the bit fields of 16 bytes at a time (SSE2 byte unpacks)
  const __m128i mask = _mm_set1_epi8((char)MASK);
  for (int j = 0; j < CHUNK / PER; j += 16) {
    const __m128i b = _mm_loadu_si128((const __m128i*)(in + j));
    __m128i f[PER];
    for (int k = 0; k < PER; ++k) f[k] = _mm_and_si128(_mm_srli_epi16(b, k * W), mask);
    __m128i* o = (__m128i*)(out + j * PER);
    if constexpr (PER == 2) {
      _mm_storeu_si128(o, _mm_unpacklo_epi8(f[0], f[1]));
      _mm_storeu_si128(o + 1, _mm_unpackhi_epi8(f[0], f[1]));
    } else {
      const __m128i lo01 = _mm_unpacklo_epi8(f[0], f[1]), hi01 = _mm_unpackhi_epi8(f[0], f[1]);
      const __m128i lo23 = _mm_unpacklo_epi8(f[2], f[3]), hi23 = _mm_unpackhi_epi8(f[2], f[3]);
      _mm_storeu_si128(o, _mm_unpacklo_epi16(lo01, lo23));
      _mm_storeu_si128(o + 1, _mm_unpackhi_epi16(lo01, lo23));
      _mm_storeu_si128(o + 2, _mm_unpacklo_epi16(hi01, hi23));
      _mm_storeu_si128(o + 3, _mm_unpackhi_epi16(hi01, hi23));
    }
  }
  return;
#endif
  for (int j = 0; j < CHUNK / PER; ++j) {
    const uint8_t b = in[j];
    for (int k = 0; k < PER; ++k) out[j * PER + k] = (uint8_t)((b >> (k * W)) & MASK);
  }
}
template <int W>
inline void pack_codes(const uint8_t* __restrict in, uint8_t* __restrict out) {
  constexpr int PER = 8 / W;
#if defined(__AVX2__)
  // neighbours' fields summed by multiply-adds: c0 + 16 c1 (4 bits); (c0 + 4 c1) + 16 (c2 + 4 c3) (2 bits)
  const __m128i pairs = _mm_set1_epi16(PER == 2 ? 0x1001 : 0x0401), quads = _mm_set1_epi32(0x00100001);
  for (int j = 0; j < CHUNK; j += 32) {
    const __m128i lo = _mm_maddubs_epi16(_mm_loadu_si128((const __m128i*)(in + j)), pairs);
    const __m128i hi = _mm_maddubs_epi16(_mm_loadu_si128((const __m128i*)(in + j + 16)), pairs);
    if constexpr (PER == 2) {
      _mm_storeu_si128((__m128i*)(out + j / 2), _mm_packus_epi16(lo, hi));
    } else {
      const __m128i w = _mm_packs_epi32(_mm_madd_epi16(lo, quads), _mm_madd_epi16(hi, quads));
      _mm_storel_epi64((__m128i*)(out + j / 4), _mm_packus_epi16(w, w));
    }
  }
  return;
#endif
  for (int j = 0; j < CHUNK / PER; ++j) {
    uint8_t b = 0;
    for (int k = 0; k < PER; ++k) b |= (uint8_t)(in[j * PER + k] << (k * W));
    out[j] = b;
  }
}

}  // namespace
