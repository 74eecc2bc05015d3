"""A model built on the meta device, materialised by ZeroOffloadAdamW parameter by parameter (`init=ParamInit(...)`).

Each tensor's values come from `fn(name, out, generator)`: `out` is an fp32 tensor of the tensor's shape on
`device`, `generator` a torch.Generator on `device` seeded with `tensor_seed(seed, name)`. The values depend on the
seed, the name and the device's random number generator only, never on the world size or the rank, so a model
materialised on any number of ranks equals the same model built normally and filled by the same calls.

The optimizer makes one such fp32 tensor at a time, writes this rank's part of it into the fp32 masters and its
16-bit cast into the device's flat buffer (stages 1, 2) or this rank's shard (stage 3), then drops it: no full fp32
copy of the model exists anywhere, and the fp32 temporaries are one parameter's.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

InitFn = Callable[[str, torch.Tensor, torch.Generator], None]
MAX_SEED = 2**31  # tensor_seed(seed, name) < 2**63: torch.Generator.manual_seed's range


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor `name` (its name in module.named_parameters() / named_buffers()):
    seed * 2**32 + crc32(name in UTF-8)."""
    return seed * 2**32 + zlib.crc32(name.encode())


@dataclass(frozen=True)
class ParamInit:
    """How ZeroOffloadAdamW materialises a model built on the meta device (`init=ParamInit(fn, device=...)`).

    Args:
        fn: fn(name, out, generator) fills `out` (fp32 zeros of the tensor's shape on `device`) in place and returns
            None; called for every trainable parameter, and for every frozen parameter and buffer left on meta.
        device: where the model trains: "cuda", "cuda:0", "cpu" or a torch.device.
        seed: an int in [0, 2**31); tensor `name`'s generator is seeded with tensor_seed(seed, name).
    """

    fn: InitFn
    device: torch.device | str = "cuda"
    seed: int = 0

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"ParamInit: fn must be callable(name, out, generator), got {type(self.fn).__name__}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"ParamInit: seed must be an int in [0, 2**31), got {self.seed!r}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"ParamInit: device must be a CUDA device or the CPU, got {self.device!r}") from e
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"ParamInit: device must be a CUDA device or the CPU, got {self.device!r}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"ParamInit: device {self.device!r}, but no CUDA device is available here")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            if device.index >= torch.cuda.device_count():
                raise ValueError(f"ParamInit: device {self.device!r}, but this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s)")  # fmt: skip
        object.__setattr__(self, "device", device)

    @torch.no_grad()
    def values(self, name: str, shape: torch.Size) -> torch.Tensor:
        """Tensor `name`'s values: fp32, `shape`, on `device`."""
        out = torch.zeros(shape, dtype=torch.float32, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(tensor_seed(self.seed, name))
        got: Any = self.fn(name, out, gen)
        if got is not None:
            raise TypeError(f"ParamInit: fn must fill `out` in place and return None; for {name!r} it returned a "
                            f"{type(got).__name__}")  # fmt: skip
        if out.dtype != torch.float32 or out.shape != shape or out.device != self.device:
            raise ValueError(f"ParamInit: fn changed `out` for {name!r} (it must stay fp32, {tuple(shape)}, on "
                             f"{self.device})")  # fmt: skip
        return out


def check_init(init: Any, module: torch.nn.Module | None, trainable: list[torch.Tensor],
               offload_optimizer: str) -> dict[torch.Tensor, str] | None:  # fmt: skip
    """With `init`: every trainable parameter is on the meta device and named in `module`; {param: its name}."""
    if init is None:
        if any(p.is_meta for p in trainable):
            raise ValueError("a parameter is on the meta device: pass init=zo_kernels.ParamInit(fn, device=...) to "
                             "materialise the model shard by shard, or build it on a real device")  # fmt: skip
        return None
    if not isinstance(init, ParamInit):
        raise TypeError(f"init must be a zo_kernels.ParamInit or None, got {type(init).__name__}")
    if module is None:
        raise ValueError("init= names each tensor by its name in the model: pass the model (ZeroOffloadAdamW(model, "
                         "init=...) or module=model)")  # fmt: skip
    if offload_optimizer != "cpu":
        raise ValueError("init= with offload_optimizer='nvme' is not supported yet: materialise with "
                         "offload_optimizer='cpu', save a checkpoint, load it with 'nvme'")  # fmt: skip
    names: dict[torch.Tensor, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(p, name)
    for i, p in enumerate(trainable):
        if not p.is_meta:
            raise ValueError(f"init= materialises a model built on the meta device, but trainable param {i} is on "
                             f"{p.device}")  # fmt: skip
        if p not in names:
            raise ValueError(f"init=: trainable param {i} is not a parameter of the module, so it has no name")
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_meta and (weakref.getweakrefs(t) or t._use_count() > 1):  # what swap_tensors refuses
            raise ValueError(f"init=: {name!r} is referenced elsewhere (a weakref or a view of it), so it cannot "
                             "become its device tensor in place: build the optimizer before taking references")
    return names


def swap_in(t: torch.Tensor, value: torch.Tensor) -> None:
    """Meta tensor `t` becomes `value` (its device and dtype), keeping its identity (modules, param groups and hooks
    hold it) and its attributes."""
    new = torch.nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else value
    new.__dict__.update(t.__dict__)  # (swap_tensors swaps the attributes too)
    torch.utils.swap_tensors(t, new)


def follower_values(init: ParamInit, module: torch.nn.Module, trainable: set[int],
                    dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """The values of the module's frozen parameters and buffers still on the meta device, each from init, whole, in
    `dtype` (floating point) on init's device, as (tensor, values) pairs for swap_in: made (and fn checked) before
    anything is swapped, so an fn failing on one of them leaves the whole model on meta (the trainable ones were
    already in place, and a second try was refused: "trainable param 0 is on cpu")."""
    seen: set[int] = set()
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    out = []
    for name, t in named:
        if id(t) in trainable or id(t) in seen or not t.is_meta:
            continue
        seen.add(id(t))
        out.append((t, init.values(name, t.shape).to(dtype if t.is_floating_point() else t.dtype)))
    return out  # (fp32 temporaries: one at a time; the values take what the tensors take once swapped in)
