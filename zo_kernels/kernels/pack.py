"""Multi-tensor pack/unpack in one launch: many tensors <-> one flat buffer, with cast, scale, the
inf/nan flag and the fp32 sum of squares computed in the same pass.

Each program copies BLOCK elements of one segment. The segment of program `pid` is found by a binary
search over the cumulative block counts (an (n + 1)-entry int64 table), so the grid has exactly as many
programs as there are blocks, whatever the mix of tensor sizes. Tensors of any dtype mix are read
through their raw addresses (an int64 table, one row per tensor), with a uniform branch on the dtype
code. All offsets are int64.

Alignment: when every address is 16-byte aligned and every segment offset and length a multiple of 16
bytes of flat, the launcher says so (VEC > 1) and the kernels carry the hints; whole blocks are then read
and written without masks, so the compiled code moves 16 bytes per access (tests/test_triton_compile.py
checks the PTX). The sum of squares is per-block partials reduced by one program in a fixed order: no float
atomics, the same bits on every run.
"""

import math

import torch
import triton
import triton.language as tl

from .cast import BLOCK, KIND, NUM_WARPS, as_kernel_arg, on_device
from .utils import bf16_bits_to_f32, f32_to_bf16_bits, is_nonfinite, store_f32

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
def _row(table_ptr, t, VEC: tl.constexpr):
    """Row t of the table: (address, numel, offset in flat, dtype code, segment length).

    With VEC > 1 the launcher guarantees that every offset and segment length is a multiple of VEC elements
    of flat (16 bytes); the hints are set here, on the loads themselves, where the compiler keeps them."""
    row = table_ptr + t * 5
    offset, seg = tl.load(row + 2), tl.load(row + 4)
    if VEC > 1:
        offset = tl.multiple_of(offset, VEC)
        seg = tl.multiple_of(seg, VEC)
    return tl.load(row), tl.load(row + 1), offset, tl.load(row + 3), seg


@triton.jit
def _ptr(addr, ty: tl.constexpr, VEC: tl.constexpr):
    """A tensor's address as a typed pointer; with VEC > 1 the launcher guarantees it is 16-byte aligned
    (the hint must sit on the pointer: one on the integer is lost in the cast)."""
    p = addr.to(tl.pointer_type(ty))
    if VEC > 1:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _load(p, mask, FULL: tl.constexpr):
    """FULL: every lane valid, no mask (a masked load would stay scalar); else masked lanes read 0."""
    if FULL:
        return tl.load(p)
    else:
        return tl.load(p, mask=mask, other=0)


@triton.jit
def _store(p, x, mask, FULL: tl.constexpr):
    if FULL:
        tl.store(p, x)
    else:
        tl.store(p, x, mask=mask)


@triton.jit
def _load_any(addr, code, offs, mask, VEC: tl.constexpr, FULL: tl.constexpr):
    """Read a tensor given by address and dtype code as fp32 (masked lanes 0)."""
    if code == 0:
        x = _load(_ptr(addr, tl.float32, VEC) + offs, mask, FULL)
    elif code == 1:
        x = _load(_ptr(addr, tl.float16, VEC) + offs, mask, FULL).to(tl.float32)
    else:
        x = bf16_bits_to_f32(_load(_ptr(addr, tl.int16, VEC) + offs, mask, FULL))
    return x


@triton.jit
def _pack_kernel(table_ptr, cum_ptr, n_seg, flat_ptr, part_ptr, scale,
                 OUT_KIND: tl.constexpr, LOG2_N: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    t = _find_segment(cum_ptr, n_seg, pid, LOG2_N)
    addr, numel, offset, code, seg = _row(table_ptr, t, VEC)
    start = (pid - tl.load(cum_ptr + t)) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    # A whole block is read without a mask (vector loads), the last block of a tensor with one; the
    # alignment gap reads as 0.
    if start + BLOCK <= numel:
        x = _load_any(addr, code, offs, offs < numel, VEC, True) * scale
    else:
        x = _load_any(addr, code, offs, offs < numel, VEC, False) * scale
    y = store_f32(flat_ptr + offset, offs, x, offs < seg, OUT_KIND)
    # Per-block partials, reduced in a fixed order by _stats_kernel: no float atomics, so the sum of
    # squares is the same bits on every run.
    tl.store(part_ptr + pid, tl.sum(x * x, axis=0))
    tl.store(part_ptr + tl.num_programs(0) + pid, tl.max(is_nonfinite(y).to(tl.float32), axis=0))


@triton.jit
def _stats_kernel(part_ptr, n_blocks, stats_ptr, BLOCK: tl.constexpr):
    """One program: stats = [sum of the block sums, max of the block flags], always in the same order."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    flag = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, n_blocks, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < n_blocks
        acc += tl.load(part_ptr + offs, mask=mask, other=0.0)
        flag = tl.maximum(flag, tl.load(part_ptr + n_blocks + offs, mask=mask, other=0.0))
    tl.store(stats_ptr, tl.sum(acc, axis=0))
    tl.store(stats_ptr + 1, tl.max(flag, axis=0))


@triton.jit
def _unpack_kernel(table_ptr, cum_ptr, n_seg, flat_ptr,
                   IN_KIND: tl.constexpr, LOG2_N: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    t = _find_segment(cum_ptr, n_seg, pid, LOG2_N)
    addr, numel, offset, code, _ = _row(table_ptr, t, VEC)
    start = (pid - tl.load(cum_ptr + t)) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:  # see _pack_kernel
        _unpack_block(addr, code, offs, offs < numel, flat_ptr + offset, IN_KIND, VEC, True)
    else:
        _unpack_block(addr, code, offs, offs < numel, flat_ptr + offset, IN_KIND, VEC, False)


@triton.jit
def _unpack_block(addr, code, offs, mask, src_ptr, IN_KIND: tl.constexpr, VEC: tl.constexpr, FULL: tl.constexpr):
    """One block of flat (from src_ptr) into the tensor at addr, cast to its dtype code."""
    if IN_KIND == 2:
        x = bf16_bits_to_f32(_load(src_ptr + offs, mask, FULL))
    else:
        x = _load(src_ptr + offs, mask, FULL).to(tl.float32)
    if code == 0:
        _store(_ptr(addr, tl.float32, VEC) + offs, x, mask, FULL)
    elif code == 1:
        _store(_ptr(addr, tl.float16, VEC) + offs, x.to(tl.float16), mask, FULL)
    else:
        _store(_ptr(addr, tl.int16, VEC) + offs, f32_to_bf16_bits(x), mask, FULL)


def _tables(tensors, offsets, segs, device):
    rows, cum = [], [0]
    for t, off, seg in zip(tensors, offsets, segs):
        rows.append((t.data_ptr(), t.numel(), off, KIND[t.dtype], seg))
        cum.append(cum[-1] + triton.cdiv(seg, BLOCK))
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, NCOL).to(device, non_blocking=True)
    return table, torch.tensor(cum, dtype=torch.int64).to(device, non_blocking=True), cum[-1]


def _log2(n: int) -> int:
    return max(1, math.ceil(math.log2(n + 1)))


def _vec(tensors, flat, multiples) -> int:
    """Elements of flat per 16 bytes when every address is 16-byte aligned and every one of `multiples`
    (segment offsets and lengths) a multiple of that; else 1 (no alignment hints)."""
    vec = 16 // flat.element_size()
    ok = flat.data_ptr() % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)
    return vec if ok and all(m % vec == 0 for m in multiples) else 1


def pack(tensors, offsets, segs, flat, scale) -> torch.Tensor:
    """Launch on validated input; returns stats = [sum_sq, found_inf (0./1.)] as an fp32 device tensor."""
    table, cum, blocks = _tables(tensors, offsets, segs, flat.device)
    if not blocks:
        return torch.zeros(2, dtype=torch.float32, device=flat.device)
    stats = torch.empty(2, dtype=torch.float32, device=flat.device)
    part = torch.empty(2 * blocks, dtype=torch.float32, device=flat.device)
    with on_device(flat):
        _pack_kernel[(blocks,)](
            table, cum, len(tensors), as_kernel_arg(flat), part, float(scale),
            OUT_KIND=KIND[flat.dtype], LOG2_N=_log2(len(tensors)), BLOCK=BLOCK,
            VEC=_vec(tensors, flat, [*offsets, *segs]), num_warps=NUM_WARPS,
        )  # fmt: skip
        _stats_kernel[(1,)](part, blocks, stats, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return stats


def unpack(flat, tensors, offsets) -> None:
    """Launch on validated input: tensors[i] <- flat[offsets[i]:][:numel], cast to tensors[i].dtype."""
    segs = [t.numel() for t in tensors]
    table, cum, blocks = _tables(tensors, offsets, segs, flat.device)
    if blocks:
        with on_device(flat):
            _unpack_kernel[(blocks,)](
                table, cum, len(tensors), as_kernel_arg(flat),
                IN_KIND=KIND[flat.dtype], LOG2_N=_log2(len(tensors)), BLOCK=BLOCK,
                VEC=_vec(tensors, flat, offsets), num_warps=NUM_WARPS,
            )  # fmt: skip
