"""Where the host blocks and where the device idles in one GPT training step: the step under torch.profiler.

Usage: python bench/profile_step.py OUT.json [--sizes 95M,1.3B] [--modes sync,dpu] [--gpu-fractions 0] [--batch 8]
       [--context 512] [--steps 3] [--device cuda|cpu]

Per size (as bench/step_rows.py builds it: the bf16 GPT) forward + backward alone (no optimizer) under the profiler
(CPU and CUDA activities), then per mode on the same model a fresh ZeroOffloadAdamW (DPU with the per-module
writeback), at each `gpu_fraction` of --gpu-fractions in turn (the rows' key `gpu_fraction`): after two warm-up steps,
`steps` steps run back to back under the profiler. From the trace (read as
Chrome trace JSON, kept in a temporary file, never in OUT), per run:
  wall_ms           per step
  busy_ms           the compute stream's kernels (the stream with the most kernel time), their union, per step
  gaps              the compute stream's longest idle spans (top 8, over 50 us), each with the host op running
                    when it began (the innermost CPU op containing that instant) and the part of the step (forward,
                    opt.backward, opt.step: labelled with record_function): why the device waited
  runtime           CUDA runtime calls by name: count, total and longest ms (a host-blocking cudaMemcpyAsync or
                    cudaEventRecord shows as a long one; cudaStreamSynchronize / cudaEventSynchronize are waits)
  copies            memcpy time and count per stream (the D2H and H2D streams' share of the step)
  phases            the optimizer's phase times of the last step (opt.stats time_*)
So one command answers what the step rows only bound: the H200's 1.3B DPU writeback phase (48 ms, the copy's
whole time) and its 95M synchronous step's forward + backward, 16.5 ms inside the step against 8.3 alone.
Without CUDA (or with --device cpu) it profiles the same on the CPU (no kernels: busy_ms and gaps are empty).
Written without a GPU; first run on the H200 in the sixth run (bench/results/profile-2026-11-27-H200.json);
tests/test_profile_step.py checks the trace analysis on a made-up trace and runs the script on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import record_function

sys.path.insert(0, os.path.dirname(__file__))
from step_rows import _model as build_model  # noqa: E402  (bench/step_rows.py: the same models)
from step_rows import config, phase_times  # noqa: E402

import zo_kernels as zk  # noqa: E402

GAP_US = 50.0  # idle spans shorter than this are launch latency, not waiting
TOP_GAPS = 8


def analyse(trace: dict, steps: int) -> dict:
    """The figures above from a Chrome trace (torch.profiler's export_chrome_trace), per step where it says so."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    by_stream: dict = defaultdict(float)
    for k in kernels:
        by_stream[k.get("args", {}).get("stream")] += k["dur"]
    out: dict = {"busy_ms": None, "gaps": [], "runtime": {}, "copies": {}}
    if kernels:
        compute = max(by_stream, key=by_stream.get)
        spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels if k.get("args", {}).get("stream") == compute)
        merged: list[list[float]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out["busy_ms"] = sum(b - a for a, b in merged) / 1e3 / steps
        out["compute_stream"] = compute
        cpu_ops = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation")), key=lambda e: e["ts"])
        gaps = sorted(((b0, a1) for (_, b0), (a1, _) in zip(merged, merged[1:]) if a1 - b0 > GAP_US),
                      key=lambda g: g[0] - g[1])[:TOP_GAPS]  # fmt: skip
        parts = [e for e in cpu_ops if e["name"].startswith("zo ")]  # the step's labelled parts (run() below)
        out["gaps"] = [{"ms": (end - start) / 1e3, "at_ms": (start - merged[0][0]) / 1e3,
                        "host_op": _innermost(cpu_ops, start), "part": _innermost(parts, start)}
                       for start, end in gaps]  # fmt: skip
    runtime: dict = defaultdict(lambda: {"count": 0, "total_ms": 0.0, "max_ms": 0.0})
    copies: dict = defaultdict(lambda: {"count": 0, "total_ms": 0.0})
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            r = runtime[e["name"]]
            r["max_ms"] = max(r["max_ms"], e["dur"] / 1e3)
        elif e.get("cat") == "gpu_memcpy":
            r = copies[str(e.get("args", {}).get("stream"))]
        else:
            continue
        r["count"] += 1
        r["total_ms"] += e["dur"] / 1e3
    out["runtime"] = dict(sorted(runtime.items(), key=lambda kv: -kv[1]["total_ms"]))
    out["copies"] = dict(copies)
    return out


def _innermost(cpu_ops: list[dict], t: float) -> str | None:
    """The name of the shortest CPU op containing instant t (the innermost one running then), or None."""
    best = None
    for e in cpu_ops:
        if e["ts"] > t:
            break
        if e["ts"] + e["dur"] >= t and (best is None or e["dur"] < best["dur"]):
            best = e
    return None if best is None else best["name"]


def _profiled(fn, steps: int, device: torch.device) -> tuple[dict, float]:
    """(the trace's analysis, wall ms per step) of `steps` calls of fn under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return analyse(trace, steps), wall


def fwd_bwd(model, x: torch.Tensor, device: torch.device, steps: int) -> dict:
    """Forward + backward alone (no optimizer) under the profiler, after two warm-up passes."""

    def plain() -> None:
        model(x[:, :-1], x[:, 1:]).backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(2):
        plain()
    analysis, wall = _profiled(plain, steps, device)
    return {**analysis, "wall_ms": wall}


def run(model, x: torch.Tensor, row: dict, mode: str, device: torch.device, steps: int,
        gpu_fraction: float = 0.0) -> dict:  # fmt: skip
    """`row` with the zo step of `mode` on `model` under the profiler (a fresh optimizer, closed after)."""
    row = {**row, "mode": mode, "gpu_fraction": gpu_fraction}
    dpu = mode == "dpu"
    opt = zk.ZeroOffloadAdamW(model, lr=1e-4, delay_update_after=0 if dpu else None, gpu_fraction=gpu_fraction,
                              dpu_writeback="per_module" if dpu else "whole")  # fmt: skip
    try:

        def step() -> None:  # (labelled: a gap's host op names the part of the step it opened in)
            with record_function("zo forward"):
                loss = model(x[:, :-1], x[:, 1:])
            with record_function("zo opt.backward"):
                opt.backward(loss)
            with record_function("zo opt.step"):
                opt.step()

        for _ in range(2):
            step()
        analysis, wall = _profiled(step, steps, device)
        row["zo"] = {**analysis, "wall_ms": wall,
                     "phases": {k: v * 1e3 for k, v in phase_times(opt).items()}}  # fmt: skip
    finally:
        opt.close()
    return row


def line(row: dict) -> str:
    zo, fb = row["zo"], row["fwd_bwd"]
    busy = lambda r: "-" if r.get("busy_ms") is None else f"{r['busy_ms']:.1f}"  # noqa: E731
    top = sorted(zo["runtime"].items(), key=lambda kv: -kv[1]["max_ms"])[:3]
    calls = ", ".join(f"{n} x{r['count']} max {r['max_ms']:.2f} ms" for n, r in top)
    gaps = "; ".join(f"{g['ms']:.2f} ms at {g['at_ms']:.1f} ({g['part']}: {g['host_op']})" for g in zo["gaps"][:3])
    twin = f" gpu_fraction {row['gpu_fraction']:g}" if row.get("gpu_fraction") else ""
    return (f"{row['size']} {row['mode']}{twin}: zo {zo['wall_ms']:.1f} ms/step, device busy {busy(zo)}; fwd+bwd alone "
            f"{fb['wall_ms']:.1f}, busy {busy(fb)}; longest runtime calls: {calls}; longest gaps: {gaps or '-'}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--sizes", default="95M,1.3B")
    ap.add_argument("--modes", default="sync,dpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--gpu-fractions", default="0", help="comma-separated gpu_fraction values, each in [0, 1]")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    try:
        fractions = [float(f) for f in a.gpu_fractions.split(",")]
    except ValueError:
        ap.error(f"--gpu-fractions: comma-separated numbers in [0, 1], got {a.gpu_fractions!r}")
    if not all(0.0 <= f <= 1.0 for f in fractions):
        ap.error(f"--gpu-fractions: each in [0, 1], got {a.gpu_fractions!r}")
    device = torch.device(a.device)
    if device.type != "cuda":
        print("profile_step: no CUDA device: profiling on the CPU (no kernels, no device gaps)")
    rows = []
    for size in a.sizes.split(","):
        row: dict = {"size": size, "batch": [a.batch, a.context], "device": str(device)}
        model = x = None  # (one model and one forward + backward alone per size, for every mode)
        for mode in a.modes.split(","):  # (a mode at each fraction, one after the other: the pairs to compare)
            for fraction in fractions:
                try:
                    if model is None:
                        cfg = config(size, a.context)
                        x = torch.randint(0, cfg.vocab, (a.batch, a.context + 1), device=device)
                        model = build_model(cfg, device).to(torch.bfloat16)
                        row["fwd_bwd"] = fwd_bwd(model, x, device, a.steps)
                    rows.append(run(model, x, row, mode, device, a.steps, fraction))
                    print("  " + line(rows[-1]), flush=True)
                except Exception as e:  # noqa: BLE001 - a run that fails is a row that says why
                    rows.append({"size": size, "mode": mode, "gpu_fraction": fraction,
                                 "error": f"{type(e).__name__}: {e}"[:300]})  # fmt: skip
                    print(f"  {size} {mode} gpu_fraction {fraction:g}: {rows[-1]['error']}", flush=True)
                with open(a.out, "w") as f:  # row by row: a run cut short keeps what finished
                    json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
