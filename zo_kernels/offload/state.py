"""State-dict conversion: this rank's partition <-> torch.optim's per-parameter layout, world-size independent."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..cpu_adam import _real, check_hparams
from ..optim_contract import (
    TORCH_OPTIONS,
    check_group_keys,
    check_state_dict_layout,
    check_torch_options,
    keep_implementation,
)
from .checks import check_int
from .formats import BLOCK_8BIT, check_raw, check_state_dtype, cut_raw
from .scaler import check_inverse

if TYPE_CHECKING:
    from .optimizer import ZeroOffloadAdamW


def state_dict(opt: ZeroOffloadAdamW) -> dict[str, Any]:
    """torch.optim layout, world-size independent: per param step/exp_avg/exp_avg_sq/master (fp32, CPU).

    With 8-bit moments the exact codes and scales of each parameter travel too, in
    state_dict["zero_offload"]["moments"][param index] (see raw_moments): a load into an 8-bit run takes them (bitwise
    resume), a load into another format the fp32 moments. (bf16 moments are exact in fp32: no copy needed.)
    """
    opt._check_alive()
    opt._check_groups()
    opt.update.finish_pending(write=False)
    masters_follow_model(opt)
    keys = ("master", "exp_avg", "exp_avg_sq")
    lay = opt.layout
    params = [p for group in opt.param_groups for p in group["params"]]
    if opt.world == 1:  # one rank holds every element: straight into the outputs (with NVMe tile by tile)
        per_param = {p: tuple(torch.empty(lay.shape[p].numel(), dtype=torch.float32) for _ in keys) for p in params}
        opt.update.copy_state([(*lay.part_range(p), outs) for p, outs in per_param.items()])
    else:  # N > 1: every rank's partition, one after the other (a collective; up to 3 full copies), then each
        # param's pieces from the ranks that own them
        full = [opt.comm.gather(t, lay.part * opt.world) for t in opt.update.state()]
        per_param = {}
        for p in params:
            off, n = lay.offset[p], lay.shape[p].numel()
            outs = tuple(torch.empty(n, dtype=torch.float32) for _ in keys)
            for r in range(opt.world):
                for a, b, pa in lay.owned(off, off + n, r):
                    for out, v in zip(outs, full):
                        out[a - off : b - off] = v[r * lay.part + pa : r * lay.part + pa + b - a]
            per_param[p] = outs
    state, groups, idx = {}, [], 0
    for group in opt.param_groups:
        ids = []
        for p in group["params"]:
            # always present, also before the first step: the masters must travel with the checkpoint
            state[idx] = {"step": torch.tensor(float(opt.update.steps[idx]))}
            state[idx].update({k: v.view(lay.shape[p]) for k, v in zip(keys, per_param[p])})
            ids.append(idx)
            idx += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    extra = {"loss_scale": opt.scaler.scale, "dynamic": opt.scaler.dynamic, "good_steps": opt.scaler.good_steps,
             "iteration": opt.grads.iteration, "world_size": opt.world, "staged": opt.update.staged,
             "state_dtype": opt.state_format}  # fmt: skip
    if opt.state_format == "8bit":
        extra["moments"] = raw_moments(opt)
    return {"state": state, "param_groups": groups, "zero_offload": extra}


def masters_follow_model(opt: ZeroOffloadAdamW) -> None:
    """With no writeback pending, the model's parameters are the masters' cast unless the model was written since
    (model.load_state_dict after construction): its values then win, as in a load without masters (quietly: the
    state dict says what the model holds). Else a round trip, state_dict() then load_state_dict() (accelerate's
    prepare does one: HF Trainer's resume loads the model's weights first), would write the stale masters over the
    loaded weights; under DPU the checkpoint's state, saved with its writeback pending, then keeps them as the
    parameters the next forward reads. The compare: a chunk of the parameters at a time, copied to the host; with
    the state on NVMe a read pass over the files, so there only under DPU (where a state saved with its writeback
    pending can follow)."""
    u = opt.update
    if u.staged or getattr(getattr(u, "host", None), "staged", False):
        return
    if u.swapper is not None and opt.delay_update_after is None:
        return
    u.refresh_stale_masters(warn=False)


def raw_moments(opt: ZeroOffloadAdamW) -> dict[int, dict[str, torch.Tensor]]:
    """Each parameter's 8-bit moments exactly: {index: {"exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes",
    "exp_avg_sq_scales"}}; its blocks are its own (it starts on a block), whatever the world size. A collective."""
    lay, per = opt.layout, (1, BLOCK_8BIT, 1, BLOCK_8BIT)  # partition elements per entry of each tensor
    names = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")
    full = [opt.comm.gather(t, t.numel() * opt.world) for t in opt.update.raw_moments()]
    out = {}
    for i, p in enumerate(p for group in opt.param_groups for p in group["params"]):
        off, n = lay.offset[p], lay.shape[p].numel()
        pieces = sorted((a, r, pa, b) for r in range(opt.world) for a, b, pa in lay.owned(off, off + n, r))
        entry = {}
        for name, t, k in zip(names, full, per):
            rank_len = t.numel() // opt.world
            entry[name] = torch.cat([t[r * rank_len + pa // k : r * rank_len + pa // k + -(-(b - a) // k)]
                                     for a, r, pa, b in pieces]).clone()  # fmt: skip
        out[i] = entry
    return out


def check_state_dict(opt: ZeroOffloadAdamW, state_dict: dict[str, Any]) -> list[tuple[int, torch.Tensor, dict, int]]:
    """Check a state dict against the optimizer (groups, counts, shapes, values); change nothing.

    Returns the per-parameter entries to load as (group index, param, state, step).
    """
    groups, state = check_state_dict_layout(state_dict, len(opt.param_groups))
    plan = []
    for gi, (saved, group) in enumerate(zip(groups, opt.param_groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
            raise ValueError(f"state_dict param group {gi} must be a dict with a 'params' list")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"param group {gi}: state_dict has {len(saved['params'])} params, "
                             f"this optimizer {len(group['params'])}")  # fmt: skip
        check_group_keys(saved, ("lr", "betas", "eps", "weight_decay"), f"state_dict param group {gi}", "Adam/AdamW")
        check_hparams(saved["lr"], saved["betas"], saved["eps"], saved["weight_decay"])
        check_torch_options(saved, f"state_dict param group {gi}", loaded=True)
        if "step" in saved:
            _check_step(saved["step"], f"param group {gi}: 'step'")
        for i, p in zip(saved["params"], group["params"]):
            st = state.get(i, state.get(str(i)))
            if st is None:
                continue
            if not isinstance(st, dict):
                raise ValueError(f"param {i}: state must be a dict, got {type(st).__name__}")
            for key in ("exp_avg", "exp_avg_sq", "master"):
                t = st.get(key)
                if t is None:
                    if key != "master":
                        raise ValueError(f"param {i}: state has no {key!r}")
                    continue
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    raise TypeError(f"param {i}: state {key!r} must be a floating-point tensor")
                if tuple(t.shape) != tuple(opt.layout.shape[p]):
                    raise ValueError(f"param {i}: saved {key} has shape {tuple(t.shape)}, "
                                     f"the model's param has {tuple(opt.layout.shape[p])}")  # fmt: skip
                check_fp32_values(t, f"param {i}: state {key!r}")
                if key == "exp_avg_sq" and bool((t < 0).any()):
                    raise ValueError(f"param {i}: state 'exp_avg_sq' has negative values")
            plan.append((gi, p, st, _check_step(st.get("step"), f"param {i}: state 'step'")))
    extra = state_dict.get("zero_offload", {})
    if not isinstance(extra, dict):
        raise ValueError(f"state_dict['zero_offload'] must be a dict, got {type(extra).__name__}")
    check_flags(extra)
    check_scaler(extra)
    check_int(extra.get("iteration"), "state_dict['zero_offload']['iteration']", 0)
    if _exact_moments(opt, extra):
        moments, ids = extra["moments"], [i for g in groups for i in g["params"]]
        if not isinstance(moments, dict):
            raise ValueError("state_dict['zero_offload']['moments'] must be a dict")
        for _, p, _, _ in plan:
            i = ids[opt.layout.index[p]]
            check_raw(moments.get(i, moments.get(str(i))), "8bit", opt.layout.shape[p].numel(),
                      f"state_dict['zero_offload']['moments'][{i!r}]")  # fmt: skip
    return plan


def check_fp32_values(t: torch.Tensor, name: str) -> None:
    """t's values, as the fp32 the state keeps them in: finite (a float64 1e39 is finite there and inf here)."""
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor (it holds no values)")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} holds inf or NaN")
    if t.dtype == torch.float64 and not bool(torch.isfinite(t.float()).all()):
        raise ValueError(f"{name} holds values beyond fp32's range (the state is kept in fp32)")


def from_zero_offload(state_dict: dict[str, Any]) -> bool:
    """Whether a state dict is one of ours (it carries `zero_offload`): only then are its masters the run's. torch's
    optimizers keep an unknown per-parameter key such as `master` and hand it back unchanged, steps old after they
    trained on: a dict of theirs refreshes the masters from the model."""
    return "zero_offload" in state_dict


def takes_masters(state_dict: dict[str, Any], plan: list) -> bool:
    """Whether a load takes its masters from the dict (one of ours with every parameter's master; `plan` is what
    check_state_dict returned) rather than refreshing them from the model."""
    return bool(plan) and from_zero_offload(state_dict) and all(st.get("master") is not None for _, _, st, _ in plan)


def check_flags(extra: dict) -> None:
    """state_dict['zero_offload']'s flags are bools (truth-tested when loaded: "yes" or 1.5 would pass for True)."""
    for key in ("staged", "dynamic"):
        if key in extra and not isinstance(extra[key], bool):
            raise ValueError(f"state_dict['zero_offload'][{key!r}] must be a bool, got {type(extra[key]).__name__}")


def _exact_moments(opt: ZeroOffloadAdamW, extra: dict) -> bool:
    """Whether the state dict carries this run's 8-bit moments exactly (then they are loaded, not requantized)."""
    saved = extra.get("state_dtype", "fp32")
    if not isinstance(saved, str):
        raise ValueError(f"state_dict['zero_offload']['state_dtype'] must be a str, got {type(saved).__name__}")
    check_state_dtype(saved)
    return opt.state_format == "8bit" and saved == "8bit" and "moments" in extra


def load_state_dict(opt: ZeroOffloadAdamW, state_dict: dict[str, Any]) -> None:
    """Load a state dict of ZeroOffloadAdamW (any world size) or of torch.optim.AdamW (see its docstring)."""
    opt._check_loadable()
    opt._check_groups()
    opt._check_between_steps()
    plan = check_state_dict(opt, state_dict)
    no_masters = not takes_masters(state_dict, plan)
    torn = _check_replaces_torn(opt, plan, no_masters)
    opt.update.finish_pending(write=False, keep_model=no_masters)  # (its masters then come from the model as it is)
    with opt._midway():  # (Ctrl-C...) part of the state the loaded one: as after an interrupted step
        _load_checked(opt, state_dict, plan, no_masters, torn)
    opt._loaded()


def _load_checked(opt: ZeroOffloadAdamW, state_dict: dict[str, Any], plan: list, no_masters: bool,
                  torn: bool) -> None:  # fmt: skip
    """load_state_dict's changes, everything checked."""
    for saved, group in zip(state_dict["param_groups"], opt.param_groups):
        for key, value in keep_implementation(saved, group).items():
            if key != "params":
                group[key] = tuple(value) if key == "betas" else value
        group["decoupled_weight_decay"] = True  # an AdamW whatever it loads, as torch.optim.AdamW (Adam's is False)
        for key, default in TORCH_OPTIONS.items():
            group.setdefault(key, default)
    if no_masters and opt.update.params_in_swapper:  # (before save_state writes the masters' cast over the file)
        opt.update.refresh_stale_masters()
    opt.update.steps = [0] * len(opt.layout.params)
    if torn:  # (the files of an interrupted step are not read: the state dict replaces them whole)
        master, exp_avg, exp_avg_sq = (torch.zeros(opt.layout.part, dtype=torch.float32) for _ in range(3))
    else:
        master, exp_avg, exp_avg_sq = opt.update.state()
    exp_avg.zero_()
    exp_avg_sq.zero_()
    for _, p, st, step in plan:
        i = opt.layout.index[p]
        opt.update.steps[i] = step
        off, n = opt.layout.offset[p], opt.layout.shape[p].numel()
        for a, b, pa in opt.layout.owned(off, off + n, opt.rank):
            src, dst = slice(a - off, b - off), slice(pa, pa + b - a)
            exp_avg[dst] = st["exp_avg"].reshape(-1)[src].float()
            exp_avg_sq[dst] = st["exp_avg_sq"].reshape(-1)[src].float()
            if st.get("master") is not None and from_zero_offload(state_dict):
                master[dst] = st["master"].reshape(-1)[src].float()
    opt.update.save_state(master, exp_avg, exp_avg_sq)  # (quantized into this run's format)
    extra = state_dict.get("zero_offload", {})
    if _exact_moments(opt, extra):
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        pieces = []
        for _, p, _, _ in plan:
            i = ids[opt.layout.index[p]]
            raw = extra["moments"].get(i, extra["moments"].get(str(i)))
            off, n = opt.layout.offset[p], opt.layout.shape[p].numel()
            for a, b, pa in opt.layout.owned(off, off + n, opt.rank):  # a - off is on a block boundary
                pieces.append((pa, pa + b - a, cut_raw(raw, a - off, b - off, BLOCK_8BIT)))
        opt.update.set_raw(pieces)
    opt._set_group_steps()
    if no_masters and not opt.update.params_in_swapper:
        opt.update.refresh_stale_masters()
    if "loss_scale" in extra and extra.get("dynamic") == opt.scaler.dynamic:
        opt.scaler.scale, opt.scaler.good_steps = float(extra["loss_scale"]), int(extra["good_steps"])
    opt.grads.iteration = int(extra.get("iteration", max(opt.update.steps, default=0)))
    opt.update.resume(staged=bool(extra.get("staged")))


def _check_replaces_torn(opt: ZeroOffloadAdamW, plan: list, no_masters: bool) -> bool:
    """Whether the NVMe state files are torn (by an interrupted step); then the state dict must hold every
    parameter's state and master, to replace them whole."""
    swapper = opt.update.swapper
    if swapper is None or not swapper.torn:
        return False
    if no_masters or len(plan) != len(opt.layout.params):
        raise RuntimeError(f"the optimizer state files are torn ({swapper.torn}): only a state dict with every "
                           "parameter's state and master (a ZeroOffloadAdamW's state_dict(), save_checkpoint) can "
                           "replace them")  # fmt: skip
    return True


def _check_step(x: Any, name: str) -> int:
    """A saved step count: an int, or a float / one-element tensor holding an integer, in [0, 2**53]."""
    x = _real(x, name)
    if not (x == int(x) and 0 <= x <= 2**53):
        raise ValueError(f"{name} must be a whole number in [0, 2**53], got {x!r}")
    return int(x)


def param_state(opt: ZeroOffloadAdamW, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """opt.state[p] (copies): step, exp_avg, exp_avg_sq, master; p's shape on one rank, this rank's elements of p
    (flat) on several."""
    a, b = opt.layout.part_range(p)
    outs = tuple(torch.empty(max(0, b - a), dtype=torch.float32) for _ in range(3))
    opt.update.copy_state([(a, b, outs)])
    if opt.world == 1:
        outs = tuple(t.view(opt.layout.shape[p]) for t in outs)
    step = torch.tensor(float(opt.update.steps[opt.layout.index[p]]))
    return {"step": step, "exp_avg": outs[1], "exp_avg_sq": outs[2], "master": outs[0]}


def check_scaler(extra: dict) -> None:
    """state_dict['zero_offload']'s loss-scale entries (a NaN or 0 scale would stop the training or crash a step)."""
    if "loss_scale" in extra:
        if _real(extra["loss_scale"], "state_dict['zero_offload']['loss_scale']") <= 0:
            raise ValueError("state_dict['zero_offload']['loss_scale'] must be > 0")
        if not extra.get("dynamic"):  # (a dynamic one that small: every step overflows, and is skipped as one)
            check_inverse(float(extra["loss_scale"]), "state_dict['zero_offload']['loss_scale']")
        check_int(extra.get("good_steps"), "state_dict['zero_offload']['good_steps']", 0, required=True)


class StateView(Mapping):
    """torch's `opt.state`, read-only: state[p] is a snapshot (copies) of this rank's part of p's state: `step`,
    `exp_avg`, `exp_avg_sq`, `master` (fp32, CPU); p's shape on one rank, this rank's elements of p (flat, maybe
    none) on several. Each read copies (with NVMe, reads the files): tools read it between steps."""

    def __init__(self, opt: ZeroOffloadAdamW) -> None:
        self._opt = opt

    def __getitem__(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        opt = self._opt
        if not isinstance(p, torch.Tensor) or p not in opt.layout.index:
            raise KeyError(p)
        opt._check_alive()
        opt.update.finish_pending(write=False)
        return opt._param_state(p)

    def __contains__(self, p: object) -> bool:
        return isinstance(p, torch.Tensor) and p in self._opt.layout.index

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._opt.layout.params)

    def __len__(self) -> int:
        return len(self._opt.layout.params)
