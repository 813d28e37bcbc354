// Fused AdamW step over block-wise quantized moments (see megatrain_lightning/optim/codecs.py for
// the formats). One pass over memory: each chunk of 256 elements is decoded, updated in fp32 and
// re-encoded while it sits in L1. Plain C ABI (loaded with ctypes by kernel.py, which compiles
// it on first use), OpenMP across chunks, one contiguous range of chunks per thread.
//
// int8 has three code paths, chosen at compile time: AVX-512 (pass1_avx512 / pass2_avx512), AVX2 and
// the portable scalar ``chunk8``; its v codes come from the value's exponent and its mantissa's place among
// one octave's (``v8_values_above``; with AVX-512 by its top 5 bits and one compare, ``v8_above16``). The
// table formats (int4, int3, int2) share ``tchunk``: with AVX-512 or AVX2 a first pass in registers
// (``tstage``: decode by in-register lookups, update, block maxima; ``clean_staged`` only where those show
// NaN, Inf or overflow), then the codes (m by search or compares; stochastic m by its bucket,
// ``m_count_at_most``; v from its exponent: ``count_above_log``); loops the compiler vectorizes otherwise.
// Every floating-point operation is mirrored one for one by the pure-torch fallback in quantized.py, so all
// of them give bit-identical results: build with -ffp-contract=off and without -ffast-math (no FMA
// contraction, no reassociation).
//
// The files, one translation unit (kernel.py compiles this one and keys its cache on all of them):
//   common.h         constants, the formats' maps, scalar helpers (bits, hash, bf16 rounding, MXCSR)
//   vectors.h        AVX-512 / AVX2 lookups, searches and random numbers
//   int8.h           int8's portable chunk (``chunk8``) and its staging between the vector passes
//   int8_vectors.h   int8's two vector passes
//   table_codes.h    the table formats' encoders and code packing
//   table_formats.h  the table formats' chunk (``tstage``, ``tchunk``)
//   this file        the loop over chunks (threads, prefetch, the tail) and the C ABI

#include "int8_vectors.h"
#include "table_formats.h"

namespace {

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
// bits: the format (8, 4, 3 or 2). sr: bit 0 rounds m stochastically, bit 1 v, with
// the keys key_m / key_v; offset: the index of p[0] in the stream of random numbers. Returns 0 on
// success, -1 for bad arguments. shadow (may be null): n bf16 values, each updated weight rounded to it.
int mq_adamw_step(float* p, const float* g, uint8_t* mc, float* ms, uint8_t* vc, float* vs, uint16_t* shadow,
                  int64_t n, int bits, const float* hyper, int maximize, int l2, int nthreads, int sr,
                  uint32_t key_m, uint32_t key_v, int64_t offset) {
  if (n < 0 || (bits != 8 && bits != 4 && bits != 3 && bits != 2)) return -1;
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
