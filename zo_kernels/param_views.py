"""How the model's parameters relate to the optimizer's flat buffer, and what `p.grad` holds after backward.

- `alias`: a tensor over [offset, offset + numel) of a flat buffer that has a storage of its own. The
  parameters of ZeroOffloadAdamW are such aliases, not views: tools that deduplicate tensors by storage
  (safetensors, accelerate's save_state, HF save_pretrained) then see one tensor per parameter and save each.
  The alias keeps the flat buffer alive.
- `MovedGrad`: the placeholder left in `p.grad` once the gradient has gone to the host. Any operation on it
  raises with instructions, so a framework that clips or reads `p.grad` fails loudly instead of silently
  doing nothing.
- `in_nested_backward`: whether autograd is running a backward inside another one (reentrant activation
  checkpointing runs one per checkpointed segment).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

_NUMPY_CODE = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<i2"}  # numpy has no bf16: int16 bits


class _HostArray:
    """numpy's __array_interface__ over a range of a CPU tensor; holds the tensor."""

    def __init__(self, flat: torch.Tensor, offset: int, numel: int) -> None:
        self.keep = flat
        addr = flat.data_ptr() + offset * flat.element_size()
        self.__array_interface__ = {"shape": (numel,), "typestr": _NUMPY_CODE[flat.dtype], "data": (addr, False),
                                    "version": 3}  # fmt: skip


class _DeviceArray:
    """__cuda_array_interface__ over a range of a CUDA tensor; holds the tensor."""

    def __init__(self, flat: torch.Tensor, offset: int, numel: int) -> None:
        self.keep = flat
        addr = flat.data_ptr() + offset * flat.element_size()
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": _NUMPY_CODE[flat.dtype], "data": (addr, False),
                                         "version": 2}  # fmt: skip


def alias(flat: torch.Tensor, offset: int, numel: int, shape: torch.Size) -> torch.Tensor:
    """flat[offset : offset + numel].view(shape), as a tensor with a storage of its own (see the module doc)."""
    if numel == 0:
        return torch.empty(shape, dtype=flat.dtype, device=flat.device)
    if flat.device.type == "cpu":
        t = torch.from_numpy(np.asarray(_HostArray(flat, offset, numel)))
    else:
        t = torch.as_tensor(_DeviceArray(flat, offset, numel), device=flat.device)
    if flat.dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.view(shape)


def is_alias_of(p: torch.Tensor, flat: torch.Tensor, offset: int) -> bool:
    """Whether p's data still lies at flat[offset] with flat's dtype and device (the model is still connected)."""
    if p.dtype != flat.dtype or p.device != flat.device:
        return False
    return p.numel() == 0 or p.data_ptr() == flat.data_ptr() + offset * flat.element_size()


MOVED_GRAD_HELP = (
    "this parameter's gradient was moved to the host by ZeroOffloadAdamW during backward, so p.grad cannot be "
    "read or changed. To clip gradients pass max_grad_norm= to ZeroOffloadAdamW and turn the framework's own "
    "clipping off (HF Trainer: TrainingArguments(max_grad_norm=0); accelerate: do not call clip_grad_norm_); "
    "opt.stats['grad_norm'] reports the norm after each step. To discard gradients call opt.zero_grad() or "
    "model.zero_grad() (set_to_none=True)."
)


class MovedGrad(torch.Tensor):
    """Placeholder in p.grad after the gradient left for the host: shape, dtype and device only, no data."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> MovedGrad:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"{func} on p.grad: {MOVED_GRAD_HELP}")

    def __repr__(self) -> str:
        return f"MovedGrad(shape={tuple(self.shape)}, dtype={self.dtype}: the gradient is on the host)"


_BACKWARD_APPLY = torch.autograd.function.BackwardCFunction.apply.__code__


def in_nested_backward() -> bool:
    """True inside a backward run from a custom autograd Function's backward (reentrant checkpointing)."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is _BACKWARD_APPLY:
            return True
        f = f.f_back
    return False
