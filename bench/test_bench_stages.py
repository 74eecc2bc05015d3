"""The cost of ZeRO-3 on the CPU device: a training step of the small GPT at stage 3 (gathers around every module's
forward and backward, with and without prefetch, shards on the "device" or in host memory) vs stage 2, one rank.

With one rank a gather is a copy of the module's shard into a fresh buffer (no collective), so this measures the
bookkeeping of ZeRO-3 (hooks, allocation, aliasing, frees, the hooks on module outputs) and the copies, not a
network. The variants run interleaved, round by round, in one process: ratios from one run. Printed with the
machine and the sizes. Never run on a GPU: there the gathers are NCCL all-gathers overlapped by prefetch.
Run: pytest bench/test_bench_stages.py -s   (sizes: $ZO_BENCH_SIZES, default 1e7)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from common import machine, sizes

import zo_kernels as zk
from zo_kernels.gpt import GPT, GPTConfig, num_params

SIZES = sizes([10_000_000])
BATCH, CONTEXT, ROUNDS = 4, 64, 7
VARIANTS = {
    "stage 2": dict(stage=2),
    "stage 3, prefetch 1": dict(stage=3, prefetch=1),
    "stage 3, prefetch 0": dict(stage=3, prefetch=0),
    "stage 3 + offload_param=cpu": dict(stage=3, offload_param="cpu", prefetch=1),
}


@pytest.mark.parametrize("n", SIZES)
def test_stage3_overhead(benchmark, n):
    cfg = GPTConfig.for_params(n, vocab=256, context=CONTEXT)
    x = torch.randint(0, cfg.vocab, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, kw in VARIANTS.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = zk.ZeroOffloadAdamW(model, lr=1e-4, bucket_numel=1 << 22, **kw)

        def step(model=model, opt=opt):
            opt.backward(model(x[:, :-1], x[:, 1:]))
            opt.step()

        step()  # the first iteration records the order (stage 3)
        runs[name] = (step, opt, [])
    params = num_params(GPT(cfg))
    for _ in range(ROUNDS):  # interleaved: every variant sees the same machine state
        for step, _, times in runs.values():
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    med = {name: statistics.median(times) for name, (_, _, times) in runs.items()}
    gather = {name: opt.stats.get("time_gather", 0.0) + opt.stats.get("time_gather_wait", 0.0)
              for name, (_, opt, _) in runs.items()}  # fmt: skip
    base = med["stage 2"]
    m = machine()
    print(f"\n{m['cpu']}, {m['cores']} cores, torch {m['torch']}; GPT {params:.3g} params, bf16, "
          f"batch {BATCH}x{CONTEXT}, one rank, device = CPU; median of {ROUNDS} interleaved steps")  # fmt: skip
    for name, t in med.items():
        print(f"  {name:<30} {t * 1e3:8.1f} ms/step  {t / base:5.2f}x stage 2   (gather copies in the last step: "
              f"{gather[name] * 1e3:.1f} ms)")  # fmt: skip
    step3 = runs["stage 3, prefetch 1"][0]
    benchmark.group = f"stage 3 vs 2, cpu, params={params:.2e}"
    # the timed row is stage 3 with prefetch 1; the ratios of every variant to stage 2 come from the rounds above
    benchmark.extra_info.update(provider="stage 3, prefetch 1", numel=params, machine=m,
                                **{f"ratio {k} / stage 2": v / base for k, v in med.items()})  # fmt: skip
    benchmark.pedantic(step3, rounds=3, iterations=1)
    for _, opt, _ in runs.values():
        opt.close()


_INFINITY_CHILD = textwrap.dedent(
    """
    import ctypes, json, re, sys, tempfile, torch
    import zo_kernels as zk
    from zo_kernels.transport import CopyEngineTransport
    n, mode, root, width = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    def rss():
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/status") as f:
            return 1024 * int(re.search(r"VmRSS:\\s*(\\d+)", f.read()).group(1))
    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, dtype=torch.bfloat16)
                                              for _ in range(max(1, n // (width * width))))
        def forward(self, x):
            for layer in self.layers:
                x = torch.nn.functional.gelu(layer(x))
            return x.float().square().mean()
    base = rss()
    torch.manual_seed(0)
    model = Stack()
    params = sum(p.numel() for p in model.parameters())
    transport = CopyEngineTransport()
    kw = (dict(stage=3, offload_param="nvme", offload_optimizer="nvme", nvme_dir=root) if mode == "infinity"
          else dict(stage=2))
    opt = zk.ZeroOffloadAdamW(model, lr=1e-4, dtype=torch.bfloat16, transport=transport, bucket_numel=1 << 20, **kw)
    x = torch.randn(8, width, dtype=torch.bfloat16)
    for _ in range(2):
        opt.backward(model(x))
        opt.step()
    out = dict(n=params, mode=mode, host=rss() - base, device_peak=opt.device_bytes.peak,
               unit=2 * (width * width + width))
    opt.close()
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_zero_infinity_small_scale(tmp_path):
    """ZeRO-Infinity for real at small scale, in the GPU-shaped CPU mode (separate "device" buffers): stage 3 with
    the parameter shards and the optimizer state on NVMe vs stage 2 in memory, a stack of bf16 Linear layers.
    Device bytes: the optimizer's own device buffers at their peak (opt.device_bytes); host: resident memory of a
    fresh process (allocator trimmed) above the start, the "device" buffers included (they are host memory here).
    Expected: the device holds a few layers + buckets whatever the model size; the host holds the pool, the
    16-bit gradient landing buffer (2 B/param) and the "device" working set."""
    width = 1024
    rows = []
    for n in sizes([16_000_000, 64_000_000], var="ZO_BENCH_INFINITY_SIZES"):
        for mode in ("stage2", "infinity"):
            out = subprocess.run([sys.executable, "-c", _INFINITY_CHILD, str(n), mode, str(tmp_path), str(width)],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            rows.append(json.loads(out.strip().splitlines()[-1]))
    m = machine()
    print(f"\n{m['cpu']}, {m['cores']} cores, torch {m['torch']}; bf16 Linear({width}, {width}) stack, GPU-shaped CPU "
          "mode, one rank, prefetch 1:")  # fmt: skip
    for r in rows:
        print(f"  {r['n']:>11,} params  {r['mode']:<9} device peak {r['device_peak'] / 2**20:7.1f} MiB "
              f"({r['device_peak'] / (2 * r['n']):5.1%} of the 16-bit model; a layer is {r['unit'] / 2**20:.1f} MiB)  "
              f"host {r['host'] / 2**20:7.1f} MiB ({r['host'] / r['n']:5.2f} B/param)")  # fmt: skip
    inf = [r for r in rows if r["mode"] == "infinity"]
    assert max(r["device_peak"] for r in inf) - min(r["device_peak"] for r in inf) < 16 << 20, rows
