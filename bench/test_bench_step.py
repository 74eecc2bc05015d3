"""A training step of the small GPT on the CPU device: ZeroOffloadAdamW vs the reference loop.

Providers: `reference` (bf16 working copy for forward/backward, fp32 masters, torch.optim.AdamW(fused=True),
grads upcast and params copied back each step) and `zo` (ZeroOffloadAdamW, device = CPU); the working copy is fp32
on a CPU that does not multiply bf16 natively (both providers, printed: WORK_DTYPE).
Reported for zo: orchestration = the optimizer's time (offload during backward + step()) minus the time
inside the CPU Adam kernel in that step, as a fraction of the whole step (bar: <= 10%); and the host memory
of the optimizer, measured as resident-set growth in a fresh process (bar: <= 18 B/param + buckets).
CUDA (skipped here, NOT MEASURED): step time and peak GPU memory (torch.cuda.max_memory_allocated) of zo
against torch.optim.AdamW(fused=True) on fp32 masters on the GPU, at the last of $ZO_BENCH_SIZES params.
test_step_in_parts (bench/step_rows.py, the rows of gpu_check.sh's summary.json): the step in parts, in one run:
phases, forward+backward alone, CPU Adam alone (with its tiled writeback), the D2H copies alone, sync and DPU
steady state, torch's fused AdamW on the device; CUDA: the 95M and 1.3B GPTs, CPU: $ZO_STEP_CPU_SIZE (1e6).
Run: pytest bench/test_bench_step.py   (sizes: $ZO_BENCH_SIZES, default 1e7,1e8)
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import pytest
import step_rows
import torch
from common import sizes
from step_rows import ReferenceLoop  # the textbook loop: bf16 work model, fp32 masters, fused AdamW

import zo_kernels as zk
from zo_kernels.demo import native_bf16, pick_dtype
from zo_kernels.gpt import GPT, GPTConfig, num_params

SIZES = sizes([10_000_000, 100_000_000])
BATCH, CONTEXT = 4, 64
BUCKET = 1 << 22
# the timed CPU steps' working dtype, both providers: bf16 where the CPU multiplies it natively, else fp32 (an AVX2-only
# EPYC emulates bf16 matmuls: zo's 9.9M step took 3.2 s there, and orchestration read 0.1% of it); the host memory
# probe keeps bf16 (its figures are per 16-bit parameter)
WORK_DTYPE, WORK_WHY = pick_dtype("cpu", native_bf16(torch.device("cpu")))
WORK_WHY = WORK_WHY.split(";")[0]  # (the demo's advice on its --dtype flag is not this file's)

_MEMORY_PROBE = r"""
import ctypes, json, re, sys, torch, zo_kernels as zk
from zo_kernels.gpt import GPT, GPTConfig
def rss():
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # count what is held, not what the allocator keeps for reuse
    return int(re.search(r"VmRSS:\s*(\d+)", open("/proc/self/status").read()).group(1)) * 1024
cfg, mode = GPTConfig(**json.loads(sys.argv[1])), sys.argv[3]
with torch.device("meta"):
    model = GPT(cfg)
n = sum(p.numel() for p in model.parameters())
base = rss()
model = model.to_empty(device="cpu")
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
x = torch.randint(0, cfg.vocab, (4, cfg.context + 1))
if mode == "zo":
    opt = zk.ZeroOffloadAdamW(model.parameters(), bucket_numel=int(sys.argv[2]))
    opt.backward(model(x[:, :-1], x[:, 1:]))
    opt.step()
    buckets = opt.memory_report().device_buckets
else:  # the same model in bf16, one forward/backward, no optimizer: what backward alone leaves resident
    model.to(torch.bfloat16)
    model(x[:, :-1], x[:, 1:]).backward()
    model.zero_grad(set_to_none=True)
    buckets = 0
print(json.dumps({"n": n, "bytes": rss() - base, "buckets": buckets}))
"""


def config(n: int) -> GPTConfig:
    return GPTConfig.for_params(n, vocab=256, context=CONTEXT)


def measure_host_memory(cfg: GPTConfig) -> dict:
    """The optimizer's resident memory: (model + optimizer after one step) - (bf16 model after one backward
    without it) + the bf16 params themselves, each in a fresh process with the allocator trimmed."""
    out = {}
    for mode in ("zo", "plain"):
        r = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, json.dumps(cfg.__dict__), str(BUCKET), mode],
                           capture_output=True, text=True, timeout=1200)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    n = out["zo"]["n"]
    # plain holds the bf16 params (2 B/param) + what backward leaves; zo's flat buffer is those same params
    return {"n": n, "bytes": out["zo"]["bytes"] - (out["plain"]["bytes"] - 2 * n), "buckets": out["zo"]["buckets"]}


@pytest.mark.parametrize("provider", ["reference", "zo"])
@pytest.mark.parametrize("n", SIZES)
def test_train_step(benchmark, n, provider):
    cfg = config(n)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = num_params(model)
    x = torch.randint(0, cfg.vocab, (BATCH, CONTEXT + 1))
    if provider == "reference":
        loop = ReferenceLoop(model, WORK_DTYPE)
        run = lambda: loop.step(x)  # noqa: E731
    else:
        opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-4, bucket_numel=BUCKET, dtype=WORK_DTYPE)

        def run():
            opt.backward(model(x[:, :-1], x[:, 1:]))
            opt.step()

    run()
    benchmark.group = f"train step cpu params={params:.2e} batch={BATCH}x{CONTEXT}"
    benchmark.extra_info.update(provider=provider, numel=params, bytes=0, dtype=str(WORK_DTYPE), dtype_why=WORK_WHY)
    phases = []
    if provider == "zo":
        inner = run

        def run():
            inner()
            phases.append(dict(opt.stats))

    benchmark.pedantic(run, warmup_rounds=1, rounds=5 if params > 3e7 else 10, iterations=1)
    if provider == "zo":
        step_time = benchmark.stats.stats.median
        # the optimizer's share: packing/sending during backward, the reduce, the end-of-backward wait, step()
        keys = ("time_offload", "time_reduce", "time_backward_offload_wait", "time_step")
        opt_time = sorted(sum(s.get(k, 0.0) for k in keys) for s in phases)
        opt_time = opt_time[len(opt_time) // 2]
        kernel = sorted(s["time_kernel"] for s in phases)[len(phases) // 2]  # inside the step, same caches
        bare = bare_kernel_time(opt)
        med = {k: sorted(s.get(f"time_{k}", 0.0) for s in phases)[len(phases) // 2] * 1e3
               for k in ("offload", "reduce", "step", "kernel")}  # fmt: skip
        pack_ms = step_rows.pack_alone(opt, 5) * 1e3
        orch = step_rows.orchestration_ms(med, pack_ms, torch.device("cpu")) / (step_time * 1e3)
        mem = measure_host_memory(cfg)
        per_param = mem["bytes"] / mem["n"]
        benchmark.extra_info.update(
            optimizer_s=opt_time, kernel_s=kernel, bare_kernel_s=bare,
            orchestration_of_step=(opt_time - kernel) / step_time,
            orchestration_of_optimizer=(opt_time - kernel) / opt_time, host_bytes_per_param=per_param,
            orchestration_outside_kernels_and_copies=orch, pack_alone_s=pack_ms / 1e3,
            host_bytes_budget_per_param=18 + mem["buckets"] / mem["n"],
        )  # fmt: skip
        noise = "; below 0: the pack timed apart took longer than in the step: noise" if orch < 0 else ""
        print(f"\nworking dtype {str(WORK_DTYPE).removeprefix('torch.')} ({WORK_WHY})"
              f"\nzo step {step_time * 1e3:.1f} ms: optimizer {opt_time * 1e3:.1f} ms, "
              f"kernel {kernel * 1e3:.1f} ms (alone, warm cache: {bare * 1e3:.1f} ms), "
              f"orchestration {(opt_time - kernel) / step_time:.1%} of the step (bar <= 10%), "
              f"{(opt_time - kernel) / opt_time:.1%} of the optimizer; outside kernels and copies (the pack alone, "
              f"{pack_ms:.1f} ms, is the copy to the host here) {orch:.1%} of the step (bar <= 5%{noise}); "
              f"host memory {per_param:.2f} B/param measured "
              f"(bar <= 18 + buckets {mem['buckets'] / mem['n']:.2f})")  # fmt: skip
        opt.close()


def bare_kernel_time(opt: zk.ZeroOffloadAdamW) -> float:
    """The CPU Adam kernel alone over a partition of the same size and dtypes (median of 5)."""
    n = opt.part
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n).to(opt.dtype)
    out = torch.empty(n, dtype=opt.dtype)
    times = []
    for i in range(6):
        t0 = time.perf_counter()
        zk.cpu_adam_step(p, g, m, v, step=i + 1, lr=1e-4, param_out=out, threads=opt.threads)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; not measured (no GPU here)")
@pytest.mark.parametrize("provider", ["torch", "torch_amp", "zo"])
def test_cuda_train_step(benchmark, provider):
    """One step (forward, backward, optimizer) of the GPT of SIZES[-1] params on the GPU, and the peak device
    memory over the warm-up and timed steps (torch.cuda.max_memory_allocated, reset after construction).
    `torch`: ReferenceLoop on the GPU, the same bf16 forward as zo, fp32 masters, AdamW(fused=True).
    `torch_amp`: fp32 params under autocast(bf16), AdamW(fused=True) on them. `zo`: ZeroOffloadAdamW(model)."""
    gc.collect()
    torch.cuda.empty_cache()
    cfg = config(SIZES[-1])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg)
        x = torch.randint(0, cfg.vocab, (BATCH, CONTEXT + 1))
    params = num_params(model)
    opt = None
    if provider == "torch":
        loop = ReferenceLoop(model)
        step = lambda: loop.step(x)  # noqa: E731
    elif provider == "torch_amp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    else:
        opt = zk.ZeroOffloadAdamW(model, lr=1e-4)

        def step():
            opt.backward(model(x[:, :-1], x[:, 1:]))
            opt.step()

    def run():
        step()
        torch.cuda.synchronize()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    benchmark.group = f"train step cuda params={params:.2e} batch={BATCH}x{CONTEXT}"
    benchmark.extra_info.update(provider=provider, numel=params, bytes=0)
    try:
        benchmark.pedantic(run, warmup_rounds=2, rounds=5, iterations=1)
        benchmark.extra_info.update(peak_gpu_bytes=torch.cuda.max_memory_allocated(),
                                    resident_gpu_bytes=torch.cuda.memory_allocated())  # fmt: skip
        if provider == "zo":
            benchmark.extra_info["zo_device_bytes"] = opt.memory_report().device_bytes
    finally:
        if provider == "zo":
            opt.close()


STEP_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs a CUDA GPU; NOT MEASURED"))]


@pytest.mark.parametrize("device", STEP_DEVICES)
def test_step_in_parts(device, tmp_path):
    """The step in parts (bench/step_rows.py): every key of a summary.json step row, sync and DPU; on CUDA the 95M
    and 1.3B GPTs at 8x512 tokens, on the CPU $ZO_STEP_CPU_SIZE params at 4x64. Prints one line per row."""
    if device == "cuda":
        argv = ["--sizes", "95M,1.3B", "--device", "cuda"]
    else:
        argv = ["--sizes", os.environ.get("ZO_STEP_CPU_SIZE", "1e6"), "--device", "cpu", "--batch", "4",
                "--context", "64", "--rounds", "3"]  # fmt: skip
    out = tmp_path / "step.json"
    assert step_rows.main([str(out), *argv]) == 0
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["sync", "dpu"] * (len(rows) // 2) and rows
    for r in rows:
        print("\n" + step_rows.line(r))
        for key in ("params", "zo_ms", "fwd_bwd_ms", "cpu_adam_ms", "d2h_ms", "torch_fused_ms", "phases"):
            assert r[key], key
        assert (r["zo_peak_gib"] is None) == (device == "cpu")


def test_step_rows_gpu_fraction_on_the_cpu(tmp_path):
    """Issue 20's "step" rows, gpu_fraction 0, 0.5 and auto, on device = CPU (the tail's "device" is the CPU too: this
    checks the rows and the pick, it measures no GPU; the GPU's rows are NOT MEASURED): tokens/s, the ratio to torch's
    fused AdamW, the pick's reasons. (On a CPU forward+backward outlasts CPU Adam: auto picks 0 there.)"""
    out = tmp_path / "step.json"
    argv = ["--sizes", os.environ.get("ZO_STEP_CPU_SIZE", "1e6"), "--device", "cpu", "--batch", "4", "--context", "64",
            "--rounds", "3", "--modes", "sync", "--gpu-fractions", "0,0.5,auto"]  # fmt: skip
    assert step_rows.main([str(out), *argv]) == 0
    rows = json.loads(out.read_text())
    assert [r["gpu_fraction_choice"] for r in rows] == ["0", "0.5", "auto"]
    assert abs(rows[1]["gpu_fraction"] - 0.5) < 1e-9 and rows[1]["cpu_adam_kernel_ms"] > 0
    for r in rows:
        print("\n" + step_rows.line(r) + (f"\n  {r['gpu_fraction_pick']}" if "gpu_fraction_pick" in r else ""))
        assert r["tokens_per_s"] > 0 and r["tokens_vs_torch"] > 0 and 0.0 <= r["gpu_fraction"] <= 1.0
        assert ("twin_time_vs_torch" in r["targets"]) == (r["gpu_fraction_choice"] != "0")
    assert all("gpu_fraction" in r["gpu_fraction_pick"] for r in rows if r["gpu_fraction_choice"] == "auto")


def test_dpu_writeback_overlaps_the_next_forward(tmp_path):
    """The DPU row on the GPU's data flow (CopyEngineTransport, copies delayed as over a 1 GB/s link): the writeback
    goes in tiles, the forward starts before the last one landed, and the row records how long it waited for them."""
    out = tmp_path / "step.json"
    argv = ["--sizes", "2e6", "--device", "cpu", "--batch", "2", "--context", "32", "--rounds", "3", "--modes", "dpu",
            "--copy-engine-gbps", "1", "--tile-numel", "65536"]  # fmt: skip
    assert step_rows.main([str(out), *argv]) == 0
    (row,) = json.loads(out.read_text())
    print("\n" + step_rows.line(row))
    assert row["writeback_tiles"] > 10 and row["writeback_in_flight_at_forward"] > 0
    assert "forward_writeback_wait" in row["phases"]

