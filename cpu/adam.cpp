// CPU Adam/AdamW: one pass over memory, element-wise, three ISA variants picked at run time.
// The moments are fp32, bf16 (stochastically rounded) or 8-bit blockwise (dequantized, updated in fp32
// and requantized block by block in the same pass; zo_kernels/quant8.py documents the format).
//
// Stateless: Python owns every buffer and passes raw addresses; this file never sees a torch type,
// so the module does not depend on torch's C++ ABI. Each element is updated with exactly the same
// sequence of fp32 operations in every variant (explicit FMAs, correctly rounded sqrt and divide,
// no compiler contraction: -ffp-contract=off), so a tiled run is bit-identical to an untiled one
// and the tails of the vector variants go through the vector code, never a scalar loop.
#include "adam.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace zo {
namespace {

// ---------------------------------------------------------------- scalar conversions (exact, RNE)
inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return u2f(sign | f2u(float(m) * 5.9604644775390625e-8f));  // m * 2^-24, exact
  if (e == 31) return u2f(sign | 0x7f800000u | (m << 13));
  return u2f(sign | ((e + 112u) << 23) | (m << 13));
}

// Same bits as vcvtps2ph with round-to-nearest-even (NaN keeps the top of its payload, made quiet).
inline uint16_t float_to_half(float f) {
  uint32_t x = f2u(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u | uint16_t((x >> 13) & 0x3ffu);
  if (x >= 0x47800000u) return sign | 0x7c00u;  // >= 65536: inf (65520..65535 round up below too)
  if (x < 0x38800000u) {                        // below 2^-14: a half subnormal or zero
    const float t = u2f(x) + 0.5f;              // the FPU rounds |f| to a multiple of 2^-24 (RNE)
    return sign | uint16_t(f2u(t) - 0x3f000000u);
  }
  x += 0xc8000fffu + ((x >> 13) & 1u);  // rebias exponent 127 -> 15 and round to nearest even
  return sign | uint16_t(x >> 13);
}

inline float bf16_to_float(uint16_t h) { return u2f(uint32_t(h) << 16); }

// torch's rounding: NaN -> 0x7fc0, everything else round-to-nearest-even on the top 16 bits.
inline uint16_t float_to_bf16(float f) {
  const uint32_t x = f2u(f);
  if (std::isnan(f)) return 0x7fc0u;
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------- stochastic rounding to bf16
// A counter-based hash (xor-shift-multiply, 32 bits): h = mix32(uint32(i) ^ key) for element i, key a hash of
// (seed, step); exp_avg rounds with h's low 16 bits, exp_avg_sq with its high 16 (one hash per element). So a
// resumed run rounds exactly as the uninterrupted one and every ISA agrees.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

uint32_t sr_key(uint64_t seed, int64_t step) {
  uint32_t h = mix32(uint32_t(seed) ^ 0x9e3779b9u);
  h = mix32(h ^ uint32_t(seed >> 32));
  h = mix32(h ^ uint32_t(uint64_t(step)));
  return mix32(h ^ uint32_t(uint64_t(step) >> 32));
}

// Round f to bf16 up (in magnitude) with probability (dropped bits) / 2^16: add 16 random bits r, truncate.
// NaN -> 0x7fc0; inf stays inf; the largest finite values may round to inf.
inline uint16_t float_to_bf16_sr(float f, uint32_t r) {
  if (std::isnan(f)) return 0x7fc0u;
  return uint16_t((f2u(f) + r) >> 16);
}

// The 8-bit exp_avg's 16 random bits for element i: the top half of uint32(i) * kWeyl + key (mod 2^32), key =
// sr_key(seed, step). For one element the key makes them uniform and independent from step to step, which is what
// stochastic rounding needs (unbiased codes); along a block they are a golden-ratio (Weyl) sequence, so a block's
// roundings spread evenly. Not independent across elements: two elements d apart keep the offset d * kWeyl in every
// step (75025 apart: within 0.2 of 65536 of each other, nearly the same bits), which can correlate their rounding
// errors (at most a code each), never bias them. One multiply-add per element (the vector kernels: one add per vector), where mix32's two multiplies made
// the 8-bit pass 39% slower (AVX2, two threads).
constexpr uint32_t kWeyl = 0x9e3779b9u;
inline uint32_t weyl16(int64_t i, uint32_t key) { return (uint32_t(i) * kWeyl + key) >> 16; }

// ---------------------------------------------------------------- 8-bit block scales
// A block whose absmax is below 2^-100 (or zero) is stored as zeros: 127 / absmax must stay finite.
constexpr uint32_t kTinyBits = uint32_t(127 - 100) << 23;

// sqrt(v) past fp32 (v overflowed: |g| > ~5.8e20) is kept as fp32's largest: an inf block scale made every code 0
// and every element of the block NaN (0 * inf) at its next read; the element's v is inf again when read (r * r),
// so its update is 0, as with fp32 moments, and the block's other elements stay finite.
inline float r_max() { return 3.40282347e38f; }

// (stored scale, multiplier to codes) of a block with absmax bits `amax` (|x| as uint32: NaN > inf > finite).
inline void block_scale(uint32_t amax, float levels, float* scale, float* mult) {
  if (amax < kTinyBits) { *scale = 0.0f; *mult = 0.0f; return; }
  *scale = u2f(amax);
  *mult = levels / *scale;
}

// ---------------------------------------------------------------- the per-element arithmetic
// Constants derived once per call (in double, then rounded to fp32 once).
struct Coef {
  float grad_scale, l2, decay, omb1, omb2, b2, inv_bc2_sqrt, eps, neg_step_size;
  float m_cap;  // kState8: the denominator is at least |m| * m_cap (update_cap); capped: m_cap > 0
  bool adamw_decay, l2_decay, capped;
  uint32_t key;  // kStateBF16, kState8: the stochastic rounding's key of this step
};

Coef make_coef(const AdamParams& a) {
  const double b1 = a.beta1, b2 = a.beta2, step = double(a.step);
  const double bc1 = a.bias_correction ? 1.0 - std::pow(b1, step) : 1.0;
  const double bc2 = a.bias_correction ? 1.0 - std::pow(b2, step) : 1.0;
  Coef c{};
  c.grad_scale = float(a.grad_scale);
  c.l2 = float(a.weight_decay);
  c.decay = float(1.0 - double(a.lr) * a.weight_decay);
  c.omb1 = float(1.0 - b1);
  c.omb2 = float(1.0 - b2);
  c.b2 = float(b2);
  c.inv_bc2_sqrt = float(1.0 / std::sqrt(bc2));
  c.eps = float(a.eps);
  c.neg_step_size = float(-double(a.lr) / bc1);
  c.adamw_decay = a.adamw && a.weight_decay != 0.0;
  c.l2_decay = !a.adamw && a.weight_decay != 0.0;
  return c;
}

struct Bufs {
  float* p;
  void *m, *v;  // the state format's elements
  const void* g;
  void* out;
  float *ms, *vs;  // kState8: the scales
  int64_t block;   // kState8
  int64_t index0;  // kStateBF16, kState8: the rounding's index of element 0
};

// One 8-bit block, its pointers at the block's first element.
struct Blk {
  float* p;
  const void* g;
  int8_t* mc;
  uint8_t* vc;
  void* out;
  float *ms, *vs;
  int64_t index0;  // the hash index of the block's first element (exp_avg's stochastic rounding)
};

inline Blk block_at(const Bufs& b, int64_t b0, int gsz, int osz) {
  return {b.p + b0, static_cast<const char*>(b.g) + b0 * gsz, static_cast<int8_t*>(b.m) + b0,
          static_cast<uint8_t*>(b.v) + b0, b.out ? static_cast<char*>(b.out) + b0 * osz : nullptr,
          b.ms + b0 / b.block, b.vs + b0 / b.block, b.index0 + b0};
}

constexpr int dsize(int dt) { return dt == kF32 ? 4 : 2; }

namespace scalar {
#include "adam_math.inc"

struct V {
  using T = float;
  static T set(float x) { return x; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T mul(T a, T b) { return a * b; }
  static T div(T a, T b) { return a / b; }
  static T sqrt(T a) { return std::sqrt(a); }
  static T fma(T a, T b, T c) { return std::fmaf(a, b, c); }
  static T abs(T a) { return std::fabs(a); }
  static T max(T a, T b) { return a > b ? a : b; }  // as maxps: b where either is NaN
};

// ---------------------------------------------------------------- scalar variant
inline float load1(const void* base, int64_t i, int dt) {
  if (dt == kF32) return static_cast<const float*>(base)[i];
  if (dt == kF16) return half_to_float(static_cast<const uint16_t*>(base)[i]);
  return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

inline void store1(void* base, int64_t i, int dt, float x) {
  if (dt == kF32) static_cast<float*>(base)[i] = x;
  else if (dt == kF16) static_cast<uint16_t*>(base)[i] = float_to_half(x);
  else if (dt == kBF16) static_cast<uint16_t*>(base)[i] = float_to_bf16(x);
}

// A bf16 moment: stochastically rounded with 16 random bits r (the stream pass truncates: same bytes, no hash).
template <bool STREAM>
inline void store_moment(void* base, int64_t i, float x, uint32_t r) {
  static_cast<uint16_t*>(base)[i] = STREAM ? uint16_t(f2u(x) >> 16) : float_to_bf16_sr(x, r);
}

template <int GDT, int ODT, int ST, bool STREAM>
void run(const Coef& c, const Bufs& b, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    const float g = load1(b.g, i, GDT);
    float p = b.p[i];
    float m = ST == kStateF32 ? static_cast<float*>(b.m)[i] : bf16_to_float(static_cast<uint16_t*>(b.m)[i]);
    float v = ST == kStateF32 ? static_cast<float*>(b.v)[i] : bf16_to_float(static_cast<uint16_t*>(b.v)[i]);
    if (STREAM) stream_math<V>(c, p, m, v, g);
    else adam_math<V>(c, p, m, v, g);
    b.p[i] = p;
    if (ST == kStateF32) {
      static_cast<float*>(b.m)[i] = m;
      static_cast<float*>(b.v)[i] = v;
    } else {
      const uint32_t h = STREAM ? 0 : mix32(uint32_t(b.index0 + i) ^ c.key);
      store_moment<STREAM>(b.m, i, m, h & 0xffffu);
      store_moment<STREAM>(b.v, i, v, h >> 16);
    }
    if (ODT != kNone) store1(b.out, i, ODT, p);
  }
}

// x (= value * levels / absmax, so |x| <= levels + a few ulps, or NaN) to its code: RNE to int32 as cvtps2dq does
// (NaN -> INT32_MIN, "integer indefinite"), then the low byte as vpmovdb keeps it (NaN -> 0). No clamp needed.
inline uint8_t code_of(float x) {
  const int32_t c = std::isnan(x) ? INT32_MIN : int32_t(std::nearbyint(x));
  return uint8_t(uint32_t(c) & 0xffu);
}

// y (= m * 127 / absmax, so |y| <= 127 + a few ulps, or NaN) to exp_avg's code, rounded stochastically with 16
// random bits r: floor(y + r * 2^-16) in fp32 (the sum rounded to nearest even), clamped to [-127, 127]; NaN -> 0.
// So a code moves up with probability (the fraction of y) and E[code] = y (within 2^-16): a small m decays as
// 0.9^t in expectation, where rounding to nearest holds 0.9 x code 1..4 at its code for ever.
inline int8_t code_sr(float y, uint32_t r) {
  if (std::isnan(y)) return 0;
  return int8_t(std::min(127.0f, std::max(-127.0f, std::floor(y + float(r) * 0x1p-16f))));
}

// Requantize one block from its fp32 values (m in mb, sqrt(v) in rb) and their absmax bits: exp_avg rounded
// stochastically (code_sr with weyl16's bits), sqrt(v) to nearest (stochastic rounding would add a random walk
// of ~9 codes to it at beta2 = 0.999). The stream pass only moves the bytes: codes rounded to nearest with
// multiplier 1.
inline void requant1(const float* mb, const float* rb, int64_t L, uint32_t am, uint32_t ar, const Blk& k,
                     uint32_t key, bool stream) {
  float sm, im, sr, ir;
  block_scale(am, 127.0f, &sm, &im);
  block_scale(ar, 255.0f, &sr, &ir);
  if (stream) { im = 1.0f; ir = 1.0f; sm = *k.ms; sr = *k.vs; }
  *k.ms = sm;
  *k.vs = sr;
  for (int64_t j = 0; j < L; ++j) {
    k.mc[j] = stream ? int8_t(code_of(mb[j])) : code_sr(mb[j] * im, weyl16(k.index0 + j, key));
    k.vc[j] = code_of(rb[j] * ir);
  }
}

// One 8-bit block of L elements: dequantize, update in fp32, requantize.
template <int GDT, int ODT, bool STREAM>
void block8(const Coef& c, const Blk& k, int64_t L) {
  float mb[kMaxBlock], rb[kMaxBlock];
  const float dm = STREAM ? 1.0f : *k.ms / 127.0f, dr = STREAM ? 1.0f : *k.vs / 255.0f;
  uint32_t am = 0, ar = 0;
  for (int64_t j = 0; j < L; ++j) {
    const float g = load1(k.g, j, GDT);
    float p = k.p[j], m = float(k.mc[j]) * dm, r = float(k.vc[j]) * dr, v = r * r;
    if (STREAM) p = p + g;
    else r = std::min(adam_math<V>(c, p, m, v, g), r_max());  // (NaN stays NaN: std::min returns its first then)
    k.p[j] = p;
    if (ODT != kNone) store1(k.out, j, ODT, p);
    mb[j] = m;
    rb[j] = r;
    am = std::max(am, f2u(m) & 0x7fffffffu);
    ar = std::max(ar, f2u(r) & 0x7fffffffu);
  }
  requant1(mb, rb, L, am, ar, k, c.key, STREAM);
}

template <int GDT, int ODT, bool STREAM>
void run8(const Coef& c, const Bufs& b, int64_t lo, int64_t hi) {
  for (int64_t b0 = lo; b0 < hi; b0 += b.block)
    block8<GDT, ODT, STREAM>(c, block_at(b, b0, dsize(GDT), dsize(ODT)), std::min(b.block, hi - b0));
}

// Sum of squares of [lo, hi) in fp32 lanes (the chunks are short: 4096), and an inf/NaN flag.
// With y, the values are also copied to y (same dtype) in the same pass.
template <int DT>
double sumsq(const void* x, void* y, int64_t lo, int64_t hi, int* bad) {
  float acc[16] = {};
  int flag = 0;
  for (int64_t i = lo; i < hi; ++i) {
    float v;
    if (DT == kF32) v = static_cast<const float*>(x)[i];
    else if (DT == kF16) v = half_to_float(static_cast<const uint16_t*>(x)[i]);
    else v = bf16_to_float(static_cast<const uint16_t*>(x)[i]);
    if (y && DT == kF32) static_cast<float*>(y)[i] = v;
    else if (y) static_cast<uint16_t*>(y)[i] = static_cast<const uint16_t*>(x)[i];
    acc[i & 15] += v * v;
    flag |= !(std::fabs(v) <= 3.40282347e38f);
  }
  double s = 0.0;
  for (float a : acc) s += a;
  *bad |= flag;
  return s;
}

// acc[i] = fma(alpha, x[i], acc[i]) over [lo, hi): acc fp32, x of dtype DT (upcast exactly); one rounding.
template <int DT>
void axpy(float* acc, const void* x, float alpha, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    float v;
    if (DT == kF32) v = static_cast<const float*>(x)[i];
    else if (DT == kF16) v = half_to_float(static_cast<const uint16_t*>(x)[i]);
    else v = bf16_to_float(static_cast<const uint16_t*>(x)[i]);
    acc[i] = std::fmaf(alpha, v, acc[i]);
  }
}

}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "adam_math.inc"

struct V {
  using T = __m256;
  static T set(float x) { return _mm256_set1_ps(x); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T sqrt(T a) { return _mm256_sqrt_ps(a); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T abs(T a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
};

// ---------------------------------------------------------------- AVX2 + F16C variant
inline __m256 load8(const void* base, int64_t i, int dt) {
  if (dt == kF32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
  if (dt == kF16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline void store8(void* base, int64_t i, int dt, __m256 x) {
  if (dt == kF32) { _mm256_storeu_ps(static_cast<float*>(base) + i, x); return; }
  __m128i h;
  if (dt == kF16) {
    h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    // pack 8 x u32 (each <= 0xffff) to 8 x u16: packus works per 128-bit lane, then gather lanes.
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    h = _mm256_castsi256_si128(r);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), h);
}

inline __m256i mix8(__m256i x) {  // scalar::mix32 on 8 lanes
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(int(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

inline __m128i narrow16(__m256i r) {  // 8 x u32 (each <= 0xffff) -> 8 x u16
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8));
}

// A moment: fp32, or bf16 stochastically rounded as scalar::float_to_bf16_sr (the stream pass truncates).
template <int ST, bool STREAM>
inline __m256 load_moment(const void* base, int64_t i) {
  return ST == kStateF32 ? _mm256_loadu_ps(static_cast<const float*>(base) + i) : load8(base, i, kBF16);
}

inline __m256i hash8(uint32_t key, int64_t index) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(int(uint32_t(index))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return mix8(_mm256_xor_si256(idx, _mm256_set1_epi32(int(key))));
}

template <int ST, bool STREAM>
inline void store_moment(void* base, int64_t i, __m256 x, __m256i r) {
  if (ST == kStateF32) { _mm256_storeu_ps(static_cast<float*>(base) + i, x); return; }
  __m256i u = _mm256_castps_si256(x);
  if (!STREAM) {
    u = _mm256_add_epi32(u, r);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc00000), nan);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), narrow16(_mm256_srli_epi32(u, 16)));
}

template <int GDT, int ODT, int ST, bool STREAM>
inline void step8(const Coef& c, const Bufs& b, int64_t i) {
  __m256 p = _mm256_loadu_ps(b.p + i), m = load_moment<ST, STREAM>(b.m, i), v = load_moment<ST, STREAM>(b.v, i);
  const __m256 g = load8(b.g, i, GDT);
  if (STREAM) stream_math<V>(c, p, m, v, g);
  else adam_math<V>(c, p, m, v, g);
  _mm256_storeu_ps(b.p + i, p);
  const __m256i h = ST == kStateF32 || STREAM ? _mm256_setzero_si256() : hash8(c.key, b.index0 + i);
  store_moment<ST, STREAM>(b.m, i, m, _mm256_and_si256(h, _mm256_set1_epi32(0xffff)));
  store_moment<ST, STREAM>(b.v, i, v, _mm256_srli_epi32(h, 16));
  if (ODT != kNone) store8(b.out, i, ODT, p);
}

template <int GDT, int ODT, int ST, bool STREAM>
void run(const Coef& coef, const Bufs& bufs, int64_t lo, int64_t hi) {
  const Coef c = coef;  // local copies, as in the AVX-512 variant
  const Bufs b = bufs;
  int64_t i = lo;
  for (; i + 32 <= hi; i += 32) {
    step8<GDT, ODT, ST, STREAM>(c, b, i); step8<GDT, ODT, ST, STREAM>(c, b, i + 8);
    step8<GDT, ODT, ST, STREAM>(c, b, i + 16); step8<GDT, ODT, ST, STREAM>(c, b, i + 24);
  }
  for (; i + 8 <= hi; i += 8) step8<GDT, ODT, ST, STREAM>(c, b, i);
  if (i == hi) return;
  // Tail (< 8): run the same vector code on a zero-padded copy, then copy the live lanes back.
  const int64_t n = hi - i;
  alignas(32) float p[8] = {}, m[8] = {}, v[8] = {}, g[8] = {}, o[8] = {};
  const size_t gsz = dsize(GDT), osz = dsize(ODT), ssz = ST == kStateF32 ? 4 : 2;
  std::memcpy(p, b.p + i, n * 4);
  std::memcpy(m, static_cast<char*>(b.m) + i * ssz, n * ssz);
  std::memcpy(v, static_cast<char*>(b.v) + i * ssz, n * ssz);
  std::memcpy(g, static_cast<const char*>(b.g) + i * gsz, n * gsz);
  const Bufs t{p, m, v, g, ODT == kNone ? nullptr : o, nullptr, nullptr, 0, b.index0 + i};
  step8<GDT, ODT, ST, STREAM>(c, t, 0);
  std::memcpy(b.p + i, p, n * 4);
  std::memcpy(static_cast<char*>(b.m) + i * ssz, m, n * ssz);
  std::memcpy(static_cast<char*>(b.v) + i * ssz, v, n * ssz);
  if (ODT != kNone) std::memcpy(static_cast<char*>(b.out) + i * osz, o, n * osz);
}

// ---------------------------------------------------------------- AVX2 8-bit blocks
inline __m256 load_codes8(const void* base, bool is_signed) {
  const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(base));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// The low byte of each of 8 int32 lanes (as vpmovdb) to 8 bytes.
inline void store_low_bytes8(void* base, __m256i c) {
  const __m256i sh = _mm256_shuffle_epi8(c, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                             -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                             -1, -1));
  const __m128i b = _mm_unpacklo_epi32(_mm256_castsi256_si128(sh), _mm256_extracti128_si256(sh, 1));
  _mm_storel_epi64(static_cast<__m128i*>(base), b);
}

// x * mult -> scalar::code_of as 8 bytes: cvtps2dq, then the low byte of each lane.
inline void store_codes8(void* base, __m256 x, __m256 mult) {
  store_low_bytes8(base, _mm256_cvtps_epi32(_mm256_mul_ps(x, mult)));
}

// x * mult -> scalar::code_sr as 8 bytes with the random bits r: + r * 2^-16, floor, clamp (a NaN passes min and
// max as their second operand, then cvtps2dq makes it INT32_MIN, whose low byte is 0).
inline void store_codes8_sr(void* base, __m256 x, __m256 mult, __m256i r) {
  const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(r), _mm256_set1_ps(0x1p-16f));
  __m256 t = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, mult), u));
  t = _mm256_max_ps(_mm256_set1_ps(-127.0f), _mm256_min_ps(_mm256_set1_ps(127.0f), t));
  store_low_bytes8(base, _mm256_cvtps_epi32(t));
}

inline uint32_t hmax8(__m256i x) {
  alignas(32) uint32_t a[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(a), x);
  uint32_t r = 0;
  for (uint32_t u : a) r = std::max(r, u);
  return r;
}

// One block of L elements, L a multiple of 8 (the caller pads a shorter tail with zeros).
template <int GDT, int ODT, bool STREAM>
void block8(const Coef& c, const Blk& k, int64_t L) {
  alignas(32) float mb[kMaxBlock], rb[kMaxBlock];
  const __m256 dm = _mm256_set1_ps(STREAM ? 1.0f : *k.ms / 127.0f);
  const __m256 dr = _mm256_set1_ps(STREAM ? 1.0f : *k.vs / 255.0f);
  const __m256i abs = _mm256_set1_epi32(0x7fffffff);
  __m256i am = _mm256_setzero_si256(), ar = _mm256_setzero_si256();
  for (int64_t j = 0; j < L; j += 8) {
    __m256 p = _mm256_loadu_ps(k.p + j);
    const __m256 g = load8(k.g, j, GDT);
    __m256 m = _mm256_mul_ps(load_codes8(k.mc + j, true), dm), r = _mm256_mul_ps(load_codes8(k.vc + j, false), dr);
    __m256 v = _mm256_mul_ps(r, r);
    if (STREAM) p = _mm256_add_ps(p, g);
    else r = _mm256_min_ps(_mm256_set1_ps(r_max()), adam_math<V>(c, p, m, v, g));  // (NaN stays NaN)
    _mm256_storeu_ps(k.p + j, p);
    if (ODT != kNone) store8(k.out, j, ODT, p);
    _mm256_store_ps(mb + j, m);
    _mm256_store_ps(rb + j, r);
    am = _mm256_max_epu32(am, _mm256_and_si256(_mm256_castps_si256(m), abs));
    ar = _mm256_max_epu32(ar, _mm256_and_si256(_mm256_castps_si256(r), abs));
  }
  float sm, im, sr, ir;
  block_scale(hmax8(am), 127.0f, &sm, &im);
  block_scale(hmax8(ar), 255.0f, &sr, &ir);
  if (STREAM) { im = 1.0f; ir = 1.0f; sm = *k.ms; sr = *k.vs; }
  *k.ms = sm;
  *k.vs = sr;
  const __m256 mi = _mm256_set1_ps(im), ri = _mm256_set1_ps(ir);
  // weyl16 on 8 lanes: uint32(index) * kWeyl + key, advanced by 8 * kWeyl a vector
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i w = _mm256_add_epi32(_mm256_set1_epi32(int(uint32_t(k.index0) * kWeyl + c.key)),
                               _mm256_mullo_epi32(lanes, _mm256_set1_epi32(int(kWeyl))));
  const __m256i dw = _mm256_set1_epi32(int(8u * kWeyl));
  for (int64_t j = 0; j < L; j += 8, w = _mm256_add_epi32(w, dw)) {
    if (STREAM) store_codes8(k.mc + j, _mm256_load_ps(mb + j), mi);
    else store_codes8_sr(k.mc + j, _mm256_load_ps(mb + j), mi, _mm256_srli_epi32(w, 16));
    store_codes8(k.vc + j, _mm256_load_ps(rb + j), ri);
  }
}

template <int GDT, int ODT, bool STREAM>
void run8(const Coef& coef, const Bufs& bufs, int64_t lo, int64_t hi) {
  const Coef c = coef;
  const Bufs b = bufs;
  const int gsz = dsize(GDT), osz = dsize(ODT);
  for (int64_t b0 = lo; b0 < hi; b0 += b.block) {
    const int64_t L = std::min(b.block, hi - b0);
    const Blk k = block_at(b, b0, gsz, osz);
    if (L % 8 == 0) { block8<GDT, ODT, STREAM>(c, k, L); continue; }
    // The last block of a tensor, not a multiple of 8 long: the same code on a zero-padded copy (zeros stay
    // zero and do not change the absmax).
    const int64_t L8 = (L + 7) / 8 * 8;
    alignas(32) float p[kMaxBlock] = {}, g[kMaxBlock] = {}, o[kMaxBlock] = {};
    alignas(32) int8_t mc[kMaxBlock] = {};
    alignas(32) uint8_t vc[kMaxBlock] = {};
    std::memcpy(p, k.p, L * 4);
    std::memcpy(g, k.g, L * gsz);
    std::memcpy(mc, k.mc, L);
    std::memcpy(vc, k.vc, L);
    block8<GDT, ODT, STREAM>(c, Blk{p, g, mc, vc, ODT == kNone ? nullptr : o, k.ms, k.vs, k.index0}, L8);
    std::memcpy(k.p, p, L * 4);
    std::memcpy(k.mc, mc, L);
    std::memcpy(k.vc, vc, L);
    if (ODT != kNone) std::memcpy(k.out, o, L * osz);
  }
}

template <int DT>
double sumsq(const void* x, void* y, int64_t lo, int64_t hi, int* bad) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m256 fmax = _mm256_set1_ps(3.40282347e38f), sign = _mm256_set1_ps(-0.0f);
  __m256 flag = _mm256_setzero_ps();
  int64_t i = lo;
  for (; i + 32 <= hi; i += 32) {
    for (int u = 0; u < 4; ++u) {
      const __m256 v = load8(x, i + 8 * u, DT);
      if (y && DT == kF32) store8(y, i + 8 * u, DT, v);
      else if (y)  // the bits as they are (through fp32 a NaN's payload and sign were not kept)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(y) + i + 8 * u),
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i + 8 * u)));
      acc[u] = _mm256_fmadd_ps(v, v, acc[u]);
      flag = _mm256_or_ps(flag, _mm256_cmp_ps(_mm256_andnot_ps(sign, v), fmax, _CMP_NLE_UQ));
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  double s = 0.0;
  for (float a : lanes) s += a;
  *bad |= _mm256_movemask_ps(flag) != 0;
  return s + scalar::sumsq<DT>(x, y, i, hi, bad);
}

template <int DT>
void axpy(float* acc, const void* x, float alpha, int64_t lo, int64_t hi) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = lo;
  for (; i + 32 <= hi; i += 32) {
    for (int u = 0; u < 4; ++u) {
      float* d = acc + i + 8 * u;
      _mm256_storeu_ps(d, _mm256_fmadd_ps(a, load8(x, i + 8 * u, DT), _mm256_loadu_ps(d)));
    }
  }
  scalar::axpy<DT>(acc, x, alpha, i, hi);
}

}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
#include "adam_math.inc"

struct V {
  using T = __m512;
  static T set(float x) { return _mm512_set1_ps(x); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T sqrt(T a) { return _mm512_sqrt_ps(a); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T abs(T a) { return _mm512_abs_ps(a); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
};

// ---------------------------------------------------------------- AVX-512 variant (unroll 8)
// Masked loads and stores only where a vector is partial: a full mask takes the plain instruction. AMD Zen 4 runs
// masked byte / word stores far slower than plain ones (measured on its EPYC: the 8-bit update at 0.62 ns/param on two
// threads with masked 16-byte code loads and stores, 0.23 with plain ones); with a constant full mask the test folds.
inline __m512 ld_ps(__mmask16 k, const float* a) {
  return k == 0xffff ? _mm512_loadu_ps(a) : _mm512_maskz_loadu_ps(k, a);
}
inline void st_ps(float* a, __mmask16 k, __m512 x) {
  if (k == 0xffff) _mm512_storeu_ps(a, x);
  else _mm512_mask_storeu_ps(a, k, x);
}
inline __m256i ld_epi16(__mmask16 k, const uint16_t* a) {
  return k == 0xffff ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)) : _mm256_maskz_loadu_epi16(k, a);
}
inline void st_epi16(uint16_t* a, __mmask16 k, __m256i x) {
  if (k == 0xffff) _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), x);
  else _mm256_mask_storeu_epi16(a, k, x);
}
inline __m128i ld_epi8(__mmask16 k, const void* a) {
  return k == 0xffff ? _mm_loadu_si128(static_cast<const __m128i*>(a)) : _mm_maskz_loadu_epi8(k, a);
}
inline void st_epi8(void* a, __mmask16 k, __m128i x) {
  if (k == 0xffff) _mm_storeu_si128(static_cast<__m128i*>(a), x);
  else _mm_mask_storeu_epi8(a, k, x);
}

inline __m512 load16(const void* base, int64_t i, int dt, __mmask16 k) {
  if (dt == kF32) return ld_ps(k, static_cast<const float*>(base) + i);
  const __m256i h = ld_epi16(k, static_cast<const uint16_t*>(base) + i);
  if (dt == kF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// NT: a full vector at an aligned address (16 x the element size), stored non-temporally (the caller fences).
template <bool NT = false>
inline void store16(void* base, int64_t i, int dt, __m512 x, __mmask16 k) {
  if (dt == kF32) {
    if (NT) _mm512_stream_ps(static_cast<float*>(base) + i, x);
    else st_ps(static_cast<float*>(base) + i, k, x);
    return;
  }
  __m256i h;
  if (dt == kF16) {
    h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    h = _mm512_cvtepi32_epi16(r);
  }
  if (NT) _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i), h);
  else st_epi16(static_cast<uint16_t*>(base) + i, k, h);
}

// param_out is write-only: on a long range whose vectors are aligned the kernels store it non-temporally (no read
// for ownership: 2 bytes per element less traffic with a 16-bit param_out), then fence once. A short range keeps
// cached stores, so a tensor stepped while it sits in L2 stays there. Measured (50M, one thread, bf16 out, under
// load): the fp32-state update 6% faster, bf16 5-8%, 8-bit 2-5% (with a software prefetch since taken out, below),
// the ceilings 10-14%. Two threads, quiet: fp32 9% faster, bf16 6%, 8-bit unchanged.
// Not where param_out is the gradient's own memory: its lines were just read into the cache, and a non-temporal
// store to a cached line evicts it. Measured (16M, one thread, bf16 grads, the 2-core machine loaded: noisy): 8-bit
// 1.84 ns/param with a separate out, 2.46 over the gradient with NT stores; without them 0.93 and 0.94.
constexpr int64_t kNtMinBytes = 1 << 20;
inline bool nt_out(const void* out, const void* g, int64_t lo, int64_t hi, int dt) {
  return out != nullptr && out != g && (hi - lo) * dsize(dt) >= kNtMinBytes &&
         (reinterpret_cast<uintptr_t>(out) + uintptr_t(lo) * dsize(dt)) % (16 * dsize(dt)) == 0;
}

inline __m512i mix16(__m512i x) {  // scalar::mix32 on 16 lanes
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

template <int ST>
inline __m512 load_moment(const void* base, int64_t i, __mmask16 k) {
  return ST == kStateF32 ? ld_ps(k, static_cast<const float*>(base) + i) : load16(base, i, kBF16, k);
}

// A moment: fp32, or bf16 stochastically rounded as scalar::float_to_bf16_sr (the stream pass truncates).
inline __m512i hash16(uint32_t key, int64_t index) {
  const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(int(uint32_t(index))),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return mix16(_mm512_xor_si512(idx, _mm512_set1_epi32(int(key))));
}

template <int ST, bool STREAM>
inline void store_moment(void* base, int64_t i, __m512 x, __mmask16 k, __m512i r) {
  if (ST == kStateF32) { st_ps(static_cast<float*>(base) + i, k, x); return; }
  __m512i u = _mm512_castps_si512(x);
  if (!STREAM) {
    u = _mm512_add_epi32(u, r);
    u = _mm512_mask_mov_epi32(u, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  }
  st_epi16(static_cast<uint16_t*>(base) + i, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

template <int GDT, int ODT, int ST, bool STREAM, bool NT = false>
inline void step16(const Coef& c, const Bufs& b, int64_t i, __mmask16 k) {
  __m512 p = ld_ps(k, b.p + i), m = load_moment<ST>(b.m, i, k), v = load_moment<ST>(b.v, i, k);
  const __m512 g = load16(b.g, i, GDT, k);
  if (STREAM) stream_math<V>(c, p, m, v, g);
  else adam_math<V>(c, p, m, v, g);
  st_ps(b.p + i, k, p);
  const __m512i h = ST == kStateF32 || STREAM ? _mm512_setzero_si512() : hash16(c.key, b.index0 + i);
  store_moment<ST, STREAM>(b.m, i, m, k, _mm512_and_si512(h, _mm512_set1_epi32(0xffff)));
  store_moment<ST, STREAM>(b.v, i, v, k, _mm512_srli_epi32(h, 16));
  if (ODT != kNone) store16<NT>(b.out, i, ODT, p, k);
}

template <int GDT, int ODT, int ST, bool STREAM>
void run(const Coef& coef, const Bufs& bufs, int64_t lo, int64_t hi) {
  constexpr int kUnroll = 8;  // the paper's auto-tuned unroll width; 8 x 16 lanes per iteration
  // Local copies: the compiler can then prove the stores never alias them and keeps the broadcast
  // constants and base pointers in registers instead of reloading them after every store.
  const Coef c = coef;
  const Bufs b = bufs;
  int64_t i = lo;
  if (ODT != kNone && nt_out(b.out, b.g, lo, hi, ODT)) {
    for (; i + 16 * kUnroll <= hi; i += 16 * kUnroll) {
#pragma GCC unroll 8
      for (int u = 0; u < kUnroll; ++u) step16<GDT, ODT, ST, STREAM, true>(c, b, i + 16 * u, 0xffff);
    }
    _mm_sfence();
  }
  for (; i + 16 * kUnroll <= hi; i += 16 * kUnroll) {
#pragma GCC unroll 8
    for (int u = 0; u < kUnroll; ++u) step16<GDT, ODT, ST, STREAM>(c, b, i + 16 * u, 0xffff);
  }
  for (; i < hi; i += 16) {
    const int64_t n = std::min<int64_t>(16, hi - i);
    step16<GDT, ODT, ST, STREAM>(c, b, i, __mmask16((1u << n) - 1u));
  }
}

// ---------------------------------------------------------------- AVX-512 8-bit blocks
inline __m512 load_codes16(const void* base, bool is_signed, __mmask16 k) {
  const __m128i b = ld_epi8(k, base);
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

// x * mult -> scalar::code_of as 16 bytes (cvtps2dq, vpmovdb).
inline void store_codes16(void* base, __m512 x, __m512 mult, __mmask16 k) {
  st_epi8(base, k, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x, mult))));
}

// x * mult -> scalar::code_sr as 16 bytes with the random bits r: + r * 2^-16, floor, clamp (a NaN passes min and
// max as their second operand, then cvtps2dq makes it INT32_MIN, whose low byte is 0).
inline void store_codes16_sr(void* base, __m512 x, __m512 mult, __m512i r, __mmask16 k) {
  const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(r), _mm512_set1_ps(0x1p-16f));
  __m512 t = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, mult), u), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  t = _mm512_max_ps(_mm512_set1_ps(-127.0f), _mm512_min_ps(_mm512_set1_ps(127.0f), t));
  st_epi8(base, k, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(t)));
}

// One block of L <= 256 elements (masked lanes read as zeros: they stay zero and do not change the absmax).
// FIXED: L known at compile time (a full block of 256: the loops unroll).
// c and k by value: local, so the compiler keeps them in registers across the stores. NT: param_out aligned.
template <int GDT, int ODT, bool STREAM, int FIXED, bool NT>
void block16(const Coef c, const Blk k, int64_t len) {
  const int64_t L = FIXED ? FIXED : len;
  alignas(64) float mb[kMaxBlock], rb[kMaxBlock];
  const __m512 dm = _mm512_set1_ps(STREAM ? 1.0f : *k.ms / 127.0f);
  const __m512 dr = _mm512_set1_ps(STREAM ? 1.0f : *k.vs / 255.0f);
  const __m512i abs = _mm512_set1_epi32(0x7fffffff);
  __m512i am = _mm512_setzero_si512(), ar = _mm512_setzero_si512();
  for (int64_t j = 0; j < L; j += 16) {
    const __mmask16 km = L - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (L - j)) - 1u);
    __m512 p = ld_ps(km, k.p + j);
    const __m512 g = load16(k.g, j, GDT, km);
    __m512 m = _mm512_mul_ps(load_codes16(k.mc + j, true, km), dm);
    __m512 r = _mm512_mul_ps(load_codes16(k.vc + j, false, km), dr);
    __m512 v = _mm512_mul_ps(r, r);
    if (STREAM) p = _mm512_add_ps(p, g);
    else r = _mm512_min_ps(_mm512_set1_ps(r_max()), adam_math<V>(c, p, m, v, g));  // (NaN stays NaN)
    st_ps(k.p + j, km, p);
    if (ODT != kNone) store16<NT>(k.out, j, ODT, p, km);  // NT only with FIXED
    _mm512_store_ps(mb + j, m);
    _mm512_store_ps(rb + j, r);
    am = _mm512_max_epu32(am, _mm512_and_si512(_mm512_castps_si512(m), abs));
    ar = _mm512_max_epu32(ar, _mm512_and_si512(_mm512_castps_si512(r), abs));
  }
  float sm, im, sr, ir;
  block_scale(_mm512_reduce_max_epu32(am), 127.0f, &sm, &im);
  block_scale(_mm512_reduce_max_epu32(ar), 255.0f, &sr, &ir);
  if (STREAM) { im = 1.0f; ir = 1.0f; sm = *k.ms; sr = *k.vs; }
  *k.ms = sm;
  *k.vs = sr;
  const __m512 mi = _mm512_set1_ps(im), ri = _mm512_set1_ps(ir);
  // weyl16 on 16 lanes: uint32(index) * kWeyl + key, advanced by 16 * kWeyl a vector
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i w = _mm512_add_epi32(_mm512_set1_epi32(int(uint32_t(k.index0) * kWeyl + c.key)),
                               _mm512_mullo_epi32(lanes, _mm512_set1_epi32(int(kWeyl))));
  const __m512i dw = _mm512_set1_epi32(int(16u * kWeyl));
  for (int64_t j = 0; j < L; j += 16, w = _mm512_add_epi32(w, dw)) {
    const __mmask16 km = L - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (L - j)) - 1u);
    if (STREAM) store_codes16(k.mc + j, _mm512_load_ps(mb + j), mi, km);
    else store_codes16_sr(k.mc + j, _mm512_load_ps(mb + j), mi, _mm512_srli_epi32(w, 16), km);
    store_codes16(k.vc + j, _mm512_load_ps(rb + j), ri, km);
  }
}

// No software prefetch: one block (256) ahead was 4-7% faster on one thread at 50M, but 2-3% slower on two threads
// (the benchmark's setting, bench/test_bench_cpu_adam.py -k formats_ratios, quiet machine), so it was taken out.
template <int GDT, int ODT, bool STREAM>
void run8(const Coef& coef, const Bufs& bufs, int64_t lo, int64_t hi) {
  const Coef c = coef;
  const Bufs b = bufs;
  // Blocks are whole vectors, so one alignment check holds for every block of the range.
  const bool nt = ODT != kNone && nt_out(b.out, b.g, lo, hi, ODT);
  for (int64_t b0 = lo; b0 < hi; b0 += b.block) {
    const int64_t L = std::min(b.block, hi - b0);
    const Blk k = block_at(b, b0, dsize(GDT), dsize(ODT));
    if (L == kMaxBlock && nt) block16<GDT, ODT, STREAM, kMaxBlock, true>(c, k, L);
    else if (L == kMaxBlock) block16<GDT, ODT, STREAM, kMaxBlock, false>(c, k, L);
    else block16<GDT, ODT, STREAM, 0, false>(c, k, L);
  }
  if (nt) _mm_sfence();
}

template <int DT>
double sumsq(const void* x, void* y, int64_t lo, int64_t hi, int* bad) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m512 fmax = _mm512_set1_ps(3.40282347e38f);
  __mmask16 flag = 0;
  for (int64_t i = lo; i < hi; i += 64) {
    for (int u = 0; u < 4; ++u) {
      const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, hi - i - 16 * u));
      const __mmask16 k = __mmask16(n >= 16 ? 0xffff : (1u << n) - 1u);
      const __m512 v = load16(x, i + 16 * u, DT, k);
      if (y && DT == kF32) store16(y, i + 16 * u, DT, v, k);
      else if (y)  // the bits as they are (through fp32 a NaN's payload and sign were not kept)
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + i + 16 * u, k,
                                 ld_epi16(k, static_cast<const uint16_t*>(x) + i + 16 * u));
      acc[u] = _mm512_fmadd_ps(v, v, acc[u]);
      flag |= _mm512_mask_cmp_ps_mask(k, _mm512_abs_ps(v), fmax, _CMP_NLE_UQ);
    }
  }
  *bad |= flag != 0;
  return double(_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]))));
}

template <int DT>
void axpy(float* acc, const void* x, float alpha, int64_t lo, int64_t hi) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int64_t i = lo; i < hi; i += 16) {
    const int64_t n = std::min<int64_t>(16, hi - i);
    const __mmask16 k = __mmask16(n >= 16 ? 0xffff : (1u << n) - 1u);
    const __m512 y = ld_ps(k, acc + i);
    st_ps(acc + i, k, _mm512_fmadd_ps(a, load16(x, i, DT, k), y));
  }
}

}  // namespace avx512
#pragma GCC pop_options

// ---------------------------------------------------------------- dispatch
using RangeFn = void (*)(const Coef&, const Bufs&, int64_t, int64_t);

template <int G, int O, bool S>
RangeFn pick_isa(int isa, int st) {
  if (st == kState8) {
    if (isa == kAvx512) return avx512::run8<G, O, S>;
    if (isa == kAvx2) return avx2::run8<G, O, S>;
    return scalar::run8<G, O, S>;
  }
  if (st == kStateBF16) {
    if (isa == kAvx512) return avx512::run<G, O, kStateBF16, S>;
    if (isa == kAvx2) return avx2::run<G, O, kStateBF16, S>;
    return scalar::run<G, O, kStateBF16, S>;
  }
  if (isa == kAvx512) return avx512::run<G, O, kStateF32, S>;
  if (isa == kAvx2) return avx2::run<G, O, kStateF32, S>;
  return scalar::run<G, O, kStateF32, S>;
}

template <int G, bool S>
RangeFn pick_out(int isa, int odt, int st) {
  switch (odt) {
    case kF32: return pick_isa<G, kF32, S>(isa, st);
    case kF16: return pick_isa<G, kF16, S>(isa, st);
    case kBF16: return pick_isa<G, kBF16, S>(isa, st);
    default: return pick_isa<G, kNone, S>(isa, st);
  }
}

template <bool S>
RangeFn pick(int isa, int gdt, int odt, int st) {
  switch (gdt) {
    case kF32: return pick_out<kF32, S>(isa, odt, st);
    case kF16: return pick_out<kF16, S>(isa, odt, st);
    default: return pick_out<kBF16, S>(isa, odt, st);
  }
}

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

void finite_arg(double x, const char* name) {
  require(std::isfinite(x), std::string(name) + " must be finite, got " + std::to_string(x));
}

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 14;
// Threads split the range on multiples of one unrolled AVX-512 iteration (128 floats = 8 lines).
constexpr int64_t kGrain = 128;

// Threads a range of n elements is split over: one per kMinPerThread elements, at most `threads`.
inline int ranges_for(int64_t n, int threads) {
  return int(std::max<int64_t>(1, std::min<int64_t>(threads, n / kMinPerThread)));
}

// fn(lo, hi) over [0, n) split into ranges_for(n, threads) ranges, each a multiple of `grain` long but the last. A
// parallel region always asks for the whole `threads` team, the threads past the ranges idle: libgomp ends pool
// threads when a region asks for fewer than the last one and starts new ones when a later one asks for more, so a
// smaller run between two large ones (a run's last tile, a short span) cost a thread start per worker (2 of 4
// threads ended and restarted here, the large call after 3.9 ms against 0.2). The team may be smaller than asked
// (OMP_THREAD_LIMIT, OMP_DYNAMIC=true, a nested region): the split is made from the threads the team has, so every
// element is covered whatever it got (each range's result does not depend on the split: the kernels are
// elementwise, 8-bit blocks whole).
// The caller's floating-point mode (MXCSR's control bits: flush-to-zero and denormals-are-zero, which
// torch.set_flush_denormal sets, rounding, exception masks) in a worker for one region: OpenMP's threads keep their
// own, so the halves of one tensor treated denormals differently (the bits then depended on the thread count).
struct CallerFpMode {
  unsigned saved;
  explicit CallerFpMode(unsigned caller) : saved(set_fp_mode(caller)) {}
  ~CallerFpMode() { set_fp_mode(saved); }
};

template <class F>
void for_ranges(int64_t n, int threads, int64_t grain, F fn) {
  const int t = ranges_for(n, threads);
  if (t == 1) { fn(int64_t(0), n); return; }
  const unsigned csr = fp_mode();
#pragma omp parallel num_threads(threads)
  {
    const CallerFpMode mode(csr);
    const int64_t parts = std::min<int64_t>(t, omp_get_num_threads());
    const int64_t me = omp_get_thread_num();
    if (me < parts) {
      const int64_t chunk = ((n + parts - 1) / parts + grain - 1) / grain * grain;
      const int64_t lo = std::min<int64_t>(n, me * chunk);
      fn(lo, std::min<int64_t>(n, lo + chunk));
    }
  }
}

// 8-bit state: the split also falls on block boundaries (grain).
void run_parallel(RangeFn fn, const Coef& c, const Bufs& b, int64_t n, int threads, int64_t grain) {
  for_ranges(n, threads, grain, [&](int64_t lo, int64_t hi) { fn(c, b, lo, hi); });
}

}  // namespace

// The 8-bit format's guard. Exact Adam's update is bounded: m_hat and v_hat are weighted sums of the gradients g_k
// (weights w_k = (1 - b1) b1^k / bc1 and u_k = (1 - b2) b2^k / bc2, k steps ago), so by Cauchy-Schwarz
// |m_hat| <= B sqrt(v_hat) with B^2 = sum_k<t w_k^2 / u_k = (1 - b1)^2 bc2 S / ((1 - b2) bc1^2), S = sum_k<t rho^k,
// rho = b1^2 / b2 (B = 1 at step 1, ~7.3 for (0.9, 0.999) at large t). Quantized m and sqrt(v) break that bond: a
// block's sqrt(v) scale is set by its largest element, and an element whose sqrt(v) rounds to a few codes or to 0
// while its m does not got an update of up to |m| / eps (measured on a 2.6B GPT: 17 x lr by step 3; heavy-tailed
// gradients: 692 x the bound within 14 steps, tests/test_cpu_adam_formats.py). The kernel raises the denominator to
// |m_hat| / B, i.e. to |m| * m_cap with m_cap = 1 / (bc1 B) = sqrt((1 - b2) / (bc2 S)) / (1 - b1): exact moments
// never reach it, quantized ones move no element further than exact Adam ever could. 0 (no guard) where B is
// infinite (b2 = 0 after step 1, or S overflows).
double update_cap(const AdamParams& a) {
  require(a.step >= 1, "step must be >= 1, got " + std::to_string(a.step));
  require(a.beta1 >= 0 && a.beta1 < 1, "beta1 must be in [0, 1), got " + std::to_string(a.beta1));
  require(a.beta2 >= 0 && a.beta2 < 1, "beta2 must be in [0, 1), got " + std::to_string(a.beta2));
  const double b1 = a.beta1, b2 = a.beta2, t = double(a.step);
  const double bc2 = a.bias_correction ? 1.0 - std::pow(b2, t) : 1.0;
  double s;
  if (a.step == 1 || b1 == 0.0) {  // (one term: rho^0; also where rho = b1^2 / b2 would overflow)
    s = 1.0;
  } else if (b2 == 0.0) {
    s = INFINITY;
  } else {
    const double rho = b1 * b1 / b2;
    s = rho == 1.0 ? t : (1.0 - std::pow(rho, t)) / (1.0 - rho);
  }
  if (!(s < INFINITY)) return 0.0;
  return std::sqrt((1.0 - b2) / (bc2 * s)) / (1.0 - b1);
}

constexpr unsigned kFpControl = 0xffc0u;  // MXCSR bits 6-15 (the rest: sticky exception flags)

unsigned fp_mode() { return _mm_getcsr() & kFpControl; }

unsigned set_fp_mode(unsigned bits) {
  const unsigned csr = _mm_getcsr();
  if ((csr & kFpControl) != (bits & kFpControl)) _mm_setcsr((csr & ~kFpControl) | (bits & kFpControl));
  return csr & kFpControl;
}

bool isa_supported(int isa) {
  __builtin_cpu_init();
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                       __builtin_cpu_supports("f16c");
    case kAvx512: return isa_supported(kAvx2) && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512dq");
    default: return false;
  }
}

void check_buffer(const void* p, const char* name, size_t align) {
  require(p != nullptr, std::string(name) + " address is null");
  require(uintptr_t(p) % align == 0, std::string(name) + " address must be " + std::to_string(align) + "-byte aligned");
}

void check_common(const Buffers& b, int isa, int threads) {
  require(b.state >= kStateF32 && b.state <= kState8, "state format code must be 0..2, got " + std::to_string(b.state));
  if (b.state == kState8)
    require(b.block >= 16 && b.block <= kMaxBlock && b.block % 16 == 0,
            "block must be a multiple of 16 in [16, 256], got " + std::to_string(b.block));
  require(b.n >= 0, "n must be >= 0, got " + std::to_string(b.n));
  require(b.grad_dtype == kF32 || b.grad_dtype == kF16 || b.grad_dtype == kBF16,
          "grad dtype code must be 0 (f32), 1 (f16) or 2 (bf16), got " + std::to_string(b.grad_dtype));
  require(b.out_dtype >= kF32 && b.out_dtype <= kNone,
          "param_out dtype code must be 0..3, got " + std::to_string(b.out_dtype));
  require(isa >= kScalar && isa <= kAvx512, "isa code must be 0..2, got " + std::to_string(isa));
  require(isa_supported(isa), "isa " + std::to_string(isa) + " is not supported by this CPU");
  require(threads >= 1, "threads must be >= 1, got " + std::to_string(threads));
  if (b.n == 0) return;
  const size_t gsz = b.grad_dtype == kF32 ? 4 : 2, osz = b.out_dtype == kF32 ? 4 : 2;
  check_buffer(b.param, "param", 4);
  const size_t ssz = b.state == kStateF32 ? 4 : b.state == kStateBF16 ? 2 : 1;
  check_buffer(b.exp_avg, "exp_avg", ssz);
  check_buffer(b.exp_avg_sq, "exp_avg_sq", ssz);
  if (b.state == kState8) {
    check_buffer(b.exp_avg_scale, "exp_avg scales", 4);
    check_buffer(b.exp_avg_sq_scale, "exp_avg_sq scales", 4);
  }
  check_buffer(b.grad, "grad", gsz);
  if (b.out_dtype != kNone) check_buffer(b.param_out, "param_out", osz);
}

Bufs bufs_of(const Buffers& b) {
  return {b.param, b.exp_avg, b.exp_avg_sq, b.grad, b.param_out, b.exp_avg_scale, b.exp_avg_sq_scale, b.block,
          b.index0};
}

int64_t grain_of(const Buffers& b) { return b.state == kState8 ? std::lcm(kGrain, b.block) : kGrain; }

void adam_step(const Buffers& b, const AdamParams& a, int isa, int threads) {
  check_common(b, isa, threads);
  require(a.step >= 1, "step must be >= 1, got " + std::to_string(a.step));
  finite_arg(a.lr, "lr"); finite_arg(a.beta1, "beta1"); finite_arg(a.beta2, "beta2");
  finite_arg(a.eps, "eps"); finite_arg(a.weight_decay, "weight_decay"); finite_arg(a.grad_scale, "grad_scale");
  require(a.lr >= 0, "lr must be >= 0, got " + std::to_string(a.lr));
  require(a.beta1 >= 0 && a.beta1 < 1, "beta1 must be in [0, 1), got " + std::to_string(a.beta1));
  require(a.beta2 >= 0 && a.beta2 < 1, "beta2 must be in [0, 1), got " + std::to_string(a.beta2));
  require(a.eps > 0, "eps must be > 0, got " + std::to_string(a.eps));
  require(a.weight_decay >= 0, "weight_decay must be >= 0, got " + std::to_string(a.weight_decay));
  if (b.n == 0) return;
  Coef c = make_coef(a);
  c.key = sr_key(b.seed, a.step);
  if (b.state == kState8) {
    c.m_cap = float(update_cap(a));
    c.capped = c.m_cap > 0.0f;
  }
  run_parallel(pick<false>(isa, b.grad_dtype, b.out_dtype, b.state), c, bufs_of(b), b.n, threads, grain_of(b));
}

void adam_step_tiled(const Buffers& b, const AdamParams& a, int isa, int threads, int64_t tile, const TileSink& sink,
                     int64_t* progress) {
  require(tile >= 1, "tile_numel must be >= 1, got " + std::to_string(tile));
  require(sink.fn != nullptr, "sink has no function");
  require(b.n <= sink.numel, "sink covers " + std::to_string(sink.numel) + " elements, the step " +
                                 std::to_string(b.n));
  Buffers none = b;
  none.n = 0;
  adam_step(none, a, isa, threads);  // every check but the buffers'
  require(b.state != kState8 || tile % b.block == 0 || tile >= b.n,  // (one tile: the whole step)
          "tile_numel must be a multiple of the block (" + std::to_string(b.block) + "), got " + std::to_string(tile));
  const size_t gsz = b.grad_dtype == kF32 ? 4 : 2, osz = b.out_dtype == kF32 ? 4 : 2;
  const size_t ssz = b.state == kStateF32 ? 4 : b.state == kStateBF16 ? 2 : 1;
  for (int64_t start = 0; start < b.n; start += tile) {
    const int64_t end = std::min(b.n, start + tile);
    Buffers t = b;
    t.param += start;
    t.exp_avg = static_cast<char*>(b.exp_avg) + start * ssz;
    t.exp_avg_sq = static_cast<char*>(b.exp_avg_sq) + start * ssz;
    if (b.state == kState8) {
      t.exp_avg_scale += start / b.block;
      t.exp_avg_sq_scale += start / b.block;
    }
    t.index0 = b.index0 + start;
    t.grad = static_cast<const char*>(b.grad) + start * gsz;
    if (b.out_dtype != kNone) t.param_out = static_cast<char*>(b.param_out) + start * osz;
    t.n = end - start;
    adam_step(t, a, isa, threads);
    if (progress) *progress = end;
    char err[256] = {};
    if (sink.fn(sink.ctx, start, end, err, sizeof(err)) != 0)
      throw std::runtime_error(std::string("tile sink failed on [") + std::to_string(start) + ", " +
                               std::to_string(end) + "): " + err);
  }
}

void stream_pass(const Buffers& b, int isa, int threads) {
  check_common(b, isa, threads);
  if (b.n == 0) return;
  run_parallel(pick<true>(isa, b.grad_dtype, b.out_dtype, b.state), Coef{}, bufs_of(b), b.n, threads, grain_of(b));
}

SumSquares sum_squares(const void* x, void* y, int dtype, int64_t n, int isa, int threads) {
  require(n >= 0, "n must be >= 0, got " + std::to_string(n));
  require(dtype == kF32 || dtype == kF16 || dtype == kBF16, "x dtype code must be 0, 1 or 2");
  require(isa >= kScalar && isa <= kAvx512 && isa_supported(isa), "isa " + std::to_string(isa) + " is not supported");
  require(threads >= 1, "threads must be >= 1, got " + std::to_string(threads));
  if (n == 0) return {0.0, false};
  require(x != nullptr, "x address is null");
  using SumFn = double (*)(const void*, void*, int64_t, int64_t, int*);
  const SumFn table[3][3] = {
      {scalar::sumsq<kF32>, scalar::sumsq<kF16>, scalar::sumsq<kBF16>},
      {avx2::sumsq<kF32>, avx2::sumsq<kF16>, avx2::sumsq<kBF16>},
      {avx512::sumsq<kF32>, avx512::sumsq<kF16>, avx512::sumsq<kBF16>},
  };
  const SumFn fn = table[isa][dtype];
  // fp32 partial sums over 4096-element chunks (a bounded fp32 error), combined in double.
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  // Each chunk's partial is kept and the partials are added in chunk order, so the sum's bits depend on neither the
  // thread count nor which thread finishes first (an OpenMP reduction adds the threads' partials in the order they
  // finish: a clipping coefficient that changed between identical runs).
  std::vector<double> part(size_t(chunks), 0.0);
  int bad = 0;
  // (the whole team, as for_ranges asks, or no region: the chunks' order fixes the sum whichever threads run them)
  if (ranges_for(n, threads) == 1) {
    for (int64_t c = 0; c < chunks; ++c) part[size_t(c)] = fn(x, y, c * kChunk, std::min(n, (c + 1) * kChunk), &bad);
  } else {
    const unsigned csr = fp_mode();
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
      const CallerFpMode mode(csr);
#pragma omp for schedule(static)
      for (int64_t c = 0; c < chunks; ++c) part[size_t(c)] = fn(x, y, c * kChunk, std::min(n, (c + 1) * kChunk), &bad);
    }
  }
  double total = 0.0;
  for (const double s : part) total += s;
  return {total, bad != 0};
}

void accumulate(float* acc, const void* x, int dtype, double alpha, int64_t n, int isa, int threads) {
  require(n >= 0, "n must be >= 0, got " + std::to_string(n));
  require(dtype == kF32 || dtype == kF16 || dtype == kBF16, "x dtype code must be 0, 1 or 2");
  require(isa >= kScalar && isa <= kAvx512 && isa_supported(isa), "isa " + std::to_string(isa) + " is not supported");
  require(threads >= 1, "threads must be >= 1, got " + std::to_string(threads));
  if (n == 0) return;
  require(acc != nullptr && x != nullptr, "acc or x address is null");
  using AxpyFn = void (*)(float*, const void*, float, int64_t, int64_t);
  const AxpyFn table[3][3] = {
      {scalar::axpy<kF32>, scalar::axpy<kF16>, scalar::axpy<kBF16>},
      {avx2::axpy<kF32>, avx2::axpy<kF16>, avx2::axpy<kBF16>},
      {avx512::axpy<kF32>, avx512::axpy<kF16>, avx512::axpy<kBF16>},
  };
  const AxpyFn fn = table[isa][dtype];
  const float a = float(alpha);
  for_ranges(n, threads, kGrain, [&](int64_t lo, int64_t hi) { fn(acc, x, a, lo, hi); });
}

}  // namespace zo
