// Fused AdamW step over block-wise quantized moments (see megatrain_lightning/optim/codecs.py for
// the formats). One pass over memory: each chunk of 256 elements is decoded, updated in fp32 and
// re-encoded while it sits in L1. Plain C ABI (loaded with ctypes by quantized.py, which compiles
// this file on first use), OpenMP across chunks, one contiguous range of chunks per thread.
//
// Three code paths, chosen at compile time: AVX-512 (pass1_avx512 / pass2_avx512), AVX2 and the
// portable scalar ``chunk``. Every floating-point operation is mirrored one for one by the
// pure-torch fallback in quantized.py, so all of them give bit-identical results: build with
// -ffp-contract=off and without -ffast-math (no FMA contraction, no reassociation).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace {

constexpr int CHUNK = 256;          // elements per chunk: one int8 m-block, two 128-blocks otherwise
constexpr int HALF = 128;           // v blocks (both widths) and int4 m blocks
constexpr uint32_t CLAMP_BITS = 0x7f7ffffdu;  // largest magnitude kept: FLT_MAX less 2 ulp
constexpr uint32_t INF_BITS = 0x7f800000u;
constexpr float TWO23 = 8388608.0f;  // 2^23: (q + 2^23) - 2^23 rounds 0 <= q < 2^22 half-to-even
constexpr float M8_TOP = 1.875f;     // largest E4M3 magnitude
constexpr float M8_MIN_NORMAL = 0x1p-14f;
constexpr float V_FLOOR = 0x1p-100f;  // v block scales never go below this (v never decodes to 0)

// The int4 first-moment map (Li et al. 2023, dynamic exponent, 16 values), indexed by code; the
// encoder finds the sorted index i (count of midpoints below y) and stores (i + 9) & 15 so that
// code 0 is 0.0.
constexpr float M4_SORTED[16] = {-0.8875f, -0.6625f, -0.4375f, -0.2125f, -0.0775f, -0.0325f,
                                 -0.0055f, 0.0f,     0.0055f,  0.0325f,  0.0775f,  0.2125f,
                                 0.4375f,  0.6625f,  0.8875f,  1.0f};
constexpr float mid(int k) { return (M4_SORTED[k] + M4_SORTED[k + 1]) * 0.5f; }
constexpr float M4_MID[15] = {mid(0), mid(1), mid(2),  mid(3),  mid(4),  mid(5),  mid(6), mid(7),
                              mid(8), mid(9), mid(10), mid(11), mid(12), mid(13), mid(14)};
alignas(64) constexpr float M4_MID_PADDED[16] = {
    M4_MID[0], M4_MID[1], M4_MID[2],  M4_MID[3],  M4_MID[4],  M4_MID[5],  M4_MID[6], M4_MID[7],
    M4_MID[8], M4_MID[9], M4_MID[10], M4_MID[11], M4_MID[12], M4_MID[13], M4_MID[14], 2.0f};
alignas(64) constexpr float M4_DECODE[16] = {
    M4_SORTED[7],  M4_SORTED[8],  M4_SORTED[9],  M4_SORTED[10], M4_SORTED[11], M4_SORTED[12],
    M4_SORTED[13], M4_SORTED[14], M4_SORTED[15], M4_SORTED[0],  M4_SORTED[1],  M4_SORTED[2],
    M4_SORTED[3],  M4_SORTED[4],  M4_SORTED[5],  M4_SORTED[6]};

inline uint32_t fbits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float bfloat(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

struct Hyper {
  float decay, wd, b1, omb1, b2, omb2, ibc2, eps, nstep;
};

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

// One chunk of 256 elements, all pointers local to the chunk. ``valid`` < 256 only for a tail that
// was copied into zero-padded buffers: the padding lanes are zeroed before the block maxima.
template <int BITS, bool MAXIMIZE, bool L2>
inline void chunk(float* __restrict p, const float* __restrict g, uint8_t* __restrict mc,
                  float* __restrict ms, uint8_t* __restrict vc, float* __restrict vs, const Hyper& h,
                  int valid) {
  alignas(64) float mn[CHUNK];
  alignas(64) float vn[CHUNK];
  alignas(64) uint32_t mab[CHUNK];
  alignas(64) uint8_t mcu[CHUNK];
  alignas(64) uint8_t vcu[CHUNK];
  const uint8_t* mcodes;
  const uint8_t* vcodes;
  if (BITS == 4) {
    for (int j = 0; j < CHUNK / 2; ++j) {
      uint8_t a = mc[j], b = vc[j];
      mcu[2 * j] = a & 15u;
      mcu[2 * j + 1] = a >> 4;
      vcu[2 * j] = b & 15u;
      vcu[2 * j + 1] = b >> 4;
    }
    mcodes = mcu;
    vcodes = vcu;
  } else {
    mcodes = mc;
    vcodes = vc;
  }

  // decode, update (fp32), write the parameter
  for (int half = 0; half < 2; ++half) {
    const float msc = BITS == 8 ? ms[0] : ms[half];
    const float vsc = vs[half];
    const int o = half * HALF;
    for (int i = 0; i < HALF; ++i) {
      float gi = g[o + i];
      if (MAXIMIZE) gi = -gi;
      float pi = p[o + i];
      if (L2) gi = gi + pi * h.wd;
      pi = pi * h.decay;
      uint32_t cm = mcodes[o + i];
      float m = (BITS == 8 ? e4m3_decode(cm) : M4_DECODE[cm]) * msc;
      float v = (float)(int32_t)(vcodes[o + i] + 1u) * vsc;
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

  // first moment: clean (NaN -> 0, |x| <= CLAMP), block maxima, encode
  const int MB = BITS == 8 ? CHUNK : HALF;
  for (int blk = 0; blk < CHUNK / MB; ++blk) {
    const int o = blk * MB;
    uint32_t amax = 0, pmax = 0;
    for (int i = 0; i < MB; ++i) {
      uint32_t u = fbits(mn[o + i]);
      uint32_t a = u & 0x7fffffffu;
      a = a > INF_BITS ? 0u : (a > CLAMP_BITS ? CLAMP_BITS : a);
      mab[o + i] = a | (u & 0x80000000u);
      amax = a > amax ? a : amax;
      uint32_t pos = (u >> 31) ? 0u : a;
      pmax = pos > pmax ? pos : pmax;
    }
    float A = bfloat(amax);
    float pre = prescale(A);
    if (BITS == 8) {
      float inv = A == 0.0f ? 0.0f : M8_TOP / (A * pre);
      ms[0] = A / M8_TOP;
      for (int i = 0; i < MB; ++i) {
        uint32_t u = mab[o + i];
        float z = (bfloat(u & 0x7fffffffu) * pre) * inv;
        int32_t code = e4m3_code(z);
        code |= ((u >> 31) & (code != 0)) << 7;
        mcu[o + i] = (uint8_t)code;
      }
    } else {
      float S = pmax >= amax ? A : -A;
      float inv = A == 0.0f ? 0.0f : 1.0f / (S * pre);
      ms[blk] = S;
      for (int i = 0; i < MB; ++i) {
        float y = (bfloat(mab[o + i]) * pre) * inv;
        int32_t idx = 0;
        for (int k = 0; k < 15; ++k) idx += y > M4_MID[k];
        mcu[o + i] = (uint8_t)((idx + 9) & 15);
      }
    }
  }

  // second moment: clean (negative/NaN -> 0, <= CLAMP), linear map without zero
  constexpr int LEVELS = 1 << BITS;
  for (int half = 0; half < 2; ++half) {
    const int o = half * HALF;
    uint32_t vmax = fbits(V_FLOOR);
    for (int i = 0; i < HALF; ++i) {
      uint32_t u = fbits(vn[o + i]);
      u = u > INF_BITS ? 0u : (u > CLAMP_BITS ? CLAMP_BITS : u);
      mab[o + i] = u;
      vmax = u > vmax ? u : vmax;
    }
    float A = bfloat(vmax);
    float inv = (float)LEVELS / A;
    vs[half] = A * (1.0f / (float)LEVELS);
    for (int i = 0; i < HALF; ++i) {
      float q = bfloat(mab[o + i]) * inv;
      int32_t r = (int32_t)((q + TWO23) - TWO23) - 1;
      r = r < 0 ? 0 : (r > LEVELS - 1 ? LEVELS - 1 : r);
      vcu[o + i] = (uint8_t)r;
    }
  }

  if (BITS == 8) {
    std::memcpy(mc, mcu, CHUNK);
    std::memcpy(vc, vcu, CHUNK);
  } else {
    for (int j = 0; j < CHUNK / 2; ++j) {
      mc[j] = (uint8_t)(mcu[2 * j] | (mcu[2 * j + 1] << 4));
      vc[j] = (uint8_t)(vcu[2 * j] | (vcu[2 * j + 1] << 4));
    }
  }
}


// A chunk between its two passes: the cleaned new moments, their block maxima and where the codes
// and scales go. Pass 2 of chunk c runs after pass 1 of chunk c + 1, so that the latency of the
// block maxima (needed before any code can be computed) overlaps with independent work.
struct Staged {
  alignas(64) float mn[CHUNK];  // cleaned new m
  alignas(64) float vn[CHUNK];  // cleaned new v
  float A[2], P[2], VA[2];      // |m| maxima, signed m maxima (int4), v maxima
  uint8_t* mc;
  float* ms;
  uint8_t* vc;
  float* vs;
  // the staged values need no cleaning: no NaN, Inf or magnitude above CLAMP (A, VA hold the maxima
  // of the raw bits, which exceed CLAMP_BITS for any of those; v is never negative)
  bool clean() const {
    return fbits(A[0]) <= CLAMP_BITS && fbits(A[1]) <= CLAMP_BITS && fbits(VA[0]) <= CLAMP_BITS &&
           fbits(VA[1]) <= CLAMP_BITS;
  }
};

// The rare slow path of the vector passes: clean the staged moments as ``chunk`` does (NaN -> 0,
// magnitudes clamped, v's sign bit -> 0) and recompute their maxima.
inline void clean_staged(Staged& st, int mblock) {
  for (int blk = 0; blk < CHUNK / mblock; ++blk) {
    uint32_t amax = 0;
    float pmax = 0.0f;
    for (int i = blk * mblock; i < (blk + 1) * mblock; ++i) {
      uint32_t u = fbits(st.mn[i]);
      uint32_t a = u & 0x7fffffffu;
      a = a > INF_BITS ? 0u : (a > CLAMP_BITS ? CLAMP_BITS : a);
      st.mn[i] = bfloat(a | (u & 0x80000000u));
      amax = a > amax ? a : amax;
      pmax = st.mn[i] > pmax ? st.mn[i] : pmax;
    }
    st.A[blk] = bfloat(amax);
    st.P[blk] = pmax;
  }
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
template <int BITS, bool MAXIMIZE, bool L2, bool TAIL>
inline void pass1_avx512(float* __restrict p, const float* __restrict g, uint8_t* __restrict mc,
                         float* __restrict ms, uint8_t* __restrict vc, float* __restrict vs,
                         const Hyper& h, int valid, Staged& st) {
  float* __restrict mn = st.mn;
  float* __restrict vn = st.vn;
  const __m512 decay = _mm512_set1_ps(h.decay), wd = _mm512_set1_ps(h.wd);
  const __m512 b1 = _mm512_set1_ps(h.b1), omb1 = _mm512_set1_ps(h.omb1);
  const __m512 b2 = _mm512_set1_ps(h.b2), omb2 = _mm512_set1_ps(h.omb2);
  const __m512 ibc2 = _mm512_set1_ps(h.ibc2), eps = _mm512_set1_ps(h.eps);
  const __m512 nstep = _mm512_set1_ps(h.nstep);
  const __m512i sign_mask = _mm512_set1_epi32((int)0x80000000u);
  const __m512 zero = _mm512_setzero_ps();
  const __m512i one = _mm512_set1_epi32(1);

  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512i amaxi[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // |m| maxima, bits (int8: [0])
  __m512 pmax[2] = {zero, zero};                                         // signed m maxima (int4)
  __m512i vmaxi[2] = {_mm512_set1_epi32((int)fbits(V_FLOOR)), _mm512_set1_epi32((int)fbits(V_FLOOR))};

  for (int half = 0; half < 2; ++half) {
    const __m512 msc = _mm512_set1_ps(BITS == 8 ? ms[0] : ms[half]);
    const __m512 vsc = _mm512_set1_ps(vs[half]);
    const int mb = BITS == 8 ? 0 : half;
    for (int k = half * HALF; k < (half + 1) * HALF; k += 16) {
      __m512i cm, cv;
      if (BITS == 8) {
        cm = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(mc + k)));  // sign-extended
        cv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(vc + k)));
      } else {
        // byte j -> qword j; qword | qword << 28 puts its low nibble in bits 0..3 of dword 2j and its
        // high nibble in bits 0..3 of dword 2j + 1 (permutexvar reads only those bits; v masks)
        __m512i bm = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i*)(mc + k / 2)));
        __m512i bv = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i*)(vc + k / 2)));
        cm = _mm512_or_si512(bm, _mm512_slli_epi64(bm, 28));
        cv = _mm512_and_si512(_mm512_or_si512(bv, _mm512_slli_epi64(bv, 28)), _mm512_set1_epi32(15));
      }
      __m512 gi = _mm512_loadu_ps(g + k);
      if (MAXIMIZE) gi = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gi), sign_mask));
      __m512 pi = _mm512_loadu_ps(p + k);
      if (L2) gi = _mm512_add_ps(gi, _mm512_mul_ps(pi, wd));
      pi = _mm512_mul_ps(pi, decay);
      __m512 m;
      if (BITS == 8) {  // sign-extended code << 20: magnitude in bits 20..26, sign in 27..31
        __m512i bits = _mm512_and_si512(_mm512_slli_epi32(cm, 20), _mm512_set1_epi32((int)0x87F00000u));
        m = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p112f));
      } else {
        m = _mm512_permutexvar_ps(cm, _mm512_load_ps(M4_DECODE));
      }
      m = _mm512_mul_ps(m, msc);
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(cv, one)), vsc);
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
      amaxi[mb] = _mm512_max_epu32(amaxi[mb], _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
      if (BITS == 4) pmax[mb] = _mm512_max_ps(m, pmax[mb]);
      _mm512_store_ps(vn + k, v);
      vmaxi[half] = _mm512_max_epu32(vmaxi[half], _mm512_castps_si512(v));
    }
  }

  for (int i = 0; i < 2; ++i) {
    st.A[i] = bfloat(_mm512_reduce_max_epu32(amaxi[i]));
    st.P[i] = _mm512_reduce_max_ps(pmax[i]);
    st.VA[i] = bfloat(_mm512_reduce_max_epu32(vmaxi[i]));
  }
  if (!st.clean()) clean_staged(st, BITS == 8 ? CHUNK : HALF);
  st.mc = mc;
  st.ms = ms;
  st.vc = vc;
  st.vs = vs;
}

// 16 codes < 16 (int32 lanes) -> 8 packed bytes, byte j = c[2j] | c[2j+1] << 4: within each qword,
// x | x >> 28 brings the odd element's code next to the even one's in the low byte.
inline __m128i nibbles16(__m512i x) { return _mm512_cvtepi64_epi8(_mm512_or_si512(x, _mm512_srli_epi64(x, 28))); }

// Pass 2: block scales and codes of a staged chunk.
template <int BITS>
inline void pass2_avx512(Staged& st) {
  const float* __restrict mn = st.mn;
  const float* __restrict vn = st.vn;
  uint8_t* __restrict mc = st.mc;
  uint8_t* __restrict vc = st.vc;
  float* __restrict ms = st.ms;
  float* __restrict vs = st.vs;
  const __m512i sign_mask = _mm512_set1_epi32((int)0x80000000u);
  const __m512i one = _mm512_set1_epi32(1);
  // first moment: encode
  if (BITS == 8) {
    const float A = st.A[0];
    const float pre = prescale(A);
    const float inv_s = A == 0.0f ? 0.0f : M8_TOP / (A * pre);
    ms[0] = A / M8_TOP;
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
  } else {
    const __m512 thv = _mm512_load_ps(M4_MID_PADDED);
    for (int blk = 0; blk < 2; ++blk) {
      const float A = st.A[blk];
      const float P = st.P[blk];
      const float S = P >= A ? A : -A;
      const float pre = prescale(A);
      const float inv_s = A == 0.0f ? 0.0f : 1.0f / (S * pre);
      ms[blk] = S;
      const __m512 vpre = _mm512_set1_ps(pre), inv = _mm512_set1_ps(inv_s);
      for (int k = blk * HALF; k < (blk + 1) * HALF; k += 16) {
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(mn + k), vpre), inv);
        __m512i idx = _mm512_setzero_si512();
        for (int bit = 8; bit >= 1; bit >>= 1) {  // branchless binary search over the midpoints
          __m512i probe = _mm512_add_epi32(idx, _mm512_set1_epi32(bit - 1));
          __mmask16 gt = _mm512_cmp_ps_mask(y, _mm512_permutexvar_ps(probe, thv), _CMP_GT_OQ);
          idx = _mm512_mask_add_epi32(idx, gt, idx, _mm512_set1_epi32(bit));
        }
        __m512i code = _mm512_and_si512(_mm512_add_epi32(idx, _mm512_set1_epi32(9)), _mm512_set1_epi32(15));
        _mm_storel_epi64((__m128i*)(mc + k / 2), nibbles16(code));
      }
    }
  }

  // second moment: encode
  constexpr int LEVELS = 1 << BITS;
  for (int half = 0; half < 2; ++half) {
    const float A = st.VA[half];
    const __m512 inv = _mm512_set1_ps((float)LEVELS / A);
    vs[half] = A * (1.0f / (float)LEVELS);
    for (int k = half * HALF; k < (half + 1) * HALF; k += 16) {
      __m512 q = _mm512_mul_ps(_mm512_load_ps(vn + k), inv);
      __m512i r = _mm512_cvt_roundps_epi32(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm512_sub_epi32(_mm512_max_epi32(r, one), one);  // round(q) - 1, at least 0
      if (BITS == 8) {
        _mm_storeu_si128((__m128i*)(vc + k), _mm512_cvtusepi32_epi8(r));  // saturates 256 -> 255
      } else {
        _mm_storel_epi64((__m128i*)(vc + k / 2), nibbles16(_mm512_min_epi32(r, _mm512_set1_epi32(LEVELS - 1))));
      }
    }
  }
}
#endif  // __AVX512F__

#if defined(__AVX2__) && !defined(__AVX512F__)

// The same two passes with AVX2 (8 lanes), for CPUs without AVX-512; bit-identical results.
inline float hmax8(__m256 x) {
  __m256 t = _mm256_max_ps(x, _mm256_permute2f128_ps(x, x, 1));
  t = _mm256_max_ps(t, _mm256_shuffle_ps(t, t, 0x4E));
  t = _mm256_max_ps(t, _mm256_shuffle_ps(t, t, 0xB1));
  return _mm256_cvtss_f32(t);
}

inline uint32_t hmaxu8(__m256i x) {
  __m256i t = _mm256_max_epu32(x, _mm256_permute2x128_si256(x, x, 1));
  t = _mm256_max_epu32(t, _mm256_shuffle_epi32(t, 0x4E));
  t = _mm256_max_epu32(t, _mm256_shuffle_epi32(t, 0xB1));
  return (uint32_t)_mm256_cvtsi256_si32(t);
}

// 16-entry table lookup: entries 0..7 in lo, 8..15 in hi, selected by bit 3 of the index.
inline __m256 lookup16(__m256 lo, __m256 hi, __m256i idx) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                          _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

// 8 int32 in [0, 255] -> 8 bytes (low half of the result)
inline __m128i bytes8(__m256i x) {
  __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  return _mm_packus_epi16(w, w);
}

// 8 codes < 16 -> 4 packed bytes: byte j = c[2j] | c[2j+1] << 4
inline uint32_t nibbles8(__m256i x) {
  __m128i b = bytes8(x);
  __m128i w = _mm_and_si128(_mm_or_si128(b, _mm_srli_epi16(b, 4)), _mm_set1_epi16(0xFF));
  return (uint32_t)_mm_cvtsi128_si32(_mm_packus_epi16(w, w));
}

template <int BITS, bool MAXIMIZE, bool L2, bool TAIL>
inline void pass1_avx2(float* __restrict p, const float* __restrict g, uint8_t* __restrict mc,
                       float* __restrict ms, uint8_t* __restrict vc, float* __restrict vs, const Hyper& h,
                       int valid, Staged& st) {
  float* __restrict mn = st.mn;
  float* __restrict vn = st.vn;
  const __m256 decay = _mm256_set1_ps(h.decay), wd = _mm256_set1_ps(h.wd);
  const __m256 b1 = _mm256_set1_ps(h.b1), omb1 = _mm256_set1_ps(h.omb1);
  const __m256 b2 = _mm256_set1_ps(h.b2), omb2 = _mm256_set1_ps(h.omb2);
  const __m256 ibc2 = _mm256_set1_ps(h.ibc2), eps = _mm256_set1_ps(h.eps);
  const __m256 nstep = _mm256_set1_ps(h.nstep);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
  const __m256 zero = _mm256_setzero_ps();
  const __m256i one = _mm256_set1_epi32(1);
  const __m256 t_lo = _mm256_load_ps(M4_DECODE), t_hi = _mm256_load_ps(M4_DECODE + 8);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);

  __m256i amaxi[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  __m256 pmax[2] = {zero, zero};
  __m256i vmaxi[2] = {_mm256_set1_epi32((int)fbits(V_FLOOR)), _mm256_set1_epi32((int)fbits(V_FLOOR))};
  for (int half = 0; half < 2; ++half) {
    const __m256 msc = _mm256_set1_ps(BITS == 8 ? ms[0] : ms[half]);
    const __m256 vsc = _mm256_set1_ps(vs[half]);
    const int mb = BITS == 8 ? 0 : half;
    for (int k = half * HALF; k < (half + 1) * HALF; k += 8) {
      __m256i cm, cv;
      if (BITS == 8) {
        cm = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(mc + k)));  // sign-extended
        cv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(vc + k)));
      } else {
        int32_t wm, wv;
        std::memcpy(&wm, mc + k / 2, 4);
        std::memcpy(&wv, vc + k / 2, 4);
        const __m128i lo4 = _mm_set1_epi8(15);
        __m128i bm = _mm_cvtsi32_si128(wm), bv = _mm_cvtsi32_si128(wv);
        bm = _mm_unpacklo_epi8(_mm_and_si128(bm, lo4), _mm_and_si128(_mm_srli_epi16(bm, 4), lo4));
        bv = _mm_unpacklo_epi8(_mm_and_si128(bv, lo4), _mm_and_si128(_mm_srli_epi16(bv, 4), lo4));
        cm = _mm256_cvtepu8_epi32(bm);
        cv = _mm256_cvtepu8_epi32(bv);
      }
      __m256 gi = _mm256_loadu_ps(g + k);
      if (MAXIMIZE) gi = _mm256_xor_ps(gi, sign);
      __m256 pi = _mm256_loadu_ps(p + k);
      if (L2) gi = _mm256_add_ps(gi, _mm256_mul_ps(pi, wd));
      pi = _mm256_mul_ps(pi, decay);
      __m256 m;
      if (BITS == 8) {
        __m256i bits = _mm256_and_si256(_mm256_slli_epi32(cm, 20), _mm256_set1_epi32((int)0x87F00000u));
        m = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p112f));
      } else {
        m = lookup16(t_lo, t_hi, cm);
      }
      m = _mm256_mul_ps(m, msc);
      __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(cv, one)), vsc);
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
      amaxi[mb] = _mm256_max_epu32(amaxi[mb], _mm256_castps_si256(_mm256_andnot_ps(sign, m)));
      if (BITS == 4) pmax[mb] = _mm256_max_ps(m, pmax[mb]);
      _mm256_store_ps(vn + k, v);
      vmaxi[half] = _mm256_max_epu32(vmaxi[half], _mm256_castps_si256(v));
    }
  }
  for (int i = 0; i < 2; ++i) {
    st.A[i] = bfloat(hmaxu8(amaxi[i]));
    st.P[i] = hmax8(pmax[i]);
    st.VA[i] = bfloat(hmaxu8(vmaxi[i]));
  }
  if (!st.clean()) clean_staged(st, BITS == 8 ? CHUNK : HALF);
  st.mc = mc;
  st.ms = ms;
  st.vc = vc;
  st.vs = vs;
}

template <int BITS>
inline void pass2_avx2(Staged& st) {
  const float* __restrict mn = st.mn;
  const float* __restrict vn = st.vn;
  uint8_t* __restrict mc = st.mc;
  uint8_t* __restrict vc = st.vc;
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
  const __m256i one = _mm256_set1_epi32(1), zeroi = _mm256_setzero_si256();
  if (BITS == 8) {
    const float A = st.A[0];
    const float pre = prescale(A);
    const float inv_s = A == 0.0f ? 0.0f : M8_TOP / (A * pre);
    st.ms[0] = A / M8_TOP;
    const __m256 vpre = _mm256_set1_ps(pre), inv = _mm256_set1_ps(inv_s);
    const __m256i rbias = _mm256_set1_epi32(0x7FFFF - (896 << 20));
    for (int k = 0; k < CHUNK; k += 8) {
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
      code = _mm256_or_si256(code, _mm256_and_si256(setsign, _mm256_set1_epi32(128)));
      _mm_storel_epi64((__m128i*)(mc + k), bytes8(code));
    }
  } else {
    // binary search over the 15 midpoints, one table per level: level 1 compares with mid[7], level 2
    // with mid[3] or mid[11], level 3 with mid[1 + 4i] (i = idx / 4), level 4 with mid[2i] (i = idx / 2)
    const __m256 t1 = _mm256_set1_ps(M4_MID[7]), t2lo = _mm256_set1_ps(M4_MID[3]), t2hi = _mm256_set1_ps(M4_MID[11]);
    const __m256 t3 = _mm256_setr_ps(M4_MID[1], M4_MID[5], M4_MID[9], M4_MID[13], 0, 0, 0, 0);
    const __m256 t4 = _mm256_setr_ps(M4_MID[0], M4_MID[2], M4_MID[4], M4_MID[6], M4_MID[8], M4_MID[10],
                                     M4_MID[12], M4_MID[14]);
    for (int blk = 0; blk < 2; ++blk) {
      const float A = st.A[blk];
      const float S = st.P[blk] >= A ? A : -A;
      const float pre = prescale(A);
      const float inv_s = A == 0.0f ? 0.0f : 1.0f / (S * pre);
      st.ms[blk] = S;
      const __m256 vpre = _mm256_set1_ps(pre), inv = _mm256_set1_ps(inv_s);
      for (int k = blk * HALF; k < (blk + 1) * HALF; k += 8) {
        __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps(mn + k), vpre), inv);
        __m256 gt = _mm256_cmp_ps(y, t1, _CMP_GT_OQ);
        __m256i idx = _mm256_and_si256(_mm256_castps_si256(gt), _mm256_set1_epi32(8));
        gt = _mm256_cmp_ps(y, _mm256_blendv_ps(t2lo, t2hi, gt), _CMP_GT_OQ);
        idx = _mm256_add_epi32(idx, _mm256_and_si256(_mm256_castps_si256(gt), _mm256_set1_epi32(4)));
        gt = _mm256_cmp_ps(y, _mm256_permutevar8x32_ps(t3, _mm256_srli_epi32(idx, 2)), _CMP_GT_OQ);
        idx = _mm256_add_epi32(idx, _mm256_and_si256(_mm256_castps_si256(gt), _mm256_set1_epi32(2)));
        gt = _mm256_cmp_ps(y, _mm256_permutevar8x32_ps(t4, _mm256_srli_epi32(idx, 1)), _CMP_GT_OQ);
        idx = _mm256_add_epi32(idx, _mm256_and_si256(_mm256_castps_si256(gt), one));
        uint32_t packed = nibbles8(_mm256_and_si256(_mm256_add_epi32(idx, _mm256_set1_epi32(9)), _mm256_set1_epi32(15)));
        std::memcpy(mc + k / 2, &packed, 4);
      }
    }
  }
  constexpr int LEVELS = 1 << BITS;
  for (int half = 0; half < 2; ++half) {
    const float A = st.VA[half];
    const __m256 inv = _mm256_set1_ps((float)LEVELS / A);
    st.vs[half] = A * (1.0f / (float)LEVELS);
    for (int k = half * HALF; k < (half + 1) * HALF; k += 8) {
      __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(vn + k), inv));  // MXCSR: nearest-even
      r = _mm256_sub_epi32(_mm256_max_epi32(r, one), one);
      if (BITS == 8) {
        _mm_storel_epi64((__m128i*)(vc + k), bytes8(r));  // packus saturates 256 -> 255
      } else {
        uint32_t packed = nibbles8(_mm256_min_epi32(r, _mm256_set1_epi32(LEVELS - 1)));
        std::memcpy(vc + k / 2, &packed, 4);
      }
    }
  }
}
#endif  // __AVX2__ && !__AVX512F__

// The vector path this build uses: AVX-512, AVX2 or none (the scalar ``chunk``).
#if defined(__AVX512F__)
#define MQ_PASS1 pass1_avx512
#define MQ_PASS2 pass2_avx512
#elif defined(__AVX2__)
#define MQ_PASS1 pass1_avx2
#define MQ_PASS2 pass2_avx2
#endif

constexpr int PREFETCH_CHUNKS = 4;  // software prefetch distance, in chunks

template <int BITS, bool MAXIMIZE, bool L2>
void run(float* p, const float* g, uint8_t* mc, float* ms, uint8_t* vc, float* vs, int64_t n,
         const Hyper& h, int nthreads) {
  constexpr int CB = BITS == 8 ? CHUNK : CHUNK / 2;  // code bytes per chunk
  constexpr int MS = BITS == 8 ? 1 : 2;              // m scales per chunk
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
        for (int l = 0; l < CB; l += 64) {
          _mm_prefetch((const char*)(mc + d * CB) + l, _MM_HINT_T0);
          _mm_prefetch((const char*)(vc + d * CB) + l, _MM_HINT_T0);
        }
      }
#endif
#if defined(MQ_PASS1)
      MQ_PASS1<BITS, MAXIMIZE, L2, false>(p + c * CHUNK, g + c * CHUNK, mc + c * CB, ms + c * MS, vc + c * CB,
                                          vs + c * 2, h, CHUNK, staged[c & 1]);
      if (c > c0) MQ_PASS2<BITS>(staged[(c - 1) & 1]);
#else
      chunk<BITS, MAXIMIZE, L2>(p + c * CHUNK, g + c * CHUNK, mc + c * CB, ms + c * MS, vc + c * CB,
                                vs + c * 2, h, CHUNK);
#endif
    }
#if defined(MQ_PASS1)
    if (c1 > c0) MQ_PASS2<BITS>(staged[(c1 - 1) & 1]);
#endif
  }
  const int rest = (int)(n - full * CHUNK);
  if (rest == 0) return;
  // tail: zero-padded copies, then write back only the valid elements / nibbles / scales
  alignas(64) float tp[CHUNK] = {0}, tg[CHUNK] = {0};
  alignas(64) uint8_t tmc[CB] = {0}, tvc[CB] = {0};
  float tms[2] = {0, 0}, tvs[2] = {0, 0};
  const int64_t c = full;
  const int cbytes = BITS == 8 ? rest : (rest + 1) / 2;
  const int nms = BITS == 8 ? 1 : (rest + HALF - 1) / HALF;
  const int nvs = (rest + HALF - 1) / HALF;
  std::memcpy(tp, p + c * CHUNK, rest * sizeof(float));
  std::memcpy(tg, g + c * CHUNK, rest * sizeof(float));
  std::memcpy(tmc, mc + c * CB, cbytes);
  std::memcpy(tvc, vc + c * CB, cbytes);
  std::memcpy(tms, ms + c * MS, nms * sizeof(float));
  std::memcpy(tvs, vs + c * 2, nvs * sizeof(float));
  uint8_t last_m = cbytes ? mc[c * CB + cbytes - 1] : 0, last_v = cbytes ? vc[c * CB + cbytes - 1] : 0;
  const FpEnv env;
#if defined(MQ_PASS1)
  Staged staged;
  MQ_PASS1<BITS, MAXIMIZE, L2, true>(tp, tg, tmc, tms, tvc, tvs, h, rest, staged);
  MQ_PASS2<BITS>(staged);
#else
  chunk<BITS, MAXIMIZE, L2>(tp, tg, tmc, tms, tvc, tvs, h, rest);
#endif
  std::memcpy(p + c * CHUNK, tp, rest * sizeof(float));
  std::memcpy(mc + c * CB, tmc, cbytes);
  std::memcpy(vc + c * CB, tvc, cbytes);
  if (BITS == 4 && (rest & 1)) {  // keep the neighbour's nibble of the last shared byte
    mc[c * CB + cbytes - 1] = (uint8_t)((last_m & 0xF0u) | (tmc[cbytes - 1] & 0x0Fu));
    vc[c * CB + cbytes - 1] = (uint8_t)((last_v & 0xF0u) | (tvc[cbytes - 1] & 0x0Fu));
  }
  std::memcpy(ms + c * MS, tms, nms * sizeof(float));
  std::memcpy(vs + c * 2, tvs, nvs * sizeof(float));
}

template <int BITS>
void dispatch_flags(float* p, const float* g, uint8_t* mc, float* ms, uint8_t* vc, float* vs,
                    int64_t n, const Hyper& h, int maximize, int l2, int nthreads) {
  if (maximize) {
    if (l2) run<BITS, true, true>(p, g, mc, ms, vc, vs, n, h, nthreads);
    else run<BITS, true, false>(p, g, mc, ms, vc, vs, n, h, nthreads);
  } else {
    if (l2) run<BITS, false, true>(p, g, mc, ms, vc, vs, n, h, nthreads);
    else run<BITS, false, false>(p, g, mc, ms, vc, vs, n, h, nthreads);
  }
}

}  // namespace

extern "C" {

int mq_abi_version() { return 1; }

const char* mq_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

// The constants the kernel was built with, for the loader to compare with codecs.py:
// out[0:16] int4 m decode table (by code), out[16:31] int4 midpoints, out[31] V_FLOOR.
void mq_tables(float* out) {
  for (int i = 0; i < 16; ++i) out[i] = M4_DECODE[i];
  for (int i = 0; i < 15; ++i) out[16 + i] = M4_MID[i];
  out[31] = V_FLOOR;
}

// hyper: decay, wd, beta1, 1-beta1, beta2, 1-beta2, 1/sqrt(bc2), eps, -lr/bc1 (all float32).
// Returns 0 on success, -1 for bad arguments.
int mq_adamw_step(float* p, const float* g, uint8_t* mc, float* ms, uint8_t* vc, float* vs, int64_t n,
                  int bits, const float* hyper, int maximize, int l2, int nthreads) {
  if (n < 0 || (bits != 8 && bits != 4)) return -1;
  if (n == 0) return 0;
  Hyper h{hyper[0], hyper[1], hyper[2], hyper[3], hyper[4], hyper[5], hyper[6], hyper[7], hyper[8]};
  if (nthreads < 1) nthreads = 1;
  if (bits == 8) dispatch_flags<8>(p, g, mc, ms, vc, vs, n, h, maximize, l2, nthreads);
  else dispatch_flags<4>(p, g, mc, ms, vc, vs, n, h, maximize, l2, nthreads);
  return 0;
}

}  // extern "C"
