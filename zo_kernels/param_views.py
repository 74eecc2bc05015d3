"""How the model's parameters relate to the optimizer's flat buffer, and what `p.grad` holds after backward.

- `alias`: a tensor over [offset, offset + numel) of a flat buffer that has a storage of its own. The
  parameters of ZeroOffloadAdamW are such aliases, not views: tools that deduplicate tensors by storage
  (safetensors, accelerate's save_state, HF save_pretrained) then see one tensor per parameter and save each.
  The alias keeps the flat buffer alive.
- `MovedGrad`: the placeholder left in `p.grad` once the gradient has gone to the host. It answers the
  norm and the scalar multiplication of gradient clipping from the host copy; anything else raises with
  instructions, so a framework that reads or changes `p.grad` otherwise fails loudly, never silently.
- `in_nested_backward`: whether autograd is running a backward inside another one (reentrant activation
  checkpointing runs one per checkpointed segment).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import numpy as np
import torch

_NUMPY_CODE = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<i2"}  # numpy has no bf16: int16 bits


class _ArrayInterface:
    """numpy's __array_interface__ (CPU) or __cuda_array_interface__ over a range of a tensor; holds the tensor."""

    def __init__(self, flat: torch.Tensor, offset: int, numel: int) -> None:
        self.keep = flat
        addr = flat.data_ptr() + offset * flat.element_size()
        iface = {"shape": (numel,), "typestr": _NUMPY_CODE[flat.dtype], "data": (addr, False)}
        if flat.device.type == "cpu":
            self.__array_interface__ = {**iface, "version": 3}
        else:
            self.__cuda_array_interface__ = {**iface, "version": 2}


def alias(flat: torch.Tensor, offset: int, numel: int, shape: torch.Size) -> torch.Tensor:
    """flat[offset : offset + numel].view(shape), as a tensor with a storage of its own (see the module doc)."""
    if numel == 0:
        return torch.empty(shape, dtype=flat.dtype, device=flat.device)
    if flat.device.type == "cpu":
        t = torch.from_numpy(np.asarray(_ArrayInterface(flat, offset, numel)))
    else:
        t = torch.as_tensor(_ArrayInterface(flat, offset, numel), device=flat.device)
    if flat.dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.view(shape)


def is_alias_of(p: torch.Tensor, flat: torch.Tensor, offset: int) -> bool:
    """Whether p's data still lies at flat[offset] with flat's dtype and device (the model is still connected)."""
    if p.dtype != flat.dtype or p.device != flat.device:
        return False
    return p.numel() == 0 or p.data_ptr() == flat.data_ptr() + offset * flat.element_size()


_DTYPE = attrgetter("dtype")


def all_aliases(params: list[torch.Tensor], flat: torch.Tensor, offsets: dict[torch.Tensor, int]) -> Callable[[], bool]:
    """A check that is_alias_of holds for every param, in a few C-level passes over the list (sizes, addresses,
    dtypes, devices) instead of one Python call per param; False: ask is_alias_of param by param (to name one)."""
    numels = tuple(p.numel() for p in params)
    nonempty = [p for p in params if p.numel()]
    base, size = flat.data_ptr(), flat.element_size()
    want = tuple(base + offsets[p] * size for p in nonempty)
    dtype, index = flat.dtype, flat.get_device()
    on = attrgetter("is_cuda" if flat.is_cuda else "is_cpu")  # (get_device() is -1 for the CPU and for meta alike)

    def check() -> bool:
        return (tuple(map(torch.Tensor.numel, params)) == numels and tuple(map(torch.Tensor.data_ptr, nonempty)) == want
                and set(map(_DTYPE, params)) <= {dtype} and all(map(on, params))
                and set(map(torch.Tensor.get_device, params)) <= {index})

    return check


MOVED_GRAD_HELP = (
    "this parameter's gradient was moved to the host by ZeroOffloadAdamW during backward: p.grad supports "
    "only a norm (torch.linalg.vector_norm of any order p >= 1 or inf; with several ranks a collective that every "
    "rank must call, as all do in clip_grad_norm_), an in-place multiplication by a scalar (what "
    "torch.nn.utils.clip_grad_norm_ does, so framework clipping works: the factor is applied on the host) and "
    "zero_() (model.zero_grad(set_to_none=False): a zero gradient is kept). To discard gradients call "
    "opt.zero_grad() or model.zero_grad()."
)

GRAD_SCALER_HELP = (
    "torch.amp.GradScaler cannot unscale ZeroOffloadAdamW's gradients (they were moved to the host during "
    "backward): drop the GradScaler, build the optimizer with loss_scale=\"dynamic\" (GradScaler's rule) and call "
    "opt.backward(loss) then opt.step(). An fp32 or bf16 model under torch.autocast(dtype=torch.bfloat16) needs no "
    "loss scale (Lightning: precision=\"bf16-mixed\", not \"16-mixed\")."
)

_aten = torch.ops.aten
_NORMS = (_aten.linalg_vector_norm.default, _aten._foreach_norm.Scalar)
_ZEROS = (_aten.zero_.default, _aten._foreach_zero_.default)
_MULS = (_aten.mul_.Tensor, _aten.mul_.Scalar, _aten._foreach_mul_.Tensor, _aten._foreach_mul_.Scalar)


class MovedGrad(torch.Tensor):
    """Placeholder in p.grad after the gradient left for the host: shape, dtype and device, no data.

    It answers what gradient clipping asks (torch.nn.utils.clip_grad_norm_, so HF Trainer and accelerate too):
    a norm is the true norm of the parameter's gradient on the host (summed over the micro-batches, averaged
    over the ranks, loss scale removed); an in-place multiplication by a scalar is applied to that gradient at
    step(); zero_() makes it zeros (kept, as torch keeps a zeroed p.grad). Anything else raises, saying so.
    """

    @staticmethod
    def __new__(cls, like: torch.Tensor, owner: Any = None, index: int = -1) -> MovedGrad:
        r = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        r._owner = weakref.ref(owner) if owner is not None else (lambda: None)
        r._index = index
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _NORMS:
            return _norms(func, args, kwargs)
        if func in _MULS:
            return _scale(func, args)
        if func in _ZEROS:
            return _zero(func, args)
        if func is _aten._amp_foreach_non_finite_check_and_unscale_.default:
            raise RuntimeError(GRAD_SCALER_HELP)
        raise RuntimeError(f"{func} on p.grad: {MOVED_GRAD_HELP}")

    def __repr__(self) -> str:
        return f"MovedGrad(shape={tuple(self.shape)}, dtype={self.dtype}: the gradient is on the host)"


def _by_owner(grads: list[Any]) -> dict[int, tuple[Any, list[int]]]:
    """{id(optimizer): (optimizer, positions in grads)} for the placeholders among grads."""
    owners: dict[int, tuple[Any, list[int]]] = {}
    for k, g in enumerate(grads):
        if isinstance(g, MovedGrad):
            owner = g._owner()
            if owner is None:
                raise RuntimeError("p.grad is a placeholder of an optimizer that no longer exists")
            owners.setdefault(id(owner), (owner, []))[1].append(k)
    return owners


def _norms(func: Any, args: Any, kwargs: dict) -> Any:
    foreach = func is _aten._foreach_norm.Scalar
    grads = list(args[0]) if foreach else [args[0]]
    ord_ = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    if not foreach and (kwargs.get("dim", args[2] if len(args) > 2 else None) is not None
                        or kwargs.get("keepdim", args[3] if len(args) > 3 else False)):  # fmt: skip
        raise RuntimeError(f"a norm over some dimensions of p.grad: {MOVED_GRAD_HELP}")
    dtype = kwargs.get("dtype")
    values: list[Any] = [None] * len(grads)
    for owner, where in _by_owner(grads).values():
        for k, v in zip(where, owner._host_grad_norms([grads[k]._index for k in where], ord_)):
            # fp32 for 16-bit params (as the host gradient is): in their dtype the norm rounded the clip factor
            # (2**-11 in fp16: beyond the oracle matrix's bound) and a norm past 65504 became inf
            like = grads[k].dtype if grads[k].dtype.itemsize >= 4 else torch.float32
            values[k] = torch.tensor(v, dtype=dtype or like, device=grads[k].device)
    for k, g in enumerate(grads):  # ordinary tensors in the same call (another optimizer's gradients)
        if values[k] is None:
            values[k] = torch.linalg.vector_norm(g, ord_, dtype=dtype)
    return values if foreach else values[0]


def _scale(func: Any, args: Any) -> Any:
    foreach = func in (_aten._foreach_mul_.Tensor, _aten._foreach_mul_.Scalar)
    grads = list(args[0]) if foreach else [args[0]]
    factor = args[1]
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise RuntimeError(f"p.grad multiplied by a tensor that is not a scalar: {MOVED_GRAD_HELP}")
    for owner, where in _by_owner(grads).values():
        owner._scale_host_grads([grads[k]._index for k in where], float(factor))
    for g in grads:
        if not isinstance(g, MovedGrad):
            g.mul_(factor)
    return None if foreach else args[0]  # the foreach op's schema returns nothing


def _zero(func: Any, args: Any) -> Any:
    """p.grad.zero_() (model.zero_grad(set_to_none=False)): the host gradient becomes zeros, kept, as in torch."""
    foreach = func is _aten._foreach_zero_.default
    grads = list(args[0]) if foreach else [args[0]]
    for owner, where in _by_owner(grads).values():
        owner._zero_host_grads([grads[k]._index for k in where])
    for g in grads:
        if not isinstance(g, MovedGrad):
            g.zero_()
    return None if foreach else args[0]


_BACKWARD_APPLY = torch.autograd.function.BackwardCFunction.apply.__code__


def in_nested_backward() -> bool:
    """True inside a backward run from a custom autograd Function's backward (reentrant checkpointing)."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is _BACKWARD_APPLY:
            return True
        f = f.f_back
    return False
