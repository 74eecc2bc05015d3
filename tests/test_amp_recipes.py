"""The common AMP recipe with ZeroOffloadAdamW: an fp32 model (dtype=torch.float32) under torch.autocast.

bf16 autocast needs no loss scale: loss.backward(); opt.step(), as with torch AdamW. fp16 autocast needs one: the
optimizer's loss_scale="dynamic" (GradScaler's rule) with opt.backward(loss) is the same run as torch AdamW with
torch.amp.GradScaler; a GradScaler given ZeroOffloadAdamW is refused with that recipe (it cannot unscale gradients
that left for the host). Judged against torch.optim.AdamW(foreach=False) on the same fp32 model and autocast, with
tests/test_clients.py's fp32 tolerances (losses 1e-4 relative, parameters 1e-2 of the distance travelled).
"""

from __future__ import annotations

import copy

import pytest
import torch
from clients_util import (
    HP,
    LOSS_RTOL,
    PARAM_FRAC,
    assert_params_track,
    assert_series_close,
    regression_batches,
    snapshot,
    tiny_mlp,
)

import zo_kernels as zk

STEPS = 6


def autocast_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    assert out.dtype == dtype, f"premise: autocast runs the Linear layers in {dtype}, got {out.dtype}"
    return torch.nn.functional.mse_loss(out.float(), y)


def torch_run(m0: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.nn.Module, list[float], list[float]]:
    """The reference: torch AdamW; fp16 with torch.amp.GradScaler (scale, step, update). Returns the model, the
    losses and the loss scale after each step (1.0 without a scaler)."""
    model = copy.deepcopy(m0)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HP)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses, scales = [], []
    for x, y in regression_batches(STEPS):
        loss = autocast_loss(model, x, y, dtype)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return model, losses, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp32_model_under_autocast_matches_torch(dtype):
    """bf16: loss.backward(), no loss scale. fp16: loss_scale="dynamic" and opt.backward(loss) in place of the
    GradScaler: the same scale, so the fp16 backward rounds the same and the same steps overflow (the first:
    2**16 is too large for this model's fp16 gradients) and are skipped."""
    m0 = tiny_mlp()
    ref, ref_losses, ref_scales = torch_run(m0, dtype)
    model = copy.deepcopy(m0)
    fp16 = dtype == torch.float16
    opt = zk.ZeroOffloadAdamW(model, dtype=torch.float32, loss_scale="dynamic" if fp16 else None, **HP)
    losses, scales = [], []
    for x, y in regression_batches(STEPS):
        loss = autocast_loss(model, x, y, dtype)
        losses.append(loss.item())
        opt.backward(loss) if fp16 else loss.backward()
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
    assert scales == ref_scales, f"loss scale per step {scales}, GradScaler's {ref_scales}"
    if fp16:  # premise: the first step overflowed, the others ran (the updates are compared below)
        assert ref_scales[0] == ref_scales[-1] == 2.0**15, f"GradScaler's scale per step: {ref_scales}"
    assert all(p.dtype == torch.float32 for p in model.parameters()), "dtype=float32 keeps the model in fp32"
    what = f"fp32 model under {dtype} autocast"
    assert_series_close(losses, ref_losses, LOSS_RTOL, f"{what}: losses, ZeroOffloadAdamW vs torch AdamW")
    assert_params_track(snapshot(model), snapshot(ref), snapshot(m0), PARAM_FRAC, f"{what}: final params")


def test_grad_scaler_is_refused_with_the_recipe():
    """torch.amp.GradScaler.step(opt) unscales p.grad: refused with a message naming loss_scale="dynamic" (before:
    the MovedGrad placeholder's generic "p.grad supports only a norm..."), and the optimizer is untouched."""
    model = tiny_mlp()
    opt = zk.ZeroOffloadAdamW(model, dtype=torch.float32, **HP)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler = torch.amp.GradScaler("cpu")
    x, y = regression_batches(STEPS)[0]
    scaler.scale(autocast_loss(model, x, y, torch.float16)).backward()
    with pytest.raises(RuntimeError, match=r'GradScaler cannot unscale.*loss_scale="dynamic".*opt\.backward\(loss\)'):
        scaler.step(opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"] == {} or all(s["step"] == 0 for s in opt.state_dict()["state"].values())
    opt.zero_grad()  # the way on: discard the scaled gradients, then the recipe
    opt.backward(autocast_loss(model, x, y, torch.bfloat16))
    opt.step()
    assert not opt.stats["skipped"]


@pytest.mark.parametrize("stage", [2, 3])
def test_loss_backward_with_a_loss_scale_is_refused(stage):
    """With loss_scale given, a backward outside opt.backward(loss) (what Lightning, accelerate and HF Trainer run)
    would leave gradients 1/scale of the true ones: refused at its first gradient (before: accepted silently, the
    step divided the unscaled gradient by the scale), nothing accumulated, and opt.backward then gives the run a
    clean one gives."""
    x = regression_batches(STEPS)[0][0].to(torch.bfloat16)

    def run(refused_first: bool) -> tuple[list[torch.Tensor], dict]:
        model = tiny_mlp()
        opt = zk.ZeroOffloadAdamW(model, dtype=torch.bfloat16, stage=stage, loss_scale="dynamic", **HP)
        for _ in range(2):
            if refused_first:
                with pytest.raises(RuntimeError, match=r"outside opt\.backward\(loss\) while the loss scale is 65536"):
                    model(x).float().square().mean().backward()
            opt.backward(model(x).float().square().mean())
            opt.step()
            opt.zero_grad()
        with opt.gathered():
            return [p.detach().clone() for p in model.parameters()], dict(opt.stats)

    (want, want_stats), (got, stats) = run(False), run(True)
    assert stats["micro_batches"] == want_stats["micro_batches"] == 1 and not stats["skipped"]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "the refused backward changed the run"
