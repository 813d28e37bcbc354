// The constants, maps and scalar helpers that every path of the kernel shares (quantized_adamw.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>

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
// The signed m maps' counts without a search (``m_count_at_most``): y's bucket is its sign and |y|'s
// "field" (bits >> SHIFT: with 22 its exponent and top mantissa bit, 16 buckets per sign for AVX-512's
// 16-lane lookups; with 23 its exponent, 8 per sign for AVX2's 8-lane ones) less FIELD_OFFSET, clamped
// (bucket 0: every smaller |y|, the last: every larger). Each bucket holds at most INSIDE of the map's
// values above its lowest, so how many of them are <= y is the bucket's ``base`` plus how many of its
// ``inside`` values y is >= (NaN where none: never). Built and checked at compile time.
template <int W, int SHIFT>
struct MBuckets {
  static constexpr int PER_SIGN = SHIFT == 22 ? 16 : 8, INSIDE = SHIFT == 22 ? 1 : 2;
  // bucket 1 starts at 2^-7 (4 bits, 16 per sign), 2^-5 (4 bits, 8 per sign), 1/4 (2 bits)
  static constexpr int FIELD_OFFSET = SHIFT == 22 ? (W == 4 ? 239 : 249) : (W == 4 ? 121 : 124);
  alignas(64) int32_t base[2 * PER_SIGN];  // positive y, then negative y (key + PER_SIGN)
  alignas(64) float inside[INSIDE][2 * PER_SIGN];
  // the smallest |y| of bucket b (b >= 1)
  static constexpr float edge(int b) {
    const int field = b + FIELD_OFFSET, exponent = SHIFT == 22 ? field >> 1 : field;
    float x = SHIFT == 22 && (field & 1) ? 1.5f : 1.0f;
    for (int e = exponent; e < 127; ++e) x *= 0.5f;
    for (int e = exponent; e > 127; --e) x *= 2.0f;
    return x;
  }
  constexpr MBuckets() : base(), inside() {
    for (int key = 0; key < 2 * PER_SIGN; ++key) {
      const int b = key % PER_SIGN;
      const bool positive = key < PER_SIGN;
      const float lo = b == 0 ? 0.0f : edge(b);
      const float hi = b == PER_SIGN - 1 ? std::numeric_limits<float>::infinity() : edge(b + 1);
      int count = 0, found = 0;
      for (int i = 0; i < INSIDE; ++i) inside[i][key] = std::numeric_limits<float>::quiet_NaN();
      for (int k = 1; k < MMap<W>::L; ++k) {
        const float s = MMap<W>::SORTED[k];
        // positive keys: y in [lo, hi); negative keys: y in (-hi, -lo], below 0 (-0.0 is a positive key's)
        const bool below_all = positive ? s <= lo : s <= -hi;
        const bool inside_it = positive ? (s > lo && s < hi) : (s > -hi && (b == 0 ? s < 0.0f : s <= -lo));
        count += below_all;
        if (!inside_it) continue;
        if (found == INSIDE) throw "too many map values in one bucket: choose another FIELD_OFFSET";
        inside[found++][key] = s;
      }
      base[key] = count;
    }
  }
};
constexpr MBuckets<4, 22> M4_BUCKETS16{};
constexpr MBuckets<2, 22> M2_BUCKETS16{};
constexpr MBuckets<4, 23> M4_BUCKETS8{};
template <int W>
constexpr const MBuckets<W, 22>& m_buckets16() {
  if constexpr (W == 4) return M4_BUCKETS16;
  else return M2_BUCKETS16;
}
// Stochastic rounding's two neighbours of y by a sorted index k (m: its map ascends, y between values k
// and k + 1; v: descends, y between k + 1 and k): the lower one and the gap up to the other times 2^-23,
// so that a random integer below 2^23 times the gap is ``uniform`` times the gap, exactly (a power of
// two). Past the last value: m's gap is +inf (y never rounds up past the top), v's 0 (its own value).
template <int N>
struct SrNeighbours16 {
  alignas(64) float lower[16];
  alignas(64) float gap[16];
  constexpr SrNeighbours16(const float* values, bool ascending) : lower(), gap() {
    for (int i = 0; i < 16; ++i) {
      const int k = i < N ? i : N - 1, n = k + 1 < N ? k + 1 : N - 1;
      const float lo = ascending ? values[k] : values[n], hi = ascending ? values[n] : values[k];
      lower[i] = lo;
      gap[i] = k == n ? (ascending ? std::numeric_limits<float>::infinity() : 0.0f) : (hi - lo) * 0x1p-23f;
    }
  }
};
constexpr SrNeighbours16<16> M4_SR(M4_SORTED, true), V4_SR(V4_DECODE, false);
constexpr SrNeighbours16<4> M2_SR(M2_SORTED, true), V2_SR(V2_DECODE, false);
template <int W>
constexpr const SrNeighbours16<W == 4 ? 16 : 4>& m_sr() {
  if constexpr (W == 4) return M4_SR;
  else return M2_SR;
}
template <int W>
constexpr const SrNeighbours16<W == 4 ? 16 : 4>& v_sr() {
  if constexpr (W == 4) return V4_SR;
  else return V2_SR;
}
template <int W>
constexpr const float* m_decode_table() { return W == 4 ? M4_DEC16.t : M2_DEC16.t; }
template <int W>
constexpr const float* v_decode_table() { return W == 4 ? V4_DEC16.t : V2_DEC16.t; }

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

// A new moment's bits made finite, as every path cleans them: a magnitude's NaN -> 0 and at most CLAMP (m
// keeps its sign beside it); v's NaN and negatives (both above inf as unsigned integers) -> 0, at most CLAMP.
inline uint32_t clean_magnitude(uint32_t u) {
  const uint32_t a = u & 0x7fffffffu;
  return a > INF_BITS ? 0u : (a > CLAMP_BITS ? CLAMP_BITS : a);
}
inline uint32_t clean_v(uint32_t u) { return u > INF_BITS ? 0u : (u > CLAMP_BITS ? CLAMP_BITS : u); }

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
  // stochastic rounding of the m / v codes, keyed per (stream, step): see uniform()
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
// Its top 20 bits, ``uniform`` truncated to a multiple of 2^-20 and scaled by 2^20 (rounding.random_bits).
inline uint32_t random_bits20(int64_t index, uint32_t key) { return mix32((uint32_t)index ^ key) >> 12; }

// rounding.quarter_power_threshold for 2-octave codes: (1 + u * (2^(1/2) - 1))^4, in the fallback's fp32
// operations (rounding.quarter_root_step(2.0) is QUARTER_ROOT_STEP).
constexpr float QUARTER_ROOT_STEP = 0x1.a8279ap-2f;  // fp32 sqrt(2) - 1
inline float quarter_power_threshold(float u) {
  float w = u * QUARTER_ROOT_STEP + 1.0f;
  w = w * w;
  return w * w;
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

}  // namespace
