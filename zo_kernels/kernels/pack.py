"""Multi-tensor pack/unpack in one launch: many tensors <-> one flat buffer, with cast, scale, the
inf/nan flag and the fp32 sum of squares computed in the same pass.

Each program copies BLOCK elements of one segment. The segment of program `pid` is found by a binary
search over the cumulative block counts (an (n + 1)-entry int64 table), so the grid has exactly as many
programs as there are blocks, whatever the mix of tensor sizes. Tensors of any dtype mix are read
through their raw addresses (an int64 table, one row per tensor), with a uniform branch on the dtype
code. All offsets are int64.
"""

import math

import torch
import triton
import triton.language as tl

from .cast import BLOCK, KIND, NUM_WARPS, as_kernel_arg
from .utils import bf16_bits_to_f32, f32_to_bf16_bits, is_nonfinite, load_f32, store_f32

# Columns of the per-tensor table.
ADDR, NUMEL, OFFSET, CODE, SEG = range(5)
NCOL = 5


@triton.jit
def _find_segment(cum_ptr, n_seg, pid, LOG2_N: tl.constexpr):
    """The segment t with cum[t] <= pid < cum[t + 1] (binary search, LOG2_N + 1 steps)."""
    lo = tl.zeros((), dtype=tl.int64)
    hi = lo + n_seg  # not n_seg.to(): compiled Triton passes n_seg == 1 as a compile-time int, which has no .to
    for _ in range(LOG2_N + 1):
        mid = (lo + hi) // 2
        right = tl.load(cum_ptr + mid + 1) <= pid
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _row(table_ptr, t):
    """Row t of the table: (address, numel, offset in flat, dtype code, segment length)."""
    row = table_ptr + t * 5
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)


@triton.jit
def _load_any(addr, code, offs, mask):
    """Read a tensor given by address and dtype code as fp32 (masked lanes 0)."""
    if code == 0:
        x = tl.load(addr.to(tl.pointer_type(tl.float32)) + offs, mask=mask, other=0.0)
    elif code == 1:
        x = tl.load(addr.to(tl.pointer_type(tl.float16)) + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        x = bf16_bits_to_f32(tl.load(addr.to(tl.pointer_type(tl.int16)) + offs, mask=mask, other=0))
    return x


@triton.jit
def _pack_kernel(table_ptr, cum_ptr, n_seg, flat_ptr, stats_ptr, scale,
                 OUT_KIND: tl.constexpr, LOG2_N: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    t = _find_segment(cum_ptr, n_seg, pid, LOG2_N)
    addr, numel, offset, code, seg = _row(table_ptr, t)
    offs = (pid - tl.load(cum_ptr + t)) * BLOCK + tl.arange(0, BLOCK)
    x = _load_any(addr, code, offs, offs < numel) * scale  # the alignment gap reads as 0
    y = store_f32(flat_ptr + offset, offs, x, offs < seg, OUT_KIND)
    tl.atomic_add(stats_ptr, tl.sum(x * x, axis=0))
    tl.atomic_max(stats_ptr + 1, tl.max(is_nonfinite(y).to(tl.float32), axis=0))


@triton.jit
def _unpack_kernel(table_ptr, cum_ptr, n_seg, flat_ptr,
                   IN_KIND: tl.constexpr, LOG2_N: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    t = _find_segment(cum_ptr, n_seg, pid, LOG2_N)
    addr, numel, offset, code, _ = _row(table_ptr, t)
    offs = (pid - tl.load(cum_ptr + t)) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = load_f32(flat_ptr + offset, offs, mask, IN_KIND)
    if code == 0:
        tl.store(addr.to(tl.pointer_type(tl.float32)) + offs, x, mask=mask)
    elif code == 1:
        tl.store(addr.to(tl.pointer_type(tl.float16)) + offs, x.to(tl.float16), mask=mask)
    else:
        tl.store(addr.to(tl.pointer_type(tl.int16)) + offs, f32_to_bf16_bits(x), mask=mask)


def _tables(tensors, offsets, segs, device):
    rows, cum = [], [0]
    for t, off, seg in zip(tensors, offsets, segs):
        rows.append((t.data_ptr(), t.numel(), off, KIND[t.dtype], seg))
        cum.append(cum[-1] + triton.cdiv(seg, BLOCK))
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, NCOL).to(device, non_blocking=True)
    return table, torch.tensor(cum, dtype=torch.int64).to(device, non_blocking=True), cum[-1]


def _log2(n: int) -> int:
    return max(1, math.ceil(math.log2(n + 1)))


def pack(tensors, offsets, segs, flat, scale) -> torch.Tensor:
    """Launch on validated input; returns stats = [sum_sq, found_inf (0./1.)] as an fp32 device tensor."""
    stats = torch.zeros(2, dtype=torch.float32, device=flat.device)
    table, cum, blocks = _tables(tensors, offsets, segs, flat.device)
    if blocks:
        _pack_kernel[(blocks,)](
            table, cum, len(tensors), as_kernel_arg(flat), stats, float(scale),
            OUT_KIND=KIND[flat.dtype], LOG2_N=_log2(len(tensors)), BLOCK=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
    return stats


def unpack(flat, tensors, offsets) -> None:
    """Launch on validated input: tensors[i] <- flat[offsets[i]:][:numel], cast to tensors[i].dtype."""
    table, cum, blocks = _tables(tensors, offsets, [t.numel() for t in tensors], flat.device)
    if blocks:
        _unpack_kernel[(blocks,)](
            table, cum, len(tensors), as_kernel_arg(flat),
            IN_KIND=KIND[flat.dtype], LOG2_N=_log2(len(tensors)), BLOCK=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
