"""Plain-PyTorch oracle for ZeroOffloadAdamW's semantics, and a small model whose features can be switched on.

Shares no code with zo_kernels (imports nothing from it). One process simulates every rank. Rules, per step():
- Working copy: `copy.deepcopy(model).to(dtype)` (every floating parameter, trainable or frozen, and every
  floating buffer; integer buffers stay as they are). Forward and backward run on it.
- Masters: an fp32 leaf tensor per trainable parameter, from the model's values before the cast, updated by
  `torch.optim.AdamW(foreach=False)`; the param groups are the caller's, each param mapped to its master
  (frozen params have no master and are dropped from the groups).
- Gradients: per rank, the micro-batches' gradients of the working copy are converted to fp32 and summed;
  then the ranks' sums are summed and divided by the number of ranks (a rank without a gradient adds zeros).
  A param with no gradient on any rank and micro-batch keeps `.grad = None`, so AdamW skips it entirely
  (no decay, no moment update, its own step count unchanged).
- Loss scale: the backward runs on `loss.float() * scale` (scale 1: plain `loss.backward()`); inf/NaN in any
  summed gradient skips the step (no update, no clipping); "dynamic" follows torch.amp.GradScaler: starts at
  2**16, x0.5 on a skipped step, x2 after 2000 good steps in a row. The gradient is divided by the scale.
- Clipping: `torch.nn.utils.clip_grad_norm_(masters, max_grad_norm)` on the unscaled, averaged gradients.
- Delayed parameter update with k: let n be the number of updates applied so far. A step is delayed when
  n + 1 > k. A delayed step first copies the current masters (P_n) into the working copy, then (if not
  skipped) applies update n+1 to the masters without touching the working copy; a synchronous step applies
  the update and then copies the masters. So forward i uses P_{i-2} for i >= k+2. `synchronize()` copies
  the latest masters into the working copy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SCALE_INIT, SCALE_GROWTH, SCALE_BACKOFF, SCALE_INTERVAL = 2.0**16, 2.0, 0.5, 2000  # torch.amp.GradScaler's


class Oracle:
    """Mixed-precision AdamW training of `model` written the plain way (see the module docstring).

    Args:
        model: the fp32 model (deep-copied, left untouched).
        dtype: the working copy's dtype.
        groups: optional param-group dicts over `model`'s params (per-group lr, weight_decay...).
        loss_scale: None, a number (static) or "dynamic".
        max_grad_norm: clip the averaged gradient to this global L2 norm (None: no clipping). Clipping by the
            framework (clip_grad_norm_ over the model's p.grad before step()) means the same: its p.grad is the
            averaged, unscaled gradient.
        delay_update_after: k of the delayed parameter update (None: always synchronous).
        foreach, reverse_sums, nudge: perturbations used to measure the oracle's own fp32 noise: AdamW's
            foreach implementation, summing micro-batches and ranks in reverse order, and moving every
            initial master by one fp32 ulp (alternating up/down).
        reduce_dtype: reduce over ranks in this dtype, as ZeRO does with 16-bit gradients: each micro-batch's
            gradient divided by the number of ranks and summed over the ranks (in rank order) in reduce_dtype,
            the micro-batches' averages then summed in fp32 (None: the rules above, all in fp32).
        adamw: AdamW's keyword arguments (lr, betas, eps, weight_decay).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, *, groups: Sequence[dict] | None = None,
                 loss_scale: float | str | None = None, max_grad_norm: float | None = None,
                 delay_update_after: int | None = None, foreach: bool = False, reverse_sums: bool = False,
                 nudge: bool = False, reduce_dtype: torch.dtype | None = None, **adamw: Any) -> None:  # fmt: skip
        self.work = copy.deepcopy(model).to(dtype)
        self.masters: dict[str, torch.Tensor] = {}
        self._work_params: dict[str, torch.Tensor] = dict(self.work.named_parameters())
        master_of: dict[int, torch.Tensor] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                m = p.detach().clone().float()
                if nudge:
                    sign = torch.ones_like(m).view(-1)
                    sign[1::2] = -1
                    m = torch.nextafter(m, m + sign.view_as(m) * float("inf"))
                self.masters[name] = m.requires_grad_()
                master_of[id(p)] = self.masters[name]
        if groups is None:
            opt_groups = [{"params": list(self.masters.values())}]
        else:
            opt_groups = [{**g, "params": [master_of[id(p)] for p in g["params"] if id(p) in master_of]}
                          for g in groups]  # fmt: skip
        self.opt = torch.optim.AdamW(opt_groups, foreach=foreach, **adamw)
        self.dynamic = loss_scale == "dynamic"
        self.scale = SCALE_INIT if self.dynamic else float(loss_scale or 1.0)
        self.scaled = loss_scale is not None
        self.max_grad_norm = max_grad_norm
        self.delay = delay_update_after
        self.reverse_sums = reverse_sums
        self.reduce_dtype = reduce_dtype
        self.updates = 0  # updates applied to the masters
        self.good_steps = 0

    def step(self, batches: Sequence[Sequence[Any]], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
             ) -> tuple[list[list[float]], bool]:  # fmt: skip
        """One iteration: batches[rank][micro] -> loss_fn(working model, batch). Returns (losses, skipped)."""
        losses, rank_sums, per_rank = [], [], []
        for rank_batches in batches:
            sums: dict[str, torch.Tensor] = {}
            losses.append([])
            grads_per_micro = []
            for batch in rank_batches:
                self.work.zero_grad(set_to_none=True)
                loss = loss_fn(self.work, batch)
                losses[-1].append(loss.item())
                (loss.float() * self.scale if self.scaled else loss).backward()
                grads_per_micro.append({n: p.grad.float() for n, p in self._work_params.items()
                                        if n in self.masters and p.grad is not None})  # fmt: skip
            for grads in reversed(grads_per_micro) if self.reverse_sums else grads_per_micro:
                for n, g in grads.items():
                    sums[n] = g.clone() if n not in sums else sums[n] + g
            rank_sums.append(sums)
            per_rank.append(grads_per_micro)
        self.work.zero_grad(set_to_none=True)
        averaged: dict[str, torch.Tensor] = {}
        if self.reduce_dtype is not None:
            for micro in zip(*per_rank):
                reduced: dict[str, torch.Tensor] = {}
                for grads in micro:
                    for n, g in grads.items():
                        part = (g / len(batches)).to(self.reduce_dtype)
                        reduced[n] = part if n not in reduced else (reduced[n] + part).to(self.reduce_dtype)
                for n, g in reduced.items():
                    averaged[n] = g.float() if n not in averaged else averaged[n] + g.float()
        else:
            for sums in reversed(rank_sums) if self.reverse_sums else rank_sums:
                for n, g in sums.items():
                    averaged[n] = g.clone() if n not in averaged else averaged[n] + g
            averaged = {n: g / len(batches) for n, g in averaged.items()}

        delayed = self.delay is not None and self.updates + 1 > self.delay
        if delayed:
            self._copy_to_work()  # P_n reaches the model before the overflow check (and before update n+1)
        if any(not torch.isfinite(g).all() for g in averaged.values()):
            if self.dynamic:
                self.scale *= SCALE_BACKOFF
                self.good_steps = 0
            return losses, True
        for n, m in self.masters.items():
            m.grad = averaged[n] / self.scale if n in averaged else None
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([m for m in self.masters.values() if m.grad is not None],
                                           self.max_grad_norm)  # fmt: skip
        self.opt.step()
        self.updates += 1
        if not delayed:
            self._copy_to_work()
        if self.dynamic:
            self.good_steps += 1
            if self.good_steps == SCALE_INTERVAL:
                self.scale *= SCALE_GROWTH
                self.good_steps = 0
        return losses, False

    def synchronize(self) -> None:
        """The latest masters into the working copy."""
        self._copy_to_work()

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """The master, exp_avg, exp_avg_sq (zeros before its first update) and step count of one param."""
        m = self.masters[name]
        st = self.opt.state.get(m, {})
        zeros = torch.zeros_like(m)
        return {"master": m.detach(), "exp_avg": st.get("exp_avg", zeros), "exp_avg_sq": st.get("exp_avg_sq", zeros),
                "step": float(st["step"]) if "step" in st else 0.0}  # fmt: skip

    @torch.no_grad()
    def _copy_to_work(self) -> None:
        for n, m in self.masters.items():
            self._work_params[n].copy_(m)


class FeatureNet(nn.Module):
    """A tiny next-token model whose features can be switched on, for the differential matrix.

    embedding -> [frozen Linear, residual] -> Linear + GELU (residual) -> [`sometimes` Linear when branch]
    -> LayerNorm -> [x fixed gain buffer, permuted by an integer buffer] -> output Linear (no bias).

    Args:
        frozen: a Linear with requires_grad=False on the path.
        tied: the output projection is the embedding's weight.
        unused: a Linear never called (`unused`) and one called only when forward gets branch=True
            (`sometimes`).
        buffers: a floating buffer (gain) and an integer buffer (a permutation) used in forward.
    """

    def __init__(self, vocab: int = 37, width: int = 24, *, frozen: bool = False, tied: bool = False,
                 unused: bool = False, buffers: bool = False, seed: int = 0) -> None:  # fmt: skip
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)
        self.frozen = nn.Linear(width, width).requires_grad_(False) if frozen else None
        self.unused = nn.Linear(width, width) if unused else None
        self.sometimes = nn.Linear(width, width) if unused else None
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 1 else 0.3))
        if tied:
            self.out.weight = self.emb.weight
        if buffers:
            self.register_buffer("gain", 1.0 + 0.25 * torch.randn(width, generator=g))
            self.register_buffer("perm", torch.randperm(width, generator=g))
        else:
            self.gain = self.perm = None

    def forward(self, x: torch.Tensor, y: torch.Tensor, branch: bool = False, inject: bool = False) -> torch.Tensor:
        """Mean cross-entropy (fp32) of predicting y from x; inject=True puts an inf into the backward."""
        h = self.emb(x)
        if self.frozen is not None:
            h = h + self.frozen(h)
        h = h + F.gelu(self.hidden(h))
        if branch and self.sometimes is not None:
            h = h + self.sometimes(h)
        h = self.norm(h)
        if self.gain is not None:
            h = (h * self.gain)[..., self.perm]
        if inject:
            h.register_hook(lambda g: g.index_fill(-1, torch.tensor([0], device=g.device), float("inf")))
        logits = self.out(h)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def param_groups(model: nn.Module, kind: str = "lr_wd") -> list[dict]:
    """Two groups: matrices (decayed, the base lr) and vectors (no decay, another lr); kind "all": the vectors
    also get their own betas and eps."""
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    more = {"betas": (0.8, 0.99), "eps": 1e-6} if kind == "all" else {}
    return [{"params": mats, "weight_decay": 0.1}, {"params": vecs, "weight_decay": 0.0, "lr": 3e-3, **more}]
