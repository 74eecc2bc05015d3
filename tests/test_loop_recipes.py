"""What users put around the optimizer in a plain loop: LR schedulers (and their state dicts in a checkpoint),
torch.nn.utils.clip_grad_norm_ vs the optimizer's max_grad_norm, an EMA of the weights (AveragedModel).

Each runs the same loop with torch.optim.AdamW(foreach=False) and with ZeroOffloadAdamW(model, dtype=torch.float32)
on a tiny fp32 MLP: the learning rates exactly equal (the schedulers only read and write param_groups), losses and
parameters within tests/test_clients.py's fp32 tolerances, a resumed run bit-identical to the uninterrupted one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from clients_util import (
    HP,
    LOSS_RTOL,
    PARAM_FRAC,
    assert_params_track,
    assert_same_tensors,
    assert_series_close,
    regression_batches,
    snapshot,
    tiny_mlp,
)
from torch.optim import lr_scheduler as sched
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import zo_kernels as zk

STEPS = 8

SCHEDULERS: dict[str, Callable] = {
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda s: 0.8**s),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=3),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "SequentialLR": lambda o: sched.SequentialLR(o, [sched.LinearLR(o, 0.1, total_iters=2),
                                                     sched.ExponentialLR(o, 0.9)], milestones=[2]),  # fmt: skip
}


def make_opt(kind: str, model: torch.nn.Module, **kw) -> torch.optim.Optimizer:
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), foreach=False, **HP)
    return zk.ZeroOffloadAdamW(model, dtype=torch.float32, **HP, **kw)


def train(model, opt, scheduler, data, after_step: Callable[[], None] = lambda: None) -> tuple[list[float], list]:
    """loss.backward(), opt.step(), opt.zero_grad(), scheduler.step() (ReduceLROnPlateau: with the loss)."""
    losses, lrs = [], []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        after_step()
        if isinstance(scheduler, sched.ReduceLROnPlateau):
            scheduler.step(loss.item())
        elif scheduler is not None:
            scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    return losses, lrs


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_matches_torch_and_resumes_bit_exact(tmp_path, name):
    """The scheduler drives ZeroOffloadAdamW's lr as torch AdamW's; a checkpoint (torch.save of the model's, the
    optimizer's and the scheduler's state dicts) after half the steps resumes into a new model, optimizer and
    scheduler and ends bit-identical to the uninterrupted run."""
    m0, data = tiny_mlp(0), regression_batches(STEPS)
    runs = {}
    for kind in ("torch", "zo"):
        model = copy.deepcopy(m0)
        opt = make_opt(kind, model)
        runs[kind] = (model, *train(model, opt, SCHEDULERS[name](opt), data))
    (ref, ref_losses, ref_lrs), (model, losses, lrs) = runs["torch"], runs["zo"]
    assert len(set(ref_lrs)) > 2, f"premise: the scheduler changes the lr: {ref_lrs}"
    assert lrs == ref_lrs, f"{name}: lr per step {lrs}, with torch AdamW {ref_lrs}"
    assert_series_close(losses, ref_losses, LOSS_RTOL, f"{name}: losses, ZeroOffloadAdamW vs torch AdamW")
    assert_params_track(snapshot(model), snapshot(ref), snapshot(m0), PARAM_FRAC, f"{name}: final params")

    first = copy.deepcopy(m0)
    opt = make_opt("zo", first)
    scheduler = SCHEDULERS[name](opt)
    train(first, opt, scheduler, data[: STEPS // 2])
    path = tmp_path / "ckpt.pt"
    torch.save({"model": first.state_dict(), "opt": opt.state_dict(), "sched": scheduler.state_dict()}, path)
    ckpt = torch.load(path, weights_only=False)  # ReduceLROnPlateau's state holds plain Python objects
    resumed = tiny_mlp(1)  # other weights: the checkpoint must bring them all
    opt = make_opt("zo", resumed)
    scheduler = SCHEDULERS[name](opt)
    resumed.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    scheduler.load_state_dict(ckpt["sched"])
    rest_losses, rest_lrs = train(resumed, opt, scheduler, data[STEPS // 2 :])
    assert rest_lrs == lrs[STEPS // 2 :], f"{name}: resumed lr {rest_lrs} vs uninterrupted {lrs[STEPS // 2 :]}"
    assert rest_losses == losses[STEPS // 2 :], f"{name}: resumed losses vs uninterrupted"
    assert_same_tensors(snapshot(resumed), snapshot(model), f"{name}: resumed end vs the uninterrupted run's")


@pytest.mark.parametrize("how", ["clip_grad_norm_", "max_grad_norm"])
def test_clipping_matches_torch(how):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), c) between backward and step (it multiplies the
    MovedGrad placeholders; its returned norm is the true one), or max_grad_norm=c: torch AdamW + clip_grad_norm_."""
    m0, data, clip = tiny_mlp(0), regression_batches(STEPS), 0.05
    norms: dict[str, list[float]] = {"torch": [], "zo": []}

    def run(kind: str, own: bool) -> tuple[torch.nn.Module, list[float], torch.optim.Optimizer]:
        model = copy.deepcopy(m0)
        opt = make_opt(kind, model, **({"max_grad_norm": clip} if own else {}))
        losses = []
        for x, y in data:
            loss = torch.nn.functional.mse_loss(model(x), y)
            losses.append(loss.item())
            loss.backward()
            if not own:
                norms[kind].append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            opt.step()
            opt.zero_grad()
            if own:
                norms[kind].append(opt.stats["grad_norm"])
        return model, losses, opt

    ref, ref_losses, _ = run("torch", own=False)
    assert min(norms["torch"]) > clip, f"premise: the clipping acts at every step: {norms['torch']}"
    model, losses, opt = run("zo", own=how == "max_grad_norm")
    assert_series_close(norms["zo"], norms["torch"], LOSS_RTOL, f"{how}: gradient norms vs torch's")
    assert_series_close(losses, ref_losses, LOSS_RTOL, f"{how}: losses vs torch AdamW + clip_grad_norm_")
    assert_params_track(snapshot(model), snapshot(ref), snapshot(m0), PARAM_FRAC, f"{how}: final params")


@pytest.mark.parametrize("stage", [1, 3])
def test_ema_of_weights_matches_torch(stage):
    """AveragedModel with an EMA, updated after each step. At stage 3 a parameter is empty outside forward: the
    EMA's copy and update_parameters run inside `with opt.gathered():` (the recipe; without it the copy sizes
    mismatch)."""
    m0, data = tiny_mlp(0), regression_batches(STEPS)
    ema_fn = get_ema_multi_avg_fn(0.9)

    ref = copy.deepcopy(m0)
    ref_ema = AveragedModel(ref, multi_avg_fn=ema_fn)
    opt = make_opt("torch", ref)
    ref_losses, _ = train(ref, opt, None, data, after_step=lambda: ref_ema.update_parameters(ref))

    model = copy.deepcopy(m0)
    opt = make_opt("zo", model, stage=stage)
    with opt.gathered():
        ema = AveragedModel(model, multi_avg_fn=ema_fn)

    def update() -> None:
        with opt.gathered():
            ema.update_parameters(model)

    losses, _ = train(model, opt, None, data, after_step=update)
    assert int(ema.n_averaged) == STEPS
    assert_series_close(losses, ref_losses, LOSS_RTOL, f"stage {stage}: losses vs torch AdamW")
    assert_params_track(snapshot(ema.module), snapshot(ref_ema.module), snapshot(m0), PARAM_FRAC,
                        f"stage {stage}: the EMA's weights vs torch AdamW's EMA")  # fmt: skip
    if stage == 3:  # the premise of the recipe: outside gathered() the weights are empty
        assert model[0].weight.numel() == 0
