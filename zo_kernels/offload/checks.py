"""Argument checks of ZeroOffloadAdamW: each raises naming the argument, and none changes anything."""

from __future__ import annotations

from typing import Any

import torch

from ..cpu_adam import MAX_THREADS  # noqa: F401  (the kernels' bound on `threads`, re-exported)
from ..optim_contract import check_torch_options, split_names
from ..scratch import check_dir

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_int(x: Any, name: str, minimum: int, required: bool = False) -> int | None:
    """An int >= minimum, or None (unless required)."""
    if x is None:
        if required:
            raise ValueError(f"{name} is missing")
        return None
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int or None, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def check_params(params: Any) -> list[dict[str, Any]]:
    """`params` as param-group dicts, each parameter a distinct dense floating-point leaf tensor; (name, tensor)
    pairs (`model.named_parameters()`) give the group torch's `param_names`; torch's AdamW options checked."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or dicts, got a single tensor")
    if isinstance(params, (str, bytes, dict)) or not hasattr(params, "__iter__"):
        raise TypeError(f"params must be the model (a torch.nn.Module), an iterable of its parameters or of param "
                        f"group dicts, got {type(params).__name__}")  # fmt: skip
    groups = list(params)
    if not groups:
        raise ValueError("params is empty")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen: set[int] = set()
    out = []
    for gi, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"param group {gi} must be a dict with a 'params' key")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        ps, names = split_names(ps, f"param group {gi}")
        check_torch_options(g, f"param group {gi}")
        for pi, p in enumerate(ps):
            where = f"param group {gi} param {pi}"
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{where} is a {type(p).__name__}, not a tensor")
            if not p.is_leaf:
                raise ValueError(f"{where} is not a leaf tensor (it was computed from others); pass model parameters")
            if not p.is_floating_point():
                raise TypeError(f"{where} has dtype {p.dtype}; parameters must be floating point")
            if p.layout != torch.strided:
                raise ValueError(f"{where} has layout {p.layout}; only dense parameters are supported")
            if id(p) in seen:
                raise ValueError(f"{where} appears more than once in params")
            seen.add(id(p))
        out.append({**g, "params": ps, **({"param_names": names} if names is not None else {})})
    if len({"param_names" in g for g in out}) > 1:
        raise ValueError("all optimizer param groups should be with/without names (param_names)")
    return out


def check_module_covered(module: torch.nn.Module, groups: list[dict[str, Any]]) -> None:
    """With module=, the optimizer owns the whole model (its dtype, every trainable parameter's gradient): each
    trainable parameter of `module` must be in `params` (one left out would get gradients no one applies, and was
    taken for a parameter unfrozen since: step() refused it, naming it frozen), and each trainable one of `params`
    a parameter of `module`."""
    listed = {id(p) for g in groups for p in g["params"]}
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in listed]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"params leaves out trainable parameters of module: {', '.join(missing[:5])}{more}. "
                         "ZeroOffloadAdamW trains every trainable parameter of the model it is given: list them "
                         "in params (a param group of their own for other hyper-parameters), or freeze them "
                         "(p.requires_grad_(False)) before building it")  # fmt: skip
    owned = {id(p) for p in module.parameters()}
    for gi, g in enumerate(groups):
        for pi, p in enumerate(g["params"]):
            if p.requires_grad and id(p) not in owned:
                raise ValueError(f"param group {gi} param {pi} (shape {tuple(p.shape)}) is not a parameter of "
                                 "module")  # fmt: skip


def check_trainable(groups: list[dict[str, Any]]) -> tuple[list[torch.Tensor], torch.device]:
    """The checked groups' trainable parameters (some in every group, with elements) and their one device."""
    trainable = [p for g in groups for p in g["params"] if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters (none has requires_grad=True)")
    if sum(p.numel() for p in trainable) == 0:
        raise ValueError("the trainable parameters have no elements")
    for gi, g in enumerate(groups):
        if not any(p.requires_grad for p in g["params"]):
            raise ValueError(f"param group {gi} has no trainable parameter")
    device = trainable[0].device
    for i, p in enumerate(trainable):
        if p.device != device:
            raise ValueError(f"all params must be on one device: param {i} is on {p.device}, param 0 on {device}")
    if device.type not in ("cpu", "cuda", "meta"):  # (meta: with init=, materialize.check_init)
        raise ValueError(f"params must be on a CUDA device or the CPU, got {device}")
    return trainable, device


def check_offload(offload_optimizer: Any, nvme_dir: Any) -> str | None:
    """offload_optimizer "cpu" or "nvme"; nvme_dir an existing writable directory, given with "nvme" only."""
    if offload_optimizer not in ("cpu", "nvme"):
        raise ValueError(f"offload_optimizer must be 'cpu' or 'nvme', got {offload_optimizer!r}")
    if offload_optimizer == "cpu":
        if nvme_dir is not None:
            raise ValueError("nvme_dir is used only with offload_optimizer='nvme' (offload_param='nvme' needs it too), "
                             "got offload_optimizer='cpu'")
        return None
    if nvme_dir is None:
        raise ValueError("offload_optimizer='nvme' needs nvme_dir=, a directory for the optimizer state's files")
    return check_dir(nvme_dir, "nvme_dir")


def check_stage(stage: Any, offload_param: Any, module: Any, nvme_dir: Any, delayed: bool, dtype: Any) -> None:
    """ZeRO stage 1, 2 or 3; offload_param (None, "cpu", "nvme") only at stage 3, which needs the module; "nvme"
    keeps the shard beside the optimizer state on NVMe (ZeRO-Infinity), in 16 bits, without DPU."""
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if offload_param not in (None, "cpu", "nvme"):
        raise ValueError(f"offload_param must be None, 'cpu' or 'nvme', got {offload_param!r}")
    if offload_param == "nvme":
        if nvme_dir is None:
            raise ValueError("offload_param='nvme' keeps the parameter shard beside the optimizer state: it needs "
                             "offload_optimizer='nvme' and nvme_dir")
        if delayed:
            raise ValueError("offload_param='nvme' does not work with delay_update_after (the background update "
                             "would rewrite the parameters' file while forward reads it): use offload_param='cpu'")
        if dtype == torch.float32:
            raise ValueError("offload_param='nvme' keeps 16-bit parameters: dtype must be torch.bfloat16 or "
                             "torch.float16")
    if offload_param is not None and stage != 3:
        raise ValueError(f"offload_param={offload_param!r} needs stage=3 (the parameters are partitioned only there)")
    if stage == 3 and module is None:
        raise ValueError("stage=3 gathers each module's parameters around its forward and backward: pass the model "
                         "(ZeroOffloadAdamW(model, stage=3, ...) or module=model)")
