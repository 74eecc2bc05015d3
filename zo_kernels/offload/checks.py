"""Argument checks of ZeroOffloadAdamW: each raises naming the argument, and none changes anything."""

from __future__ import annotations

from typing import Any

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_THREADS = 4096


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
    """`params` as param-group dicts, each parameter a distinct dense floating-point leaf tensor."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or dicts, got a single tensor")
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
        out.append({**g, "params": ps})
    return out
