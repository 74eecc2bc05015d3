"""Crash-safe, world-size independent checkpoints of a model and its optimizer."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import socket
import tempfile
import warnings
from collections import OrderedDict
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


# What torch.load(weights_only=True) reads back, by exact type (np.float64 is a float subclass it cannot load).
_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.nn.Parameter, torch.Size,
           torch.dtype, torch.device)  # fmt: skip
_CONTAINERS = (dict, OrderedDict, list, tuple, set)


def _check_loadable(value: Any, name: str) -> None:
    """Raise TypeError naming the first part of `value` that load_checkpoint could not read back."""
    if type(value) in _LEAVES:
        return
    if type(value) not in _CONTAINERS:
        raise TypeError(f"{name} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint "
                        "cannot load back (weights_only): use plain Python values, tensors, lists, tuples and "
                        "dicts")  # fmt: skip
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for k, v in items:
        if isinstance(value, dict):
            _check_loadable(k, f"{name} key {k!r}")
        _check_loadable(v, f"{name}[{k!r}]")


def _check_payload(ckpt: Any, path: Path, model: torch.nn.Module, optimizer: Any) -> tuple[Any, dict[str, Any]]:
    """Everything load_checkpoint relies on, checked before anything changes; returns (optimizer state, extra)."""
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"path: {path} is not a zo_kernels checkpoint (format {FORMAT!r} expected)")
    saved, current = ckpt.get("model"), _full_state(model, optimizer)
    if not isinstance(saved, dict):
        raise ValueError(f"path: {path} holds no 'model' state dict")
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        raise ValueError(f"checkpoint and model differ: missing in the checkpoint {missing[:5]}, "
                         f"not in the model {unexpected[:5]}")  # fmt: skip
    for key, (value, shape) in current.items():
        got = saved[key]
        if not isinstance(got, torch.Tensor):
            raise ValueError(f"checkpoint model[{key!r}] is a {type(got).__name__}, not a tensor")
        if tuple(got.shape) != tuple(shape):
            raise ValueError(f"checkpoint model[{key!r}] has shape {tuple(got.shape)}, "
                             f"the model's has {tuple(shape)}")  # fmt: skip
        if got.is_floating_point() != value.is_floating_point() or got.is_complex() != value.is_complex():
            raise ValueError(f"checkpoint model[{key!r}] is {got.dtype}, the model's is {value.dtype}")
    extra = ckpt.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"checkpoint extra is a {type(extra).__name__}, not a dict")
    state = ckpt.get("optimizer")
    if optimizer is not None and state is not None:
        if not (isinstance(state, dict) and isinstance(state.get("state"), dict)
                and isinstance(state.get("param_groups"), list)):  # fmt: skip
            raise ValueError("checkpoint optimizer state is not a state dict ('state' dict and 'param_groups' list)")
        if isinstance(optimizer, ZeroOffloadAdamW):
            optimizer._check_between_steps()
            optimizer.check_state_dict(state)
        else:
            _check_optimizer_state(state, optimizer)
    return state, dict(extra or {})


def _full_state(model: torch.nn.Module, optimizer: Any) -> dict[str, tuple[torch.Tensor, torch.Size]]:
    """model.state_dict() as {key: (tensor, its full shape)}: a ZeRO-3 parameter is empty outside a gather, its shape
    is its layout's. The checks of a load run before anything is gathered (at stage 3 under the delayed update a
    write gather lands the pending update: a refused checkpoint would have moved the run)."""
    owners = [o for o in _owners(model, optimizer) if not o._closed and o.shards is not None]
    for o in owners:  # (the keys and dtypes of state_dict(), its parameters not gathered: no collective, no read)
        o.shards.probing = True
    try:
        sd = model.state_dict(keep_vars=True)
    finally:
        for o in owners:
            o.shards.probing = False
    return {key: (t.detach(), next((o.layout.shape[t] for o in owners if t in o.layout.index), t.shape))
            for key, t in sd.items()}


def _check_optimizer_state(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """What torch's Optimizer.load_state_dict would refuse (or accept and fail on later), checked up front."""
    groups = state["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint optimizer state has {len(groups)} param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")  # fmt: skip
    params = {}
    for gi, (saved, group) in enumerate(zip(groups, optimizer.param_groups)):
        ids = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(ids, list) or len(ids) != len(group["params"]):
            got = len(ids) if isinstance(ids, list) else repr(ids)
            raise ValueError(f"checkpoint optimizer param group {gi} has {got} params, the optimizer's "
                             f"{len(group['params'])}")  # fmt: skip
        params.update(zip(ids, group["params"]))
    for pid, entry in state["state"].items():
        if pid not in params or not isinstance(entry, dict):
            raise ValueError(f"checkpoint optimizer state[{pid!r}] belongs to no param of its param groups")
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(params[pid].shape):
                raise ValueError(f"checkpoint optimizer state[{pid!r}][{k!r}] has shape {tuple(v.shape)}, its param "
                                 f"{tuple(params[pid].shape)}")  # fmt: skip


def _whole(model: torch.nn.Module, optimizer: Any, write: bool = False) -> Any:
    """The model's parameters whole inside the block: the ZeroOffloadAdamW that owns them (passed or not) gathers
    them at stage 3."""
    stack = contextlib.ExitStack()
    for o in _owners(model, optimizer):
        if not o._closed and o.shards is not None:
            stack.enter_context(o.gathered(write))
    return stack


def _owners(model: torch.nn.Module, optimizer: Any) -> list[ZeroOffloadAdamW]:
    """The ZeroOffloadAdamW objects that own the model's parameters, and `optimizer` if it is one."""
    owners = {id(o): o for o in (getattr(p, "_zo_owner", lambda: None)() for p in model.parameters()) if o}
    if isinstance(optimizer, ZeroOffloadAdamW):
        owners[id(optimizer)] = optimizer
    return list(owners.values())


def _temp_prefix(path: Path) -> str:
    """The name of save_checkpoint's temporary files for `path` start with this: the writer's host and pid."""
    return f".{path.name}.{socket.gethostname()}.{os.getpid()}."


def _writer_dead(name: str, path: Path) -> bool:
    """Whether the temporary file `name` of `path` was left by a process of this host that no longer runs."""
    head = f".{path.name}.{socket.gethostname()}."
    if not (name.startswith(head) and name.endswith(".tmp")):
        return False
    pid = name[len(head) :].split(".", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def reclaim_temp_files(path: Path) -> list[Path]:
    """Remove the temporary files of `path` that a killed save_checkpoint (SIGKILL, power loss of a process)
    left beside it: those of this host whose writer is gone (a live writer's are kept). Returns what it removed."""
    removed = []
    for entry in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        if _writer_dead(entry.name, path):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _chain(e: BaseException | None) -> list[BaseException]:
    """e and the exceptions it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    while e is not None and all(e is not x for x in seen):
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _underlying(e: BaseException) -> BaseException | None:
    """The Ctrl-C (any non-Exception) or OSError behind e: torch's writer turns one inside a write into its own
    RuntimeError 'unexpected pos', which says nothing of what happened."""
    return next((x for x in _chain(e)[1:] if isinstance(x, OSError) or not isinstance(x, Exception)), None)


def _disk_full(e: BaseException) -> bool:
    """An exception of a write that ran out of space (torch's writer reports it as a failed 'unexpected pos')."""
    chain = _chain(e)
    for x in chain:
        if isinstance(x, OSError):  # the underlying error decides: EIO, EACCES... are not a full disk
            return x.errno in (errno.ENOSPC, errno.EDQUOT)
        if not isinstance(x, Exception):  # Ctrl-C inside torch.save
            return False
    return any(isinstance(x, RuntimeError) and ("unexpected pos" in str(x) or "No space left" in str(x))
               for x in chain)  # fmt: skip


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    **extra: Any) -> None:  # fmt: skip
    """Write model, optimizer state and `extra` (plain values) to `path`, atomically.

    Anything load_checkpoint could not read back (numpy values, datetimes, Namespaces, functions...) is refused
    with a TypeError naming it, before a file is written.
    The file is written to a temporary file in the same directory, flushed and fsync'ed, then renamed over
    `path` (and the directory fsync'ed): a crash at any moment leaves either the previous checkpoint or the
    new one, never a torn file; the temporary files of a killed save are removed by the next save or load of
    `path`. A full disk raises OSError(ENOSPC) saying that the last checkpoint is intact. The optimizer state
    is world-size independent; with a ZeroOffloadAdamW on several ranks this is a collective (every rank calls
    it) and rank 0 writes.
    """
    path = _check_objects(path, model, optimizer)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"path: directory {path.parent} does not exist")
    with _whole(model, optimizer):
        weights = model.state_dict()
    payload = {"format": FORMAT, "model": weights,
               "optimizer": optimizer.state_dict() if optimizer is not None else None, "extra": extra}  # fmt: skip
    for key, value in extra.items():
        _check_loadable(value, key)
    _check_loadable(payload["model"], "model state")
    _check_loadable(payload["optimizer"], "optimizer state")
    if _rank(optimizer) == 0:
        reclaim_temp_files(path)
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            Path(tmp).unlink(missing_ok=True)
            if _disk_full(e):
                last = f"the last checkpoint {path} is intact" if path.exists() else f"{path} was not written"
                raise OSError(errno.ENOSPC, f"no space left on the device of {path.parent} while writing a "
                              f"checkpoint: {last} (the partial file was removed)") from e
            underlying = _underlying(e)
            if underlying is not None:
                raise underlying from None  # the Ctrl-C or I/O error, not torch's 'unexpected pos'
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
    if path.parent.is_dir():
        reclaim_temp_files(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"path: {path} is not a readable checkpoint ({type(e).__name__}: {e})") from e
    # after an interrupted step the optimizer's state goes first: at stage 3 storing the model's weights writes the
    # parameters' NVMe file, which that step tore and the state replaces
    interrupted = isinstance(optimizer, ZeroOffloadAdamW) and optimizer._interruption() is not None
    state, extra = _check_payload(ckpt, path, model, optimizer)  # (before any gather: see _full_state)
    with _whole(model, optimizer, write=True):
        state_first = interrupted and state is not None
        if state_first:
            optimizer.load_state_dict(state)
        model.load_state_dict(ckpt["model"])
    if optimizer is None or state_first:
        return extra
    if state is not None:
        optimizer.load_state_dict(state)
    elif isinstance(optimizer, ZeroOffloadAdamW):
        warnings.warn(f"{path} holds no optimizer state: the fp32 masters were refreshed from the loaded "
                      "weights (bits below their dtype are lost); Adam's moments and steps are unchanged",
                      stacklevel=2)  # fmt: skip
        optimizer.refresh_masters_from_model()
    return extra
