"""The parts of torch.optim's Optimizer contract that CPUAdam and ZeroOffloadAdamW share: torch's AdamW options
(accepted where they mean what they say here, refused by name where they do not), named parameters, and the
state-dict hooks of a class that builds or loads its state dict itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# torch.optim.AdamW's options, their defaults, and which values each optimizer here takes. `maximize` is
# supported (the kernel's grad_scale is negated: -g, as torch's maximize). The others select an implementation or
# an algorithm this kernel does not have: the default value (and False) is accepted, True refused by name.
TORCH_OPTIONS = {"amsgrad": False, "maximize": False, "foreach": None, "fused": None, "capturable": False,
                 "differentiable": False}  # fmt: skip
# Which implementation of the same algorithm torch ran: a state dict saved with any of them loads (the loading
# optimizer keeps its own values).
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
_REFUSED_WHY = {
    "amsgrad": "the fused CPU kernel keeps no max_exp_avg_sq state; use torch.optim.AdamW(amsgrad=True)",
    "foreach": "the update is one fused C++ pass over each parameter, never torch's foreach kernels",
    "fused": "the update is this library's own fused CPU kernel, not torch's fused Adam",
    "capturable": "the update runs on the CPU outside any CUDA graph",
    "differentiable": "the C++ update is not recorded by autograd",
}


def check_torch_options(options: dict[str, Any], where: str, loaded: bool = False) -> dict[str, Any]:
    """torch's AdamW options found in `options` (a group, keyword arguments; with `loaded`, a saved group, whose
    implementation options are not ours to check), checked."""
    out = {}
    for key, default in TORCH_OPTIONS.items():
        if key not in options or (loaded and key in IMPLEMENTATION):
            continue
        value = options[key]
        if not (isinstance(value, bool) or (value is None and default is None)):
            raise TypeError(f"{where}: {key} must be a bool{' or None' if default is None else ''}, "
                            f"got {type(value).__name__}")  # fmt: skip
        if value and key in _REFUSED_WHY:
            raise ValueError(f"{where}: {key}=True is not supported ({_REFUSED_WHY[key]}); {key}="
                             f"{default} is accepted")  # fmt: skip
        out[key] = value
    if "decoupled_weight_decay" in options and not isinstance(options["decoupled_weight_decay"], bool):
        raise TypeError(f"{where}: decoupled_weight_decay must be a bool, "
                        f"got {type(options['decoupled_weight_decay']).__name__}")  # fmt: skip
    return out


def check_state_dict_layout(state_dict: Any, n_groups: int) -> tuple[list[Any], dict[Any, Any]]:
    """The (param_groups, state) of a state dict with `n_groups` groups, checked only for their outer shape."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise ValueError("state_dict must have 'param_groups' (a list) and 'state' (a dict)")
    if len(groups) != n_groups:
        raise ValueError(f"state_dict has {len(groups)} param groups, this optimizer {n_groups}")
    return groups, state


def check_group_keys(saved: dict[str, Any], keys: tuple[str, ...], where: str, kind: str) -> None:
    """A saved param group holds the rule's hyper-parameters (a state dict of another rule, e.g. SGD's, would load
    its lr and start the moments afresh without a word)."""
    missing = [k for k in keys if k not in saved]
    if missing:
        raise ValueError(f"{where} has no {missing} (not an {kind} state dict?)")


def keep_implementation(saved: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
    """A saved group to load into `group`: the implementation options stay the loading optimizer's."""
    return {**saved, **{k: group[k] for k in IMPLEMENTATION if k in group}}


def split_names(params: list[Any], where: str) -> tuple[list[Any], list[str] | None]:
    """(tensors, names): `model.named_parameters()`'s (name, tensor) pairs split as torch's add_param_group does."""
    named = [isinstance(p, tuple) for p in params]
    if not any(named):
        return params, None
    if not all(named):
        raise ValueError(f"{where}: all optimizer params should be with/without names. Some param names are missing")
    for i, pair in enumerate(params):
        if len(pair) != 2 or not isinstance(pair[0], str):
            raise TypeError(f"{where} param {i}: a named parameter must be a (str, tensor) pair, got {pair!r:.80}")
    return [p for _, p in params], [n for n, _ in params]


def state_dict_with_hooks(opt: torch.optim.Optimizer, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`build()`'s state dict with the optimizer's state-dict pre- and post-hooks run around it, as torch's
    Optimizer.state_dict runs them (a post-hook's non-None result replaces the dict)."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    state_dict = build()
    for hook in opt._optimizer_state_dict_post_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def run_load_pre_hooks(opt: torch.optim.Optimizer, state_dict: Any) -> Any:
    """The load-state-dict pre-hooks, as torch's Optimizer.load_state_dict runs them first (on a shallow copy; a
    hook's non-None result replaces it)."""
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def run_load_post_hooks(opt: torch.optim.Optimizer) -> None:
    """The load-state-dict post-hooks, run after a successful load."""
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)
