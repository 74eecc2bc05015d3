"""The combinations a hand-made mutation run found untested (issue 24), one targeted test each.

Each was a seeded bug that passed the whole suite: an option that changes the schedule meeting an option that
changes the values. The oracle matrix (tests/test_oracle_matrix.py) now crosses them pairwise; these are the
cheap, direct versions (one rank, one case) that tests/mutate.py runs against its mutants.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_verbose, ref_adam
from test_oracle_matrix import Case, run_zo
from test_oracle_matrix import oracle_errors as matrix_oracle_errors

import zo_kernels as zk
from zo_kernels import CPUAdam


def oracle_errors(case: Case) -> list[str]:
    """The case run by ZeroOffloadAdamW on one rank against the oracle, judged as the matrix judges; what differs."""
    zo = [run_zo(case, 0, None)]
    threads = torch.get_num_threads()
    errors = matrix_oracle_errors(case, zo)
    assert torch.get_num_threads() == threads
    return errors


def one_rank_case(**kw) -> Case:
    base = dict(index=900, dtype="fp32", micro=1, clip=None, scale=None, dpu=None, world=1, groups=None, frozen=False,
                tied=False, unused=False, buffers=False, inf=None, transport="host", stage="2")  # fmt: skip
    return Case(**{**base, **kw})


@pytest.mark.parametrize("scale", [None, "dynamic"])
def test_overflow_before_the_delayed_update_starts_is_not_an_iteration(scale) -> None:
    """DPU k=2 and an inf in step 1 (0-based): that skipped step is not one of the k synchronous ones, so the
    delayed update starts at step 3, not step 2 (a skipped step counted as an iteration started it early)."""
    errors = oracle_errors(one_rank_case(dpu=2, inf="early", scale=scale))
    assert not errors, "\n".join(errors[:8])


@pytest.mark.parametrize("stage", ["2", "3+cpu"])
def test_framework_clipping_with_the_state_on_nvme(stage) -> None:
    """clip_grad_norm_ on the p.grad placeholders (Trainer, accelerate) sets a factor per parameter: the update
    streamed from NVMe files must apply it as the in-memory one does."""
    errors = oracle_errors(one_rank_case(clip="framework", offload="nvme", stage=stage, groups="lr_wd"))
    assert not errors, "\n".join(errors[:8])


@pytest.mark.parametrize("default_adamw", [True, False])
def test_cpu_adam_takes_adamw_from_each_param_group(default_adamw) -> None:
    """Two groups with different `adamw` (decoupled decay vs L2 in the gradient): each follows its own flag,
    not the constructor's default; judged against the formulas in float64 (tests/helpers.ref_adam)."""
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(33, generator=g), torch.randn(4, 5, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in init] for _ in range(5)]
    params = [p.clone() for p in init]
    hp = dict(lr=1e-2, weight_decay=0.3)
    opt = CPUAdam([{"params": [params[0]], "adamw": True}, {"params": [params[1]], "adamw": False}],
                  adamw=default_adamw, **hp)  # fmt: skip
    for step in grads:
        for p, gr in zip(params, step):
            p.grad = gr.clone()
        opt.step()
    for i, adamw in enumerate((True, False)):
        want, m, v = ref_adam(init[i], [s[i] for s in grads], adamw=adamw, **hp)
        st = opt.state[params[i]]
        bound = 1e-5 * max(1.0, want.abs().max().item())
        assert_close_verbose(params[i], want, bound, f"group {i} (adamw={adamw}) param")
        assert_close_verbose(st["exp_avg"], m, 1e-6, f"group {i} exp_avg")
        assert_close_verbose(st["exp_avg_sq"], v, 1e-6, f"group {i} exp_avg_sq")


@pytest.mark.parametrize("micro", [1, 2])
def test_a_gradient_factor_on_one_param_of_a_group_stays_its_own(micro: int) -> None:
    """p.grad.mul_(f) on one parameter only (per-parameter or per-group clipping in user code), with f changing
    every step: that parameter's update uses f, its neighbours' in the same group do not (against torch). With
    two micro-batches f comes after the first: it scales the sum so far only, once."""
    g = torch.Generator().manual_seed(4)
    init = [torch.randn(40, generator=g), torch.randn(24, generator=g), torch.randn(16, generator=g)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = zk.ZeroOffloadAdamW(ours, dtype=torch.float32, lr=0.1, weight_decay=0.1)
    topt = torch.optim.AdamW(ref, foreach=False, lr=0.1, weight_decay=0.1)
    for step in range(4):
        for ps in (ours, ref):
            for m in range(micro):
                sum(((i + m + 1) * p.sin()).sum() for i, p in enumerate(ps)).backward()
                if m == 0:
                    ps[1].grad.mul_(0.1 * (step + 1))
        opt.step()
        topt.step()
        opt.zero_grad()
        topt.zero_grad()
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_close_verbose(a.detach(), b.detach(), 1e-6, f"param {i}")


GROWTH_INTERVAL = 3  # the scaler's 2000 shortened (monkeypatched) so that growth happens within a few steps
# inf in the gradient at these steps of 12: growth, an overflow one good step before the next growth, two in a row
INF_STEPS = {4, 6, 7}


def torch_scales(steps: int) -> list[float]:
    """torch.amp.GradScaler's loss scale after each step (same infs), with growth_interval=GROWTH_INTERVAL."""
    p = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    out = []
    for t in range(steps):
        scaler.scale(p.sum()).backward()
        if t in INF_STEPS:
            p.grad[0] = float("inf")
        scaler.step(sgd)
        scaler.update()
        sgd.zero_grad()
        out.append(scaler.get_scale())
    return out


def zo_dynamic(monkeypatch) -> tuple[torch.nn.Module, zk.ZeroOffloadAdamW]:
    monkeypatch.setattr("zo_kernels.offload.scaler.SCALE_INTERVAL", GROWTH_INTERVAL)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, zk.ZeroOffloadAdamW(model, dtype=torch.float32, lr=1e-3, loss_scale="dynamic")


def zo_step(model: torch.nn.Module, opt: zk.ZeroOffloadAdamW, t: int) -> float:
    """One step (an inf in the gradient at INF_STEPS); the loss scale after it."""
    opt.backward(model(torch.ones(2, 4)).sum() * (float("inf") if t in INF_STEPS else 1.0))
    opt.step()
    opt.zero_grad()
    return opt.loss_scale


def test_dynamic_scale_follows_torch_grad_scaler_through_overflows(monkeypatch) -> None:
    """2**16, x2 after GROWTH_INTERVAL good steps, /2 on an overflow, which restarts the count of good steps:
    the scale after every step equals torch.amp.GradScaler's with the same overflows."""
    want = torch_scales(12)
    assert want[0] == 2.0**16 and max(want) > 2.0**16 and min(want) < 2.0**16  # the schedule grows and backs off
    model, opt = zo_dynamic(monkeypatch)
    got = [zo_step(model, opt, t) for t in range(12)]
    assert got == want


@pytest.mark.parametrize("save_at", [1, 5, 9])
def test_dynamic_scale_after_a_state_dict_round_trip(monkeypatch, save_at: int) -> None:
    """Saved after step `save_at` (good steps counted since the last change) and loaded into a fresh optimizer:
    the next growth comes at the same step as without the round trip (torch.amp.GradScaler's schedule)."""
    want = torch_scales(12)
    model, opt = zo_dynamic(monkeypatch)
    got = [zo_step(model, opt, t) for t in range(save_at + 1)]
    sd, msd = opt.state_dict(), model.state_dict()
    opt.close()
    model, opt = zo_dynamic(monkeypatch)
    model.load_state_dict(msd)
    opt.load_state_dict(sd)
    got += [zo_step(model, opt, t) for t in range(save_at + 1, 12)]
    assert got == want


def stage_weights(stage: int) -> list[dict[str, torch.Tensor]]:
    """3 steps of a small MLP, an evaluation forward (no_grad) between each backward and step; the weights read
    right after each step, by model.state_dict() and inside opt.gathered() (no forward in between)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 6), torch.nn.Tanh(),
                                torch.nn.Linear(6, 3))  # fmt: skip
    kw = dict(stage=3, prefetch=2) if stage == 3 else dict(stage=stage)
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, **kw)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        model(torch.randn(4, 5, generator=g)).square().sum().backward()
        with torch.no_grad():  # at stage 3 this forward leaves a unit prefetched (gathered, pre-update values)
            model(torch.randn(4, 5, generator=g))
        opt.step()
        opt.zero_grad()
        out.append({k: v.clone() for k, v in model.state_dict().items()})
        with opt.gathered():
            out.append({"gathered " + k: v.clone() for k, v in model.state_dict().items()})
    opt.close()
    return out


def test_stage3_weights_read_right_after_a_step_are_the_updated_ones() -> None:
    """An update makes every gathered copy of the parameters stale: model.state_dict() or opt.gathered() right
    after opt.step() must read the new weights, bit for bit stage 2's (fp32, one rank), also when a forward before
    the step left a unit gathered (prefetched)."""
    want, got = stage_weights(2), stage_weights(3)
    for i, (w, o) in enumerate(zip(want, got)):
        assert w.keys() == o.keys()
        bad = [k for k in w if not torch.equal(w[k], o[k])]
        assert not bad, f"{('state_dict()', 'gathered()')[i % 2]} after step {i // 2 + 1}: {bad} differ from stage 2's"
