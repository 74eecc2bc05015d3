"""AdamW with fp32, bf16 or 8-bit moments in one pass over the device's memory: gpu_fraction's tail on a GPU
(zo_kernels/offload/device_adam.py).

Each element is read once (fp32 master, 16-bit or fp32 gradient, the moments' 2, 4 or 8 bytes, 8-bit: its block's
two scales) and written once: 16 bytes per element moved with 8-bit moments, 18 with bf16, 26 with fp32 (torch's fused
AdamW, after the fp32 copy of the scaled gradient it needs, 34; decoding to fp32, a fused AdamW and encoding back in
separate kernels ~100). The arithmetic is CPU Adam's (cpu/adam.cpp, adam_math), operation for operation: the same
fp32 coefficients (derived in double, rounded once), the same fused multiply-adds (tl.fma), IEEE division and square
root (div_rn, sqrt_rn; no contraction of the rest: enable_fp_fusion=False), so the tail's update equals the host's
bit for bit:
- 8-bit: one program per block of 256 (the format's block, BLOCK_8BIT): dequantize with the block's scales (scale /
  levels, times the code; exp_avg_sq's codes hold sqrt(v)), update, take the block's new absmax from the bits of
  |m| and sqrt(v) (NaN > inf > finite, as the kernel's integer max), requantize: mult = levels / absmax, exp_avg's
  code = floor(x * mult + r * 2^-16) clamped to [-127, 127] (stochastic, r = the top 16 bits of uint32(index) *
  0x9E3779B9 + key, cpu/adam.cpp's weyl16), exp_avg_sq's round-half-even(x * mult); NaN -> 0, a block below
  2^-100 stored as zeros with scale 0; the update's denominator is at least |m| x update_cap (the host's guard: no
  element moves further than exact Adam could);
- bf16: the stochastic rounding of the host kernel: 16 bits of mix32(uint32(index) ^ key) added to the fp32 bits,
  exp_avg the low half, exp_avg_sq the high, then truncated; NaN -> 0x7fc0.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._cpu import update_cap
from .cast import as_kernel_arg, on_device
from .utils import BF16, F16, F32, bf16_bits_to_f32, load_f32

FMT = {"fp32": 0, "bf16": 1, "8bit": 2}
BLOCK_8BIT = 256  # one program per 8-bit block: its scale is the program's
BLOCK_WIDE = 1024  # elements per program with fp32 or bf16 moments
KIND = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}


@triton.jit
def _mix32(x):
    """cpu/adam.cpp's mix32 on uint32 (multiplication wraps modulo 2^32)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _sr_bits(x, r):
    """fp32 -> bf16 bits (int16) rounded up in magnitude with probability (dropped bits) / 2^16: r (< 2^16) added,
    then truncated; NaN -> 0x7fc0."""
    b = (x.to(tl.uint32, bitcast=True) + r) >> 16
    b = tl.where(x != x, 0x7FC0, b)
    return b.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _requant(x, mask, levels, r, STOCHASTIC: tl.constexpr):
    """A block's fp32 values -> (codes as int32, scale): absmax from the bits of |x| (integer max), y = x * levels /
    absmax, codes round-half-even(y), or with STOCHASTIC floor(y + r * 2^-16) clamped to [-levels, levels] (r: 16
    random bits); NaN -> 0. A block whose absmax bits are below (127 - 100) << 23 (2^-100) is stored as zeros;
    12582912 = 1.5 * 2^23: y + it - it rounds |y| < 2^22 to an integer, half to even."""
    bits = tl.where(mask, x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, 0)
    amax_bits = tl.max(bits, 0)
    amax = amax_bits.to(tl.float32, bitcast=True)
    small = amax_bits < 226492416
    scale = tl.where(small, 0.0, amax)
    mult = tl.where(small, 0.0, tl.math.div_rn(levels, tl.where(small, 1.0, amax)))
    y = x * mult
    if STOCHASTIC:
        code = tl.floor(y + r.to(tl.float32) * 0.0000152587890625)  # 2^-16
        code = tl.minimum(tl.maximum(code, -levels), levels)
    else:
        code = (y + 12582912.0) - 12582912.0
    code = tl.where(y != y, 0.0, code)
    return code.to(tl.int32), scale


# (the key and the hash index change with every step and run: one compiled variant for all of their values; and the
# key argument equal to 1 would become a constant, which the kernel cannot bitcast)
@triton.jit(do_not_specialize=["index0", "key_flipped"])
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, n, index0, key_flipped, grad_scale, decay, omb1, omb2,
                 b2, inv_bc2_sqrt, eps, neg_step_size, m_cap, G_KIND: tl.constexpr, FMT: tl.constexpr,
                 DECAY: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = load_f32(g_ptr, offs, mask, G_KIND) * grad_scale
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    if FMT == 2:
        dm = tl.math.div_rn(tl.load(ms_ptr + pid), 127.0)
        dr = tl.math.div_rn(tl.load(vs_ptr + pid), 255.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.float32) * dm
        r = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.float32) * dr
        v = r * r
    elif FMT == 1:
        m = bf16_bits_to_f32(tl.load(m_ptr + offs, mask=mask, other=0))
        v = bf16_bits_to_f32(tl.load(v_ptr + offs, mask=mask, other=0))
    else:
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if DECAY:
        p = p * decay
    m = tl.fma(g - m, omb1, m)
    v = tl.fma(g * omb2, g, v * b2)
    r = tl.sqrt_rn(v)
    denom = tl.fma(r, inv_bc2_sqrt, eps)
    if FMT == 2:  # the 8-bit guard (cpu/adam.cpp, update_cap): as maxps(|m| * m_cap, denom), denom where NaN
        capped = tl.abs(m) * m_cap
        denom = tl.where(capped > denom, capped, denom)
    p = tl.fma(tl.math.div_rn(m, denom), neg_step_size, p)
    tl.store(p_ptr + offs, p, mask=mask)
    if FMT == 2:
        key = key_flipped.to(tl.uint32, bitcast=True) ^ 0x80000000
        w = ((index0 + offs).to(tl.uint32) * 0x9E3779B9 + key) >> 16  # (uint32: wraps modulo 2^32)
        cm, sm = _requant(m, mask, 127.0, w, True)
        cr, sr = _requant(r, mask, 255.0, w, False)
        tl.store(m_ptr + offs, cm.to(tl.int8), mask=mask)
        tl.store(v_ptr + offs, cr.to(tl.uint8), mask=mask)
        tl.store(ms_ptr + pid, sm)
        tl.store(vs_ptr + pid, sr)
    elif FMT == 1:
        key = key_flipped.to(tl.uint32, bitcast=True) ^ 0x80000000
        h = _mix32((index0 + offs).to(tl.uint32) ^ key)
        tl.store(m_ptr + offs, _sr_bits(m, h & 0xFFFF), mask=mask)
        tl.store(v_ptr + offs, _sr_bits(v, h >> 16), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def adam_step(master: torch.Tensor, grad: torch.Tensor, moments: list[torch.Tensor], fmt: str, *, step: int,
              lr: float, betas: tuple[float, float], eps: float, weight_decay: float, grad_scale: float = 1.0,
              maximize: bool = False, key: int = 0, index0: int = 0) -> None:  # fmt: skip
    """One AdamW step in place on contiguous 1-D tensors of one device: `master` fp32, `grad` fp32/fp16/bf16,
    `moments` [exp_avg, exp_avg_sq] fp32 or bf16 (fmt "fp32", "bf16") or [exp_avg codes int8, their scales,
    exp_avg_sq codes uint8, their scales] (fmt "8bit": master[0] starts a block; the last block may be short).
    `key`: the stochastic rounding's key (bf16 moments, 8-bit exp_avg: offload.device_adam.sr_key(seed, step)),
    `index0`: the hash index of element 0 (index0 + numel <= 2**32). Checked by the caller."""
    n = master.numel()
    if n == 0:
        return
    b1, b2 = float(betas[0]), float(betas[1])
    bc1, bc2 = 1.0 - b1 ** float(step), 1.0 - b2 ** float(step)
    coef = dict(grad_scale=-float(grad_scale) if maximize else float(grad_scale), decay=1.0 - lr * weight_decay,
                omb1=1.0 - b1, omb2=1.0 - b2, b2=b2, inv_bc2_sqrt=1.0 / math.sqrt(bc2), eps=float(eps),
                neg_step_size=-lr / bc1, m_cap=update_cap(step, b1, b2) if fmt == "8bit" else 0.0)  # fmt: skip
    is8 = fmt == "8bit"
    block = BLOCK_8BIT if is8 else BLOCK_WIDE
    # Two launches: the whole blocks, whose length (a multiple of 16) lets Triton prove the mask constant over a
    # vector, so their loads and stores are 16-byte ones; then the last, short block, masked element by element.
    full = n // block * block
    for lo, hi in ((0, full), (full, n)):
        if lo == hi:
            continue
        m, v = (moments[0][lo:hi], moments[2][lo:hi]) if is8 else (as_kernel_arg(t[lo:hi]) for t in moments)
        ms, vs = ((moments[1][lo // block :], moments[3][lo // block :]) if is8
                  else (master, master))  # (unused pointers with bf16 / fp32)  # fmt: skip
        with on_device(master):
            _adam_kernel[(triton.cdiv(hi - lo, block),)](
                master[lo:hi], as_kernel_arg(grad[lo:hi]), m, v, ms, vs, hi - lo, index0 + lo,
                (key & 0xFFFFFFFF) - (1 << 31), **coef, G_KIND=KIND[grad.dtype], FMT=FMT[fmt],
                DECAY=weight_decay != 0.0, BLOCK=block, num_warps=2 if is8 else 4, enable_fp_fusion=False,
            )  # fmt: skip
