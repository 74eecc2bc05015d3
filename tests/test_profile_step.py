"""bench/profile_step.py: its trace analysis on a made-up Chrome trace (figures worked out by hand), and the script
end to end on the CPU (no kernels there)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import profile_step  # noqa: E402  (bench/profile_step.py)


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_busy_time_gaps_and_blocking_calls_from_a_trace():
    trace = {"traceEvents": [
        # compute stream 7: kernels [0, 100), [80, 150) (overlapping), [400, 500), [520, 600); stream 9: a small one
        _x("kernel", "a", 0, 100, stream=7), _x("kernel", "b", 80, 70, stream=7), _x("kernel", "c", 400, 100, stream=7),
        _x("kernel", "d", 520, 80, stream=7), _x("kernel", "e", 0, 30, stream=9),
        # host ops: the step (long), inside it a write_staging-like op when the 250 us gap opens at 150
        _x("user_annotation", "zo opt.step", 0, 700), _x("cpu_op", "h2d_tiles", 140, 260), _x("cpu_op", "tiny", 10, 5),
        _x("cuda_runtime", "cudaMemcpyAsync", 150, 240), _x("cuda_runtime", "cudaMemcpyAsync", 450, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 0, 5),
        _x("gpu_memcpy", "Memcpy HtoD", 150, 200, stream=11), {"ph": "i", "name": "marker", "ts": 3},
    ]}  # fmt: skip
    out = profile_step.analyse(trace, steps=2)
    assert out["compute_stream"] == 7
    assert out["busy_ms"] == (150 + 100 + 80) / 1e3 / 2  # the union, per step
    assert out["gaps"] == [{"ms": 0.25, "at_ms": 0.15, "host_op": "h2d_tiles", "part": "zo opt.step"}]  # (20 us
    # at 500: under GAP_US)
    copy = out["runtime"]["cudaMemcpyAsync"]
    assert copy["count"] == 2 and copy["max_ms"] == 0.24 and abs(copy["total_ms"] - 0.25) < 1e-12
    assert list(out["runtime"])[0] == "cudaMemcpyAsync"  # ordered by total time
    assert out["copies"] == {"11": {"count": 1, "total_ms": 0.2}}


def test_a_trace_without_kernels():
    out = profile_step.analyse({"traceEvents": [_x("cpu_op", "step", 0, 10)]}, steps=1)
    assert out["busy_ms"] is None and out["gaps"] == [] and out["runtime"] == {}


def test_the_script_on_the_cpu(tmp_path):
    path = tmp_path / "profile.json"
    assert profile_step.main([str(path), "--sizes", "2e5", "--modes", "sync,dpu", "--batch", "2", "--context", "32",
                              "--steps", "1", "--device", "cpu"]) == 0  # fmt: skip
    rows = json.loads(path.read_text())
    assert [(r["size"], r["mode"]) for r in rows] == [("2e5", "sync"), ("2e5", "dpu")]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert r["zo"]["wall_ms"] > 0 and r["fwd_bwd"]["wall_ms"] > 0 and r["zo"]["phases"]["step"] > 0


def test_the_script_with_part_of_the_optimizer_on_the_device(tmp_path, monkeypatch):
    """--gpu-fractions: each mode once per fraction, the fraction in the row and given to the optimizer; a fraction
    outside [0, 1] is refused by name."""
    path = tmp_path / "profile.json"
    real, seen = profile_step.zk.ZeroOffloadAdamW, []

    def recorded(*args, **kwargs):
        seen.append(kwargs["gpu_fraction"])
        return real(*args, **kwargs)

    monkeypatch.setattr(profile_step.zk, "ZeroOffloadAdamW", recorded)
    assert profile_step.main([str(path), "--sizes", "2e5", "--modes", "dpu", "--gpu-fractions", "0.5,0", "--batch",
                              "2", "--context", "32", "--steps", "1", "--device", "cpu"]) == 0  # fmt: skip
    rows = json.loads(path.read_text())
    assert [(r["mode"], r["gpu_fraction"]) for r in rows] == [("dpu", 0.5), ("dpu", 0.0)]
    assert all("error" not in r for r in rows), rows
    assert seen == [0.5, 0.0]
    with pytest.raises(SystemExit):
        profile_step.main([str(path), "--gpu-fractions", "1.5", "--device", "cpu"])
