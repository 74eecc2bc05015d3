"""The formats of Adam's moments on the host (state_dtype): fp32, bf16, or 8-bit blockwise; one flat pair per rank.

The fp32 masters stay fp32 in every format. "8bit" keeps exp_avg as signed and exp_avg_sq as unsigned codes with one
fp32 scale per block of BLOCK_8BIT elements (zo_kernels.Quantized8bit). Its blocks are laid out per parameter: every
parameter starts on a block boundary of the flat space (the layout aligns it), so each parameter's blocks are its
own, the same at any world size (checkpoints are per parameter and resume bitwise across world sizes), and every run
of the update and every partition starts on a block boundary.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

BLOCK_8BIT = 256  # elements per 8-bit block: one fp32 scale each (0.03 B/param per moment)
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", "8bit": "8bit"}
MOMENTS = ("exp_avg", "exp_avg_sq")
# The stochastic rounding (bf16 moments, 8-bit exp_avg) hashes a 32-bit element index: no kernel call crosses a
# multiple of SR_PERIOD (sr_pieces), and each piece has its own seed (sr_args).
SR_PERIOD = 1 << 32


def sr_pieces(x: int, y: int) -> Iterator[tuple[int, int]]:
    """[x, y) cut at the multiples of SR_PERIOD (one piece below 2**32 elements a partition)."""
    while x < y:
        z = min(y, (x // SR_PERIOD + 1) * SR_PERIOD)
        yield x, z
        x = z


def sr_args(base: int, x: int) -> dict:
    """The rounding's seed and hash index for a kernel call starting at partition offset x (within one piece of
    sr_pieces) of a rank whose seed base is `base` (rank << 40): base + x // SR_PERIOD, x % SR_PERIOD. So each element
    rounds by its place in the partition, whoever updates it (the host's tiles, in memory or on NVMe, or
    gpu_fraction's tail on the device) and however the calls are split; no two elements of a partition share their
    random bits."""
    return {"seed": base + x // SR_PERIOD, "index0": x % SR_PERIOD}


def check_state_dtype(state_dtype: Any) -> str:
    """torch.float32, torch.bfloat16 or "8bit" (also "fp32", "bf16") -> its name; TypeError/ValueError otherwise."""
    if isinstance(state_dtype, str):
        if state_dtype in ("fp32", "bf16", "8bit"):
            return state_dtype
        raise ValueError(f"state_dtype must be torch.float32, torch.bfloat16 or '8bit', got {state_dtype!r}")
    if isinstance(state_dtype, torch.dtype):
        if state_dtype in NAMES:
            return NAMES[state_dtype]
        raise ValueError(f"state_dtype must be torch.float32, torch.bfloat16 or '8bit', got {state_dtype}")
    raise TypeError(f"state_dtype must be torch.float32, torch.bfloat16 or '8bit', got {type(state_dtype).__name__}")


def _quantized() -> Any:
    from .. import Quantized8bit  # (zo_kernels' package namespace: imported after this module)

    return Quantized8bit


def block_of(fmt: str) -> int:
    """Elements per block of the format: where runs, partitions and tiles must start (1: anywhere)."""
    return BLOCK_8BIT if fmt == "8bit" else 1


def bytes_per_element(fmt: str) -> float:
    """Host bytes per element of both moments together (the scales of 8-bit included, on average)."""
    return {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 2 * 4 / BLOCK_8BIT}[fmt]


class Moments:
    """exp_avg and exp_avg_sq of `numel` elements in format `fmt`, zero at first.

    fp32/bf16: two tensors of that dtype. 8bit: two Quantized8bit (exp_avg signed, exp_avg_sq unsigned). `pair`:
    these moments over existing ones (e.g. an NVMe tile's buffers) instead of new zeros.
    """

    def __init__(self, fmt: str, numel: int, pair: tuple[Any, Any] | None = None) -> None:
        self.fmt, self.numel, self.block = fmt, numel, block_of(fmt)
        if pair is not None:
            self.pair = pair
        elif fmt == "8bit":
            q = _quantized()
            self.pair = (q.empty(numel, signed=True, block=BLOCK_8BIT), q.empty(numel, signed=False, block=BLOCK_8BIT))
        else:
            dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
            self.pair = (torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype))

    @property
    def nbytes(self) -> int:
        """Host bytes the two moments take (codes and scales for 8-bit)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding the moments' bits."""
        if self.fmt == "8bit":
            return [t for q in self.pair for t in (q.codes, q.scales)]
        return list(self.pair)

    def view(self, a: int, b: int) -> tuple[Any, Any]:
        """(exp_avg, exp_avg_sq) of elements [a, b) for the kernel: views (8-bit: whole blocks, or to the end)."""
        if self.fmt == "8bit":
            return tuple(q.narrow(a, b - a) for q in self.pair)
        return tuple(t[a:b] for t in self.pair)

    def _blocks(self, a: int, b: int) -> tuple[int, int]:
        """[a, b) widened to whole blocks (a is on a block boundary; the end may be the last, short block)."""
        return a, min(self.numel, -(-b // self.block) * self.block)

    def get(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 copies of elements [a, b) of both moments (dequantized; a on a block boundary)."""
        if self.fmt == "8bit":
            return tuple(q.to_float()[: b - a] for q in self.view(*self._blocks(a, b)))
        return tuple(t.float() for t in self.view(a, b))

    def set(self, a: int, b: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Elements [a, b) from fp32 values (rounded or quantized into the format). 8-bit: a is on a block boundary
        and the rest of [a, b)'s last block holds zeros (a parameter's padding), which it keeps."""
        if self.fmt != "8bit":
            for dst, x in zip(self.pair, (exp_avg, exp_avg_sq)):
                dst[a:b].copy_(x.reshape(-1))
            return
        lo, hi = self._blocks(a, b)
        for dst, x, signed in zip(self.view(lo, hi), (exp_avg, exp_avg_sq), (True, False)):
            padded = torch.zeros(hi - lo, dtype=torch.float32)
            padded[: b - a] = x.reshape(-1)
            q = _quantized().from_float(padded, signed=signed, block=BLOCK_8BIT)
            dst.codes.copy_(q.codes)
            dst.scales.copy_(q.scales)

    def raw(self, a: int, b: int) -> dict[str, torch.Tensor]:
        """The exact bits of elements [a, b) (copies; 8-bit: a on a block boundary, the scales of the blocks it
        touches): what a checkpoint keeps to resume bitwise."""
        if self.fmt == "8bit":
            out = {}
            for name, q in zip(MOMENTS, self.pair):
                out[f"{name}_codes"] = q.codes[a:b].clone()
                out[f"{name}_scales"] = q.scales[a // self.block : -(-b // self.block)].clone()
            return out
        return {name: t[a:b].clone() for name, t in zip(MOMENTS, self.pair)}

    def set_raw(self, a: int, b: int, raw: dict[str, torch.Tensor]) -> None:
        """Elements [a, b) from raw() bits of the same format (checked by check_raw)."""
        if self.fmt == "8bit":
            for name, q in zip(MOMENTS, self.pair):
                q.codes[a:b].copy_(raw[f"{name}_codes"])
                q.scales[a // self.block : -(-b // self.block)].copy_(raw[f"{name}_scales"])
        else:
            for name, t in zip(MOMENTS, self.pair):
                t[a:b].copy_(raw[name])

    def zero_(self) -> None:
        for t in self.tensors():
            t.zero_()


def cut_raw(raw: dict[str, torch.Tensor], x: int, y: int, block: int) -> dict[str, torch.Tensor]:
    """Elements [x, y) of raw() bits whose element 0 starts a block (x on a block too): the codes or values of those
    elements, the scales of the blocks they touch (views)."""
    return {k: t[x // block : -(-y // block)] if "scales" in k else t[x:y] for k, t in raw.items()}


def raw_spec(fmt: str, n: int) -> dict[str, tuple[torch.dtype, int]]:
    """The raw() entries of a parameter of n elements: name -> (dtype, numel)."""
    if fmt == "8bit":
        blocks = -(-n // BLOCK_8BIT)
        return {"exp_avg_codes": (torch.int8, n), "exp_avg_scales": (torch.float32, blocks),
                "exp_avg_sq_codes": (torch.uint8, n), "exp_avg_sq_scales": (torch.float32, blocks)}  # fmt: skip
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    return {name: (dtype, n) for name in MOMENTS}


def check_raw(raw: Any, fmt: str, n: int, where: str) -> None:
    """Raise ValueError/TypeError unless `raw` is a raw() dict of a parameter of n elements in format fmt."""
    if not isinstance(raw, dict):
        raise TypeError(f"{where} must be a dict, got {type(raw).__name__}")
    for key, (dtype, numel) in raw_spec(fmt, n).items():
        t = raw.get(key)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 or t.numel() != numel:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}[{key!r}] must be a 1-D {dtype} tensor of {numel} elements, got {got}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}[{key!r}] holds inf or NaN")
