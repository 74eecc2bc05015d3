"""ZeroOffloadAdafactor: the offload machinery of ZeroOffloadAdamW with torch.optim.Adafactor's update on the host.

No first moment; a parameter of 2 or more dimensions keeps a factored second moment (row and column statistics of its
last two dimensions), a vector a full one. The update runs with torch ops on the host (per parameter: it needs the
whole parameter's RMS and row/column means), on the fp32 masters, then the new parameters go to the device as with
AdamW. On several ranks the flat partition (the same as AdamW's) splits parameters: each rank sums its elements' share
of the row/column sums of g^2 (a vector's g^2), of the parameter's and of the update's sum of squares, and two
all-reduces per step combine them; every rank then keeps every parameter's statistics (rows + columns: small), so a
checkpoint is world-size independent.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from ..cpu_adam import _real
from ..optim_contract import (
    check_group_keys,
    check_state_dict_layout,
    keep_implementation,
    run_load_post_hooks,
    run_load_pre_hooks,
    state_dict_with_hooks,
)
from .checks import check_int
from .comm import Comm
from .layout import Run
from .optimizer import ZeroOffloadAdamW
from .state import from_zero_offload, masters_follow_model, takes_masters
from .update import HostUpdate


def _stats_shapes(shape: torch.Size) -> dict[str, tuple[int, ...]]:
    """torch.optim.Adafactor's state of a parameter of this shape: row_var and col_var (>= 2 dims), or variance."""
    if len(shape) >= 2:
        return {"row_var": (*shape[:-1], 1), "col_var": (*shape[:-2], 1, shape[-1])}
    return {"variance": tuple(shape)}


@torch.no_grad()
def adafactor_step(param: torch.Tensor, grad: torch.Tensor, stats: dict[str, torch.Tensor], step: int, *, lr: float,
                   beta2_decay: float, eps: tuple[float | None, float], d: float, weight_decay: float,
                   maximize: bool) -> None:  # fmt: skip
    """One Adafactor step of one fp32 parameter in place (torch.optim.Adafactor's single-tensor update, step >= 1)."""
    eps1 = torch.finfo(param.dtype).eps if eps[0] is None else eps[0]
    grad = -grad if maximize else grad
    one_minus_beta2 = step**beta2_decay
    rho = min(lr, 1 / step**0.5)
    alpha = max(eps[1], param.norm(2).item() / param.numel() ** 0.5) * rho
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if grad.dim() > 1:
        row, col = stats["row_var"], stats["col_var"]
        row.lerp_(torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1)), one_minus_beta2)
        col.lerp_(torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2)), one_minus_beta2)
        var = row @ col
        var.div_(row.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    else:
        stats["variance"].lerp_(grad * grad, one_minus_beta2)
        var = stats["variance"].clone()
    update = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
    denom = max(1.0, update.norm(2).item() / (update.numel() ** 0.5 * d))
    param.add_(update, alpha=-alpha / denom)


class AdafactorUpdate(HostUpdate):
    """The host update with Adafactor's rule: the fp32 masters and each parameter's statistics in host memory.

    `comm` (set by the optimizer): with world > 1, the statistics of parameters split across ranks are combined with
    all-reduces (SplitAdafactor)."""

    HAS_MOMENTS = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        lay = self.layout
        # (partition start, end, param): params this rank does not own have empty ranges, (0, 0) alike
        self.ranges = sorted(((*lay.part_range(p), p) for p in lay.params), key=lambda r: r[:2])
        self.stats = {p: {k: torch.zeros(s) for k, s in _stats_shapes(lay.shape[p]).items()} for p in lay.params}
        self.comm: Any = None
        self._split: SplitAdafactor | None = None

    @property
    def host_state_bytes(self) -> int:
        return self._master.numel() * 4 + sum(t.numel() * 4 for st in self.stats.values() for t in st.values())

    @property
    def state_bytes_per_param(self) -> float:
        return self.host_state_bytes / max(1, self.layout.numel)

    def state(self) -> tuple[torch.Tensor, ...]:
        return (self._master,)

    def copy_state(self, ranges: list) -> None:
        for a, b, outs in ranges:
            outs[0].copy_(self._master[a:b])

    def save_state(self, master: torch.Tensor, *moments: torch.Tensor) -> None:
        self.save_master(master)

    def cpu_update(self, grad: torch.Tensor, grad_scale: float, runs: list[Run], hparams: list[dict],
                   writeback: bool, threads: int | None = None) -> float:  # fmt: skip
        """Adafactor on each parameter of the runs, then (as the in-memory AdamW update) the runs' new 16-bit
        parameters into staging and, with writeback, to the device. (threads: torch's ops here take torch's.)"""
        t0 = time.perf_counter()
        self.transport.wait(self._staging_read)
        send = writeback and not self.staging_in_place
        events: list = []
        try:
            if self.comm is not None and self.comm.world > 1:
                self._split = self._split or SplitAdafactor(self)
                self._split.step(grad, grad_scale, runs, hparams)
            for gi, a, b, step, factor in runs:
                for pa, pb, p in self.ranges if self.comm is None or self.comm.world == 1 else ():
                    if a <= pa and pb <= b and pa < pb:
                        shape = self.layout.shape[p]
                        g = grad[pa:pb].float().mul(grad_scale * factor).view(shape)
                        adafactor_step(self._master[pa:pb].view(shape), g, self.stats[p], step, **hparams[gi])
                self.staging_buf[a:b].copy_(self._master[a:b])
                if send:
                    events.append(self.transport.h2d(self.own[a:b], self.staging_buf[a:b]))
        finally:
            if events:
                self._staging_read = events[-1]
        for ev in events:
            self.transport.device_wait(ev)
        return time.perf_counter() - t0


class SplitAdafactor:
    """One Adafactor step of every parameter on several ranks, each rank updating its elements of the partition.

    torch.optim.Adafactor's update needs whole-parameter quantities: the row and column means of g^2 (a vector's g^2
    itself), the parameter's RMS and the update's RMS. Each rank adds its elements' share of them into one buffer
    laid out per parameter (rows, columns or elements, then the parameter's sum of squares and a "stepped" count),
    an all-reduce sums it; every rank then updates every stepped parameter's statistics (so they are the same on
    all ranks) and its own elements; a second all-reduce sums the update's squares. Sums of squares replace torch's
    norm().square(): equal up to fp32 rounding.
    """

    def __init__(self, up: AdafactorUpdate) -> None:
        self.up, lay = up, up.layout
        self.slots: dict[torch.Tensor, tuple[int, int]] = {}  # param -> (start in the buffer, statistics' length)
        pos = 0
        for p in lay.params:
            shape = lay.shape[p]
            n = shape[:-1].numel() + shape[:-2].numel() * shape[-1] if len(shape) >= 2 else shape.numel()
            self.slots[p] = (pos, n)
            pos += n + 2
        self.numel = pos

    def _reduce(self, buf: torch.Tensor, what: str) -> torch.Tensor:
        comm = self.up.comm
        t = buf.to(comm.device_of_collectives)
        comm.collective(what, dist.all_reduce, t)
        return t.cpu()

    @torch.no_grad()
    def step(self, grad: torch.Tensor, grad_scale: float, runs: list[Run], hparams: list[dict]) -> None:
        up, lay = self.up, self.up.layout
        mine = []  # (param, its group, partition range, its first element's index in the param, fp32 gradient)
        for gi, a, b, _, factor in runs:
            for pa, pb, p in up.ranges:
                if a <= pa and pb <= b and pa < pb:
                    (x, _, _), = lay.owned(lay.offset[p], lay.offset[p] + lay.shape[p].numel(), lay.rank)
                    g = grad[pa:pb].float().mul(grad_scale * factor)
                    mine.append((p, gi, pa, pb, x - lay.offset[p], g.neg_() if hparams[gi]["maximize"] else g))
        buf = torch.zeros(self.numel, dtype=torch.float64)
        for p, _, pa, pb, x, g in mine:
            start, n = self.slots[p]
            shape, sq = lay.shape[p], g.double().square()
            if len(shape) >= 2:
                rows, cols, idx = shape[:-1].numel(), shape[-1], torch.arange(x, x + pb - pa)
                buf[start : start + rows].index_add_(0, idx // cols, sq)
                col = idx // (shape[-2] * cols) * cols + idx % cols
                buf[start + rows : start + n].index_add_(0, col, sq)
            else:
                buf[start + x : start + x + pb - pa] = sq
            buf[start + n] = up._master[pa:pb].double().square().sum()
            buf[start + n + 1] = 1.0
        total = self._reduce(buf, "Adafactor's statistics (all-reduce)")
        for i, p in enumerate(lay.params):  # every rank: the same statistics
            start, n = self.slots[p]
            if total[start + n + 1] == 0:
                continue
            shape, st, omb2 = lay.shape[p], up.stats[p], up.steps[i] ** hparams[lay.pgroup[i]]["beta2_decay"]
            if len(shape) >= 2:
                rows = shape[:-1].numel()
                st["row_var"].lerp_(total[start : start + rows].float().view(st["row_var"].shape) / shape[-1], omb2)
                st["col_var"].lerp_(total[start + rows : start + n].float().view(st["col_var"].shape) / shape[-2],
                                    omb2)  # fmt: skip
            else:
                st["variance"].lerp_(total[start : start + n].float().view(shape), omb2)
        updates, sums = [], torch.zeros(len(lay.params), dtype=torch.float64)
        for p, gi, pa, pb, x, g in mine:
            i, hp, shape, st = lay.index[p], hparams[gi], lay.shape[p], up.stats[p]
            start, n = self.slots[p]
            eps1 = torch.finfo(torch.float32).eps if hp["eps"][0] is None else hp["eps"][0]
            step = up.steps[i]
            rho = min(hp["lr"], 1 / step**0.5)
            alpha = max(hp["eps"][1], math.sqrt(float(total[start + n])) / shape.numel() ** 0.5) * rho
            master = up._master[pa:pb]
            if hp["weight_decay"] != 0:
                master.mul_(1 - hp["lr"] * hp["weight_decay"])
            idx = torch.arange(x, x + pb - pa)
            if len(shape) >= 2:
                cols, rc = shape[-1], shape[-2] * shape[-1]
                row, col = st["row_var"].reshape(-1), st["col_var"].reshape(-1)
                mean = st["row_var"].mean(dim=-2).reshape(-1).clamp(min=eps1)
                var = (row[idx // cols] * col[idx // rc * cols + idx % cols]).div_(mean[idx // rc])
            else:
                var = st["variance"].reshape(-1)[x : x + pb - pa].clone()
            update = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
            sums[i] = update.double().square().sum()
            updates.append((master, update, alpha, hp["d"], shape.numel(), i))
        sums = self._reduce(sums, "Adafactor's update norms (all-reduce)")
        for master, update, alpha, d, numel, i in updates:
            denom = max(1.0, math.sqrt(float(sums[i])) / (numel**0.5 * d))
            master.add_(update, alpha=-alpha / denom)


class ZeroOffloadAdafactor(ZeroOffloadAdamW):
    """Adafactor (torch.optim.Adafactor's update and defaults) with ZeroOffloadAdamW's offload machinery.

    Stages 1/2/3, the delayed parameter update, accumulation, clipping (`max_grad_norm`), loss scaling, the
    transports and checkpoints work as in ZeroOffloadAdamW (see its docstring); the update on the host is
    torch.optim.Adafactor's on the fp32 masters: no first moment, a factored second moment (row and column
    statistics, fp32) for parameters of 2 or more dimensions, a full one for vectors. Host state: 4 bytes per
    parameter (masters) + 4 x (rows + columns) per matrix + 4 per vector element. On several ranks the partition
    is AdamW's (parameters split across ranks): two small all-reduces per step combine the split parameters'
    row/column sums and norms (SplitAdafactor), every rank keeps every parameter's statistics; with the delayed
    update they run on a gloo group of the update's own (made at construction by every rank of the default
    group, destroyed by close()), never beside the gradients' on one group. offload_optimizer="nvme"
    and state_dtype are refused. state_dict() has torch.optim.Adafactor's keys per parameter (step, row_var,
    col_var or variance) plus `master` (world-size independent; a collective on several ranks), and loads
    torch.optim.Adafactor's.

    Args:
        params, lr, beta2_decay, eps, d, weight_decay, maximize: as torch.optim.Adafactor (eps = (eps1, eps2);
            eps1 None: the fp32 machine epsilon).
        **kwargs: ZeroOffloadAdamW's keyword arguments (dtype, loss_scale, max_grad_norm, delay_update_after,
            stage, module, transport, ...).
    """

    _update_class = AdafactorUpdate

    def __init__(self, params: Any, lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0, *,
                 maximize: bool = False, **kwargs: Any) -> None:  # fmt: skip
        self._ada = dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay, maximize=maximize)
        for name in ("offload_optimizer", "nvme_dir", "state_dtype", "betas"):
            if kwargs.get(name) not in (None, "cpu"):
                raise ValueError(f"ZeroOffloadAdafactor does not take {name}={kwargs[name]!r} (host memory, fp32 "
                                 "statistics)")  # fmt: skip
        group = kwargs.get("process_group")
        world = (group.size() if group is not None else
                 dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)  # fmt: skip
        delayed = world > 1 and kwargs.get("delay_update_after") is not None
        if delayed and world != dist.get_world_size():
            raise ValueError(f"ZeroOffloadAdafactor with delay_update_after on a process group of {world} of the "
                             f"{dist.get_world_size()} ranks is not supported: the background update's own group "
                             "is made by every rank of the default group")  # fmt: skip
        super().__init__(params, lr=lr, weight_decay=weight_decay, **kwargs)
        self.update.comm = self.comm
        if delayed:
            # The statistics' all-reduces run on the update's thread, beside the main thread's gradient collectives:
            # never two threads on one group. A gloo group of its own (host tensors: the statistics live there),
            # made here on every rank in the same order; destroyed by close().
            self.update.comm = Comm(dist.new_group(backend="gloo"), torch.device("cpu"), self.collective_timeout_s,
                                    self._times)  # fmt: skip

    def close(self) -> None:
        """ZeroOffloadAdamW.close(), then the background update's own process group (if any) is destroyed."""
        try:
            super().close()  # (a timed-out update raises here, keeping the group it may still run on)
        except TimeoutError:
            raise
        except Exception:  # noqa: BLE001 (a failed update: everything else is released; so is the group, then raise)
            self._destroy_update_group()
            raise
        self._destroy_update_group()

    def _destroy_update_group(self) -> None:
        comm = self.update.comm
        if comm is not self.comm and comm.group is not None:
            group, comm.group = comm.group, None
            try:
                dist.destroy_process_group(group)
            except ValueError:  # the default group was destroyed first, and this one with it
                pass

    def _defaults(self, lr: Any, betas: Any, eps: Any, weight_decay: Any) -> dict[str, Any]:
        return self._group_hparams(dict(self._ada))

    def _group_hparams(self, group: dict[str, Any]) -> dict[str, Any]:
        lr = _real(group["lr"], "lr")
        if not (0 <= lr < math.inf):
            raise ValueError(f"lr must be >= 0 and finite, got {lr}")
        if not (_real(group["beta2_decay"], "beta2_decay") <= 0):
            raise ValueError(f"beta2_decay must be <= 0, got {group['beta2_decay']}")
        eps = group["eps"]
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise TypeError(f"eps must be a pair (eps1 or None, eps2), got {eps!r}")
        if eps[0] is not None and not (_real(eps[0], "eps[0]") >= 0):
            raise ValueError(f"eps[0] must be >= 0 or None, got {eps[0]}")
        if not (_real(eps[1], "eps[1]") >= 0):
            raise ValueError(f"eps[1] must be >= 0, got {eps[1]}")
        if not (_real(group["d"], "d") >= 1):  # (torch's Adafactor: the clipping threshold is at least 1)
            raise ValueError(f"d must be >= 1, got {group['d']}")
        if not (_real(group["weight_decay"], "weight_decay") >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
        if not isinstance(group["maximize"], bool):
            raise TypeError(f"maximize must be a bool, got {type(group['maximize']).__name__}")
        return dict(lr=float(lr), beta2_decay=float(group["beta2_decay"]),
                    eps=(None if eps[0] is None else float(eps[0]), float(eps[1])), d=float(group["d"]),
                    weight_decay=float(group["weight_decay"]), maximize=group["maximize"])  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Adafactor's layout: per param step, row_var/col_var or variance, plus master (fp32, CPU); the
        state-dict hooks run around it, as torch's."""
        return state_dict_with_hooks(self, self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        self._check_alive()
        self._check_groups()
        self.update.finish_pending(write=False)
        masters_follow_model(self)  # (as ZeroOffloadAdamW's: weights loaded into the model since the last update)
        lay = self.layout
        full = self.comm.gather(self.update.master, lay.part * self.world)  # (a collective on several ranks)
        state, groups, idx = {}, [], 0
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                off, n = lay.offset[p], lay.shape[p].numel()
                master = torch.empty(n)
                for r in range(self.world):
                    for a, b, pa in lay.owned(off, off + n, r):
                        master[a - off : b - off] = full[r * lay.part + pa : r * lay.part + pa + b - a]
                state[idx] = {"step": torch.tensor(float(self.update.steps[idx])), "master": master.view(lay.shape[p]),
                              **{k: v.clone() for k, v in self.update.stats[p].items()}}  # fmt: skip
                ids.append(idx)
                idx += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        extra = {"loss_scale": self.scaler.scale, "dynamic": self.scaler.dynamic, "good_steps": self.scaler.good_steps,
                 "iteration": self.grads.iteration, "world_size": self.world, "staged": self.update.staged}  # fmt: skip
        return {"state": state, "param_groups": groups, "zero_offload": extra}

    def check_state_dict(self, state_dict: dict[str, Any]) -> list[tuple[int, torch.Tensor, dict, int]]:
        """Check a state dict of this class or torch.optim.Adafactor against the optimizer; change nothing."""
        from .state import _check_step, check_flags, check_fp32_values, check_scaler

        groups, state = check_state_dict_layout(state_dict, len(self.param_groups))
        plan = []
        for gi, (saved, group) in enumerate(zip(groups, self.param_groups)):
            if not isinstance(saved, dict) or len(saved.get("params", ())) != len(group["params"]):
                raise ValueError(f"param group {gi}: the saved group does not have this optimizer's params")
            check_group_keys(saved, ("lr", "beta2_decay", "eps", "d", "weight_decay"), f"state_dict param group {gi}",
                             "Adafactor")  # fmt: skip
            self._group_hparams({**group, **{k: v for k, v in saved.items() if k != "params"}})
            for i, p in zip(saved["params"], group["params"]):
                st = state.get(i, state.get(str(i)))
                if st is None:
                    continue
                want = {**_stats_shapes(self.layout.shape[p]), "master": tuple(self.layout.shape[p])}
                for key, shape in want.items():
                    t = st.get(key)
                    if t is None and key == "master":
                        continue
                    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
                        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                        raise ValueError(f"param {i}: state {key!r} must be a tensor of shape {shape}, got {got}")
                    if not t.is_floating_point():
                        raise TypeError(f"param {i}: state {key!r} must be a floating-point tensor")
                    check_fp32_values(t, f"param {i}: state {key!r}")
                plan.append((gi, p, st, _check_step(st.get("step"), f"param {i}: state 'step'")))
        extra = state_dict.get("zero_offload", {})
        if not isinstance(extra, dict):
            raise ValueError("state_dict['zero_offload'] must be a dict")
        check_flags(extra)
        check_scaler(extra)
        check_int(extra.get("iteration"), "state_dict['zero_offload']['iteration']", 0)
        return plan

    def _param_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """opt.state[p] (copies): torch.optim.Adafactor's keys (step, row_var and col_var, or variance) and master
        (p's shape on one rank, this rank's elements of p, flat, on several)."""
        a, b = self.layout.part_range(p)
        master = self.update.master[a:b].clone()
        if self.world == 1:
            master = master.view(self.layout.shape[p])
        return {"step": torch.tensor(float(self.update.steps[self.layout.index[p]])), "master": master,
                **{k: v.clone() for k, v in self.update.stats[p].items()}}  # fmt: skip

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of torch.optim.Adafactor (then the masters are the model's); the
        loading optimizer keeps its own foreach/differentiable options; the load hooks run as torch's."""
        self._check_not_replaced()
        state_dict = run_load_pre_hooks(self, state_dict)
        self._check_loadable()
        self._check_groups()
        self._check_between_steps()
        plan = self.check_state_dict(state_dict)
        self.update.finish_pending(write=False)
        with self._midway():  # (Ctrl-C...) part of the state the loaded one: as after an interrupted step
            self._load_checked(state_dict, plan)
        self._loaded()
        run_load_post_hooks(self)

    def _load_checked(self, state_dict: dict[str, Any], plan: list) -> None:
        """load_state_dict's changes, everything checked."""
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            group.update({k: (tuple(v) if k == "eps" else v) for k, v in keep_implementation(saved, group).items()
                          if k != "params"})  # fmt: skip
        self.update.steps = [0] * len(self.layout.params)
        for st in self.update.stats.values():
            for t in st.values():
                t.zero_()
        for _, p, st, step in plan:
            self.update.steps[self.layout.index[p]] = step
            for k, t in self.update.stats[p].items():
                t.copy_(st[k])
            if st.get("master") is not None and from_zero_offload(state_dict):
                off, n = self.layout.offset[p], self.layout.shape[p].numel()
                for a, b, pa in self.layout.owned(off, off + n, self.rank):
                    self.update.master[pa : pa + b - a] = st["master"].reshape(-1)[a - off : b - off].float()
        self._set_group_steps()
        if not takes_masters(state_dict, plan):
            self.update.refresh_stale_masters()
        extra = state_dict.get("zero_offload", {})
        if "loss_scale" in extra and extra.get("dynamic") == self.scaler.dynamic:
            self.scaler.scale, self.scaler.good_steps = float(extra["loss_scale"]), int(extra["good_steps"])
        self.grads.iteration = int(extra.get("iteration", max(self.update.steps, default=0)))
        self.update.resume(staged=bool(extra.get("staged")))
