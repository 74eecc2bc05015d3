"""Quantized8bit: one Adam moment in 8 bits per element, blockwise, with an fp32 scale per block."""

from __future__ import annotations

from typing import Any

import torch

DEFAULT_BLOCK = 256
TINY = 2.0**-100  # a block whose absmax is below this is stored as zeros (levels / absmax must stay finite)


def _levels(signed: bool) -> float:
    return 127.0 if signed else 255.0


def check_block(block: Any) -> int:
    """Validate a block size: a multiple of 16 in [16, 256] (the kernels' vectors and their one-block buffer)."""
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"block must be an int, got {type(block).__name__}")
    if not (16 <= block <= 256 and block % 16 == 0):
        raise ValueError(f"block must be a multiple of 16 in [16, 256], got {block}")
    return block


def num_blocks(numel: int, block: int) -> int:
    """Scales needed for `numel` elements: ceil(numel / block)."""
    return -(-numel // block)


def quantize(t: torch.Tensor, *, signed: bool, block: int,
             noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(codes, scales) of the 1-D fp32 values `t` (a moment: m, or v >= 0 when unsigned), on t's device, in blocks of
    `block` from t's first element, as the kernels quantize (see Quantized8bit): to nearest, or with `noise` (signed
    only: an integer tensor of t's length, 16 random bits per element) stochastically as the step rounds exp_avg. A
    NaN gets code 0 (as the kernels' conversion gives it) and makes its block's scale NaN."""
    n = t.numel()
    x = t if signed else t.sqrt()
    pad = num_blocks(n, block) * block - n
    xb = torch.nn.functional.pad(x, (0, pad)).view(-1, block)
    amax = xb.abs().amax(1) if n else torch.zeros(0, device=t.device)
    small = amax < TINY
    scales = torch.where(small, torch.zeros_like(amax), amax)
    # (a tensor divided: a Python number over a tensor is computed as reciprocal x number, rounded twice)
    mult = torch.where(small, torch.zeros_like(amax), torch.full_like(amax, _levels(signed)) / amax)
    y = (xb * mult[:, None]).flatten()[:n]
    if noise is None:
        codes = torch.round(y)
    else:  # floor(y + r * 2^-16), the sum rounded to fp32 (the product is exact)
        codes = (y + noise.to(torch.float32) * 2.0**-16).floor_().clamp_(-_levels(signed), _levels(signed))
    codes = codes.nan_to_num_(0.0)
    return codes.to(torch.int8 if signed else torch.uint8), scales.contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, *, signed: bool, block: int) -> torch.Tensor:
    """The fp32 values of (codes, scales), on their device: scale / levels in fp32, times the code (squared when
    unsigned: the codes hold sqrt(v))."""
    # (over a tensor: CUDA divides a tensor by a Python number as a multiplication by its rounded reciprocal)
    d = (scales / torch.full_like(scales, _levels(signed))).repeat_interleave(block)[: codes.numel()]
    x = codes.float() * d
    return x if signed else x * x


class Quantized8bit:
    """One Adam moment stored blockwise in 8 bits: `codes` (one byte per element) and `scales` (fp32 per block).

    Signed (exp_avg): `codes` int8 in [-127, 127], x = code * (scale / 127), scale = the block's max |x|.
    Unsigned (exp_avg_sq, v >= 0): the codes hold sqrt(v) linearly: `codes` uint8, r = code * (scale / 255),
    v = r * r, scale = the block's max sqrt(v). Storing sqrt(v) halves v's dynamic range in bits (a block spans
    255^2 = 65025 : 1 of v) and costs nothing: the update computes sqrt(v) anyway. Chosen by measurement over
    quantizing v linearly in v^(1/4) and over bitsandbytes/torchao-style dynamic tree codes (the update
    m / sqrt(v)'s relative error on the moments of a 300-step GPT run: 1.01%, 1.02% and 1.38%).
    Quantizing a block (in fp32, every operation rounded to nearest even): mult = levels / absmax, code =
    round(x * mult), which lies in [-127, 127] (signed) or [0, 255] since |x| <= absmax; a block with absmax
    below 2^-100 is stored as zeros with scale 0; a NaN (only a diverged step makes one) gets code 0. In the Adam
    step a sqrt(v) past fp32 (v overflowed: |g| > ~5.8e20) is stored as fp32's largest, read back as v = inf:
    that element's update is 0, as with fp32 moments (an inf scale made the whole block NaN). The Adam step
    rounds exp_avg's codes stochastically instead: code = floor(x * mult + r * 2^-16) (the sum rounded to fp32),
    clamped to [-127, 127], r 16 random bits from (seed, step, element index) (cpu/adam.cpp's weyl16); so a code
    moves up with probability (the fraction of x * mult), E[code] = x * mult, and an element's m decays as exact
    Adam's in expectation once its gradient stops (rounded to nearest, 0.9 x code 1..4 rounds back to the same
    code for ever under a scale another element of its block holds up). exp_avg_sq's codes round to nearest: at
    beta2 = 0.999 stochastic rounding's error would persist ~1000 steps, a random walk of ~9 codes; rounded to
    nearest, a sqrt(v) whose gradient stops stays at its code while its block's scale holds, which only shortens
    that element's steps.
    Dequantizing: scale / levels in fp32, times the code. The last block may be short. `empty` (all codes and
    scales 0) represents zeros.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, *, signed: bool, block: int = DEFAULT_BLOCK) -> None:
        block = check_block(block)
        want = torch.int8 if signed else torch.uint8
        for t, name, dtype in ((codes, "codes", want), (scales, "scales", torch.float32)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise TypeError(f"{name} must have dtype {dtype} for signed={signed}, got {t.dtype}")
            if t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
                raise ValueError(f"{name} must be a 1-D contiguous CPU tensor, got {tuple(t.shape)} on {t.device}")
        if scales.numel() != num_blocks(codes.numel(), block):
            raise ValueError(f"scales has {scales.numel()} elements; {codes.numel()} codes in blocks of {block} need "
                             f"{num_blocks(codes.numel(), block)}")  # fmt: skip
        self.codes, self.scales, self.signed, self.block = codes, scales, bool(signed), block
        self._sealed = True

    def __setattr__(self, name: str, value: Any) -> None:
        # codes and scales are checked together, once: a swapped one (another dtype, a strided view) let the
        # kernels write past it, so the attributes are read-only; build a new Quantized8bit instead
        if getattr(self, "_sealed", False):
            raise AttributeError(f"Quantized8bit.{name} is read-only: build a new Quantized8bit (codes and scales "
                                 "are checked together when it is made)")  # fmt: skip
        object.__setattr__(self, name, value)

    @property
    def numel(self) -> int:
        """The number of elements (codes)."""
        return self.codes.numel()

    def __repr__(self) -> str:
        return f"Quantized8bit(numel={self.numel}, block={self.block}, signed={self.signed})"

    @classmethod
    def empty(cls, numel: int, *, signed: bool, block: int = DEFAULT_BLOCK) -> Quantized8bit:
        """All zeros: zero codes and zero scales."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be an int >= 0, got {numel!r}")
        block = check_block(block)
        codes = torch.zeros(numel, dtype=torch.int8 if signed else torch.uint8)
        return cls(codes, torch.zeros(num_blocks(numel, block)), signed=signed, block=block)

    @classmethod
    def from_float(cls, t: torch.Tensor, *, signed: bool, block: int = DEFAULT_BLOCK) -> Quantized8bit:
        """Quantize a 1-D contiguous fp32 CPU tensor (finite; >= 0 when unsigned) as the kernels do."""
        block = check_block(block)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"t must be a 1-D contiguous fp32 CPU tensor, got {t.dtype} {tuple(t.shape)} {t.device}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError("t must be finite")
        if not signed and bool((t < 0).any()):
            raise ValueError("t must be >= 0 for an unsigned (exp_avg_sq) moment")
        codes, scales = quantize(t, signed=signed, block=block)
        return cls(codes, scales, signed=signed, block=block)

    def to_float(self) -> torch.Tensor:
        """The dequantized values, fp32, [numel] (what the kernel reads)."""
        return dequantize(self.codes, self.scales, signed=self.signed, block=self.block)

    def narrow(self, start: int, length: int) -> Quantized8bit:
        """Elements [start, start + length) as a view sharing codes and scales (whole blocks only)."""
        for x, name in ((start, "start"), (length, "length")):
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ValueError(f"{name} must be an int >= 0, got {x!r}")
        if start + length > self.numel:
            raise ValueError(f"start + length = {start + length} exceeds numel = {self.numel}")
        if start % self.block:
            raise ValueError(f"start must be a multiple of the block ({self.block}), got {start}")
        if length % self.block and start + length != self.numel:
            raise ValueError(f"length must be a multiple of the block ({self.block}) unless the view ends at the "
                             f"end (a partial block shares its scale with what follows it), got {length}")  # fmt: skip
        nb = num_blocks(length, self.block)
        return Quantized8bit(self.codes.narrow(0, start, length), self.scales.narrow(0, start // self.block, nb),
                             signed=self.signed, block=self.block)  # fmt: skip
