// Public C++ surface of the CPU Adam kernels: plain addresses and sizes, no torch types.
#pragma once
#include <cstdint>

#include "tile_sink.h"

namespace zo {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kNone = 3 };
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
// How exp_avg / exp_avg_sq are stored. kState8: exp_avg int8 codes, exp_avg_sq uint8 codes, one fp32 scale per
// block of each (see zo_kernels/quant8.py for the format); kStateBF16 (and kState8's exp_avg): rounded stochastically (see adam.cpp).
enum State : int { kStateF32 = 0, kStateBF16 = 1, kState8 = 2 };
constexpr int64_t kMaxBlock = 256;

struct Buffers {
  float* param = nullptr;       // fp32, n elements, updated in place
  void* exp_avg = nullptr;      // n elements of the state format, updated in place
  void* exp_avg_sq = nullptr;   // n elements of the state format, updated in place
  const void* grad = nullptr;   // grad_dtype, n elements, read only
  int grad_dtype = kF32;
  void* param_out = nullptr;    // out_dtype, n elements, written (kNone: not written)
  int out_dtype = kNone;
  int64_t n = 0;
  int state = kStateF32;
  float* exp_avg_scale = nullptr;     // kState8: ceil(n / block) fp32 scales each, updated in place
  float* exp_avg_sq_scale = nullptr;
  int64_t block = kMaxBlock;          // kState8: elements per scale, a multiple of 16 in [16, 256]
  int64_t index0 = 0;                 // kStateBF16, kState8: the index of element 0 in the stochastic rounding
  uint64_t seed = 0;                  // kStateBF16, kState8: the rounding's seed
};

struct AdamParams {
  int64_t step = 1;  // counted from 1
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0, grad_scale = 1.0;
  bool adamw = true, bias_correction = true;
};

bool isa_supported(int isa);
// This thread's floating-point mode: MXCSR's control bits (flush-to-zero, denormals-are-zero, rounding,
// exception masks), which torch.set_flush_denormal sets per thread. set_fp_mode returns the bits it replaced.
unsigned fp_mode();
unsigned set_fp_mode(unsigned bits);
// Both throw std::invalid_argument on bad input before touching any buffer.
void adam_step(const Buffers& b, const AdamParams& a, int isa, int threads);
// The 8-bit format's guard at this step: an 8-bit update's denominator is at least |exp_avg| times it (0: none).
double update_cap(const AdamParams& a);
// adam_step over [0, n) in tiles of `tile` elements, calling sink.fn(ctx, start, end) after each tile is
// final (param_out included). The whole loop runs without Python; a sink error is thrown as runtime_error.
// With `progress`, *progress is set to the end of each tile once it is updated (what a failure left written).
void adam_step_tiled(const Buffers& b, const AdamParams& a, int isa, int threads, int64_t tile, const TileSink& sink,
                     int64_t* progress = nullptr);
// The streaming ceiling: the same loads and stores as adam_step (of its state format) with trivial arithmetic.
void stream_pass(const Buffers& b, int isa, int threads);

// Sum of squares of n fp32/fp16/bf16 values (fp32 partials over 4096-element chunks, combined in double),
// and whether any of them is inf or NaN: one pass. With y (else nullptr), x is also copied to y.
struct SumSquares {
  double sum;
  bool nonfinite;
};
SumSquares sum_squares(const void* x, void* y, int dtype, int64_t n, int isa, int threads);

// acc[i] = fma(alpha, x[i], acc[i]) for n fp32 acc and fp32/fp16/bf16 x (upcast exactly, one rounding): a sum of
// gradients in fp32 without torch's mixed-dtype path (~5x slower for a 16-bit x).
void accumulate(float* acc, const void* x, int dtype, double alpha, int64_t n, int isa, int threads);

}  // namespace zo
