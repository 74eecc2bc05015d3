// CPU Adam/AdamW: one pass over memory, element-wise, three ISA variants picked at run time.
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
#include <stdexcept>
#include <string>

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

// ---------------------------------------------------------------- the per-element arithmetic
// Constants derived once per call (in double, then rounded to fp32 once).
struct Coef {
  float grad_scale, l2, decay, omb1, omb2, b2, inv_bc2_sqrt, eps, neg_step_size;
  bool adamw_decay, l2_decay;
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
  float *p, *m, *v;
  const void* g;
  void* out;
};

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
};

// ---------------------------------------------------------------- scalar variant
template <int GDT, int ODT, bool STREAM>
void run(const Coef& c, const Bufs& b, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    float g;
    if (GDT == kF32) g = static_cast<const float*>(b.g)[i];
    else if (GDT == kF16) g = half_to_float(static_cast<const uint16_t*>(b.g)[i]);
    else g = bf16_to_float(static_cast<const uint16_t*>(b.g)[i]);
    float p = b.p[i], m = b.m[i], v = b.v[i];
    if (STREAM) stream_math<V>(c, p, m, v, g);
    else adam_math<V>(c, p, m, v, g);
    b.p[i] = p; b.m[i] = m; b.v[i] = v;
    if (ODT == kF32) static_cast<float*>(b.out)[i] = p;
    else if (ODT == kF16) static_cast<uint16_t*>(b.out)[i] = float_to_half(p);
    else if (ODT == kBF16) static_cast<uint16_t*>(b.out)[i] = float_to_bf16(p);
  }
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

template <int GDT, int ODT, bool STREAM>
inline void step8(const Coef& c, const Bufs& b, int64_t i) {
  __m256 p = _mm256_loadu_ps(b.p + i), m = _mm256_loadu_ps(b.m + i), v = _mm256_loadu_ps(b.v + i);
  const __m256 g = load8(b.g, i, GDT);
  if (STREAM) stream_math<V>(c, p, m, v, g);
  else adam_math<V>(c, p, m, v, g);
  _mm256_storeu_ps(b.p + i, p); _mm256_storeu_ps(b.m + i, m); _mm256_storeu_ps(b.v + i, v);
  if (ODT != kNone) store8(b.out, i, ODT, p);
}

template <int GDT, int ODT, bool STREAM>
void run(const Coef& coef, const Bufs& bufs, int64_t lo, int64_t hi) {
  const Coef c = coef;  // local copies, as in the AVX-512 variant
  const Bufs b = bufs;
  int64_t i = lo;
  for (; i + 32 <= hi; i += 32) {
    step8<GDT, ODT, STREAM>(c, b, i); step8<GDT, ODT, STREAM>(c, b, i + 8);
    step8<GDT, ODT, STREAM>(c, b, i + 16); step8<GDT, ODT, STREAM>(c, b, i + 24);
  }
  for (; i + 8 <= hi; i += 8) step8<GDT, ODT, STREAM>(c, b, i);
  if (i == hi) return;
  // Tail (< 8): run the same vector code on a zero-padded copy, then copy the live lanes back.
  const int64_t n = hi - i;
  alignas(32) float p[8] = {}, m[8] = {}, v[8] = {}, g[8] = {}, o[8] = {};
  const size_t gsz = GDT == kF32 ? 4 : 2, osz = ODT == kF32 ? 4 : 2;
  std::memcpy(p, b.p + i, n * 4); std::memcpy(m, b.m + i, n * 4); std::memcpy(v, b.v + i, n * 4);
  std::memcpy(g, static_cast<const char*>(b.g) + i * gsz, n * gsz);
  const Bufs t{p, m, v, g, ODT == kNone ? nullptr : o};
  step8<GDT, ODT, STREAM>(c, t, 0);
  std::memcpy(b.p + i, p, n * 4); std::memcpy(b.m + i, m, n * 4); std::memcpy(b.v + i, v, n * 4);
  if (ODT != kNone) std::memcpy(static_cast<char*>(b.out) + i * osz, o, n * osz);
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
      if (y) store8(y, i + 8 * u, DT, v);  // 16-bit -> fp32 -> 16-bit is exact (NaN stays NaN)
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
};

// ---------------------------------------------------------------- AVX-512 variant (unroll 8)
inline __m512 load16(const void* base, int64_t i, int dt, __mmask16 k) {
  if (dt == kF32) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(base) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(base) + i);
  if (dt == kF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(void* base, int64_t i, int dt, __m512 x, __mmask16 k) {
  if (dt == kF32) { _mm512_mask_storeu_ps(static_cast<float*>(base) + i, k, x); return; }
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
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(base) + i, k, h);
}

template <int GDT, int ODT, bool STREAM>
inline void step16(const Coef& c, const Bufs& b, int64_t i, __mmask16 k) {
  __m512 p = _mm512_maskz_loadu_ps(k, b.p + i), m = _mm512_maskz_loadu_ps(k, b.m + i);
  __m512 v = _mm512_maskz_loadu_ps(k, b.v + i);
  const __m512 g = load16(b.g, i, GDT, k);
  if (STREAM) stream_math<V>(c, p, m, v, g);
  else adam_math<V>(c, p, m, v, g);
  _mm512_mask_storeu_ps(b.p + i, k, p); _mm512_mask_storeu_ps(b.m + i, k, m); _mm512_mask_storeu_ps(b.v + i, k, v);
  if (ODT != kNone) store16(b.out, i, ODT, p, k);
}

template <int GDT, int ODT, bool STREAM>
void run(const Coef& coef, const Bufs& bufs, int64_t lo, int64_t hi) {
  constexpr int kUnroll = 8;  // the paper's auto-tuned unroll width; 8 x 16 lanes per iteration
  // Local copies: the compiler can then prove the stores never alias them and keeps the broadcast
  // constants and base pointers in registers instead of reloading them after every store.
  const Coef c = coef;
  const Bufs b = bufs;
  int64_t i = lo;
  for (; i + 16 * kUnroll <= hi; i += 16 * kUnroll) {
#pragma GCC unroll 8
    for (int u = 0; u < kUnroll; ++u) step16<GDT, ODT, STREAM>(c, b, i + 16 * u, 0xffff);
  }
  for (; i < hi; i += 16) {
    const int64_t n = std::min<int64_t>(16, hi - i);
    step16<GDT, ODT, STREAM>(c, b, i, __mmask16((1u << n) - 1u));
  }
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
      if (y) store16(y, i + 16 * u, DT, v, k);  // 16-bit -> fp32 -> 16-bit is exact (NaN stays NaN)
      acc[u] = _mm512_fmadd_ps(v, v, acc[u]);
      flag |= _mm512_mask_cmp_ps_mask(k, _mm512_abs_ps(v), fmax, _CMP_NLE_UQ);
    }
  }
  *bad |= flag != 0;
  return double(_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]))));
}

}  // namespace avx512
#pragma GCC pop_options

// ---------------------------------------------------------------- dispatch
using RangeFn = void (*)(const Coef&, const Bufs&, int64_t, int64_t);

template <int G, int O, bool S>
RangeFn pick_isa(int isa) {
  if (isa == kAvx512) return avx512::run<G, O, S>;
  if (isa == kAvx2) return avx2::run<G, O, S>;
  return scalar::run<G, O, S>;
}

template <int G, bool S>
RangeFn pick_out(int isa, int odt) {
  switch (odt) {
    case kF32: return pick_isa<G, kF32, S>(isa);
    case kF16: return pick_isa<G, kF16, S>(isa);
    case kBF16: return pick_isa<G, kBF16, S>(isa);
    default: return pick_isa<G, kNone, S>(isa);
  }
}

template <bool S>
RangeFn pick(int isa, int gdt, int odt) {
  switch (gdt) {
    case kF32: return pick_out<kF32, S>(isa, odt);
    case kF16: return pick_out<kF16, S>(isa, odt);
    default: return pick_out<kBF16, S>(isa, odt);
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

void run_parallel(RangeFn fn, const Coef& c, const Bufs& b, int64_t n, int threads) {
  const int t = int(std::max<int64_t>(1, std::min<int64_t>(threads, n / kMinPerThread)));
  if (t == 1) { fn(c, b, 0, n); return; }
  const int64_t chunk = ((n + t - 1) / t + kGrain - 1) / kGrain * kGrain;
#pragma omp parallel num_threads(t)
  {
    const int64_t lo = std::min<int64_t>(n, omp_get_thread_num() * chunk);
    fn(c, b, lo, std::min<int64_t>(n, lo + chunk));
  }
}

}  // namespace

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
  check_buffer(b.exp_avg, "exp_avg", 4);
  check_buffer(b.exp_avg_sq, "exp_avg_sq", 4);
  check_buffer(b.grad, "grad", gsz);
  if (b.out_dtype != kNone) check_buffer(b.param_out, "param_out", osz);
}

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
  const Bufs bufs{b.param, b.exp_avg, b.exp_avg_sq, b.grad, b.param_out};
  run_parallel(pick<false>(isa, b.grad_dtype, b.out_dtype), make_coef(a), bufs, b.n, threads);
}

void adam_step_tiled(const Buffers& b, const AdamParams& a, int isa, int threads, int64_t tile, const TileSink& sink,
                     int64_t* progress) {
  require(tile >= 1, "tile_numel must be >= 1, got " + std::to_string(tile));
  require(sink.fn != nullptr, "sink has no function");
  require(b.n <= sink.numel, "sink covers " + std::to_string(sink.numel) + " elements, the step " +
                                 std::to_string(b.n));
  adam_step({b.param, b.exp_avg, b.exp_avg_sq, b.grad, b.grad_dtype, b.param_out, b.out_dtype, 0}, a, isa, threads);
  const size_t gsz = b.grad_dtype == kF32 ? 4 : 2, osz = b.out_dtype == kF32 ? 4 : 2;
  for (int64_t start = 0; start < b.n; start += tile) {
    const int64_t end = std::min(b.n, start + tile);
    Buffers t = b;
    t.param += start;
    t.exp_avg += start;
    t.exp_avg_sq += start;
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
  const Bufs bufs{b.param, b.exp_avg, b.exp_avg_sq, b.grad, b.param_out};
  run_parallel(pick<true>(isa, b.grad_dtype, b.out_dtype), Coef{}, bufs, b.n, threads);
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
  const int t = int(std::max<int64_t>(1, std::min<int64_t>(threads, n / kMinPerThread)));
  double total = 0.0;
  int bad = 0;
#pragma omp parallel for num_threads(t) reduction(+ : total) reduction(| : bad) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) total += fn(x, y, c * kChunk, std::min(n, (c + 1) * kChunk), &bad);
  return {total, bad != 0};
}

}  // namespace zo
