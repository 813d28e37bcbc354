// Fused AdamW step over block-wise quantized moments (see megatrain_lightning/optim/codecs.py for
// the formats). One pass over memory: each chunk of 256 elements is decoded, updated in fp32 and
// re-encoded while it sits in L1. Plain C ABI (loaded with ctypes by quantized.py, which compiles
// this file on first use), OpenMP across chunks, one contiguous range of chunks per thread.
//
// int8 has three code paths, chosen at compile time: AVX-512 (pass1_avx512 / pass2_avx512), AVX2 and
// the portable scalar ``chunk8``; its v codes come from the value's exponent and its mantissa's place among
// one octave's (``v8_values_above``; with AVX-512 by its top 5 bits and one compare, ``v8_above16``). The
// table formats (int4, int3, int2) share ``tchunk``: with AVX-512 or AVX2 a first pass in registers
// (``tstage``: decode by in-register lookups, update, clean, block maxima), then the codes (m by search or
// compares, v from its exponent: ``count_above_log``); loops the compiler vectorizes otherwise. Every floating-point
// operation is mirrored one for one by the pure-torch fallback in quantized.py, so all of them give
// bit-identical results: build with -ffp-contract=off and without -ffast-math (no
// FMA contraction, no reassociation).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace {

constexpr int CHUNK = 256;          // elements per chunk (ALIGN in store/layout.py)
constexpr int HALF = 128;           // int8 v blocks
constexpr int V8_LAST = 255;        // int8 v: the last code
constexpr uint32_t CLAMP_BITS = 0x7f7ffffdu;  // largest magnitude kept: FLT_MAX less 2 ulp
constexpr uint32_t INF_BITS = 0x7f800000u;
constexpr float TWO23 = 8388608.0f;  // 2^23: (q + 2^23) - 2^23 rounds 0 <= q < 2^22 half-to-even
constexpr float M8_TOP = 1.875f;     // largest E4M3 magnitude
constexpr float M8_MIN_NORMAL = 0x1p-14f;
constexpr float V_FLOOR = 0x1p-100f;  // v block maxima never go below this (v never decodes to 0)

// The table formats (codecs.FORMATS 4, 3, 2). First moment: a signed map sorted ascending with +1
// largest (the signed block max); the encoder counts the midpoints below y (sorted index i) and stores
// (i - ZERO) mod L so that code 0 is 0.0. 4 bits: Li et al. 2023's dynamic-exponent map.
constexpr float M4_SORTED[16] = {-0.8875f, -0.6625f, -0.4375f, -0.2125f, -0.0775f, -0.0325f,
                                 -0.0055f, 0.0f,     0.0055f,  0.0325f,  0.0775f,  0.2125f,
                                 0.4375f,  0.6625f,  0.8875f,  1.0f};
constexpr float M2_SORTED[4] = {-0.5f, 0.0f, 0.5f, 1.0f};
// Second moment: logarithmic without zero, code c -> 2^(-c * step), descending from 1; the code is the
// count of thresholds (geometric means of neighbours) above y. 4 bits: half-octave steps; 2 bits: 2 octaves.
constexpr float V4_DECODE[16] = {0x1p+0f, 0x1.6a09e6p-1f, 0x1p-1f, 0x1.6a09e6p-2f, 0x1p-2f, 0x1.6a09e6p-3f,
                                 0x1p-3f, 0x1.6a09e6p-4f, 0x1p-4f, 0x1.6a09e6p-5f, 0x1p-5f, 0x1.6a09e6p-6f,
                                 0x1p-6f, 0x1.6a09e6p-7f, 0x1p-7f, 0x1.6a09e6p-8f};
constexpr float V4_TH[15] = {0x1.ae89fap-1f, 0x1.306fe0p-1f, 0x1.ae89fap-2f, 0x1.306fe0p-2f, 0x1.ae89fap-3f,
                             0x1.306fe0p-3f, 0x1.ae89fap-4f, 0x1.306fe0p-4f, 0x1.ae89fap-5f, 0x1.306fe0p-5f,
                             0x1.ae89fap-6f, 0x1.306fe0p-6f, 0x1.ae89fap-7f, 0x1.306fe0p-7f, 0x1.ae89fap-8f};
constexpr float V2_DECODE[4] = {0x1p+0f, 0x1p-2f, 0x1p-4f, 0x1p-6f};
constexpr float V2_TH[3] = {0x1p-1f, 0x1p-3f, 0x1p-5f};
// int8's v: logarithmic, code c -> 2^(-c/16) (256 codes in 1/16-octave steps), kept as one octave: code
// c's value is V8_OCTAVE[c & 15] * 2^-(c >> 4), an exact shift of the exponent (``v8_shifted``); likewise
// nearest rounding's thresholds, the geometric means of neighbouring values (2^(-(c + 1/2)/16)).
constexpr float V8_OCTAVE[16] = {0x1p+0f, 0x1.ea4afap-1f, 0x1.d5818ep-1f, 0x1.c199bep-1f, 0x1.ae89fap-1f,
                                 0x1.9c4918p-1f, 0x1.8ace54p-1f, 0x1.7a1148p-1f, 0x1.6a09e6p-1f, 0x1.5ab07ep-1f,
                                 0x1.4bfdaep-1f, 0x1.3dea64p-1f, 0x1.306fe0p-1f, 0x1.2387a6p-1f, 0x1.172b84p-1f,
                                 0x1.0b5586p-1f};
constexpr float V8_TH_OCTAVE[16] = {0x1.f50766p-1f, 0x1.dfc974p-1f, 0x1.cb720ep-1f, 0x1.b7f770p-1f,
                                    0x1.a5503cp-1f, 0x1.93737cp-1f, 0x1.82589ap-1f, 0x1.71f75ep-1f,
                                    0x1.6247ecp-1f, 0x1.5342b6p-1f, 0x1.44e086p-1f, 0x1.371a74p-1f,
                                    0x1.29e9e0p-1f, 0x1.1d4874p-1f, 0x1.11301ep-1f, 0x1.059b0ep-1f};

template <int W>
struct MMap;
template <>
struct MMap<4> {
  static constexpr int L = 16, ZERO = 7;
  static constexpr const float* SORTED = M4_SORTED;
};
template <>
struct MMap<2> {
  static constexpr int L = 4, ZERO = 1;
  static constexpr const float* SORTED = M2_SORTED;
};
template <int W>
struct VMap;
// ROOT_SR: stochastic rounding unbiased in v^(1/4) (codecs.Format.v_root_rounding), OCTAVES apart per code
template <>
struct VMap<4> {
  static constexpr int L = 16;
  static constexpr const float* DECODE = V4_DECODE;
  static constexpr const float* TH = V4_TH;
  static constexpr bool ROOT_SR = false;
};
template <>
struct VMap<2> {
  static constexpr int L = 4;
  static constexpr const float* DECODE = V2_DECODE;
  static constexpr const float* TH = V2_TH;
  static constexpr bool ROOT_SR = true;
  static constexpr float OCTAVES = 2.0f;
};

// A table format's decode table and midpoints of its first moment, built once.
template <int W>
struct MTables {
  alignas(64) float decode[MMap<W>::L];
  float mid[MMap<W>::L - 1];
  constexpr MTables() : decode(), mid() {
    constexpr int L = MMap<W>::L;
    for (int c = 0; c < L; ++c) decode[c] = MMap<W>::SORTED[(c + MMap<W>::ZERO) % L];
    for (int k = 0; k < L - 1; ++k) mid[k] = (MMap<W>::SORTED[k] + MMap<W>::SORTED[k + 1]) * 0.5f;
  }
};
constexpr MTables<4> M4{};
constexpr MTables<2> M2{};

inline uint32_t mantissa(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u & 0x7fffffu;
}

// 16-lane copies of the tables for in-register lookups (AVX-512: permutexvar; AVX2: two 8-lane permutes):
// decode tables padded with 0, ascending m midpoints padded with 2 (above every normalized m). (v's codes
// need no table to search: ``count_above_log``.)
template <int N, int L>
struct Padded16 {
  alignas(64) float t[16];
  constexpr Padded16(const float* src, float pad) : t() {
    for (int i = 0; i < 16; ++i) t[i] = i < N ? src[i] : pad;
  }
};
constexpr Padded16<16, 16> M4_DEC16(M4.decode, 0.0f), V4_DEC16(V4_DECODE, 0.0f);
constexpr Padded16<4, 4> M2_DEC16(M2.decode, 0.0f), V2_DEC16(V2_DECODE, 0.0f);
constexpr Padded16<15, 16> M4_MID16(M4.mid, 2.0f);
constexpr Padded16<3, 4> M2_MID16(M2.mid, 2.0f);
// for stochastic rounding: the sorted m maps and their values above the lowest (padded with 2)
constexpr Padded16<16, 16> M4_SORT16(M4_SORTED, 0.0f);
constexpr Padded16<4, 4> M2_SORT16(M2_SORTED, 0.0f);
constexpr Padded16<15, 16> M4_ABOVE16(M4_SORTED + 1, 2.0f);
constexpr Padded16<3, 4> M2_ABOVE16(M2_SORTED + 1, 2.0f);
template <int W>
constexpr const float* m_decode_table() { return W == 4 ? M4_DEC16.t : M2_DEC16.t; }
template <int W>
constexpr const float* v_decode_table() { return W == 4 ? V4_DEC16.t : V2_DEC16.t; }
template <int W>
constexpr const float* m_sorted_table() { return W == 4 ? M4_SORT16.t : M2_SORT16.t; }

#if defined(__AVX512F__)
template <int W>
inline __m512 m_decode16() { return _mm512_load_ps(m_decode_table<W>()); }
template <int W>
inline __m512 v_decode16() { return _mm512_load_ps(v_decode_table<W>()); }
template <int W>
inline __m512 m_mid16() { return _mm512_load_ps(W == 4 ? M4_MID16.t : M2_MID16.t); }
template <int W>
inline __m512 m_sorted16() { return _mm512_load_ps(m_sorted_table<W>()); }
template <int W>
inline __m512 m_above16() { return _mm512_load_ps(W == 4 ? M4_ABOVE16.t : M2_ABOVE16.t); }

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
#endif
template <int W>
constexpr const MTables<W>& mtables() {
  if constexpr (W == 4) return M4;
  else return M2;
}

inline uint32_t fbits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
// fbits for constant tables: the bits of a positive normal float, by arithmetic
constexpr uint32_t fbits_c(float x) {
  int e = 0;
  while (x >= 2.0f) x *= 0.5f, ++e;
  while (x < 1.0f) x *= 2.0f, --e;
  return (uint32_t)(e + 127) << 23 | (uint32_t)((x - 1.0f) * 8388608.0f);
}
inline float bfloat(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// int8's v map: the value (``octave`` = V8_OCTAVE) or threshold (V8_TH_OCTAVE) of code c, in c's octave.
inline float v8_shifted(const float* octave, uint32_t c) { return bfloat(fbits(octave[c & 15u]) - ((c >> 4) << 23)); }
// How many of int8's v values below the largest (codes 1..255) lie above y (finite, >= 0): 16 for each
// octave wholly above y's (y in [2^-k, 2^(1-k)): 16 (k - 1)), and those of y's own octave, whose exponent
// is y's, by their mantissas; at most 255.
inline int v8_values_above(float y) {
  const uint32_t b = fbits(y);
  int count = 16 * (126 - (int)(b >> 23));
  for (int j = 1; j < 16; ++j) count += (b & 0x7fffffu) < (fbits(V8_OCTAVE[j]) & 0x7fffffu);
  return count < 0 ? 0 : (count > V8_LAST ? V8_LAST : count);
}
// int8's v code of a normalized y: the nearest (how many thresholds lie above y: the values above it, and
// the threshold below the last of those if it is above y too) or, with ``sr``, y rounded stochastically
// between its neighbouring values by ``u`` (as ``sr_encode_v``).
inline uint8_t v8_code(float y, bool sr, float u) {
  const int k = v8_values_above(y);
  if (!sr) {
    const int code = k + (v8_shifted(V8_TH_OCTAVE, k) > y);
    return (uint8_t)(code < V8_LAST ? code : V8_LAST);
  }
  const int nx = k < V8_LAST ? k + 1 : V8_LAST;
  const float upper = v8_shifted(V8_OCTAVE, k), lower = v8_shifted(V8_OCTAVE, nx);
  return (uint8_t)((y - lower) > u * (upper - lower) ? k : nx);
}

// fp32 -> bf16, round to nearest even (Tensor.to(torch.bfloat16) for every number and infinity); every
// NaN becomes the quiet NaN 0x7fc0, as the torch fallback (optim/bf16.py) writes it. A loop the compiler
// vectorizes: the compute-dtype shadow of the updated weights, written while they sit in L1.
inline void to_bf16(const float* __restrict src, uint16_t* __restrict dst, int n) {
  for (int i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, 4);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    dst[i] = (u & 0x7fffffffu) > INF_BITS ? (uint16_t)0x7fc0u : (uint16_t)r;
  }
}

struct Hyper {
  float decay, wd, b1, omb1, b2, omb2, ibc2, eps, nstep;
  // stochastic rounding of the table formats' m / v codes, keyed per (stream, step): see uniform()
  bool sr_m, sr_v;
  uint32_t key_m, key_v;
};

// A 32-bit integer hash (rounding._mix32): the counter-based random numbers of stochastic rounding.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x2c1b3c6du;
  return x ^ (x >> 16);
}
// The uniform number in [0, 1) (a multiple of 2^-23) of element ``index`` of a stream (rounding.uniforms):
// a function of (key, index) only, so chunking and threads do not matter.
inline float uniform(int64_t index, uint32_t key) { return (float)(mix32((uint32_t)index ^ key) >> 9) * 0x1p-23f; }

// rounding.quarter_power_threshold for 2-octave codes: (1 + u * (2^(1/2) - 1))^4, in the fallback's fp32
// operations (rounding.quarter_root_step(2.0) is QUARTER_ROOT_STEP).
constexpr float QUARTER_ROOT_STEP = 0x1.a8279ap-2f;  // fp32 sqrt(2) - 1
inline float quarter_power_threshold(float u) {
  float w = u * QUARTER_ROOT_STEP + 1.0f;
  w = w * w;
  return w * w;
}

// int8's v map in vectors (as v8_shifted, v8_values_above, v8_code). Within an octave, how many values or
// thresholds lie above a mantissa comes from its top 5 bits and one compare: a 1/32 slice of mantissas holds
// at most one of them (their spacing is above 1/32 of an octave's span), so ``V8Slices`` counts those above
// each whole slice and the next one (descending) is compared; 0 past the end is never above. The counts
// include the 16 * 126 values or thresholds of the octaves above [2^-127, 2^-126), so that y's own count is
// theirs less 16 per octave of its exponent; lookups read only an index's low 4 or 5 bits, which adding
// 16 * 126 (a multiple of 32) leaves alone.
constexpr int32_t V8_OCTAVES_ABOVE = 16 * 126;
struct V8Slices {
  alignas(64) int32_t values_above[32], thresholds_above[32];  // per slice of the top 5 mantissa bits
  alignas(64) int32_t value_after[16], threshold_after[32];     // the mantissa compared: the next one down
  constexpr V8Slices() : values_above(), thresholds_above(), value_after(), threshold_after() {
    for (int j = 1; j < 16; ++j) value_after[j - 1] = (int32_t)(fbits_c(V8_OCTAVE[j]) & 0x7fffffu);
    for (int j = 0; j < 16; ++j) threshold_after[j] = (int32_t)(fbits_c(V8_TH_OCTAVE[j]) & 0x7fffffu);
    for (int b = 0; b < 32; ++b) {
      const int32_t top = (b + 1) << 18;  // every mantissa of slice b is below this
      values_above[b] = thresholds_above[b] = V8_OCTAVES_ABOVE;
      for (int j = 0; j < 15; ++j) values_above[b] += value_after[j] >= top;
      for (int j = 0; j < 16; ++j) thresholds_above[b] += threshold_after[j] >= top;
    }
  }
};
constexpr V8Slices V8_SLICES{};

#if defined(__AVX512F__)
inline __m512i mix32x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x2c1b3c6d));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
// ``uniform`` of the 16 elements from ``index``.
inline __m512 uniform16(int64_t index, uint32_t key) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i x = _mm512_xor_si512(_mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)index), iota),
                                     _mm512_set1_epi32((int)key));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(mix32x16(x), 9)), _mm512_set1_ps(0x1p-23f));
}

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

// ``uniform`` of the 8 elements from ``index``.
inline __m256 uniform8(int64_t index, uint32_t key) {
  __m256i x = _mm256_xor_si256(_mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)index), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                               _mm256_set1_epi32((int)key));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x2c1b3c6d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 9)), _mm256_set1_ps(0x1p-23f));
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
  const __m512 sorted = m_sorted16<W>(), above = m_above16<W>();
  const __m512 vpre = _mm512_set1_ps(pre), vinv = _mm512_set1_ps(inv);
  const __m512i last = _mm512_set1_epi32(L - 1), one = _mm512_set1_epi32(1);
  const __m512i off = _mm512_set1_epi32(L - MMap<W>::ZERO);
  for (int i = 0; i < nb; i += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_loadu_si512(bits + i)), vpre), vinv);
    const __m512i j = count_prefix<L, _CMP_GE_OQ>(y, above);  // values above the lowest that are <= y
    const __m512i nx = _mm512_min_epi32(_mm512_add_epi32(j, one), last);
    const __m512 lo = _mm512_permutexvar_ps(j, sorted), hi = _mm512_permutexvar_ps(nx, sorted);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(y, lo),
                                            _mm512_mul_ps(uniform16(index + i, key), _mm512_sub_ps(hi, lo)), _CMP_GT_OQ);
    const __m512i idx = _mm512_mask_blend_epi32(up, j, nx);
    const __m512i code = _mm512_and_si512(_mm512_add_epi32(idx, off), last);
    _mm_storeu_si128((__m128i*)(out + i), _mm512_cvtepi32_epi8(code));
  }
  return;
#elif defined(__AVX2__)
  const __m256 vpre = _mm256_set1_ps(pre), vinv = _mm256_set1_ps(inv);
  const __m256i last = _mm256_set1_epi32(L - 1), one = _mm256_set1_epi32(1);
  const __m256i off = _mm256_set1_epi32(L - MMap<W>::ZERO);
  for (int i = 0; i < nb; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_loadu_si256((const __m256i*)(bits + i))), vpre), vinv);
    const __m256i j = count_holding<L, _CMP_GE_OQ>(y, MMap<W>::SORTED + 1);  // values above the lowest <= y
    const __m256i nx = _mm256_min_epi32(_mm256_add_epi32(j, one), last);
    const __m256 lo = lookup<L>(m_sorted_table<W>(), j), hi = lookup<L>(m_sorted_table<W>(), nx);
    const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(y, lo), _mm256_mul_ps(uniform8(index + i, key), _mm256_sub_ps(hi, lo)),
                                    _CMP_GT_OQ);
    const __m256i idx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(j), _mm256_castsi256_ps(nx), up));
    _mm_storel_epi64((__m128i*)(out + i), bytes8(_mm256_and_si256(_mm256_add_epi32(idx, off), last)));
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
  const __m512 table = v_decode16<W>(), vinv = _mm512_set1_ps(inv);
  const __m512i last = _mm512_set1_epi32(L - 1), one = _mm512_set1_epi32(1);
  for (int i = 0; i < nb; i += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_loadu_si512(bits + i)), vinv);
    const __m512i k = v_values_above<W>(y);  // values below the largest that are > y
    const __m512i nx = _mm512_min_epi32(_mm512_add_epi32(k, one), last);
    const __m512 upper = _mm512_permutexvar_ps(k, table), lower = _mm512_permutexvar_ps(nx, table);
    const __mmask16 up = _mm512_cmp_ps_mask(
        _mm512_sub_ps(y, lower), _mm512_mul_ps(uniform16(index + i, key), _mm512_sub_ps(upper, lower)), _CMP_GT_OQ);
    _mm_storeu_si128((__m128i*)(out + i), _mm512_cvtepi32_epi8(_mm512_mask_blend_epi32(up, nx, k)));
  }
  return;
#elif defined(__AVX2__)
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i last = _mm256_set1_epi32(L - 1), one = _mm256_set1_epi32(1);
  for (int i = 0; i < nb; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_loadu_si256((const __m256i*)(bits + i))), vinv);
    const __m256i k = v_values_above<W>(y);  // values below the largest that are > y
    const __m256i nx = _mm256_min_epi32(_mm256_add_epi32(k, one), last);
    const __m256 upper = lookup<L>(v_decode_table<W>(), k), lower = lookup<L>(v_decode_table<W>(), nx);
    const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(y, lower),
                                    _mm256_mul_ps(uniform8(index + i, key), _mm256_sub_ps(upper, lower)), _CMP_GT_OQ);
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
    const float upper = D[k], lower = D[nx];
    out[i] = (uint8_t)((y - lower) > uniform(index + i, key) * (upper - lower) ? k : nx);
  }
}

// IEEE arithmetic for the duration of a kernel call on this thread: round to nearest even, no
// flush-to-zero / denormals-are-zero (torch.set_flush_denormal may have set them).
struct FpEnv {
#if defined(__SSE__)
  unsigned saved;
  FpEnv() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~(0x8040u | 0x6000u)); }
  ~FpEnv() { _mm_setcsr(saved); }
#endif
};

// Power-of-two pre-scale keeping absmax * pre within [2^-64, 2^64], so 1/absmax never overflows.
inline float prescale(float a) { return a < 0x1p-64f ? 0x1p64f : (a > 0x1p64f ? 0x1p-64f : 1.0f); }

// E4M3 magnitude code (0..127) of z in [0, ~1.875], round half to even.
inline int32_t e4m3_code(float z) {
  uint32_t zb = fbits(z);
  int32_t normal = (int32_t)((zb + 0x7FFFFu + ((zb >> 20) & 1u)) >> 20) - 896;
  float q = z * 131072.0f;  // 2^17: subnormal step
  int32_t sub = (int32_t)((q + TWO23) - TWO23);
  int32_t code = z < M8_MIN_NORMAL ? sub : normal;
  return code < 127 ? code : 127;
}

inline float e4m3_decode(uint32_t c) {
  uint32_t mag = c & 127u;
  float normal = bfloat((mag << 20) + (112u << 23));
  float sub = (float)(int32_t)mag * 0x1p-17f;
  float val = mag < 8u ? sub : normal;
  return (c & 128u) ? -val : val;
}

// One int8 chunk of 256 elements, all pointers local to the chunk (the portable path; the vector
// passes below compute the same). ``valid`` < 256 only for a tail that was copied into zero-padded
// buffers: the padding lanes are zeroed before the block maxima. ``base``: the stream index of element 0.
template <bool MAXIMIZE, bool L2>
inline void chunk8(float* __restrict p, const float* __restrict g, uint8_t* __restrict mc,
                   float* __restrict ms, uint8_t* __restrict vc, float* __restrict vs, const Hyper& h,
                   int valid, int64_t base) {
  alignas(64) float mn[CHUNK];
  alignas(64) float vn[CHUNK];
  alignas(64) uint32_t mab[CHUNK];
  alignas(64) uint8_t mcu[CHUNK];
  alignas(64) uint8_t vcu[CHUNK];

  // decode, update (fp32), write the parameter
  for (int half = 0; half < 2; ++half) {
    const float msc = ms[0];
    const float vsc = vs[half];
    const int o = half * HALF;
    for (int i = 0; i < HALF; ++i) {
      float gi = g[o + i];
      if (MAXIMIZE) gi = -gi;
      float pi = p[o + i];
      if (L2) gi = gi + pi * h.wd;
      pi = pi * h.decay;
      float m = e4m3_decode(mc[o + i]) * msc;
      float v = v8_shifted(V8_OCTAVE, vc[o + i]) * vsc;
      m = m * h.b1 + gi * h.omb1;
      v = v * h.b2 + (gi * gi) * h.omb2;
      float den = std::sqrt(v) * h.ibc2 + h.eps;
      pi = pi + h.nstep * (m / den);
      p[o + i] = pi;
      mn[o + i] = m;
      vn[o + i] = v;
    }
  }
  if (valid < CHUNK) {
    for (int i = valid; i < CHUNK; ++i) mn[i] = vn[i] = 0.0f;
  }

  // first moment: clean (NaN -> 0, |x| <= CLAMP), block max, encode
  uint32_t amax = 0;
  for (int i = 0; i < CHUNK; ++i) {
    uint32_t u = fbits(mn[i]);
    uint32_t a = u & 0x7fffffffu;
    a = a > INF_BITS ? 0u : (a > CLAMP_BITS ? CLAMP_BITS : a);
    mab[i] = a | (u & 0x80000000u);
    amax = a > amax ? a : amax;
  }
  const float A = bfloat(amax);
  const float pre = prescale(A);
  const float inv = A == 0.0f ? 0.0f : M8_TOP / (A * pre);
  ms[0] = A / M8_TOP;
  for (int i = 0; i < CHUNK; ++i) {
    uint32_t u = mab[i];
    float z = (bfloat(u & 0x7fffffffu) * pre) * inv;
    int32_t code = e4m3_code(z);
    code |= ((u >> 31) & (code != 0)) << 7;
    mcu[i] = (uint8_t)code;
  }

  // second moment: clean (negative/NaN -> 0, <= CLAMP), log map
  for (int half = 0; half < 2; ++half) {
    const int o = half * HALF;
    uint32_t vmax = fbits(V_FLOOR);
    for (int i = 0; i < HALF; ++i) {
      uint32_t u = fbits(vn[o + i]);
      u = u > INF_BITS ? 0u : (u > CLAMP_BITS ? CLAMP_BITS : u);
      mab[o + i] = u;
      vmax = u > vmax ? u : vmax;
    }
    const float VA = bfloat(vmax);
    const float vinv = 1.0f / VA;
    vs[half] = VA;
    for (int i = 0; i < HALF; ++i) {
      const float u = h.sr_v ? uniform(base + o + i, h.key_v) : 0.0f;
      vcu[o + i] = v8_code(bfloat(mab[o + i]) * vinv, h.sr_v, u);
    }
  }
  std::memcpy(mc, mcu, CHUNK);
  std::memcpy(vc, vcu, CHUNK);
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

// A table-format chunk's new moments after its update, cleaned (NaN -> 0, magnitudes at most CLAMP; v's
// negatives -> 0), as bits: m's magnitude with its sign, v's value; and per block the maxima its scales
// come from: m's largest magnitude and largest positive value, v's largest value (at least V_FLOOR).
struct TStaged {
  alignas(64) uint32_t m[CHUNK];
  alignas(64) uint32_t v[CHUNK];
  uint32_t m_abs[CHUNK / 16], m_pos[CHUNK / 16], v_max[CHUNK / 16];  // per block (blocks of >= 16)
};

#if defined(__AVX512F__)
// Pass 1 of a table-format chunk, 16 elements at a time in registers: decode (in-register table lookups),
// update (fp32), write the parameter, clean the new moments and take their block maxima.
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
  const __m512i zero = _mm512_setzero_si512(), inf = _mm512_set1_epi32((int)INF_BITS);
  const __m512i clamp = _mm512_set1_epi32((int)CLAMP_BITS), abs_mask = _mm512_set1_epi32(0x7fffffff);
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
    const __m512i u = _mm512_castps_si512(m);
    const __m512i a = _mm512_min_epu32(_mm512_mask_mov_epi32(_mm512_and_si512(u, abs_mask),
                                                             _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf), zero),
                                       clamp);
    _mm512_store_si512(st.m + i, _mm512_or_si512(a, _mm512_andnot_si512(abs_mask, u)));
    am = _mm512_max_epu32(am, a);
    pm = _mm512_max_epu32(pm, _mm512_mask_mov_epi32(a, _mm512_cmplt_epi32_mask(u, zero), zero));
    __m512i w = _mm512_castps_si512(v);  // negative values and NaN compare above inf: 0
    w = _mm512_min_epu32(_mm512_mask_mov_epi32(w, _mm512_cmpgt_epu32_mask(w, inf), zero), clamp);
    _mm512_store_si512(st.v + i, w);
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
  const __m256i zero = _mm256_setzero_si256(), inf = _mm256_set1_epi32((int)INF_BITS);
  const __m256i above_inf = _mm256_set1_epi32((int)INF_BITS + 1);
  const __m256i clamp = _mm256_set1_epi32((int)CLAMP_BITS), abs_mask = _mm256_set1_epi32(0x7fffffff);
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
    const __m256i u = _mm256_castps_si256(m);
    __m256i a = _mm256_and_si256(u, abs_mask);  // NaN -> 0, then at most CLAMP
    a = _mm256_min_epu32(_mm256_andnot_si256(_mm256_cmpgt_epi32(a, inf), a), clamp);
    _mm256_store_si256((__m256i*)(st.m + i), _mm256_or_si256(a, _mm256_andnot_si256(abs_mask, u)));
    am = _mm256_max_epu32(am, a);
    pm = _mm256_max_epu32(pm, _mm256_andnot_si256(_mm256_srai_epi32(u, 31), a));  // negatives: 0
    __m256i w = _mm256_castps_si256(v);  // negative values and NaN are above inf as unsigned integers: 0
    w = _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_max_epu32(w, above_inf), w), w);
    w = _mm256_min_epu32(w, clamp);
    _mm256_store_si256((__m256i*)(st.v + i), w);
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
// by selects over codes: no gathers, slow on CPUs with the gather-data-sampling mitigation).
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
  for (int o = 0; o < CHUNK; o += MB) {
    uint32_t amax = 0, pmax = 0;
    for (int i = o; i < o + MB; ++i) {
      uint32_t u = fbits(mn[i]);
      uint32_t a = u & 0x7fffffffu;
      a = a > INF_BITS ? 0u : (a > CLAMP_BITS ? CLAMP_BITS : a);
      st.m[i] = a | (u & 0x80000000u);
      amax = a > amax ? a : amax;
      uint32_t pos = (u >> 31) ? 0u : a;
      pmax = pos > pmax ? pos : pmax;
    }
    st.m_abs[o / MB] = amax;
    st.m_pos[o / MB] = pmax;
  }
  for (int o = 0; o < CHUNK; o += VB) {
    uint32_t vmax = fbits(V_FLOOR);
    for (int i = o; i < o + VB; ++i) {
      uint32_t u = fbits(vn[i]);
      u = u > INF_BITS ? 0u : (u > CLAMP_BITS ? CLAMP_BITS : u);
      st.v[i] = u;
      vmax = u > vmax ? u : vmax;
    }
    st.v_max[o / VB] = vmax;
  }
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

// An int8 chunk between its two passes: the cleaned new moments, their block maxima and where the
// codes and scales go. Pass 2 of chunk c runs after pass 1 of chunk c + 1, so that the latency of the
// block maxima (needed before any code can be computed) overlaps with independent work.
struct Staged {
  alignas(64) float mn[CHUNK];  // cleaned new m
  alignas(64) float vn[CHUNK];  // cleaned new v
  float A, VA[2];               // |m| maximum, v maxima
  int64_t base;                 // the stream index of the chunk's first element (stochastic rounding)
  uint8_t* mc;
  float* ms;
  uint8_t* vc;
  float* vs;
  // the staged values need no cleaning: no NaN, Inf or magnitude above CLAMP (A, VA hold the maxima
  // of the raw bits, which exceed CLAMP_BITS for any of those; v is never negative)
  bool clean() const {
    return fbits(A) <= CLAMP_BITS && fbits(VA[0]) <= CLAMP_BITS && fbits(VA[1]) <= CLAMP_BITS;
  }
};

// The rare slow path of the vector passes: clean the staged moments as ``chunk`` does (NaN -> 0,
// magnitudes clamped, v's sign bit -> 0) and recompute their maxima.
inline void clean_staged(Staged& st) {
  uint32_t amax = 0;
  for (int i = 0; i < CHUNK; ++i) {
    uint32_t u = fbits(st.mn[i]);
    uint32_t a = u & 0x7fffffffu;
    a = a > INF_BITS ? 0u : (a > CLAMP_BITS ? CLAMP_BITS : a);
    st.mn[i] = bfloat(a | (u & 0x80000000u));
    amax = a > amax ? a : amax;
  }
  st.A = bfloat(amax);
  for (int half = 0; half < 2; ++half) {
    uint32_t vmax = fbits(V_FLOOR);
    for (int i = half * HALF; i < (half + 1) * HALF; ++i) {
      uint32_t u = fbits(st.vn[i]);
      u = u > INF_BITS ? 0u : (u > CLAMP_BITS ? CLAMP_BITS : u);
      st.vn[i] = bfloat(u);
      vmax = u > vmax ? u : vmax;
    }
    st.VA[half] = bfloat(vmax);
  }
}

#if defined(__AVX512F__)

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
  const __m512i one = _mm512_set1_epi32(1);
  // first moment: encode
  const float A = st.A;
  const float pre = prescale(A);
  const float inv_s = A == 0.0f ? 0.0f : M8_TOP / (A * pre);
  st.ms[0] = A / M8_TOP;
  const __m512 vpre = _mm512_set1_ps(pre), inv = _mm512_set1_ps(inv_s);
  const __m512i rbias = _mm512_set1_epi32(0x7FFFF - (896 << 20));
  for (int k = 0; k < CHUNK; k += 16) {
    __m512 x = _mm512_load_ps(mn + k);
    __m512 z = _mm512_mul_ps(_mm512_mul_ps(_mm512_abs_ps(x), vpre), inv);
    __m512i zb = _mm512_castps_si512(z);
    __m512i normal = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(zb, rbias), _mm512_and_si512(_mm512_srli_epi32(zb, 20), one)), 20);
    __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(z, _mm512_set1_ps(64.0f))),
                                   _mm512_set1_epi32((int)fbits(64.0f)));
    __mmask16 is_sub = _mm512_cmp_ps_mask(z, _mm512_set1_ps(M8_MIN_NORMAL), _CMP_LT_OQ);
    __m512i code = _mm512_min_epi32(_mm512_mask_blend_epi32(is_sub, normal, sub), _mm512_set1_epi32(127));
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
  const __m256i one = _mm256_set1_epi32(1), zeroi = _mm256_setzero_si256();
  const float A = st.A;
  const float pre = prescale(A);
  const float inv_s = A == 0.0f ? 0.0f : M8_TOP / (A * pre);
  st.ms[0] = A / M8_TOP;
  const __m256 vpre = _mm256_set1_ps(pre), inv = _mm256_set1_ps(inv_s);
  const __m256i rbias = _mm256_set1_epi32(0x7FFFF - (896 << 20));
  const auto m_code = [&](int k) {
    __m256 x = _mm256_load_ps(mn + k);
    __m256 z = _mm256_mul_ps(_mm256_mul_ps(_mm256_andnot_ps(sign, x), vpre), inv);
    __m256i zb = _mm256_castps_si256(z);
    __m256i normal = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(zb, rbias), _mm256_and_si256(_mm256_srli_epi32(zb, 20), one)), 20);
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(z, _mm256_set1_ps(64.0f))),
                                   _mm256_set1_epi32((int)fbits(64.0f)));
    __m256 is_sub = _mm256_cmp_ps(z, _mm256_set1_ps(M8_MIN_NORMAL), _CMP_LT_OQ);
    __m256i code = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub), is_sub));
    code = _mm256_min_epi32(code, _mm256_set1_epi32(127));
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

constexpr int PREFETCH_CHUNKS = 4;  // software prefetch distance, in chunks

// A format's layout: code widths and elements per scale of m and v (codecs.FORMATS).
template <int MW_, int MB_, int VW_, int VB_>
struct Fmt {
  static constexpr int MW = MW_, MB = MB_, VW = VW_, VB = VB_;
  static constexpr int MCB = CHUNK * MW / 8, VCB = CHUNK * VW / 8;  // code bytes per chunk
  static constexpr int MS = CHUNK / MB, VS = CHUNK / VB;            // scales per chunk
};
using Int8 = Fmt<8, 256, 8, 128>;
using Int4 = Fmt<4, 64, 4, 128>;
using Int3 = Fmt<4, 64, 2, 64>;
using Int2 = Fmt<2, 32, 2, 64>;

template <class F, bool MAXIMIZE, bool L2>
inline void one_chunk(float* p, const float* g, uint8_t* mc, float* ms, uint8_t* vc, float* vs, const Hyper& h,
                      int valid, int64_t base) {
  if constexpr (F::MW == 8) chunk8<MAXIMIZE, L2>(p, g, mc, ms, vc, vs, h, valid, base);
  else tchunk<F::MW, F::MB, F::VW, F::VB, MAXIMIZE, L2>(p, g, mc, ms, vc, vs, h, valid, base);
}

template <class F, bool MAXIMIZE, bool L2>
void run(float* p, const float* g, uint8_t* mc, float* ms, uint8_t* vc, float* vs, uint16_t* shadow,
         int64_t n, const Hyper& h, int nthreads, int64_t offset) {
  const int64_t full = n / CHUNK;
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && full > 16)
#endif
  {
    const FpEnv env;
#ifdef _OPENMP
    const int64_t team = omp_get_num_threads(), tid = omp_get_thread_num();
#else
    const int64_t team = 1, tid = 0;
#endif
    const int64_t per = (full + team - 1) / team;  // static split: one contiguous range per thread
    const int64_t c0 = std::min(full, tid * per), c1 = std::min(full, c0 + per);
#if defined(MQ_PASS1)
    Staged staged[2];
#endif
    for (int64_t c = c0; c < c1; ++c) {
#if defined(__SSE__)
      if (c + PREFETCH_CHUNKS < c1) {
        const int64_t d = c + PREFETCH_CHUNKS;
        const char* pp = (const char*)(p + d * CHUNK);
        const char* gg = (const char*)(g + d * CHUNK);
        for (int l = 0; l < CHUNK * 4; l += 64) {
          _mm_prefetch(pp + l, _MM_HINT_T0);
          _mm_prefetch(gg + l, _MM_HINT_T0);
        }
        for (int l = 0; l < F::MCB; l += 64) _mm_prefetch((const char*)(mc + d * F::MCB) + l, _MM_HINT_T0);
        for (int l = 0; l < F::VCB; l += 64) _mm_prefetch((const char*)(vc + d * F::VCB) + l, _MM_HINT_T0);
      }
#endif
      float* pc = p + c * CHUNK;
      const float* gc = g + c * CHUNK;
      uint8_t *mcc = mc + c * F::MCB, *vcc = vc + c * F::VCB;
      float *msc = ms + c * F::MS, *vsc = vs + c * F::VS;
#if defined(MQ_PASS1)
      if constexpr (F::MW == 8) {
        MQ_PASS1<MAXIMIZE, L2, false>(pc, gc, mcc, msc, vcc, vsc, h, CHUNK, offset + c * CHUNK, staged[c & 1]);
        if (shadow) to_bf16(pc, shadow + c * CHUNK, CHUNK);  // pass 1 wrote the chunk's weights
        if (c > c0) MQ_PASS2(staged[(c - 1) & 1], h);
        continue;
      }
#endif
      one_chunk<F, MAXIMIZE, L2>(pc, gc, mcc, msc, vcc, vsc, h, CHUNK, offset + c * CHUNK);
      if (shadow) to_bf16(pc, shadow + c * CHUNK, CHUNK);
    }
#if defined(MQ_PASS1)
    if constexpr (F::MW == 8) {
      if (c1 > c0) MQ_PASS2(staged[(c1 - 1) & 1], h);
    }
#endif
  }
  const int rest = (int)(n - full * CHUNK);
  if (rest == 0) return;
  // tail: zero-padded copies, then write back only the valid elements, code bits and scales
  alignas(64) float tp[CHUNK] = {0}, tg[CHUNK] = {0};
  alignas(64) uint8_t tmc[F::MCB] = {0}, tvc[F::VCB] = {0};
  float tms[F::MS] = {0}, tvs[F::VS] = {0};
  const int64_t c = full;
  const int mbytes = (rest * F::MW + 7) / 8, vbytes = (rest * F::VW + 7) / 8;
  const int nms = (rest + F::MB - 1) / F::MB, nvs = (rest + F::VB - 1) / F::VB;
  uint8_t *mcc = mc + c * F::MCB, *vcc = vc + c * F::VCB;
  std::memcpy(tp, p + c * CHUNK, rest * sizeof(float));
  std::memcpy(tg, g + c * CHUNK, rest * sizeof(float));
  std::memcpy(tmc, mcc, mbytes);
  std::memcpy(tvc, vcc, vbytes);
  std::memcpy(tms, ms + c * F::MS, nms * sizeof(float));
  std::memcpy(tvs, vs + c * F::VS, nvs * sizeof(float));
  const uint8_t last_m = mcc[mbytes - 1], last_v = vcc[vbytes - 1];
  const FpEnv env;
#if defined(MQ_PASS1)
  if constexpr (F::MW == 8) {
    Staged staged;
    MQ_PASS1<MAXIMIZE, L2, true>(tp, tg, tmc, tms, tvc, tvs, h, rest, offset + c * CHUNK, staged);
    MQ_PASS2(staged, h);
  } else {
    one_chunk<F, MAXIMIZE, L2>(tp, tg, tmc, tms, tvc, tvs, h, rest, offset + c * CHUNK);
  }
#else
  one_chunk<F, MAXIMIZE, L2>(tp, tg, tmc, tms, tvc, tvs, h, rest, offset + c * CHUNK);
#endif
  std::memcpy(p + c * CHUNK, tp, rest * sizeof(float));
  if (shadow) to_bf16(tp, shadow + c * CHUNK, rest);
  std::memcpy(mcc, tmc, mbytes);
  std::memcpy(vcc, tvc, vbytes);
  // keep the code bits of the elements after the slice in a shared last byte
  if (const int used = rest * F::MW % 8) {
    const uint8_t keep = (uint8_t)(0xFFu << used);
    mcc[mbytes - 1] = (uint8_t)((last_m & keep) | (tmc[mbytes - 1] & ~keep));
  }
  if (const int used = rest * F::VW % 8) {
    const uint8_t keep = (uint8_t)(0xFFu << used);
    vcc[vbytes - 1] = (uint8_t)((last_v & keep) | (tvc[vbytes - 1] & ~keep));
  }
  std::memcpy(ms + c * F::MS, tms, nms * sizeof(float));
  std::memcpy(vs + c * F::VS, tvs, nvs * sizeof(float));
}

template <class F>
void dispatch_flags(float* p, const float* g, uint8_t* mc, float* ms, uint8_t* vc, float* vs, uint16_t* sh,
                    int64_t n, const Hyper& h, int maximize, int l2, int nthreads, int64_t offset) {
  if (maximize) {
    if (l2) run<F, true, true>(p, g, mc, ms, vc, vs, sh, n, h, nthreads, offset);
    else run<F, true, false>(p, g, mc, ms, vc, vs, sh, n, h, nthreads, offset);
  } else {
    if (l2) run<F, false, true>(p, g, mc, ms, vc, vs, sh, n, h, nthreads, offset);
    else run<F, false, false>(p, g, mc, ms, vc, vs, sh, n, h, nthreads, offset);
  }
}

}  // namespace

extern "C" {

int mq_abi_version() { return 7; }

const char* mq_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

// The constants the kernel was built with, for the loader to compare with codecs.py: the layout of
// formats 8, 4, 3, 2 (m width, m block, v width, v block: 16 values), then m decode tables by code (4
// bits: 16, 2 bits: 4), m midpoints (15, 3), v decode tables (16, 4), v thresholds (15, 3), V_FLOOR,
// int8's v map as one octave: values (16) and thresholds (16), whether formats 4, 3, 2 round v stochastically
// unbiased in v^(1/4) (3) and QUARTER_ROOT_STEP (1): 129 floats.
void mq_tables(float* out) {
  int k = 0;
  for (int f : {Int8::MW, Int8::MB, Int8::VW, Int8::VB, Int4::MW, Int4::MB, Int4::VW, Int4::VB, Int3::MW,
                Int3::MB, Int3::VW, Int3::VB, Int2::MW, Int2::MB, Int2::VW, Int2::VB})
    out[k++] = (float)f;
  for (float x : M4.decode) out[k++] = x;
  for (float x : M2.decode) out[k++] = x;
  for (float x : M4.mid) out[k++] = x;
  for (float x : M2.mid) out[k++] = x;
  for (float x : V4_DECODE) out[k++] = x;
  for (float x : V2_DECODE) out[k++] = x;
  for (float x : V4_TH) out[k++] = x;
  for (float x : V2_TH) out[k++] = x;
  out[k++] = V_FLOOR;
  for (float x : V8_OCTAVE) out[k++] = x;
  for (float x : V8_TH_OCTAVE) out[k++] = x;
  for (bool x : {VMap<Int4::VW>::ROOT_SR, VMap<Int3::VW>::ROOT_SR, VMap<Int2::VW>::ROOT_SR}) out[k++] = x;
  out[k++] = QUARTER_ROOT_STEP;
}

// hyper: decay, wd, beta1, 1-beta1, beta2, 1-beta2, 1/sqrt(bc2), eps, -lr/bc1 (all float32).
// bits: the format (8, 4, 3 or 2). sr: bit 0 rounds m stochastically (not int8's), bit 1 v, with
// the keys key_m / key_v; offset: the index of p[0] in the stream of random numbers. Returns 0 on
// success, -1 for bad arguments. shadow (may be null): n bf16 values, each updated weight rounded to it.
int mq_adamw_step(float* p, const float* g, uint8_t* mc, float* ms, uint8_t* vc, float* vs, uint16_t* shadow,
                  int64_t n, int bits, const float* hyper, int maximize, int l2, int nthreads, int sr,
                  uint32_t key_m, uint32_t key_v, int64_t offset) {
  if (n < 0 || (bits != 8 && bits != 4 && bits != 3 && bits != 2) || (bits == 8 && (sr & 1))) return -1;
  if (n == 0) return 0;
  Hyper h{hyper[0], hyper[1], hyper[2], hyper[3], hyper[4], hyper[5],
          hyper[6], hyper[7], hyper[8], (sr & 1) != 0, (sr & 2) != 0, key_m, key_v};
  if (nthreads < 1) nthreads = 1;
  switch (bits) {
    case 8: dispatch_flags<Int8>(p, g, mc, ms, vc, vs, shadow, n, h, maximize, l2, nthreads, offset); break;
    case 4: dispatch_flags<Int4>(p, g, mc, ms, vc, vs, shadow, n, h, maximize, l2, nthreads, offset); break;
    case 3: dispatch_flags<Int3>(p, g, mc, ms, vc, vs, shadow, n, h, maximize, l2, nthreads, offset); break;
    default: dispatch_flags<Int2>(p, g, mc, ms, vc, vs, shadow, n, h, maximize, l2, nthreads, offset); break;
  }
  return 0;
}

// dst[i] = src[i] rounded to bf16 (to_bf16) for i < n, OpenMP across nthreads: the shadow of weights that
// torch's own Adam updated (fp32 moments). Returns 0, or -1 for bad arguments.
int mq_to_bf16(const float* src, uint16_t* dst, int64_t n, int nthreads) {
  if (n < 0) return -1;
  const int64_t blocks = (n + CHUNK - 1) / CHUNK;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nthreads < 1 ? 1 : nthreads) if (nthreads > 1 && blocks > 64)
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t a = b * CHUNK;
    to_bf16(src + a, dst + a, (int)std::min<int64_t>(CHUNK, n - a));
  }
  return 0;
}

}  // extern "C"
