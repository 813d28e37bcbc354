// int8's portable chunk (E4M3 m, 1/16-octave log v) and what its vector passes share with it.
#pragma once

#include "common.h"

namespace {

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

// E4M3 magnitude code of z in [0, 1.875] rounded stochastically (rounding.random_bits): z's bits (a subnormal's
// multiple of 2^-20 of its step) plus ``r``, 20 random bits, truncated to the code, i.e. the code below z or
// the next, the next with probability (z - lower) / (upper - lower) in steps of 2^-20.
inline int32_t e4m3_code_sr(float z, uint32_t r) {
  const int32_t code = z < M8_MIN_NORMAL ? (int32_t)(((uint32_t)(z * 0x1p37f) + r) >> 20)
                                         : (int32_t)((fbits(z) + r) >> 20) - 896;
  return code < 127 ? code : 127;
}

// One int8 chunk of 256 elements, all pointers local to the chunk (the portable path; the vector
// passes of int8_vectors.h compute the same). ``valid`` < 256 only for a tail that was copied into zero-padded
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
    const uint32_t u = fbits(mn[i]), a = clean_magnitude(u);
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
    int32_t code = h.sr_m ? e4m3_code_sr(z, random_bits20(base + i, h.key_m)) : e4m3_code(z);
    code |= ((u >> 31) & (code != 0)) << 7;
    mcu[i] = (uint8_t)code;
  }

  // second moment: clean (negative/NaN -> 0, <= CLAMP), log map
  for (int half = 0; half < 2; ++half) {
    const int o = half * HALF;
    uint32_t vmax = fbits(V_FLOOR);
    for (int i = 0; i < HALF; ++i) {
      const uint32_t u = clean_v(fbits(vn[o + i]));
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
    const uint32_t u = fbits(st.mn[i]), a = clean_magnitude(u);
    st.mn[i] = bfloat(a | (u & 0x80000000u));
    amax = a > amax ? a : amax;
  }
  st.A = bfloat(amax);
  for (int half = 0; half < 2; ++half) {
    uint32_t vmax = fbits(V_FLOOR);
    for (int i = half * HALF; i < (half + 1) * HALF; ++i) {
      const uint32_t u = clean_v(fbits(st.vn[i]));
      st.vn[i] = bfloat(u);
      vmax = u > vmax ? u : vmax;
    }
    st.VA[half] = bfloat(vmax);
  }
}

}  // namespace
