"""The cost of ZeRO-3 on the CPU device: a training step of the small GPT at stage 3 (gathers around every module's
forward and backward, with and without prefetch, shards on the "device" or in host memory) vs stage 2, one rank.

With one rank a gather is a copy of the module's shard into a fresh buffer (no collective), so this measures the
bookkeeping of ZeRO-3 (hooks, allocation, aliasing, frees, the hooks on module outputs) and the copies, not a
network. The variants run interleaved, round by round, in one process: ratios from one run. Printed with the
machine and the sizes. Never run on a GPU: there the gathers are NCCL all-gathers overlapped by prefetch.
Run: pytest bench/test_bench_stages.py -s   (sizes: $ZO_BENCH_SIZES, default 1e7)
"""

from __future__ import annotations

import statistics
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
    benchmark.extra_info.update(numel=params, machine=m, **{f"ratio {k}": v / base for k, v in med.items()})
    benchmark.pedantic(step3, rounds=3, iterations=1)
    for _, opt, _ in runs.values():
        opt.close()
