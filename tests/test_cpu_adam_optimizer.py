"""CPUAdam as a drop-in for torch.optim.AdamW / Adam: trajectories, param groups, schedulers, state dicts."""

import pytest
import torch
from helpers import assert_within_2x_of, digest, ref_adam

from zo_kernels import CPUAdam


def make_params(seed=0, shapes=((7, 5), (5,), (4097,), (1,))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen) for s in shapes]


def grads_for(params, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]


def run(opt_cls, init, grads, group_kw=None, sched=None, **kw):
    params = [p.clone().requires_grad_() for p in init]
    if group_kw is None:
        opt = opt_cls(params, **kw)
    else:
        opt = opt_cls([{"params": params[:2], **group_kw}, {"params": params[2:]}], **kw)
    scheduler = sched(opt) if sched else None
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        if scheduler:
            scheduler.step()
    return params, opt


@pytest.mark.parametrize("adamw, torch_cls", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_many_steps_match_torch_with_state(adamw, torch_cls):
    init, grads = make_params(), None
    grads = grads_for(init, 50)
    kw = dict(lr=2e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    ours, opt = run(CPUAdam, init, grads, adamw=adamw, **kw)
    theirs, topt = run(torch_cls, init, grads, **kw)
    for i, (a, b, p0) in enumerate(zip(ours, theirs, init)):
        ref = ref_adam(p0, [g[i] for g in grads], adamw=adamw, **kw)
        assert_within_2x_of(a.detach(), ref[0], b.detach(), f"param {i}")
        assert_within_2x_of(opt.state[a]["exp_avg"], ref[1], topt.state[b]["exp_avg"], f"exp_avg {i}")
        assert_within_2x_of(opt.state[a]["exp_avg_sq"], ref[2], topt.state[b]["exp_avg_sq"], f"exp_avg_sq {i}")
        assert opt.state[a]["step"].item() == topt.state[b]["step"].item() == 50


def test_param_groups_and_scheduler_match_torch():
    init = make_params(seed=2)
    grads = grads_for(init, 30, seed=3)
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5)  # noqa: E731
    group_kw = dict(lr=5e-3, weight_decay=0.0, betas=(0.85, 0.99))
    ours, opt = run(CPUAdam, init, grads, group_kw=group_kw, sched=sched, lr=1e-3, weight_decay=0.1)
    theirs, topt = run(torch.optim.AdamW, init, grads, group_kw=group_kw, sched=sched, lr=1e-3, weight_decay=0.1)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in topt.param_groups]
    for i, (a, b) in enumerate(zip(ours, theirs)):
        # ref: replay each group's schedule in float64
        lr0, wd, betas = (5e-3, 0.0, (0.85, 0.99)) if i < 2 else (1e-3, 0.1, (0.9, 0.999))
        p, m, v = init[i], None, None
        for s, gs in enumerate(grads):
            p, m, v = ref_adam(p, [gs[i]], m, v, lr=lr0 * 0.5 ** (s // 7), weight_decay=wd, betas=betas,
                               first_step=s + 1)  # fmt: skip
        assert_within_2x_of(a.detach(), p, b.detach(), f"param {i}")


def test_state_dict_round_trip_through_torch_adamw_mid_run():
    """CPUAdam 10 steps -> torch AdamW 10 steps -> CPUAdam 10 steps, against 30 uninterrupted steps of either."""
    init = make_params(seed=4)
    grads = grads_for(init, 30, seed=5)
    kw = dict(lr=3e-3, weight_decay=0.02)
    straight, sopt = run(CPUAdam, init, grads, **kw)
    straight_t, _ = run(torch.optim.AdamW, init, grads, **kw)

    params = [p.clone().requires_grad_() for p in init]
    segments = [CPUAdam, torch.optim.AdamW, CPUAdam]
    sd = None
    for k, cls in enumerate(segments):
        opt = cls(params, **kw)
        if sd is not None:
            opt.load_state_dict(sd)
        for gs in grads[10 * k : 10 * (k + 1)]:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        sd = opt.state_dict()
    for i, (a, b, c, p0) in enumerate(zip(params, straight, straight_t, init)):
        ref = ref_adam(p0, [g[i] for g in grads], **kw)
        assert_within_2x_of(a.detach(), ref[0], c.detach(), f"resumed param {i}")
        assert_within_2x_of(b.detach(), ref[0], c.detach(), f"straight param {i}")
    assert sd["state"][0]["step"].item() == 30


def test_state_dict_keys_match_torch():
    init = make_params()
    grads = grads_for(init, 2)
    _, ours = run(CPUAdam, init, grads)
    _, theirs = run(torch.optim.AdamW, init, grads)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        assert a["state"][k]["step"].dtype == b["state"][k]["step"].dtype


def test_zero_grad_and_params_without_grad():
    p = torch.randn(10, requires_grad=True)
    q = torch.randn(10, requires_grad=True)
    opt = CPUAdam([p, q], lr=0.1)
    p.grad = torch.ones(10)
    q0 = q.detach().clone()
    opt.step()
    assert torch.equal(q.detach(), q0) and q not in opt.state
    opt.zero_grad()
    assert p.grad is None


def test_closure_returns_loss():
    p = torch.randn(3, requires_grad=True)
    opt = CPUAdam([p])

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() > 0


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(lr=-1.0), ValueError, "lr must be >= 0"),
        (dict(betas=(0.9, 1.0)), ValueError, r"betas\[1\]"),
        (dict(eps=0.0), ValueError, "eps must be > 0"),
        (dict(weight_decay=-1.0), ValueError, "weight_decay"),
    ],
)
def test_bad_hparams(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        CPUAdam([torch.zeros(3, requires_grad=True)], **kwargs)


def test_bad_params_and_loaded_groups_touch_nothing():
    with pytest.raises(TypeError, match=r"params\[0\] must have dtype float32"):
        CPUAdam([torch.zeros(3, dtype=torch.float16, requires_grad=True)])
    with pytest.raises(ValueError, match=r"params\[0\] must be contiguous"):
        CPUAdam([torch.zeros(3, 4).t().requires_grad_()])
    p = torch.randn(5, requires_grad=True)
    opt = CPUAdam([p])
    p.grad = torch.ones(5)
    opt.step()
    opt.param_groups[0]["lr"] = float("nan")  # e.g. a broken scheduler
    before = digest(p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], opt.state[p]["step"])
    with pytest.raises(ValueError, match="lr must be finite"):
        opt.step()
    opt.param_groups[0]["lr"] = 1e-3
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()
    assert digest(p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], opt.state[p]["step"]) == before
