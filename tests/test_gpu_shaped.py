"""The GPU's data flow on the CPU: ZeroOffloadAdamW with CopyEngineTransport (separate "device" buffers,
required staging, asynchronous copies with delays) against the same run with the default CPU transport.

With the default CPU transport one rank packs gradients straight into the landing buffer and the update
writes the parameters in place, so buckets, D2H copies, staging and the copy events are never exercised.
CopyEngineTransport runs all of them, with copies that land only after a delay: a missing wait changes the
result (test_a_missing_device_wait_is_caught shows the comparison failing).
"""

import copy
import time

import pytest
import torch
from offload_ref import make_data, make_model

import zo_kernels as zk
from zo_kernels.transport import CopyEngineTransport, HostTransport

SCENARIOS = {
    "synchronous": dict(),
    "dpu": dict(delay_update_after=1),
    "accumulation": dict(micro=2),
    "clip+dynamic": dict(max_grad_norm=0.5, loss_scale="dynamic"),
}


def train(transport, scenario, steps=4):
    kw = dict(SCENARIOS[scenario])
    micro = kw.pop("micro", 1)
    model = make_model(seed=0)
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=2e-3, weight_decay=0.01, bucket_numel=50_000,
                              tile_numel=4096, transport=transport, **kw)  # fmt: skip
    losses = []
    for step in make_data(steps, batch=4, micro=micro, seed=3):
        for x in step:
            loss = model(x[:, :-1], x[:, 1:])
            losses.append(loss.item())
            opt.backward(loss)
        opt.step()
    opt.synchronize()
    state = copy.deepcopy(opt.state_dict()["state"])
    params = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    opt.close()
    return losses, state, params


def assert_same_run(a, b):
    losses_a, state_a, params_a = a
    losses_b, state_b, params_b = b
    assert losses_a == losses_b, "losses differ"
    assert torch.equal(params_a, params_b), f"device params differ: max err {(params_a - params_b).abs().max()}"
    for i in state_a:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state_a[i][key], state_b[i][key]), f"param {i} {key} differs"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_copy_engine_run_is_bit_identical_to_the_cpu_run(scenario):
    reference = train(HostTransport(), scenario)
    tr = CopyEngineTransport(delay_s=0.002)
    got = train(tr, scenario)
    tr.close()
    assert_same_run(got, reference)


def test_the_delayed_update_waits_for_the_gradients_copies():
    """Under DPU the host does not wait for the backward's last copies (GradPath.defer_copies): the background update
    waits for them before it reads the gradient. Here the stand-in's compute stream is the host thread, so a device
    wait for a bucket buffer's copy already blocks the host and the copies have landed by the end of backward: the
    run (copies of 5 ms) is bit for bit the CPU run's, and the order is checked on the events themselves. The
    transport's record() gives events that land only when waited for: each delayed step's is waited for in the
    update's thread, before its CPU Adam, never by the main thread (a mutant that drops the wait fails here)."""
    reference = train(HostTransport(), "dpu", steps=3)
    tr = CopyEngineTransport(delay_s=0.005)
    got = train(tr, "dpu", steps=3)
    tr.close()
    assert_same_run(got, reference)

    import threading

    from zo_kernels.transport import Event

    log = []

    class Marking(CopyEngineTransport):
        def record(self):
            ev = Event(threading.Event())
            ev.mark = len([x for x in log if x[0] == "record"])
            log.append(("record", ev.mark, threading.current_thread().name))
            return [ev]

        def wait(self, event):
            if hasattr(event, "mark"):
                log.append(("wait", event.mark, threading.current_thread().name))
                event.handle.set()  # (it lands when waited for)
            super().wait(event)

    tr = Marking()
    model = make_model(seed=0)
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=2e-3, bucket_numel=50_000, tile_numel=4096, transport=tr,
                              delay_update_after=1)  # fmt: skip
    cpu_update = opt.update.cpu_update

    def logged(*a, **kw):
        log.append(("cpu_update", None, threading.current_thread().name))
        return cpu_update(*a, **kw)

    opt.update.cpu_update = logged
    for step in make_data(4, batch=4, seed=3):
        opt.backward(model(step[0][:, :-1], step[0][:, 1:]))
        opt.step()
    opt.close()
    tr.close()
    main = threading.main_thread().name
    records = [x for x in log if x[0] == "record"]
    assert [m for _, m, _ in records] == [0, 1, 2] and all(t == main for *_, t in records)  # steps 2-4: delayed
    for m in (0, 1, 2):  # each waited for once, in the update's thread, right before its CPU Adam
        i = log.index(("record", m, main))
        waits = [x for x in log if x[:2] == ("wait", m)]
        assert len(waits) == 1 and waits[0][2].startswith("zo-dpu"), (m, waits)
        j = log.index(waits[0])
        assert j > i and log[j + 1] == ("cpu_update", None, waits[0][2]), log


def test_the_gpu_path_is_taken():
    """Buckets, D2H copies into pinned landing buffers and H2D copies of the new parameters out of the same landing
    buffer (the update writes them over the gradients: no staging buffer) all happen."""
    seen = []

    def delay(dst, src):
        seen.append((dst.data_ptr(), src.data_ptr(), dst.numel()))
        return 0.0

    tr = CopyEngineTransport(delay_s=delay)
    model = make_model(seed=0)
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-3, bucket_numel=50_000, tile_numel=4096, transport=tr)
    x = make_data(1, batch=2)[0][0]
    opt.backward(model(x[:, :-1], x[:, 1:]))
    opt.step()
    assert opt.memory_report().host_staging == 0 and opt.staging_buf is None
    assert opt.memory_report().device_buckets > 0
    landing = opt.landing[0]
    d2h = [s for s in seen if landing.data_ptr() <= s[0] < landing.data_ptr() + landing.nbytes]
    h2d = [s for s in seen if landing.data_ptr() <= s[1] < landing.data_ptr() + landing.nbytes]
    assert len(d2h) == len(opt._buckets) > 1, "one D2H copy per bucket"
    assert sum(n for _, _, n in h2d) == opt.part, "every parameter went back through the landing buffer"
    opt.close()
    tr.close()


def test_a_missing_device_wait_is_caught():
    """The same run whose writeback is never waited for: the next forward reads parameters the H2D copies
    have not written yet, and the comparison fails (two steps: the second forward is the first to read them)."""
    reference = train(HostTransport(), "synchronous", steps=2)
    tr = CopyEngineTransport(delay_s=0.01)
    tr.device_wait = lambda event: None  # a deliberately broken consumer
    got = train(tr, "synchronous", steps=2)
    tr.close()
    with pytest.raises(AssertionError, match="differ"):
        assert_same_run(got, reference)


# ---------------------------------------------------------------- the transport itself


def test_destination_written_only_when_the_copy_runs():
    tr = CopyEngineTransport(delay_s=0.2)
    host = tr.pool.take(1000, torch.float32)
    host.fill_(float("nan"))
    dev = torch.arange(1000, dtype=torch.float32)
    ev = tr.d2h(host, dev)
    assert not ev.done() and host.isnan().all(), "written before the copy ran"
    dev += 1  # like CUDA: the copy reads its source when it runs, not when it is queued
    tr.wait(ev)
    assert ev.done() and torch.equal(host, torch.arange(1000, dtype=torch.float32) + 1)
    tr.close()


def test_h2d_event_and_device_wait_order_the_reader():
    tr = CopyEngineTransport(delay_s=0.1)
    host = tr.pool.take(64, torch.float16)
    host.fill_(3.0)
    dev = torch.zeros(64, dtype=torch.float16)
    t0 = time.perf_counter()
    ev = tr.h2d(dev, host)
    assert (dev == 0).all()
    tr.device_wait(ev)  # the CPU's compute stream is the host thread: it blocks until the copy has landed
    assert time.perf_counter() - t0 >= 0.1 and (dev == 3.0).all()
    tr.h2d(dev, host)
    marker = tr.record_h2d()  # after every H2D copy queued so far
    assert not marker.done()
    tr.synchronize()
    assert marker.done()
    tr.close()


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_pageable_host_memory_and_pool_device_memory_are_refused(direction):
    tr = CopyEngineTransport()
    pageable, dev = torch.zeros(8), torch.zeros(8)
    pinned, pinned2 = tr.pool.take(8, torch.float32), tr.pool.take(8, torch.float32)
    copy_fn = getattr(tr, direction)
    host_name = "src" if direction == "h2d" else "dst"
    args = (dev, pageable) if direction == "h2d" else (pageable, dev)
    with pytest.raises(ValueError, match=f"{host_name} must be page-locked"):
        copy_fn(*args)
    args = (pinned, pinned2)
    with pytest.raises(ValueError, match="must be device memory"):
        copy_fn(*args)
    tr.close()


def test_a_block_given_back_early_is_not_reused_before_its_copy_is_done():
    """Finding 4: a pool block handed out again is fenced by the events of the copies still using it."""
    tr = CopyEngineTransport(delay_s=0.2)
    host = tr.pool.take(1000, torch.float32)
    host.fill_(7.0)
    dev = torch.zeros(1000)
    ev = tr.h2d(dev, host)
    tr.pool.give(host)  # too early: the copy has not read it yet
    again = tr.pool.take(1000, torch.float32)
    assert again.data_ptr() == host.data_ptr() and ev.done(), "handed out again while a copy still reads it"
    again.fill_(-1.0)
    tr.synchronize()
    assert (dev == 7.0).all()
    tr.close()
