"""Host memory and step time of ZeroOffloadAdamW per state_dtype (fp32 / bf16 / 8-bit Adam moments), one CPU rank.

Memory: the optimizer's resident-set growth in a fresh process (the small GPT, bf16 parameters, after one step;
minus what the same bf16 model holds after a backward without an optimizer, plus its 2 B/param of parameters,
as bench/test_bench_step.py measures it). Bars: 8bit <= 8.1 B/param, bf16 <= 10.1, fp32 <= 14.1, each + the
gradient buckets per parameter + 0.2 B/param of allocator slack, after subtracting the 2 B/param "device" copy of
the parameters (host memory on the CPU device; on a GPU it is device memory). One CPU rank has no staging buffer.
Time: one training step of the same model (forward, backward, opt.step()), each format's ratio to fp32 in one run.
Run: pytest bench/test_bench_formats.py -s   (sizes: $ZO_BENCH_SIZES, default 1e7)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from common import size_label, sizes

import zo_kernels as zk
from zo_kernels.gpt import GPT, GPTConfig

SIZES = sizes([10_000_000])
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": "8bit"}
BARS = {"fp32": 14.1, "bf16": 10.1, "8bit": 8.1}
BUCKET = 1 << 22
SLACK = 0.2

_PROBE = r"""
import ctypes, json, re, sys, torch, zo_kernels as zk
from zo_kernels.gpt import GPT, GPTConfig
def rss():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(re.search(r"VmRSS:\s*(\d+)", open("/proc/self/status").read()).group(1)) * 1024
cfg, fmt = GPTConfig(**json.loads(sys.argv[1])), sys.argv[3]
with torch.device("meta"):
    model = GPT(cfg)
n = sum(p.numel() for p in model.parameters())
base = rss()
model = model.to_empty(device="cpu")
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
x = torch.randint(0, cfg.vocab, (4, cfg.context + 1))
if fmt != "plain":
    state = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": "8bit"}[fmt]
    opt = zk.ZeroOffloadAdamW(model.parameters(), bucket_numel=int(sys.argv[2]), state_dtype=state)
    opt.backward(model(x[:, :-1], x[:, 1:]))
    opt.step()
    rep = opt.memory_report()
    extra = {"buckets": rep.device_buckets, "accounted": rep.host_bytes}
else:
    model.to(torch.bfloat16)
    model(x[:, :-1], x[:, 1:]).backward()
    model.zero_grad(set_to_none=True)
    extra = {}
print(json.dumps({"n": n, "bytes": rss() - base, **extra}))
"""

_RESULTS: dict = {}


def config(n: int) -> GPTConfig:
    return GPTConfig.for_params(n, vocab=256, context=64)


def probe(cfg: GPTConfig, mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cfg.__dict__), str(BUCKET), mode],
                       capture_output=True, text=True, timeout=1200)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_host_memory(n: int, fmt: str) -> None:
    cfg = config(n)
    plain, zo = probe(cfg, "plain"), probe(cfg, fmt)
    params = zo["n"]
    measured = (zo["bytes"] - (plain["bytes"] - 2 * params)) / params
    host = measured - 2  # less the 2 B/param "device" copy, which on the CPU device is host memory too
    bar = BARS[fmt] + zo["buckets"] / params + SLACK
    print(f"\n[formats] {fmt:5s} n={params:,}: resident {measured:.2f} B/param ({host:.2f} without the CPU "
          f"device's parameter copy), accounted (memory_report) {zo['accounted'] / params:.2f} B/param, bar "
          f"{bar:.2f}")  # fmt: skip
    assert host <= bar


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_step_time(benchmark, n: int, fmt: str) -> None:
    torch.manual_seed(0)
    cfg = config(n)
    model = GPT(cfg)
    opt = zk.ZeroOffloadAdamW(model, dtype=torch.bfloat16, bucket_numel=BUCKET, state_dtype=FORMATS[fmt])
    x = torch.randint(0, cfg.vocab, (2, cfg.context + 1))

    def step() -> None:
        opt.backward(model(x[:, :-1], x[:, 1:]))
        opt.step()

    step()
    params = sum(p.numel() for p in model.parameters())  # (the GPT the config gives: near n, not n)
    benchmark.group = f"formats step n={size_label(params)}"
    benchmark.extra_info.update(provider=fmt, numel=params, requested_numel=n)
    benchmark.pedantic(step, rounds=5, iterations=1)
    kernel = opt.stats.get("time_kernel", 0.0)
    _RESULTS[(n, fmt)] = benchmark.stats.stats.median
    opt.close()
    base = _RESULTS.get((n, "fp32"))
    ratio = f", {benchmark.stats.stats.median / base:.2f}x fp32" if base else ""
    print(f"\n[formats] {fmt:5s} n={size_label(params)}: step {benchmark.stats.stats.median * 1e3:.1f} ms (last kernel "
          f"{kernel * 1e3:.1f} ms){ratio}")
