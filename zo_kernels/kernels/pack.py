"""Multi-tensor pack/unpack in one launch: many tensors <-> one flat buffer, with cast, scale, the inf/NaN flag
and the fp32 sum of squares computed in the same pass and reduced in the same launch.

The launch plan (kernels/plan.py) holds two int64 tables on the device, built once per bucket:
  - the tensor table, one row per tensor: (address, numel, offset in flat, dtype code, segment length);
  - the work table, one row per program: (tensor, chunk), as apex's multi_tensor_apply and torch's _foreach
    kernels do, so a program reads its row and streams its chunk: no search.
Program k of a tensor moves elements [k * CHUNK + h, (k + 1) * CHUNK + h) of it (program 0 starts at 0, the
last one ends at the segment's end), where the head h (under 16 bytes of elements) is the index of the tensor's
first 16-byte aligned element. So every chunk but the last is whole aligned BLOCKs, accessed without masks
through a pointer marked 16-byte aligned: 16-byte loads (pack) or stores (unpack) of the tensor whatever its
offset in flat (align=1 included). The flat
side gets 16-byte accesses too when its address at that point is aligned as well (the kernel checks, per
program); otherwise pack stores 8 or 4 bytes at a time where that address allows, else element by element, still
coalesced (unpack reads it element by element). tests/test_triton_compile.py checks
the PTX of both paths.

Σx² and the flag: each program writes its partials, then takes a ticket from an integer counter; the program
that takes the last ticket sums the partials in index order and resets the counter for the next launch. No
float atomics: the same bits on every run.
"""

import os

import torch
import triton
import triton.language as tl

from .cast import KIND, on_device
from .launch import Launches
from .utils import bf16_bits_to_f32, f32_to_bf16_bits

# 16384 elements per program: 64 KB of fp32 read and 32 KB of bf16 written, ~6k programs at 100M elements
# (the first GPU run moved 4 KB per program, 98k programs, at 27% of a copy; not yet measured: no GPU here).
CHUNK = 16384
# One loop iteration: 2048 elements = 8 per thread at 8 warps, one 16-byte access of a 16-bit tensor or two of
# an fp32 one, all issued before the first is used.
BLOCK = 2048
NUM_WARPS = 8
RBLOCK = 1024  # partials summed per step by the last program
if os.environ.get("TRITON_INTERPRET") == "1":
    # The same code with small constants on the CPU interpreter (tests): its cost grows with the lanes of every
    # operation, and more, smaller chunks cross more chunk and block boundaries. The GPU constants above are the
    # ones tests/test_triton_compile.py compiles.
    CHUNK, BLOCK, RBLOCK = 1024, 128, 64
NCOL = 5  # columns of the tensor table: address, numel, offset, dtype code, segment length


@triton.jit
def _row(table_ptr, work_ptr, pid, CHUNK: tl.constexpr):
    """This program's tensor and range [start, end): start is aligned (16 bytes) but for chunk 0."""
    t = tl.load(work_ptr + 2 * pid)
    k = tl.load(work_ptr + 2 * pid + 1)
    row = table_ptr + t * 5
    addr, numel, offset = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    code, seg = tl.load(row + 3), tl.load(row + 4)
    esize = tl.where(code == 0, 4, 2)
    head = ((16 - addr % 16) % 16) // esize  # elements before the first 16-byte aligned one
    start = tl.minimum(tl.where(k == 0, 0, k * CHUNK + head), seg)
    end = tl.minimum((k + 1) * CHUNK + head, seg)
    end = tl.where(k == tl.cdiv(seg, CHUNK) - 1, seg, end)
    aligned = tl.minimum(tl.where(k == 0, head, start), end)  # first aligned element of this range
    return addr, numel, offset, code, start, end, aligned


@triton.jit
def _typed(addr, CODE: tl.constexpr):
    if CODE == 0:
        return addr.to(tl.pointer_type(tl.float32))
    elif CODE == 1:
        return addr.to(tl.pointer_type(tl.float16))
    else:
        return addr.to(tl.pointer_type(tl.int16))


@triton.jit
def _typed_aligned(addr, CODE: tl.constexpr, ALIGN: tl.constexpr = 16):
    """_typed for an address the caller knows is ALIGN-byte aligned (16 unless said), marked so on the cast itself:
    Triton 3.6 drops a mark put on a call's result (3.9 keeps it), and a mark on a pointer sum is folded away."""
    if CODE == 0:
        return tl.multiple_of(addr.to(tl.pointer_type(tl.float32)), ALIGN)
    elif CODE == 1:
        return tl.multiple_of(addr.to(tl.pointer_type(tl.float16)), ALIGN)
    else:
        return tl.multiple_of(addr.to(tl.pointer_type(tl.int16)), ALIGN)


@triton.jit
def _ld(ptr, mask, KIND: tl.constexpr, FULL: tl.constexpr):
    """Elements of a KIND (0 fp32, 1 fp16, 2 bf16 bits) buffer as fp32; masked lanes read 0."""
    if FULL:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=mask, other=0)
    if KIND == 2:
        return bf16_bits_to_f32(x)
    else:
        return x.to(tl.float32)


@triton.jit
def _st(ptr, x, mask, KIND: tl.constexpr, FULL: tl.constexpr):
    """Store fp32 values rounded to KIND (nearest even); returns them as stored, in fp32."""
    if KIND == 2:
        y = f32_to_bf16_bits(x)
        back = bf16_bits_to_f32(y)
    elif KIND == 1:
        y = x.to(tl.float16)
        back = y.to(tl.float32)
    else:
        y = x
        back = x
    if FULL:
        tl.store(ptr, y)
    else:
        tl.store(ptr, y, mask=mask)
    return back


@triton.jit
def _pack_block(src, dst, offs, n_read, n_write, scale, acc, bad,
                IN_KIND: tl.constexpr, OUT_KIND: tl.constexpr, FULL: tl.constexpr):  # fmt: skip
    x = _ld(src + offs, offs < n_read, IN_KIND, FULL) * scale
    if not FULL:  # (a masked lane loads 0, and 0 x a negative scale is -0.0: a gap holds +0, as the torch path's)
        x = tl.where(offs < n_read, x, 0.0)
    y = _st(dst + offs, x, offs < n_write, OUT_KIND, FULL)
    return acc + x * x, bad | (y != y) | (tl.abs(y) == float("inf"))  # inline: a call costs the interpreter ~1 ms


@triton.jit
def _pack_full(s, d_addr, n_full, lanes, scale, acc, bad, IN_KIND: tl.constexpr, OUT_KIND: tl.constexpr,
               BLOCK: tl.constexpr, ALIGN: tl.constexpr):  # fmt: skip
    """A chunk's n_full whole blocks from s (16-byte aligned) to the bucket at d_addr, marked ALIGN-byte aligned (0:
    not marked); no masks."""
    if ALIGN > 0:
        d = _typed_aligned(d_addr, OUT_KIND, ALIGN)
    else:
        d = _typed(d_addr, OUT_KIND)
    for j in range(0, n_full):  # i = j * BLOCK: visibly a multiple of BLOCK (a loop variable is not)
        i = j * BLOCK
        acc, bad = _pack_block(s + i, d + i, lanes, 0, 0, scale, acc, bad, IN_KIND, OUT_KIND, True)
    return acc, bad


@triton.jit
def _pack_tensor(addr, flat_addr, numel, offset, start, end, aligned, scale,
                 IN_KIND: tl.constexpr, OUT_KIND: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Pack elements [start, end) of one tensor (those past numel are the segment's zero gap); (Σx², any bad)."""
    IN_BYTES: tl.constexpr = 4 if IN_KIND == 0 else 2
    OUT_BYTES: tl.constexpr = 4 if OUT_KIND == 0 else 2
    src = _typed(addr, IN_KIND)
    dst = _typed(flat_addr + offset * OUT_BYTES, OUT_KIND)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    bad = tl.zeros((BLOCK,), dtype=tl.int1)
    if aligned > start:  # chunk 0's head: the few elements before the first aligned one
        acc, bad = _pack_block(src, dst, start + lanes, tl.minimum(aligned, numel), aligned, scale, acc, bad, IN_KIND,
                               OUT_KIND, False)  # fmt: skip
    n_full = tl.maximum(tl.minimum(end, numel) - aligned, 0) // BLOCK
    if n_full > 0:
        s = _typed_aligned(addr + aligned * IN_BYTES, IN_KIND)  # the head makes it so
        d_addr = flat_addr + (offset + aligned) * OUT_BYTES
        # the bucket side marked with the widest alignment its address has (8 or 4 bytes: the bucket's phase
        # differs from the tensor's; 0: none, element by element)
        if d_addr % 16 == 0:
            acc, bad = _pack_full(s, d_addr, n_full, lanes, scale, acc, bad, IN_KIND, OUT_KIND, BLOCK, 16)
        elif d_addr % 8 == 0:
            acc, bad = _pack_full(s, d_addr, n_full, lanes, scale, acc, bad, IN_KIND, OUT_KIND, BLOCK, 8)
        elif OUT_BYTES == 2 and d_addr % 4 == 0:
            acc, bad = _pack_full(s, d_addr, n_full, lanes, scale, acc, bad, IN_KIND, OUT_KIND, BLOCK, 4)
        else:
            acc, bad = _pack_full(s, d_addr, n_full, lanes, scale, acc, bad, IN_KIND, OUT_KIND, BLOCK, 0)
    for i in range(aligned + n_full * BLOCK, end, BLOCK):  # the last partial block and the gap (read as 0)
        acc, bad = _pack_block(src, dst, i + lanes, numel, end, scale, acc, bad, IN_KIND, OUT_KIND, False)
    return tl.sum(acc, axis=0), tl.max(bad.to(tl.int32), axis=0)


@triton.jit
def _pack_kernel(table_ptr, work_ptr, n_work, flat_addr, part_ptr, count_ptr, sum_ptr, flag_ptr, scale,
                 OUT_KIND: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
                 ACCUMULATE: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    addr, numel, offset, code, start, end, aligned = _row(table_ptr, work_ptr, pid, CHUNK)
    if code == 0:
        sq, bad = _pack_tensor(addr, flat_addr, numel, offset, start, end, aligned, scale, 0, OUT_KIND, BLOCK)
    elif code == 1:
        sq, bad = _pack_tensor(addr, flat_addr, numel, offset, start, end, aligned, scale, 1, OUT_KIND, BLOCK)
    else:
        sq, bad = _pack_tensor(addr, flat_addr, numel, offset, start, end, aligned, scale, 2, OUT_KIND, BLOCK)
    tl.store(part_ptr + pid, sq)
    tl.store(part_ptr + n_work + pid, bad.to(tl.float32))
    # The barrier orders the partials' stores (whichever thread makes them) before the ticket; the ticket's release
    # (cumulative, gpu scope) publishes them, and the last ticket's acquire sees everyone's.
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == n_work - 1:
        total = tl.zeros((RBLOCK,), dtype=tl.float32)
        flag = tl.zeros((RBLOCK,), dtype=tl.float32)
        for i in range(0, n_work, RBLOCK):
            offs = i + tl.arange(0, RBLOCK)
            mask = offs < n_work
            total += tl.load(part_ptr + offs, mask=mask, other=0.0, volatile=True)
            flag = tl.maximum(flag, tl.load(part_ptr + n_work + offs, mask=mask, other=0.0, volatile=True))
        total_sum = tl.sum(total, axis=0)
        flagged = tl.max(flag, axis=0) > 0
        if ACCUMULATE:  # into the caller's running sum and flag (their earlier launches are done: stream order)
            total_sum = tl.load(sum_ptr) + total_sum
            flagged = flagged | (tl.load(flag_ptr) != 0)
        tl.store(sum_ptr, total_sum)
        tl.store(flag_ptr, flagged)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _unpack_tensor(addr, flat_addr, offset, start, end, aligned,
                   OUT_CODE: tl.constexpr, IN_KIND: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Elements [start, end) of flat's segment into the tensor at addr, cast to its dtype."""
    IN_BYTES: tl.constexpr = 4 if IN_KIND == 0 else 2
    OUT_BYTES: tl.constexpr = 4 if OUT_CODE == 0 else 2
    dst = _typed(addr, OUT_CODE)
    src = _typed(flat_addr + offset * IN_BYTES, IN_KIND)
    lanes = tl.arange(0, BLOCK)
    if aligned > start:
        offs = start + lanes
        _st(dst + offs, _ld(src + offs, offs < aligned, IN_KIND, False), offs < aligned, OUT_CODE, False)
    n_full = tl.maximum(end - aligned, 0) // BLOCK
    if n_full > 0:
        d = _typed_aligned(addr + aligned * OUT_BYTES, OUT_CODE)
        s_addr = flat_addr + (offset + aligned) * IN_BYTES
        if s_addr % 16 == 0:
            s = _typed_aligned(s_addr, IN_KIND)
            for j in range(0, n_full):  # see _pack_tensor
                i = j * BLOCK
                _st(d + i + lanes, _ld(s + i + lanes, None, IN_KIND, True), None, OUT_CODE, True)
        else:
            s = _typed(s_addr, IN_KIND)
            for j in range(0, n_full):
                i = j * BLOCK
                _st(d + i + lanes, _ld(s + i + lanes, None, IN_KIND, True), None, OUT_CODE, True)
    for i in range(aligned + n_full * BLOCK, end, BLOCK):
        offs = i + lanes
        _st(dst + offs, _ld(src + offs, offs < end, IN_KIND, False), offs < end, OUT_CODE, False)


@triton.jit
def _unpack_kernel(table_ptr, work_ptr, flat_addr,
                   IN_KIND: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    addr, numel, offset, code, start, end, aligned = _row(table_ptr, work_ptr, pid, CHUNK)
    end = tl.minimum(end, numel)  # a pack plan's segment runs on over the gap; the tensor ends at numel
    aligned = tl.minimum(aligned, end)
    start = tl.minimum(start, end)
    if code == 0:
        _unpack_tensor(addr, flat_addr, offset, start, end, aligned, 0, IN_KIND, BLOCK)
    elif code == 1:
        _unpack_tensor(addr, flat_addr, offset, start, end, aligned, 1, IN_KIND, BLOCK)
    else:
        _unpack_tensor(addr, flat_addr, offset, start, end, aligned, 2, IN_KIND, BLOCK)


def work_rows(segs, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """(tensor, chunk) for every program: cdiv(seg, chunk) per tensor, none for an empty one."""
    return [(t, k) for t, seg in enumerate(segs) for k in range(-(-seg // chunk))]


def pack(table: torch.Tensor, work: torch.Tensor, n_work: int, flat: torch.Tensor, scale: float,
         part: torch.Tensor, count: torch.Tensor, sum_sq: torch.Tensor, found: torch.Tensor,
         accumulate: bool = False, key: tuple | None = None) -> None:  # fmt: skip
    """One launch on a validated plan: packs, and writes Σx² to sum_sq and the flag to found (n_work >= 1); with
    accumulate, adds Σx² to sum_sq (one fp32 addition, as `sum_sq += Σx²` would) and ORs the flag into found.

    part: 2 * n_work fp32 scratch; count: one int32, 0 before the launch and after it. key: pack_key of these
    very arguments, kept by a caller that launches with them again (computed here otherwise)."""
    kind = KIND[flat.dtype]
    if key is None:
        key = pack_key(table, work, n_work, flat, part, count, sum_sq, found, accumulate)
    with on_device(flat):
        args = (table, work, n_work, flat.data_ptr(), part, count, sum_sq, found, scale)
        _PACK(key, (n_work,), args, _constexprs(kind, accumulate), NUM_WARPS)


def pack_key(table: torch.Tensor, work: torch.Tensor, n_work: int, flat: torch.Tensor, part: torch.Tensor,
             count: torch.Tensor, sum_sq: torch.Tensor, found: torch.Tensor, accumulate: bool) -> tuple:  # fmt: skip
    """The launch key of a pack launch with these arguments (launch_key, and whether it accumulates)."""
    return (launch_key(flat.get_device(), KIND[flat.dtype], n_work, flat.data_ptr(), table, work, part, count, sum_sq,
                       found), accumulate)  # fmt: skip


_CONSTEXPRS: dict[tuple[int, bool], dict] = {}


def _constexprs(kind: int, accumulate: bool) -> dict:
    """The pack kernel's constexprs for a bucket dtype and mode (one dict each, made once: read by the first launch
    of each key only)."""
    c = _CONSTEXPRS.get((kind, accumulate))
    if c is None:
        c = _CONSTEXPRS[(kind, accumulate)] = dict(OUT_KIND=kind, CHUNK=CHUNK, BLOCK=BLOCK, RBLOCK=RBLOCK,
                                                   ACCUMULATE=accumulate)  # fmt: skip
    return c


def unpack(table: torch.Tensor, work: torch.Tensor, n_work: int, flat: torch.Tensor) -> None:
    """One launch on a validated plan: every tensor of the table <- its segment of flat (n_work >= 1)."""
    flat_addr, kind = flat.data_ptr(), KIND[flat.dtype]
    key = launch_key(flat.get_device(), kind, n_work, flat_addr, table, work)
    with on_device(flat):
        _UNPACK(key, (n_work,), (table, work, flat_addr), dict(IN_KIND=kind, CHUNK=CHUNK, BLOCK=BLOCK), NUM_WARPS)


def launch_key(device: int, kind: int, n_work: int, flat_addr: int, *pointers: torch.Tensor) -> tuple:
    """All that picks the compiled variant of a pack or unpack launch (see launch.py): the device, the bucket's
    dtype, the integer arguments n_work and flat's address (equal to 1, divisible by 16, 32 or 64 bits) and each
    pointer's 16-byte alignment (tests/test_launch.py checks it against Triton's own specialization)."""
    return device, kind, n_work, flat_addr % 16, flat_addr >> 31 == 0, tuple(t.data_ptr() % 16 == 0 for t in pointers)


_PACK, _UNPACK = Launches(_pack_kernel), Launches(_unpack_kernel)
