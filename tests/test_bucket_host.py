"""bench/bucket_host.py: the per-bucket host-time probe runs on the CPU and its clock comes off what it timed."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import bucket_host  # noqa: E402


def test_bucket_host_runs_on_the_cpu(tmp_path):
    """One launch per bucket per step, each inside the pack and copy calls it times; every replay condition."""
    out = tmp_path / "bucket_host.json"
    argv = [str(out), "--device", "cpu", "--sizes", "5e5", "--modes", "dpu", "--batch", "2", "--context", "32",
            "--steps", "2", "--bucket-numels", "16384,default"]  # fmt: skip
    assert bucket_host.main(argv) == 0
    small, row = json.loads(out.read_text())
    assert (small["bucket_numel"], row["bucket_numel"]) == (16384, 1 << 24)
    assert small["buckets"] > row["buckets"] >= 1 and row["params_per_bucket"] > 0
    assert small["in_backward"]["launch"]["per_step"] == small["buckets"]
    assert row["in_backward"]["step_ms"] > 0 and row["in_backward_isolated"]["step_ms"] > 0
    # on the CPU the torch path packs (no table) and pack_step trusts its bucket view after its first call
    assert "pack_upload" not in row["in_backward"] and "pack_full" not in row["in_backward"], row["in_backward"]
    for key in ("in_backward", "in_backward_isolated"):
        calls = row[key]
        assert calls["launch"]["per_step"] == row["buckets"], calls
        assert calls["pack_call"]["per_step"] == row["buckets"], calls
        assert calls["d2h"]["per_step"] >= row["buckets"], calls  # (GPU-shaped: one copy per owned piece)
        assert 0 < calls["pack_call"]["us"] < calls["launch"]["us"], calls
        for name, c in calls.items():  # (a call's thread CPU time within its wall time, give or take a clock tick)
            if name != "step_ms":
                assert 0 <= c["cpu_us"] <= c["us"] + 50 and c["voluntary_per_100"] >= 0, (name, c)
    assert set(row["replay"]) == {"quiet", "pipelined", "beside_update", "after_flush"}
    for cond in row["replay"].values():
        assert cond["calls"] >= row["buckets"] and cond["pack_call_us"] > 0 and cond["d2h_us"] > 0, cond


def test_clock_times_calls_and_comes_off():
    """Clock.wrap counts each call and its time; undo restores the object as it was (a class method again, an
    instance attribute as it was)."""

    class Thing:
        def work(self, x):
            return x + 1

    t = Thing()
    t.own = lambda: 5
    clock = bucket_host.Clock()
    clock.wrap(t, "work", "work")
    clock.wrap(t, "own", "own")
    assert t.work(1) == 2 and t.work(2) == 3 and t.own() == 5
    assert clock.calls == {"work": 2, "own": 1} and clock.seconds["work"] > 0
    per = clock.per_call_us(steps=2)
    assert per["work"]["per_step"] == 1 and per["own"]["per_step"] == 0.5
    clock.undo()
    assert "work" not in t.__dict__ and t.work(1) == 2 and t.own() == 5 and "own" in t.__dict__
    assert clock.calls == {"work": 2, "own": 1}  # (undo takes the wrappers off; the figures stay)


def test_clock_tells_a_call_off_its_core_from_one_working():
    """A call that sleeps: its wall time, not its thread's CPU time, and a voluntary context switch (it blocked) each
    time; a call that spins: CPU time about its wall time. (What tells, on a GPU's host, a pack call's 100 us of
    Python from 100 us of waiting for the GIL or a core.)"""
    import time

    class Thing:
        def sleep(self):
            time.sleep(0.02)

        def spin(self):
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.02:
                pass

    t = Thing()
    clock = bucket_host.Clock()
    clock.wrap(t, "sleep", "sleep")
    clock.wrap(t, "spin", "spin")
    for _ in range(3):
        t.sleep()
        t.spin()
    per = clock.per_call_us(steps=1)
    assert per["sleep"]["us"] >= 19_000 and per["sleep"]["cpu_us"] < 5_000, per
    assert per["sleep"]["max_us"] >= per["sleep"]["us"] >= 19_000, per
    assert per["spin"]["cpu_us"] >= 19_000 and per["spin"]["us"] + 50 >= per["spin"]["cpu_us"], per  # (clock ticks)
    if bucket_host._RUSAGE_THREAD is not None:  # (Linux)
        assert per["sleep"]["voluntary_per_100"] >= 100, per


def test_bucket_numels_asked_once_by_the_size_they_resolve_to():
    """At 95M the optimizer's default is 2**24: `default,16777216` is one row there, two at 1.3B (2**26 and 2**24);
    the order asked is kept."""
    assert bucket_host.bucket_numels("95M", 512, [None, 1 << 24]) == [None]
    assert bucket_host.bucket_numels("95M", 512, [1 << 24, None, 1 << 20]) == [1 << 24, 1 << 20]
    assert bucket_host.bucket_numels("1.3B", 512, [None, 1 << 24]) == [None, 1 << 24]


def test_bucket_host_counts_table_uploads_where_addresses_move(monkeypatch):
    """With the GPU's path taken on CPU tensors (the launch stubbed), the gradients' addresses move every step on
    the CPU: each bucket's pack call re-uploads its address table, and the row says so (pack_upload, a step)."""
    import torch

    from zo_kernels.kernels import pack as kpack
    from zo_kernels.offload import grads as grads_mod

    made = grads_mod.plan

    def gpu_style(*a, **k):
        p = made(*a, **k)
        p.impl = "triton"
        return p

    monkeypatch.setattr(grads_mod, "plan", gpu_style)
    monkeypatch.setattr(kpack, "pack", lambda *a, **k: None)
    row = bucket_host.measure("5e5", "sync", torch.device("cpu"), 2, 32, 2, bucket_numel=1 << 16)
    calls = row["in_backward"]
    assert row["buckets"] > 1 and calls["pack_upload"]["per_step"] >= row["buckets"] // 2, calls  # (one may reuse)
    assert "pack_full" not in calls and calls["kernel_launch"]["per_step"] == row["buckets"], calls
