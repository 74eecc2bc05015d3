"""gpu_fraction's tail on the device: its fp32 masters and Adam's moments in the run's format (state_dtype), and the
AdamW step that updates them there.

The tail keeps its moments in the format the host keeps the head's (formats.py), so a checkpoint holds the same bits
whatever the fraction.
- On a GPU, every format by zo_kernels/kernels/adam.py's Triton kernel in one pass (16, 18 or 26 bytes per element):
  CPU Adam's arithmetic operation for operation, and each element's random bits hashed from its partition offset as
  the host hashes them, so each element's new master and moments are the host kernel's bits: the run does not
  depend on the fraction, bit for bit, in every format.
- Elsewhere (the CPU stand-in for the device, and the reference the kernel is compared with), fp32 moments are
  updated in place by torch's fused AdamW; bf16 and 8-bit moments in torch ops: decoded to fp32 a chunk at a time,
  updated (bf16: by the fused kernel; 8-bit: by torch ops with the host's guard, guarded_adamw), and encoded back as
  CPU Adam stores them (cpu/adam.cpp):
- bf16: rounded stochastically: 16 random bits added to the fp32 bits, then truncated; the bits come from the host
  kernel's counter hash of (seed, step, element index), exp_avg's from its low 16 bits, exp_avg_sq's from its high
  16; seed and index from the element's partition offset (formats.sr_args), as the host's, so the bits do not
  depend on the chunks or the fraction;
- 8-bit: requantized per block of BLOCK_8BIT from the block's new absmax (zo_kernels.quant8.quantize), exp_avg's
  codes rounded stochastically with the host kernel's bits (weyl16: from the same key and index); a parameter
  starts on a block, the split and every chunk too, so every block is whole in one chunk.
In torch ops only the update's fp32 rounding differs from the host's (torch's fused kernel against ours), as with
fp32 moments.

Device workspace: none for the Triton kernel; in torch ops, per chunk of CHUNK_NUMEL / 4 elements, its fp32 gradient,
the two decoded moments and (bf16) the rounding's 64-bit integers: about 40 bytes per element, 160 MiB; fp32 moments
need only the gradient's copy, 64 MiB.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._cpu import update_cap
from ..quant8 import dequantize, num_blocks, quantize
from ..versions import default_impl
from .formats import BLOCK_8BIT, MOMENTS, block_of, raw_spec, sr_args, sr_pieces

# Elements per fused AdamW call on the tail: its fp32 scaled gradient is a copy of this many elements (64 MiB of device
# workspace, whatever the tail's size; a 1.3B model's tail would otherwise need a copy of gigabytes).
CHUNK_NUMEL = 1 << 24
M32 = 0xFFFFFFFF
# How the tail is updated: "auto" (the Triton kernel on CUDA where Triton runs it, torch ops elsewhere:
# versions.default_impl), "triton" (tests: the kernel on CPU tensors, through Triton's interpreter), "torch".
IMPL = "auto"


def _mul32(x: Any, c: int) -> Any:
    """(x * c) mod 2**32 for x in [0, 2**32) (an int, or an int64 tensor) and a 32-bit constant c, without leaving
    int64's range."""
    return ((x & 0xFFFF) * c + (((x >> 16) * (c & 0xFFFF)) << 16)) & M32


def _mix32(x: Any) -> Any:
    """cpu/adam.cpp's mix32 (xor-shift-multiply) on a uint32 value: an int, or an int64 tensor holding them."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sr_key(seed: int, step: int) -> int:
    """cpu/adam.cpp's sr_key: the hash of (seed, step) that each element's index is mixed with."""
    h = _mix32((seed & M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seed >> 32) & M32))
    h = _mix32(h ^ (step & M32))
    return _mix32(h ^ ((step >> 32) & M32))


def weyl16(n: int, seed: int, step: int, index0: int, device: torch.device) -> torch.Tensor:
    """The 8-bit exp_avg's 16 random bits (int64) of the n elements of a CPU Adam call with this seed at this step
    whose first element has index `index0`: element i's (uint32(index0 + i) * 0x9E3779B9 + sr_key(seed, step)) mod
    2**32, its top 16 bits (cpu/adam.cpp's weyl16)."""
    index = torch.arange(index0, index0 + n, dtype=torch.int64, device=device) & M32
    return ((_mul32(index, 0x9E3779B9) + sr_key(seed, step)) & M32) >> 16


def round_bf16_sr(m: torch.Tensor, v: torch.Tensor, seed: int, step: int,
                  index0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """exp_avg and exp_avg_sq (1-D fp32, one length) rounded to bf16 as CPU Adam rounds the elements of a call with this
    seed at this step whose first element has index `index0`: element i's hash h = mix32(uint32(index0 + i) ^ key),
    exp_avg adds h's low 16 bits, exp_avg_sq its high 16, then the low 16 bits are dropped; NaN becomes 0x7fc0."""
    index = torch.arange(index0, index0 + m.numel(), dtype=torch.int64, device=m.device) & M32
    h = _mix32(index ^ sr_key(seed, step))
    out = []
    for x, r in ((m, h & 0xFFFF), (v, h >> 16)):
        bits = ((x.view(torch.int32).long() & M32) + r) >> 16
        bits = torch.where(x.isnan(), 0x7FC0, bits & 0xFFFF)
        out.append(torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16))
    return out[0], out[1]


def decode(fmt: str, views: list[torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values of the first n elements of moments held in `views` (DeviceState._views: exp_avg and exp_avg_sq;
    8-bit codes and scales from a block's start), on their device (fp32: the views themselves)."""
    if fmt != "8bit":
        return tuple(t[:n].float() for t in views)
    mc, ms, vc, vs = views
    return tuple(dequantize(c, sc, signed=signed, block=BLOCK_8BIT)[:n]
                 for c, sc, signed in ((mc, ms, True), (vc, vs, False)))  # fmt: skip


def encode(fmt: str, views: list[torch.Tensor], n: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           sr: tuple[int, int, int] | None = None) -> None:  # fmt: skip
    """Store fp32 values (on the views' device) as the first n elements of the moments in `views`: bf16 rounded to
    nearest even, 8-bit quantized per block to nearest (the rest of the last block, past n, keeping its values); or
    with sr = (seed, step, index of element 0) as CPU Adam's step stores them: bf16 stochastically, 8-bit exp_avg's
    codes stochastically (the rest of its last block hashed on from n)."""
    if fmt == "bf16" and sr is not None:
        exp_avg, exp_avg_sq = round_bf16_sr(exp_avg, exp_avg_sq, sr[0], sr[1], index0=sr[2])
    if fmt != "8bit":
        for dst, x in zip(views, (exp_avg, exp_avg_sq)):
            dst[:n].copy_(x)
        return
    for (codes, scales), x, signed in zip((views[:2], views[2:]), (exp_avg, exp_avg_sq), (True, False)):
        if codes.numel() > n:  # the rest of the last block as it is
            x = torch.cat([x, dequantize(codes, scales, signed=signed, block=BLOCK_8BIT)[n:]])
        noise = None  # (with sr the rest of the last block is rounded anew too: zero padding, where the host
        if signed and sr is not None:  # leaves its zero codes, which round to zero)
            noise = weyl16(x.numel(), sr[0], sr[1], sr[2], x.device)
        c, sc = quantize(x, signed=signed, block=BLOCK_8BIT, noise=noise)
        codes.copy_(c)
        scales.copy_(sc)


class DeviceState:
    """The tail's fp32 masters and moments on the device, in format `fmt` ("fp32", "bf16", "8bit"), moments zero.

    Args:
        fmt: the moments' format.
        master: the tail's fp32 masters, on the device (kept, not copied).
        seed, offset: the stochastic rounding's (bf16 moments, 8-bit exp_avg): element i rounds as the host rounds
            partition offset offset + i on a rank whose seed base is `seed` (formats.sr_args: rank << 40).
    """

    def __init__(self, fmt: str, master: torch.Tensor, seed: int = 0, offset: int = 0) -> None:
        self.fmt, self.master, self.seed, self.offset = fmt, master, seed, offset
        self.numel, self.block = master.numel(), block_of(fmt)
        n, dev = self.numel, master.device
        if fmt == "8bit":
            nb = num_blocks(n, BLOCK_8BIT)
            self.moments = [torch.zeros(n, dtype=torch.int8, device=dev), torch.zeros(nb, device=dev),
                            torch.zeros(n, dtype=torch.uint8, device=dev), torch.zeros(nb, device=dev)]  # fmt: skip
        else:
            dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
            self.moments = [torch.zeros(n, dtype=dtype, device=dev) for _ in MOMENTS]

    @property
    def nbytes(self) -> int:
        """Device bytes of the masters and the moments (8-bit: codes and scales)."""
        return sum(t.numel() * t.element_size() for t in (self.master, *self.moments))

    def _widen(self, b: int) -> int:
        """The end of [a, b)'s last block (a is on a block boundary; the tail's last block may be short)."""
        return min(self.numel, -(-b // self.block) * self.block)

    def get(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 values of elements [a, b) of both moments, on the host (copies; a on a block boundary): the bits are
        copied to the host and decoded there (no device memory beyond them; the host's division, exact)."""
        views = self._views(a, self._widen(b))
        local = [t.cpu() for t in views]
        out = decode(self.fmt, local, b - a)
        shared = self.fmt == "fp32" and local[0].data_ptr() == views[0].data_ptr()  # (the CPU stand-in's fp32 views)
        return tuple(x.clone() for x in out) if shared else out

    def set(self, a: int, b: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Elements [a, b) from fp32 values: encoded on the host (bf16 rounded to nearest even; 8-bit quantized, a on
        a block boundary, the rest of the last block keeping its values: a parameter's padding, zeros), then the
        bits copied to the device."""
        views = self._views(a, self._widen(b))
        local = [t.cpu() for t in views]
        encode(self.fmt, local, b - a, exp_avg.reshape(-1).float().cpu(), exp_avg_sq.reshape(-1).float().cpu())
        for dst, src in zip(views, local):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)

    def raw(self) -> list[torch.Tensor]:
        """The tensors holding the moments' bits, on the host (copies of a device's; formats.Moments.tensors()'s
        order)."""
        return [t.cpu() for t in self.moments]

    def set_raw(self, a: int, b: int, raw: dict[str, torch.Tensor]) -> None:
        """Elements [a, b) from formats.Moments.raw() bits (8-bit: a on a block boundary, the scales of its blocks)."""
        for dst, key in zip(self._views(a, b), raw_spec(self.fmt, 0)):  # (the views are in raw()'s key order)
            dst.copy_(raw[key])

    def _views(self, a: int, b: int) -> list[torch.Tensor]:
        """The moments' tensors of elements [a, b) (8-bit: a on a block; the scales of its blocks)."""
        if self.fmt != "8bit":
            return [t[a:b] for t in self.moments]
        blk = BLOCK_8BIT
        mc, ms, vc, vs = self.moments
        return [mc[a:b], ms[a // blk : -(-b // blk)], vc[a:b], vs[a // blk : -(-b // blk)]]

    def _pieces(self, a: int, b: int, size: int | None = None) -> list[tuple[int, int, dict]]:
        """[a, b) in tail coordinates cut where the partition offsets cross a multiple of formats.SR_PERIOD (and every
        `size` elements from each cut), each piece with the rounding's seed and index of its first element
        (formats.sr_args)."""
        o = self.offset
        return [(z - o, min(y, z + (size or y)) - o, sr_args(self.seed, z))
                for x, y in sr_pieces(o + a, o + b) for z in range(x, y, size or y - x)]  # fmt: skip

    def step(self, grad: torch.Tensor, grad_scale: float, runs: list, hparams: list[dict]) -> None:
        """AdamW over `runs` (tail coordinates: (group, a, b, step, factor)) with the device gradient `grad` (16-bit or
        fp32, the tail's), on the current stream."""
        master = self.master
        if (IMPL if IMPL != "auto" else default_impl(master.device.type)) == "triton":
            from ..kernels.adam import adam_step

            for gi, a0, b0, step, factor in runs:
                h = hparams[gi]
                for a, b, sr in self._pieces(a0, b0):
                    adam_step(master[a:b], grad[a:b], self._views(a, b), self.fmt, step=step, lr=float(h["lr"]),
                              betas=h["betas"], eps=float(h["eps"]), weight_decay=float(h["weight_decay"]),
                              grad_scale=grad_scale * factor, maximize=bool(h["maximize"]),
                              key=sr_key(sr["seed"], step), index0=sr["index0"])  # fmt: skip
            return
        chunk = CHUNK_NUMEL if self.fmt == "fp32" else max(BLOCK_8BIT, CHUNK_NUMEL >> 2)
        for gi, a0, b0, step, factor in runs:
            h = hparams[gi]
            steps = torch.full((), float(step), dtype=torch.float32, device=master.device)
            for x, y, sr in self._pieces(a0, b0, chunk):
                g = grad[x:y].float() * (grad_scale * factor)  # (a copy: the landing buffer keeps the gradient)
                views = self._views(x, self._widen(y))
                m, v = (t[x:y] for t in self.moments) if self.fmt == "fp32" else decode(self.fmt, views, y - x)
                if self.fmt == "8bit":
                    guarded_adamw(master[x:y], g, m, v, step=step, hparams=h)
                else:
                    torch._fused_adamw_([master[x:y]], [g], [m], [v], [], [steps], lr=float(h["lr"]),
                                        beta1=float(h["betas"][0]), beta2=float(h["betas"][1]),
                                        weight_decay=float(h["weight_decay"]), eps=float(h["eps"]), amsgrad=False,
                                        maximize=bool(h["maximize"]))  # fmt: skip
                if self.fmt != "fp32":
                    encode(self.fmt, views, y - x, m, v, sr=(sr["seed"], step, sr["index0"]))


def guarded_adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int,
                  hparams: dict) -> None:  # fmt: skip
    """AdamW in place in torch ops (fp32 `p`, `m`, `v`, scaled gradient `g`) with the 8-bit format's guard: the
    denominator is at least |m| x update_cap (cpu/adam.cpp), as the host kernel's with 8-bit moments."""
    lr, (b1, b2), eps = float(hparams["lr"]), hparams["betas"], float(hparams["eps"])
    if hparams["maximize"]:
        g = -g
    if hparams["weight_decay"]:
        p.mul_(1.0 - lr * float(hparams["weight_decay"]))
    m.lerp_(g, 1.0 - b1)
    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
    denom = v.sqrt().mul_(1.0 / math.sqrt(1.0 - b2**step)).add_(eps)
    cap = update_cap(step, b1, b2)
    if cap:
        capped = m.abs().mul_(cap)
        denom = torch.where(capped > denom, capped, denom)
    p.addcdiv_(m, denom, value=-lr / (1.0 - b1**step))
