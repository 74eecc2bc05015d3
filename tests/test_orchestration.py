"""The optimizer's host work per step stays off the per-tensor path: the usual step's update ranges are computed
once (and equal the general computation), the pass's scalars are not reallocated, and the per-gradient hooks do
not re-check every parameter (issue 17: orchestration <= 5% of the step)."""

import pytest
import torch
from offload_ref import make_data, make_model

import zo_kernels as zk
from zo_kernels.offload.layout import FlatLayout


def params(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("zero3", [False, True])
def test_usual_step_runs_equal_the_general_computation(world, zero3):
    ps = params([5, 17, 300, 1, 64, 999, 8, 33])
    groups = [ps[:3], ps[3:6], ps[6:]]
    units = [ps[:2], ps[2:5], ps[5:]] if zero3 else None
    for rank in range(world):
        lay = FlatLayout(groups, torch.bfloat16, world, rank, bucket_numel=400, units=units)
        n = len(ps)
        for step in (0, 1, 7):
            want = lay._runs([True] * n, [step] * n, [1.0] * n)
            assert lay.runs([True] * n, [step] * n, [1.0] * n) == want
            assert lay.runs([True] * n, [step] * n, [1.0] * n) == want  # from the cache
        # the general path where the usual one does not apply: a param skipped, steps apart, a factor
        got = [True] * n
        got[4] = False
        assert lay.runs(got, [2] * n, [1.0] * n) == lay._runs(got, [2] * n, [1.0] * n)
        assert lay.runs([True] * n, [2] * (n - 1) + [1], [1.0] * n) == lay._runs([True] * n, [2] * (n - 1) + [1],
                                                                                   [1.0] * n)  # fmt: skip
        assert lay.runs([True] * n, [2] * n, [0.5] + [1.0] * (n - 1)) == lay._runs([True] * n, [2] * n,
                                                                                   [0.5] + [1.0] * (n - 1))  # fmt: skip


def test_per_step_host_work_is_not_per_tensor_per_hook():
    model = make_model(seed=0)
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-3, bucket_numel=5_000)
    n = len(opt.layout.params)
    calls = [0]
    connected = opt.grads.connected

    def counting(p):
        calls[0] += 1
        return connected(p)

    opt.grads.connected = counting
    scalars = (opt.grads._found_inf, opt.grads._sum_sq)
    for x in make_data(3, batch=2):
        x = x[0]
        calls[0] = 0
        opt.backward(model(x[:, :-1], x[:, 1:]))
        opt.step()
        # the pass's start and step() check every param once each; the hooks only on the pass's first gradient
        assert calls[0] <= 2 * n + 1, (calls[0], n)
        assert opt.grads._found_inf is scalars[0] and opt.grads._sum_sq is scalars[1]  # zeroed in place
    opt.close()


def test_a_step_hashes_no_tensor_per_parameter(monkeypatch):
    """A tensor's __hash__ is a Python function (torch's Tensor.__hash__): the hooks and a bucket's launch looked
    each parameter up by tensor, six calls a parameter a step (5 of 7 in a hook's and a placeholder's lookups);
    now by index. A step over a model of n params hashes a bounded number of tensors, whatever n."""
    import dataclasses

    from offload_ref import CFG

    counts = {}
    for layers in (1, 4):
        model = make_model(seed=0, cfg=dataclasses.replace(CFG, layers=layers))
        opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-3, bucket_numel=5_000)
        n = len(opt.layout.params)
        data = make_data(3, batch=2)
        opt.backward(model(data[0][0][:, :-1], data[0][0][:, 1:]))
        opt.step()
        hashes = [0]
        own = torch.Tensor.__hash__

        def counting(self, own=own, hashes=hashes):
            hashes[0] += 1
            return own(self)

        monkeypatch.setattr(torch.Tensor, "__hash__", counting)
        for x in data[1:]:
            opt.backward(model(x[0][:, :-1], x[0][:, 1:]))
            opt.step()
        monkeypatch.setattr(torch.Tensor, "__hash__", own)
        counts[n] = hashes[0] / 2
        opt.close()
    small, large = sorted(counts)
    assert large > small and counts[large] == counts[small] and counts[small] <= 4, counts


def test_the_offload_phase_is_told_in_parts(monkeypatch):
    """stats' time_offload (the host's time per bucket in backward) in parts: offload_wait, offload_pack and
    offload_copy, within it, each where its time goes (a copy call slowed by 3 ms shows in offload_copy, not in the
    pack), and the gradient hooks' own time apart (time_hooks)."""
    import time

    from zo_kernels.transport import CopyEngineTransport

    model = make_model()
    tr = CopyEngineTransport()
    opt = zk.ZeroOffloadAdamW(model.parameters(), transport=tr, bucket_numel=4096, lr=1e-3)
    real = tr.d2h
    monkeypatch.setattr(tr, "d2h", lambda dst, src: (time.sleep(0.003), real(dst, src))[1])
    x = make_data(1)[0][0]
    try:
        for _ in range(2):
            opt.backward(model(x[:, :-1], x[:, 1:]))
            opt.step()
            opt.zero_grad()
        s = opt.stats
        buckets = len(opt.layout.buckets)
        parts = s["time_offload_wait"] + s["time_offload_pack"] + s["time_offload_copy"]
        assert buckets >= 3 and 0 < parts <= s["time_offload"] * (1 + 1e-9), s
        assert s["time_offload_copy"] >= 0.003 * buckets > s["time_offload_pack"], s
        assert s["time_hooks"] > 0 and s["time_offload_wait"] >= 0
        assert 0 < s["time_global_checks"] <= s["time_reduce"], s  # (one rank: reduce is the checks' read)
        # a pass's start is not the hooks' own time: accumulation's sum of the micro-batches (slowed by 50 ms) is not
        # in time_hooks
        from zo_kernels.offload import grads as grads_mod

        real_acc = grads_mod.accumulate
        monkeypatch.setattr(grads_mod, "accumulate", lambda *a, **k: (time.sleep(0.05), real_acc(*a, **k))[1])
        for _ in range(3):
            opt.backward(model(x[:, :-1], x[:, 1:]))
        opt.step()
        assert opt.stats["time_hooks"] < 0.05, opt.stats
    finally:
        opt.close()
        tr.close()


def test_the_nesting_question_is_asked_once_per_backward(monkeypatch):
    """Whether a backward is nested in another (reentrant checkpointing) is a walk up the Python stack, long under a
    trainer's frames: asked once per graph task, not once per gradient (a 40-frame stack cost 2.8 us a parameter in
    the hooks, 1.2 once asked once; the 2-core machine)."""
    from zo_kernels.offload import grads as grads_mod

    asked = []
    real = grads_mod.in_nested_backward
    monkeypatch.setattr(grads_mod, "in_nested_backward", lambda: (asked.append(1), real())[1])
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-3)
    x = make_data(1)[0][0]
    for _ in range(2):
        asked.clear()
        opt.backward(model(x[:, :-1], x[:, 1:]))
        opt.step()
        assert len(list(model.parameters())) > 5 and len(asked) == 1, len(asked)
    opt.close()
    # reentrant checkpointing: each segment's nested backward is asked once too, not once per gradient in it
    from torch.utils.checkpoint import checkpoint

    blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
    opt = zk.ZeroOffloadAdamW(blocks.parameters(), lr=1e-3, dtype=torch.float32)
    asked.clear()
    h = torch.randn(2, 8, requires_grad=True)
    for b in blocks:
        h = checkpoint(b, h, use_reentrant=True)
    h.sum().backward()
    opt.step()
    assert len(asked) == 4, len(asked)  # four nested backwards, eight gradients
    opt.close()


def test_the_all_at_once_connection_check_agrees_with_the_one_by_one():
    """param_views.all_aliases (the step's and each pass's check that the model still holds the optimizer's
    parameters, in C-level passes over the list) says True exactly when is_alias_of holds for every param, whatever
    was done to one of them (as module._apply does it, through .data): replaced, cast (also a zero-size one, whose
    address is not compared), given other data of its size, a zero-size one given data."""
    from zo_kernels.param_views import alias, all_aliases, is_alias_of

    sizes = [(4, 3), (0,), (5,), (2, 2)]
    offsets, off = [], 0
    for s in sizes:
        offsets.append(off)
        off += torch.Size(s).numel()
    flat = torch.randn(off)

    def fresh() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(alias(flat, o, torch.Size(s).numel(), torch.Size(s)))
                for o, s in zip(offsets, sizes)]  # fmt: skip

    changes = [
        ("none", lambda ps: None),
        ("replaced", lambda ps: setattr(ps[0], "data", ps[0].data.clone())),
        ("cast", lambda ps: setattr(ps[2], "data", ps[2].data.double())),
        ("zero-size cast", lambda ps: setattr(ps[1], "data", torch.empty(0, dtype=torch.float16))),
        ("other data", lambda ps: setattr(ps[2], "data", torch.randn(5))),
        ("zero-size given data", lambda ps: setattr(ps[1], "data", torch.randn(3))),
    ]
    for name, change in changes:
        ps = fresh()
        by_param = dict(zip(ps, offsets))
        check = all_aliases(ps, flat, by_param)
        change(ps)
        want = all(is_alias_of(p, flat, by_param[p]) for p in ps)
        assert check() == want, name
        assert want == (name == "none"), name


def test_each_param_has_one_placeholder_for_the_run(monkeypatch):
    """p.grad's placeholder (MovedGrad) is made once per param and reused every step (a new one is ~1.5 us a param a
    step); a param whose shape it no longer has (ZeRO-3 gathers and frees) gets a new one. Clipping through the
    reused placeholders still reads each step's gradient."""
    from zo_kernels.offload import grads as grads_mod
    from zo_kernels.param_views import MovedGrad

    made = []

    class Counting(MovedGrad):
        @staticmethod
        def __new__(cls, like, owner=None, index=-1):
            made.append(index)
            return MovedGrad.__new__(cls, like, owner, index)

    monkeypatch.setattr(grads_mod, "MovedGrad", Counting)
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-3)
    n = len(list(model.parameters()))
    data = make_data(3)
    norms = []
    for x in data:
        opt.backward(model(x[0][:, :-1], x[0][:, 1:]))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad()
    assert sorted(made) == list(range(n)), made  # each param once, over three steps
    assert len(set(norms)) == 3 and all(v > 0 for v in norms), norms  # each step's own gradient
    opt.close()


def test_a_cast_model_still_hears_why_after_zero_grad_keeping_zeros():
    """The reused placeholder no longer fits a param of a model cast after step(): zero_grad(set_to_none=False) makes
    a fitting one (torch refused the old one halfway through, with its own words), and the next backward names the
    cast, as it did with a new placeholder every step."""
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-3)
    x = make_data(1)[0][0]
    opt.backward(model(x[:, :-1], x[:, 1:]))
    opt.step()
    model.half()
    opt.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match="no longer the optimizer's"):
        opt.backward(model(x[:, :-1], x[:, 1:]))


@pytest.mark.parametrize("dpu", [False, True])
@pytest.mark.parametrize("engine", [False, True])
def test_buckets_pack_through_trusted_buffers_after_the_first_step(dpu, engine):
    """Each bucket's pack checks the step's own bucket view and totals once (PackPlan.pack_step's first call with
    them), then trusts them: no full pack() call per step after the first steps, also under DPU, whose landing slots
    alternate (with device = CPU and one rank a bucket packs into either slot: each plan trusted only one of them,
    so every DPU call took the full path, found by a review), and with the GPU-shaped transport's bucket buffers."""
    from zo_kernels.kernels.plan import PackPlan
    from zo_kernels.transport import CopyEngineTransport

    model = make_model(seed=0)
    transport = CopyEngineTransport() if engine else None
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-3, bucket_numel=5_000, transport=transport,
                              delay_update_after=0 if dpu else None)  # fmt: skip
    full = [0]
    real = PackPlan.pack

    def counting(self, *a, **k):
        full[0] += 1
        return real(self, *a, **k)

    try:
        PackPlan.pack = counting
        per_step = []
        for x in make_data(6, batch=2):
            x = x[0]
            full[0] = 0
            opt.backward(model(x[:, :-1], x[:, 1:]))
            opt.step()
            per_step.append(full[0])
        plans = len(opt.grads.plans)
        assert per_step[0] == plans and sum(per_step[1:]) == (plans if dpu and not engine else 0), (per_step, plans)
    finally:
        PackPlan.pack = real
        opt.close()
        if transport is not None:
            transport.close()
