"""ZeroOffloadAdafactor: the offload machinery of ZeroOffloadAdamW with torch.optim.Adafactor's update on the host.

No first moment; a parameter of 2 or more dimensions keeps a factored second moment (row and column statistics of its
last two dimensions), a vector a full one. The update runs with torch ops on the host (per parameter: it needs the
whole parameter's RMS and row/column means), on the fp32 masters, then the new parameters go to the device as with
AdamW. One rank only: the statistics belong to whole parameters, which a partition across ranks would split.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from ..cpu_adam import _real
from ..optim_contract import check_state_dict_layout
from .checks import check_int
from .layout import Run
from .optimizer import ZeroOffloadAdamW
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
    """The host update with Adafactor's rule: the fp32 masters and each parameter's statistics in host memory."""

    HAS_MOMENTS = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        lay = self.layout
        self.ranges = sorted((*lay.part_range(p), p) for p in lay.params)  # (partition start, end, param)
        self.stats = {p: {k: torch.zeros(s) for k, s in _stats_shapes(lay.shape[p]).items()} for p in lay.params}

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
                   writeback: bool) -> float:  # fmt: skip
        """Adafactor on each parameter of the runs, then (as the in-memory AdamW update) the runs' new 16-bit
        parameters into staging and, with writeback, to the device."""
        t0 = time.perf_counter()
        self.transport.wait(self._staging_read)
        send = writeback and not self.staging_in_place
        events: list = []
        try:
            for gi, a, b, step, factor in runs:
                for pa, pb, p in self.ranges:
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


class ZeroOffloadAdafactor(ZeroOffloadAdamW):
    """Adafactor (torch.optim.Adafactor's update and defaults) with ZeroOffloadAdamW's offload machinery.

    Stages 1/2/3, the delayed parameter update, accumulation, clipping (`max_grad_norm`), loss scaling, the
    transports and checkpoints work as in ZeroOffloadAdamW (see its docstring); the update on the host is
    torch.optim.Adafactor's on the fp32 masters: no first moment, a factored second moment (row and column
    statistics, fp32) for parameters of 2 or more dimensions, a full one for vectors. Host state: 4 bytes per
    parameter (masters) + 4 x (rows + columns) per matrix + 4 per vector element. One rank only (a parameter
    split across ranks would need its row and column sums combined): world_size > 1 is refused, as are
    offload_optimizer="nvme" and state_dtype. state_dict() has torch.optim.Adafactor's keys per parameter (step,
    row_var, col_var or variance) plus `master`, and loads torch.optim.Adafactor's.

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
        if world > 1:
            raise ValueError(f"ZeroOffloadAdafactor runs on one rank (world_size 1), got a process group of {world}: "
                             "its factored statistics belong to whole parameters; pass a single-rank "
                             "process_group")  # fmt: skip
        super().__init__(params, lr=lr, weight_decay=weight_decay, **kwargs)

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
        if not (_real(group["d"], "d") > 0):
            raise ValueError(f"d must be > 0, got {group['d']}")
        if not (_real(group["weight_decay"], "weight_decay") >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
        if not isinstance(group["maximize"], bool):
            raise TypeError(f"maximize must be a bool, got {type(group['maximize']).__name__}")
        return dict(lr=float(lr), beta2_decay=float(group["beta2_decay"]),
                    eps=(None if eps[0] is None else float(eps[0]), float(eps[1])), d=float(group["d"]),
                    weight_decay=float(group["weight_decay"]), maximize=group["maximize"])  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Adafactor's layout: per param step, row_var/col_var or variance, plus master (fp32, CPU)."""
        self._check_alive()
        self.update.finish_pending(write=False)
        state, groups, idx = {}, [], 0
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                a, b = self.layout.part_range(p)
                state[idx] = {"step": torch.tensor(float(self.update.steps[idx])),
                              "master": self.update.master[a:b].clone().view(self.layout.shape[p]),
                              **{k: v.clone() for k, v in self.update.stats[p].items()}}  # fmt: skip
                ids.append(idx)
                idx += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        extra = {"loss_scale": self.scaler.scale, "dynamic": self.scaler.dynamic, "good_steps": self.scaler.good_steps,
                 "iteration": self.grads.iteration, "world_size": 1, "staged": self.update.staged}  # fmt: skip
        return {"state": state, "param_groups": groups, "zero_offload": extra}

    def check_state_dict(self, state_dict: dict[str, Any]) -> list[tuple[int, torch.Tensor, dict, int]]:
        """Check a state dict of this class or torch.optim.Adafactor against the optimizer; change nothing."""
        from .state import _check_step

        groups, state = check_state_dict_layout(state_dict, len(self.param_groups))
        plan = []
        for gi, (saved, group) in enumerate(zip(groups, self.param_groups)):
            if not isinstance(saved, dict) or len(saved.get("params", ())) != len(group["params"]):
                raise ValueError(f"param group {gi}: the saved group does not have this optimizer's params")
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
                    if not bool(torch.isfinite(t).all()):
                        raise ValueError(f"param {i}: state {key!r} holds inf or NaN")
                plan.append((gi, p, st, _check_step(st.get("step"), f"param {i}: state 'step'")))
        extra = state_dict.get("zero_offload", {})
        if not isinstance(extra, dict):
            raise ValueError("state_dict['zero_offload'] must be a dict")
        check_int(extra.get("iteration"), "state_dict['zero_offload']['iteration']", 0)
        return plan

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of torch.optim.Adafactor (then the masters are the model's)."""
        self._check_alive()
        if self.grads.n_micro or self.grads.in_backward:
            raise RuntimeError("load_state_dict() between backward and step(): call step() or zero_grad() first")
        plan = self.check_state_dict(state_dict)
        self.update.finish_pending(write=False)
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            group.update({k: (tuple(v) if k == "eps" else v) for k, v in saved.items() if k != "params"})
        self.update.steps = [0] * len(self.layout.params)
        for st in self.update.stats.values():
            for t in st.values():
                t.zero_()
        for _, p, st, step in plan:
            self.update.steps[self.layout.index[p]] = step
            for k, t in self.update.stats[p].items():
                t.copy_(st[k])
            if st.get("master") is not None:
                a, b = self.layout.part_range(p)
                self.update.master[a:b] = st["master"].reshape(-1).float()
        self._set_group_steps()
        if not plan or any(st.get("master") is None for _, _, st, _ in plan):
            self.update.refresh_stale_masters()
        extra = state_dict.get("zero_offload", {})
        if "loss_scale" in extra and extra.get("dynamic") == self.scaler.dynamic:
            self.scaler.scale, self.scaler.good_steps = float(extra["loss_scale"]), int(extra["good_steps"])
        self.grads.iteration = int(extra.get("iteration", max(self.update.steps, default=0)))
        self.update.resume(staged=bool(extra.get("staged")))
