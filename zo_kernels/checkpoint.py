"""Crash-safe, world-size independent checkpoints of a model and its optimizer."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .offload import ZeroOffloadAdamW

FORMAT = "zo_kernels.checkpoint/1"


def _rank(optimizer: Any) -> int:
    if isinstance(optimizer, ZeroOffloadAdamW):
        return optimizer.rank
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _check_objects(path: Any, model: Any, optimizer: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    return Path(path)


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    **extra: Any) -> None:  # fmt: skip
    """Write model, optimizer state and `extra` (plain values) to `path`, atomically.

    The file is written to a temporary file in the same directory, flushed and fsync'ed, then renamed over
    `path` (and the directory fsync'ed): a crash at any moment leaves either the previous checkpoint or the
    new one, never a torn file. The optimizer state is world-size independent; with a ZeroOffloadAdamW on
    several ranks this is a collective (every rank calls it) and rank 0 writes.
    """
    path = _check_objects(path, model, optimizer)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"path: directory {path.parent} does not exist")
    payload = {"format": FORMAT, "model": model.state_dict(),
               "optimizer": optimizer.state_dict() if optimizer is not None else None, "extra": extra}  # fmt: skip
    if _rank(optimizer) == 0:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power loss
        finally:
            os.close(dir_fd)
    if isinstance(optimizer, ZeroOffloadAdamW) and optimizer.world > 1:
        optimizer._collective("the barrier after saving a checkpoint", dist.barrier)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:  # fmt: skip
    """Load a checkpoint written by save_checkpoint (any world size) into model and optimizer; returns `extra`.

    Everything is checked before anything changes: a model whose parameter names or shapes differ from the
    checkpoint's is refused with a ValueError naming the first difference. If the checkpoint has no optimizer
    state but a ZeroOffloadAdamW is given, its fp32 masters are refreshed from the loaded weights (so they are
    never stale) and a warning says so (the bits below the weights' dtype are lost; moments stay as they are).
    """
    path = _check_objects(path, model, optimizer)
    if not path.is_file():
        raise FileNotFoundError(f"path: no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"path: {path} is not a readable checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"path: {path} is not a zo_kernels checkpoint (format {FORMAT!r} expected)")
    saved, current = ckpt["model"], model.state_dict()
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        raise ValueError(f"checkpoint and model differ: missing in the checkpoint {missing[:5]}, "
                         f"not in the model {unexpected[:5]}")  # fmt: skip
    for key, value in current.items():
        if tuple(saved[key].shape) != tuple(value.shape):
            raise ValueError(f"checkpoint model[{key!r}] has shape {tuple(saved[key].shape)}, "
                             f"the model's has {tuple(value.shape)}")  # fmt: skip
    state = ckpt.get("optimizer")
    if optimizer is not None and state is not None:
        if isinstance(optimizer, ZeroOffloadAdamW):
            optimizer.check_state_dict(state)
        elif len(state.get("param_groups", [])) != len(optimizer.param_groups):
            raise ValueError("checkpoint optimizer state has a different number of param groups")
    model.load_state_dict(saved)
    if optimizer is not None:
        if state is not None:
            optimizer.load_state_dict(state)
        elif isinstance(optimizer, ZeroOffloadAdamW):
            warnings.warn(f"{path} holds no optimizer state: the fp32 masters were refreshed from the loaded "
                          "weights (bits below their dtype are lost); Adam's moments and steps are unchanged",
                          stacklevel=2)  # fmt: skip
            optimizer.refresh_masters_from_model()
    return dict(ckpt.get("extra") or {})
