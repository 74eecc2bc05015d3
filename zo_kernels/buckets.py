"""Fused cast and bucket packing of gradients: `cast`, `pack`, `unpack`.

On CUDA tensors the Triton kernels in `zo_kernels.kernels` run (one launch per call). On CPU tensors an
exact torch reference runs; `impl="triton"` forces the kernels (on CPU that needs TRITON_INTERPRET=1 set
before triton is first imported — that is how the kernels are tested without a GPU).
All values are computed in fp32 and rounded once: cast(x) == (x.float() * scale).to(dtype).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter

import torch

from .cpu_adam import _real, bump_version, check_memory, check_no_overlap
from .kernels.plan import Packed, PackPlan, check_float, check_writable
from .versions import default_impl, triton_problem

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
IMPLS = ("triton", "torch")
PLAN_CACHE_SIZE = 256  # plans kept by pack()/unpack() (least recently used dropped): buckets of a model
_plans: OrderedDict[tuple, PackPlan] = OrderedDict()
_DTYPE = attrgetter("dtype")
_TENSORS = repeat(torch.Tensor)

__all__ = ["Packed", "PackPlan", "cast", "layout", "pack", "plan", "unpack"]

def _choose_impl(impl: str | None, device: torch.device) -> str:
    if impl is None:
        return default_impl(device.type)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"impl='triton' on {device.type} tensors needs TRITON_INTERPRET=1 (set before "
                         "triton is imported); without it only CUDA tensors can run the kernels")  # fmt: skip
    if impl == "triton" and triton_problem():
        raise ValueError(f"impl='triton': {triton_problem()}")
    return impl


def _check_dtype(dtype, name: str = "dtype") -> torch.dtype:
    if dtype not in FLOATS:
        raise TypeError(f"{name} must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
    return dtype


def _check_tensor_list(tensors, name: str = "tensors") -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        check_float(t, f"{name}[{i}]")
        if t.device != tensors[0].device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on {tensors[0].device}")
    return tensors


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
    check_float(x, "x")
    check_memory(x, "x")  # (a storage resized under x: torch's own read of it segfaulted)
    dtype = _check_dtype(dtype)
    scale = _real(scale, "scale")
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    else:
        check_float(out, "out")
        if out.dtype != dtype:
            raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")
        if out.numel() != x.numel():
            raise ValueError(f"out has {out.numel()} elements, x has {x.numel()}")
        if out.device != x.device:
            raise ValueError(f"out is on {out.device}, x on {x.device}")
        check_writable(out, "out")
        if not (out.data_ptr() == x.data_ptr() and out.dtype == x.dtype):  # in place is fine, overlap is not
            check_no_overlap({"x": x, "out": out})
    if _choose_impl(impl, x.device) == "triton":
        from .kernels import cast as kcast

        kcast.cast(x.resolve_neg(), out, scale)
        bump_version(out)
    else:
        out.copy_((x.float() * scale).reshape(out.shape))
    return out




def plan(tensors: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None, align: int = 1) -> PackPlan:
    """A launch plan for packing tensors of these sizes and dtypes (and unpacking them): validated once, kept
    by the caller, then `plan.pack(tensors, scale=, out=)` / `plan.unpack(flat, tensors)` every call."""
    tensors = _check_tensor_list(tensors)
    dtype = _check_dtype(tensors[0].dtype if dtype is None and tensors else dtype or torch.float32)
    offsets, total = layout(tensors, align)
    segs = tuple(b - a for a, b in zip(offsets, offsets[1:] + (total,)))
    device = tensors[0].device if tensors else torch.device("cpu")
    return PackPlan(tuple(t.numel() for t in tensors), tuple(t.dtype for t in tensors), dtype, offsets, segs, total,
                    device)  # fmt: skip


def _cached(key: tuple, build) -> PackPlan:
    p = _plans.get(key)
    if p is None:
        p = _plans[key] = build()
        if len(_plans) > PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    return p


def pack(tensors: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None, scale: float = 1.0,
         out: torch.Tensor | None = None, align: int = 1, impl: str | None = None,
         into: tuple[torch.Tensor, torch.Tensor] | None = None) -> Packed:  # fmt: skip
    """Cast, scale and pack many tensors into one flat bucket; flags inf/NaN and sums squares in the same pass.

    Segment i starts at offsets[i] (a multiple of `align`); the gaps between segments are zero-filled.
    The bucket's size is the sum of the aligned sizes. One kernel launch for any number of tensors; the launch
    plan is cached by the tensors' sizes and dtypes (see `plan` to keep one yourself). into=(sum_sq, found_inf):
    running totals over several calls, updated in place (Σx² added, the flag ORed) instead of new tensors.
    """
    if isinstance(tensors, (list, tuple)) and tensors and all(map(isinstance, tensors, _TENSORS)):
        dtypes = tuple(map(_DTYPE, tensors))
        if dtype is not None:
            _check_dtype(dtype)
        if type(align) is not int:
            layout([], align)  # raises the TypeError
        key = ("pack", tensors[0].device, dtype or dtypes[0], align, tuple(map(torch.Tensor.numel, tensors)), dtypes)
        p = _cached(key, lambda: plan(tensors, dtype=dtype, align=align))
    else:
        p = plan(tensors, dtype=dtype, align=align)
        if not p.n and isinstance(out, torch.Tensor):
            p.device = out.device
    return p.pack(tensors if isinstance(tensors, (list, tuple)) else list(tensors), scale=scale, out=out,
                  impl=_choose_impl(impl, p.device), into=into)  # fmt: skip


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], *, offsets: Sequence[int] | None = None,
           impl: str | None = None) -> None:  # fmt: skip
    """Copy each segment of `flat` back into its tensor, cast to that tensor's dtype (one launch).

    offsets: where each tensor's segment starts (`Packed.offsets`); segments may not overlap. None: the dense
    layout of `pack(..., align=1)`, and then `flat` must hold exactly the tensors' elements (a bucket packed with
    another align has gaps: pass its offsets)."""
    check_float(flat, "flat")
    check_memory(flat, "flat")
    if flat.dim() != 1:
        raise ValueError(f"flat must be 1-D, got shape {tuple(flat.shape)}")
    if not (isinstance(tensors, (list, tuple)) and tensors and all(map(isinstance, tensors, _TENSORS))):
        tensors = _check_tensor_list(tensors)
        if not tensors:
            return
    if offsets is None:
        offsets, dense = layout(tensors, 1)
        if flat.numel() != dense:
            raise ValueError(f"flat has {flat.numel()} elements, the tensors {dense}: without offsets= flat must be "
                             "the dense (align=1) bucket; pass offsets= (pack's Packed.offsets)")  # fmt: skip
    if isinstance(offsets, torch.Tensor) or not isinstance(offsets, Sequence) or len(offsets) != len(tensors):
        raise ValueError(f"offsets must be a sequence of {len(tensors)} ints, got {offsets!r}")
    offsets = tuple(offsets)
    if not set(map(type, offsets)) <= {int}:
        i = next(i for i, o in enumerate(offsets) if type(o) is not int)
        raise ValueError(f"offsets[{i}] must be an int >= 0, got {offsets[i]!r}")
    numels, dtypes = tuple(map(torch.Tensor.numel, tensors)), tuple(map(_DTYPE, tensors))

    def build() -> PackPlan:
        checked = _check_tensor_list(tensors)
        if checked[0].device != flat.device:
            raise ValueError(f"tensors are on {checked[0].device}, flat on {flat.device}")
        for i, (off, n) in enumerate(zip(offsets, numels)):
            if off < 0:
                raise ValueError(f"offsets[{i}] must be an int >= 0, got {off!r}")
            if off + n > flat.numel():
                raise ValueError(f"offsets[{i}] + tensors[{i}].numel() = {off + n} > flat.numel() = {flat.numel()}")
        spans = sorted((o, o + n, i) for i, (o, n) in enumerate(zip(offsets, numels)) if n)
        for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
            if start < end:
                raise ValueError(f"offsets: the segments of tensors[{min(i, j)}] and tensors[{max(i, j)}] overlap "
                                 f"(tensors[{i}] covers flat[{end - numels[i]}:{end}], tensors[{j}] starts at {start})")
        total = max(o + n for o, n in zip(offsets, numels))
        return PackPlan(numels, dtypes, flat.dtype, offsets, numels, total, flat.device)

    p = _cached(("unpack", flat.device, flat.dtype, offsets, numels, dtypes), build)
    p.unpack(flat.resolve_neg(), tensors, impl=_choose_impl(impl, flat.device))
