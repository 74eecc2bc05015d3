"""Fused cast and bucket packing of gradients: `cast`, `pack`, `unpack`.

On CUDA tensors the Triton kernels in `zo_kernels.kernels` run (one launch per call). On CPU tensors an
exact torch reference runs; `impl="triton"` forces the kernels (on CPU that needs TRITON_INTERPRET=1 set
before triton is first imported — that is how the kernels are tested without a GPU).
All values are computed in fp32 and rounded once: cast(x) == (x.float() * scale).to(dtype).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .cpu_adam import _real, bump_version, check_memory, check_no_overlap, sum_squares

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
IMPLS = ("triton", "torch")


class Packed(NamedTuple):
    """The result of `pack`.

    Args:
        flat: 1-D bucket of the packed values (a view of `out` when one was given).
        offsets: where each tensor starts in `flat` (multiples of `align`).
        found_inf: 0-dim bool tensor on the device: some scaled value is inf/NaN or overflows the dtype.
        sum_sq: 0-dim fp32 tensor on the device: sum of squares of the scaled values, accumulated in fp32.
    """

    flat: torch.Tensor
    offsets: tuple[int, ...]
    found_inf: torch.Tensor
    sum_sq: torch.Tensor


_warned_fallback = False


def _choose_impl(impl: str | None, device: torch.device) -> str:
    global _warned_fallback
    if impl is not None:
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
        if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"impl='triton' on {device.type} tensors needs TRITON_INTERPRET=1 (set before "
                             "triton is imported); without it only CUDA tensors can run the kernels")  # fmt: skip
        return impl
    if device.type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        if not _warned_fallback:
            warnings.warn("triton is not installed: zo_kernels packs CUDA tensors with the multi-pass torch "
                          "path (pip install 'zo-kernels[triton]')", stacklevel=3)  # fmt: skip
            _warned_fallback = True
        return "torch"
    return "triton"


def _check_float(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOATS:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense strided tensor, got layout {t.layout}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")


def _check_writable(t: torch.Tensor, name: str) -> None:
    """An output must not need grad: autograd would refuse the write halfway (after earlier outputs changed)."""
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{name} requires grad: it cannot be written in place here (use torch.no_grad() or "
                           f"{name}.detach())")  # fmt: skip
    check_memory(t, name, written=t.device.type == "cpu")


def _check_dtype(dtype, name: str = "dtype") -> torch.dtype:
    if dtype not in FLOATS:
        raise TypeError(f"{name} must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
    return dtype


def _check_tensor_list(tensors, name: str = "tensors") -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        _check_float(t, f"{name}[{i}]")
        if t.device != tensors[0].device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on {tensors[0].device}")
    return tensors


def _check_out(out, dtype: torch.dtype, numel: int, device: torch.device, name: str = "out") -> None:
    _check_float(out, name)
    if out.dtype != dtype:
        raise TypeError(f"{name} has dtype {out.dtype}, expected {dtype}")
    if out.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(out.shape)}")
    if out.numel() < numel:
        raise ValueError(f"{name} has {out.numel()} elements, needs at least {numel}")
    if out.device != device:
        raise ValueError(f"{name} is on {out.device}, the tensors on {device}")


def layout(tensors: Sequence[torch.Tensor], align: int = 1) -> tuple[tuple[int, ...], int]:
    """Offsets of each tensor in a bucket whose segments start at multiples of `align`, and the bucket size."""
    if isinstance(align, bool) or not isinstance(align, int):
        raise TypeError(f"align must be an int, got {type(align).__name__}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    offsets, pos = [], 0
    for t in tensors:
        offsets.append(pos)
        pos += -(-t.numel() // align) * align
    return tuple(offsets), pos


def cast(x: torch.Tensor, dtype: torch.dtype, *, scale: float = 1.0, out: torch.Tensor | None = None,
         impl: str | None = None) -> torch.Tensor:  # fmt: skip
    """(x.float() * scale).to(dtype) in one pass; fp32/fp16/bf16 in and out; writes `out` if given."""
    _check_float(x, "x")
    dtype = _check_dtype(dtype)
    scale = _real(scale, "scale")
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    else:
        _check_float(out, "out")
        if out.dtype != dtype:
            raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")
        if out.numel() != x.numel():
            raise ValueError(f"out has {out.numel()} elements, x has {x.numel()}")
        if out.device != x.device:
            raise ValueError(f"out is on {out.device}, x on {x.device}")
        _check_writable(out, "out")
        if not (out.data_ptr() == x.data_ptr() and out.dtype == x.dtype):  # in place is fine, overlap is not
            check_no_overlap({"x": x, "out": out})
    if _choose_impl(impl, x.device) == "triton":
        from .kernels import cast as kcast

        kcast.cast(x.resolve_neg(), out, scale)
        bump_version(out)
    else:
        out.copy_((x.float() * scale).reshape(out.shape))
    return out


def pack(tensors: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None, scale: float = 1.0,
         out: torch.Tensor | None = None, align: int = 1, impl: str | None = None) -> Packed:  # fmt: skip
    """Cast, scale and pack many tensors into one flat bucket; flags inf/NaN and sums squares in the same pass.

    Segment i starts at offsets[i] (a multiple of `align`); the gaps between segments are zero-filled.
    The bucket's size is the sum of the aligned sizes. One kernel launch for any number of tensors.
    """
    tensors = [t.resolve_neg() for t in _check_tensor_list(tensors)]  # the kernels read raw values
    if dtype is None:
        dtype = tensors[0].dtype if tensors else torch.float32
    dtype = _check_dtype(dtype)
    scale = _real(scale, "scale")
    offsets, total = layout(tensors, align)
    device = tensors[0].device if tensors else (out.device if isinstance(out, torch.Tensor) else torch.device("cpu"))
    if out is not None:
        _check_out(out, dtype, total, device)
        _check_writable(out, "out")
        check_no_overlap({"out": out, **{f"tensors[{i}]": t for i, t in enumerate(tensors)}})
        flat = out[:total]
    else:
        flat = torch.empty(total, dtype=dtype, device=device)
    impl = _choose_impl(impl, device)
    segs = [b - a for a, b in zip(offsets, offsets[1:] + (total,))]
    if impl == "triton":
        from .kernels import pack as kpack

        stats = kpack.pack(tensors, offsets, segs, flat, scale)
        bump_version(flat)
        return Packed(flat, offsets, stats[1] > 0, stats[0])
    # The exact torch path. On the CPU, when the bucket holds the values unchanged (same dtype, scale 1: the
    # offload step's case), one C++ pass per tensor copies it and sums its squares and flags inf/NaN.
    exact = scale == 1.0 and all(t.dtype == dtype for t in tensors)
    cpu = device.type == "cpu"
    sum_sq = torch.zeros((), dtype=torch.float32, device=device)
    squares, nonfinite = 0.0, False
    for t, off, seg in zip(tensors, offsets, segs):
        src, dst = t.reshape(-1), flat[off : off + t.numel()]
        if cpu and exact and t.numel():
            s, bad = sum_squares(src.contiguous(), out=dst)
            squares, nonfinite = squares + s, nonfinite or bad
        else:
            dst.copy_(src if scale == 1.0 else src.float() * scale)
            if not exact:
                sum_sq += (src.float() * scale).square().sum()
        flat[off + t.numel() : off + seg].zero_()
    if cpu:
        if not exact and total:
            nonfinite = sum_squares(flat)[1]
        found_inf = torch.tensor(nonfinite)
        if exact:
            sum_sq = torch.tensor(squares, dtype=torch.float32)
    else:
        found_inf = ~torch.isfinite(flat).all() if total else torch.zeros((), dtype=torch.bool, device=device)
        if exact:
            sum_sq = flat.float().square().sum()
    return Packed(flat, offsets, found_inf, sum_sq)


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], *, offsets: Sequence[int] | None = None,
           impl: str | None = None) -> None:  # fmt: skip
    """Copy each segment of `flat` back into its tensor, cast to that tensor's dtype (one launch)."""
    _check_float(flat, "flat")
    if flat.dim() != 1:
        raise ValueError(f"flat must be 1-D, got shape {tuple(flat.shape)}")
    tensors = _check_tensor_list(tensors)
    if tensors and tensors[0].device != flat.device:
        raise ValueError(f"tensors are on {tensors[0].device}, flat on {flat.device}")
    if offsets is None:
        offsets, _ = layout(tensors, 1)
    if isinstance(offsets, torch.Tensor) or not isinstance(offsets, Sequence) or len(offsets) != len(tensors):
        raise ValueError(f"offsets must be a sequence of {len(tensors)} ints, got {offsets!r}")
    for i, (off, t) in enumerate(zip(offsets, tensors)):
        if isinstance(off, bool) or not isinstance(off, int) or off < 0:
            raise ValueError(f"offsets[{i}] must be an int >= 0, got {off!r}")
        if off + t.numel() > flat.numel():
            raise ValueError(f"offsets[{i}] + tensors[{i}].numel() = {off + t.numel()} > flat.numel() = {flat.numel()}")
    for i, t in enumerate(tensors):
        _check_writable(t, f"tensors[{i}]")
    check_no_overlap({"flat": flat, **{f"tensors[{i}]": t for i, t in enumerate(tensors)}})
    if _choose_impl(impl, flat.device) == "triton":
        from .kernels import pack as kpack

        kpack.unpack(flat.resolve_neg(), tensors, list(offsets))
        bump_version(*tensors)
        return
    for t, off in zip(tensors, offsets):
        t.copy_(flat[off : off + t.numel()].reshape(t.shape))
