"""An update that runs beside forward and backward (DPU's, selective's window sum and apply) leaves one core to the
thread that drives the device: with the default threads (from 4 up) its kernels get one thread fewer than the
synchronous update's; threads given explicitly are used as given everywhere; the results do not depend on it."""

from __future__ import annotations

import threading

import pytest
import torch
from offload_ref import flat, make_data, make_model

import zo_kernels as zk
import zo_kernels.offload.selective as selective_mod
import zo_kernels.offload.update as update_mod
from zo_kernels.offload.comm import beside_compute

ORIGINAL = {(update_mod, "cpu_adam_step"): update_mod.cpu_adam_step, (update_mod, "tiled_writeback"):
            update_mod.tiled_writeback, (selective_mod, "cpu_adam_step"): selective_mod.cpu_adam_step,
            (selective_mod, "accumulate"): selective_mod.accumulate}  # fmt: skip


def test_beside_compute():
    assert [beside_compute(n) for n in (1, 2, 3, 4, 5, 16, 64)] == [1, 2, 3, 3, 4, 15, 63]


def _train(monkeypatch, seen, **kw):
    """Three steps of the test GPT; seen[(thread kind, kernel)] collects the `threads` each kernel call got."""

    def spy(fn, name):
        def wrapped(*a, **k):
            kind = "main" if threading.current_thread() is threading.main_thread() else "background"
            seen.setdefault((kind, name), set()).add(k.get("threads"))
            return fn(*a, **k)

        return wrapped

    for (mod, name), fn in ORIGINAL.items():
        monkeypatch.setattr(mod, name, spy(fn, "sum" if name == "accumulate" else "adam"))
    model = make_model(seed=0)
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-3, **kw)
    for step in make_data(3, batch=2):
        x = step[0]
        opt.backward(model(x[:, :-1], x[:, 1:]))
        opt.step()
    opt.synchronize()
    out = flat(model.parameters())
    opt.close()
    return out


@pytest.mark.parametrize("kind", ["dpu", "selective"])
def test_the_background_update_leaves_a_core(monkeypatch, kind):
    before = torch.get_num_threads()
    torch.set_num_threads(4)  # (a 2-core machine too: the count is what is checked, not the speed)
    try:
        extra = (dict(delay_update_after=0) if kind == "dpu"
                 else dict(selective={"fraction": 0.25, "apply_every": 2, "select_every": 2}))  # fmt: skip
        sync_seen, seen, given_seen = {}, {}, {}
        sync = _train(monkeypatch, sync_seen)
        got = _train(monkeypatch, seen, **extra)
        given = _train(monkeypatch, given_seen, threads=4, **extra)
    finally:
        torch.set_num_threads(before)
    assert sync_seen == {("main", "adam"): {4}}, sync_seen
    background = {k: v for k, v in seen.items() if k[0] == "background"}
    assert background and all(v == {3} for v in background.values()), seen
    # what runs on the main thread (selective's drain at a new selection, with nothing beside it) keeps every thread
    assert all(v == {4} for k, v in seen.items() if k[0] == "main"), seen
    if kind == "selective":
        assert ("main", "adam") in seen, seen  # (select_every 2 within 3 steps: a drain ran)
    assert all(v == {4} for v in given_seen.values()), given_seen
    assert torch.equal(got, given), "the update's results depend on its thread count"
    if kind == "dpu":
        assert not torch.equal(sync, got)  # (DPU is one step behind: the spies saw the runs they were meant to)
