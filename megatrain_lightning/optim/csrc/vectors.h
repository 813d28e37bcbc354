// In-register building blocks of the vector passes: lookups, searches and random numbers, with AVX-512
// (16 lanes) or AVX2 (8 lanes).
#pragma once

#include "common.h"

namespace {

#if defined(__AVX512F__)
template <int W>
inline __m512 m_decode16() { return _mm512_load_ps(m_decode_table<W>()); }
template <int W>
inline __m512 v_decode16() { return _mm512_load_ps(v_decode_table<W>()); }
template <int W>
inline __m512 m_mid16() { return _mm512_load_ps(W == 4 ? M4_MID16.t : M2_MID16.t); }

// Branchless binary search over L - 1 sorted thresholds (padded to 16): the number of leading
// thresholds for which ``pred(y, threshold)`` holds, when it holds for a prefix of them.
template <int L, int PRED>
inline __m512i count_prefix(__m512 y, __m512 th) {
  __m512i idx = _mm512_setzero_si512();
  for (int bit = L / 2; bit >= 1; bit >>= 1) {
    __m512i probe = _mm512_add_epi32(idx, _mm512_set1_epi32(bit - 1));
    __mmask16 hit = _mm512_cmp_ps_mask(y, _mm512_permutexvar_ps(probe, th), PRED);
    idx = _mm512_mask_add_epi32(idx, hit, idx, _mm512_set1_epi32(bit));
  }
  return idx;
}

// How many of the m map's values above its lowest are <= y (count_prefix with _CMP_GE_OQ over them) by
// y's bucket (MBuckets): no search; bitwise the same for every y but NaN.
template <int W>
inline __m512i m_count_at_most(__m512 y) {
  constexpr auto& B = m_buckets16<W>();
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7fffffff));
  __m512i key = _mm512_sub_epi32(_mm512_srli_epi32(a, 22), _mm512_set1_epi32(B.FIELD_OFFSET));
  key = _mm512_min_epi32(_mm512_max_epi32(key, _mm512_setzero_si512()), _mm512_set1_epi32(15));
  const __mmask16 negative = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ);  // -0.0 is not
  key = _mm512_mask_or_epi32(key, negative, key, _mm512_set1_epi32(16));
  const __m512i base = _mm512_permutex2var_epi32(_mm512_load_si512(B.base), key, _mm512_load_si512(B.base + 16));
  const __m512 t = _mm512_permutex2var_ps(_mm512_load_ps(B.inside[0]), key, _mm512_load_ps(B.inside[0] + 16));
  return _mm512_mask_add_epi32(base, _mm512_cmp_ps_mask(y, t, _CMP_GE_OQ), base, _mm512_set1_epi32(1));
}

// The log maps of v repeat per octave: at 4 bits two values (and two thresholds) in each octave below 1,
// at 2 bits one every second octave. So how many of a map's descending values or thresholds lie above a
// normalized y (0 <= y < 2, finite) follows from y's octave k (y in [2^-k, 2^(1-k)), k = 127 - exponent
// field: large for 0 and subnormals) and compares of its mantissa with those of octave k's values: the
// binary search's count without its lookups. ``from``: the octave of the first value counted; ``mants``:
// the mantissas of octave k's values that can lie above y (a power of two in it never does); counts past
// the map's end clamp to ``L - 1``. Bitwise the search's result (tests: kernel against fallback).
template <int L, bool TWO_PER_OCTAVE>
inline __m512i count_above_log(__m512 y, int from, std::initializer_list<uint32_t> mants) {
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i k = _mm512_sub_epi32(_mm512_set1_epi32(127), _mm512_srli_epi32(bits, 23));
  const __m512i mant = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffff));
  const __m512i octaves = _mm512_sub_epi32(k, _mm512_set1_epi32(from));  // wholly above y
  __m512i count = TWO_PER_OCTAVE ? _mm512_slli_epi32(octaves, 1) : _mm512_srai_epi32(octaves, 1);
  for (uint32_t m : mants) {
    const __mmask16 above = _mm512_cmplt_epu32_mask(mant, _mm512_set1_epi32((int)m));
    count = _mm512_mask_add_epi32(count, above, count, _mm512_set1_epi32(1));
  }
  return _mm512_min_epi32(_mm512_max_epi32(count, _mm512_setzero_si512()), _mm512_set1_epi32(L - 1));
}

inline __m512i mix32x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x2c1b3c6d));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
// ``mix32(index ^ key)`` of the 16 elements from ``index``: the random bits of ``uniform``.
inline __m512i hash16(int64_t index, uint32_t key) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return mix32x16(_mm512_xor_si512(_mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)index), iota),
                                   _mm512_set1_epi32((int)key)));
}
// ``uniform`` of the 16 elements from ``index`` in units of 2^-23: integers below 2^23 (see Gaps16).
inline __m512 uniform_units16(int64_t index, uint32_t key) {
  return _mm512_cvtepi32_ps(_mm512_srli_epi32(hash16(index, key), 9));
}
// ``uniform`` of the 16 elements from ``index``.
inline __m512 uniform16(int64_t index, uint32_t key) {
  return _mm512_mul_ps(uniform_units16(index, key), _mm512_set1_ps(0x1p-23f));
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
inline uint32_t hmaxu8(__m256i x) {
  __m256i t = _mm256_max_epu32(x, _mm256_permute2x128_si256(x, x, 1));
  t = _mm256_max_epu32(t, _mm256_shuffle_epi32(t, 0x4E));
  t = _mm256_max_epu32(t, _mm256_shuffle_epi32(t, 0xB1));
  return (uint32_t)_mm256_cvtsi256_si32(t);
}

// 8 int32 in [0, 255] -> 8 bytes (low half of the result)
inline __m128i bytes8(__m256i x) {
  __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  return _mm_packus_epi16(w, w);
}
// 4 x 8 int32 in [0, 255] -> 32 bytes at ``out``, in order (the packs work per 128-bit lane: a lane permute
// puts the 4-byte groups back in place)
inline void store_bytes32(uint8_t* out, __m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
  _mm256_storeu_si256((__m256i*)out, _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// table[c & 15] from two 8-lane halves
inline __m256 lookup16(const float* table, __m256i c) {
  const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), c);
  const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8), c);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));  // by bit 3 of c
}
// table[c] of an L-value table (a Padded16's: at least 8 floats), 0 <= c < L
template <int L>
inline __m256 lookup(const float* table, __m256i c) {
  if constexpr (L <= 8) return _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), c);
  else return lookup16(table, c);
}

// ``mix32(index ^ key)`` of the 8 elements from ``index``: the random bits of ``uniform``.
inline __m256i hash8(int64_t index, uint32_t key) {
  __m256i x = _mm256_xor_si256(_mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)index), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                               _mm256_set1_epi32((int)key));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x2c1b3c6d));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}
// ``uniform`` of the 8 elements from ``index`` in units of 2^-23.
inline __m256 uniform_units8(int64_t index, uint32_t key) {
  return _mm256_cvtepi32_ps(_mm256_srli_epi32(hash8(index, key), 9));
}
// ``uniform`` of the 8 elements from ``index``.
inline __m256 uniform8(int64_t index, uint32_t key) {
  return _mm256_mul_ps(uniform_units8(index, key), _mm256_set1_ps(0x1p-23f));
}

// How many of the table codes' values or thresholds (``pred``, e.g. _CMP_GE_OQ: y >= t) hold for y: one
// compare per value (count_prefix's result without lookups; L - 1 values of ``t``, ascending).
template <int L, int PRED>
inline __m256i count_holding(__m256 y, const float* t) {
  __m256i count = _mm256_setzero_si256();
  for (int k = 0; k < L - 1; ++k)  // a true compare is -1
    count = _mm256_sub_epi32(count, _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_set1_ps(t[k]), PRED)));
  return count;
}

// m_count_at_most with 8 lanes, for the 4-bit map (the 2-bit one's 3 compares are cheaper): buckets by
// exponent (MBuckets<4, 23>), each a lookup of 16 by sign and bucket and up to two compares.
inline __m256i m4_count_at_most(__m256 y) {
  constexpr auto& B = M4_BUCKETS8;
  const __m256i a = _mm256_and_si256(_mm256_castps_si256(y), _mm256_set1_epi32(0x7fffffff));
  __m256i key = _mm256_sub_epi32(_mm256_srli_epi32(a, 23), _mm256_set1_epi32(B.FIELD_OFFSET));
  key = _mm256_min_epi32(_mm256_max_epi32(key, _mm256_setzero_si256()), _mm256_set1_epi32(7));
  const __m256 negative = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_LT_OQ);  // -0.0 is not
  const auto by_key = [&](const float* table) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(table), key),
                            _mm256_permutevar8x32_ps(_mm256_load_ps(table + 8), key), negative);
  };
  const __m256i base = _mm256_castps_si256(by_key((const float*)B.base));
  const __m256i first = _mm256_castps_si256(_mm256_cmp_ps(y, by_key(B.inside[0]), _CMP_GE_OQ));  // true: -1
  const __m256i second = _mm256_castps_si256(_mm256_cmp_ps(y, by_key(B.inside[1]), _CMP_GE_OQ));
  return _mm256_sub_epi32(_mm256_sub_epi32(base, first), second);
}

// count_above_log with 8 lanes (mantissas are below 2^23: signed compares are unsigned ones)
template <int L, bool TWO_PER_OCTAVE>
inline __m256i count_above_log(__m256 y, int from, std::initializer_list<uint32_t> mants) {
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i k = _mm256_sub_epi32(_mm256_set1_epi32(127), _mm256_srli_epi32(bits, 23));
  const __m256i mant = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffff));
  const __m256i octaves = _mm256_sub_epi32(k, _mm256_set1_epi32(from));
  __m256i count = TWO_PER_OCTAVE ? _mm256_slli_epi32(octaves, 1) : _mm256_srai_epi32(octaves, 1);
  for (uint32_t m : mants) count = _mm256_sub_epi32(count, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), mant));
  return _mm256_min_epi32(_mm256_max_epi32(count, _mm256_setzero_si256()), _mm256_set1_epi32(L - 1));
}
#endif

}  // namespace
