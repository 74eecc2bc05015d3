"""CPU Adam: zo vs torch.optim.AdamW (fused, foreach) vs DeepSpeedCPUAdam, against the streaming ceiling.

Cases: `fp32` (fp32 grads and params) and `bf16` (the offload case: bf16 grads in, bf16 params out; torch
and DeepSpeed run the chain: upcast into a held fp32 grad -> AdamW -> param.to(bf16), zo one fused pass).
Both move 28 bytes per parameter: read g, p, m, v; write p, m, v (+ p16 and - 2 bytes of g in the bf16 case).
The moment formats (fp32, bf16, 8-bit blockwise) at 50M params in the offload case, each against the fp32-state
update and its own streaming ceiling: test_cpu_adam_formats (pytest-benchmark) and test_cpu_adam_formats_ratios
(the ratios, timed interleaved in one run; `-s` prints them).
Run: pytest bench/test_bench_cpu_adam.py   (sizes: $ZO_BENCH_SIZES, default 1e7,1e8; $ZO_BENCH_FORMAT_SIZES, 5e7)
"""

from __future__ import annotations

import gc
import importlib.util
import time

import pytest
import torch
from common import peak_extra_bytes, size_label, sizes

import zo_kernels as zk

SIZES = sizes([10_000_000, 100_000_000])
THREADS = sorted({1, torch.get_num_threads()})
CASES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, torch.bfloat16)}
PROVIDERS = ["zo", "torch_fused", "torch_foreach", "deepspeed", "ceiling"]
BYTES_PER_PARAM = 28
# The bars, as ratios of best-of-N times from one run: (a) <= 1.0x torch fused and >= 85% of the
# ceiling; (b) <= 0.75x torch's chain.
BARS = {"fp32": {"max_vs_baseline": 1.0, "min_of_ceiling": 0.85}, "bf16": {"max_vs_baseline": 0.75}}

_buffers: dict = {}


def buffers(n: int, case: str) -> dict:
    """One set of tensors per (size, case), reused by every provider; the previous set is freed first."""
    key = (n, case)
    if key not in _buffers:
        _buffers.clear()
        gc.collect()
        gdt, odt = CASES[case]
        gen = torch.Generator().manual_seed(0)
        p = torch.randn(n, generator=gen)
        _buffers[key] = dict(
            p=p, g=torch.randn(n, generator=gen).to(gdt), m=torch.zeros(n), v=torch.zeros(n),
            out=torch.empty(n, dtype=odt) if odt else None,
        )  # fmt: skip
    return _buffers[key]


def make_step(provider: str, b: dict, threads: int):
    p, g, m, v, out = b["p"], b["g"], b["m"], b["v"], b["out"]
    if provider == "zo":
        step = [0]

        def run():
            step[0] += 1
            zk.cpu_adam_step(p, g, m, v, step=step[0], lr=1e-4, weight_decay=0.01, param_out=out, threads=threads)

        return run
    if provider == "ceiling":
        return lambda: zk.stream_pass(p, g, m, v, param_out=out, threads=threads)
    param = torch.nn.Parameter(p, requires_grad=True)
    if provider.startswith("torch"):
        opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, **{provider.split("_")[1]: True})
    else:
        if importlib.util.find_spec("deepspeed") is None:
            pytest.skip("deepspeed is not installed (pip install deepspeed)")
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([param], lr=1e-4, weight_decay=0.01, adamw_mode=True)  # builds its op here
    opt.state[param].update(step=torch.tensor(0.0), exp_avg=m, exp_avg_sq=v) if provider != "deepspeed" else None
    # The chain's fp32 gradient is allocated once, as a training loop keeps it: a fresh `g.float()` per step would
    # time an allocation and its page faults (4 bytes per param) that zo never does.
    param.grad = g if g.dtype == torch.float32 else torch.empty(g.shape)

    def run():
        if param.grad is not g:
            param.grad.copy_(g)  # the chain's upcast
        opt.step()
        if out is not None:
            out.copy_(param.detach())  # the chain's downcast

    return run


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("n", SIZES)
def test_cpu_adam(benchmark, n, case, threads, provider):
    torch.set_num_threads(threads)
    b = buffers(n, case)
    run = make_step(provider, b, threads)
    run()  # first-use costs (DeepSpeed's state, page faults) stay out of the timing
    benchmark.group = f"cpu_adam {case} n={size_label(n)} threads={threads}"
    benchmark.extra_info.update(provider=provider, numel=n, case=case, threads=threads, bytes=BYTES_PER_PARAM * n)
    # + the chain's fp32 gradient, held from step to step (allocated in make_step, before this measure)
    held = 4 * n if case == "bf16" and provider not in ("zo", "ceiling") else 0
    peak = peak_extra_bytes(run)
    benchmark.extra_info["peak_extra_bytes"] = None if peak is None else peak + held
    if provider == "zo":
        benchmark.extra_info["bar"] = BARS[case]
    rounds = 20 if n <= 10_000_000 else 8
    benchmark.pedantic(run, warmup_rounds=1, rounds=rounds, iterations=1)
    benchmark.extra_info["GB/s"] = BYTES_PER_PARAM * n / benchmark.stats.stats.min / 1e9
    torch.set_num_threads(THREADS[-1])


# ---------------------------------------------------------------- moment formats (the offload case)
# bf16 grads in, bf16 params out, fp32 master; the moments fp32, bf16 or 8-bit blockwise. Bytes per param moved
# by the update: read g 2 + p 4 + moments, write p 4 + moments + p16 2; the moments move 2 x 4 x 2 (fp32), 2 x 2 x 2
# (bf16) or 2 x 1 x 2 + 2 x 2 x 4 / 256 (8-bit codes + scales).
FORMAT_SIZE = sizes([50_000_000], "ZO_BENCH_FORMAT_SIZES")
FORMATS = {"fp32": 28.0, "bf16": 20.0, "8bit": 16.0 + 16 / 256}
FORMAT_BARS = {"bf16": 0.75, "8bit": 0.6}  # x the fp32-state update; and each >= 0.9 of its own ceiling


def format_buffers(n: int) -> dict:
    key = ("formats", n)
    if key not in _buffers:
        _buffers.clear()
        gc.collect()
        gen = torch.Generator().manual_seed(0)
        _buffers[key] = dict(
            p=torch.randn(n, generator=gen), g=torch.randn(n, generator=gen).bfloat16(),
            out=torch.empty(n, dtype=torch.bfloat16),
            fp32=(torch.zeros(n), torch.zeros(n)),
            bf16=(torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)),
            **{"8bit": (zk.Quantized8bit.empty(n, signed=True), zk.Quantized8bit.empty(n, signed=False))},
        )  # fmt: skip
    return _buffers[key]


def format_run(b: dict, fmt: str, provider: str, threads: int):
    """One update (or its streaming ceiling) of the format's moments, stepping on from call to call."""
    m, v = b[fmt]
    step = [0]

    def run():
        if provider == "ceiling":
            zk.stream_pass(b["p"], b["g"], m, v, param_out=b["out"], threads=threads)
            return
        step[0] += 1
        zk.cpu_adam_step(b["p"], b["g"], m, v, step=step[0], lr=1e-4, weight_decay=0.01, param_out=b["out"],
                         threads=threads)  # fmt: skip

    return run


@pytest.mark.parametrize("provider", ["zo", "ceiling"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n", FORMAT_SIZE)
def test_cpu_adam_formats(benchmark, n, fmt, provider):
    threads = THREADS[-1]
    run = format_run(format_buffers(n), fmt, provider, threads)
    run()
    benchmark.group = f"cpu_adam state={fmt} n={size_label(n)} threads={threads}"
    benchmark.extra_info.update(provider=provider, numel=n, state=fmt, threads=threads, bytes=FORMATS[fmt] * n)
    benchmark.pedantic(run, warmup_rounds=1, rounds=10, iterations=1)


@pytest.mark.parametrize("n", FORMAT_SIZE)
def test_cpu_adam_formats_ratios(n):
    """Each format against the fp32-state update and its own ceiling: the six timed interleaved, round by round, in
    one run (so a load that comes and goes hits them alike), best of 15 rounds."""
    threads = THREADS[-1]
    b = format_buffers(n)
    runs = {(f, p): format_run(b, f, p, threads) for f in FORMATS for p in ("zo", "ceiling")}
    best = dict.fromkeys(runs, float("inf"))
    for fn in runs.values():
        fn()
    for _ in range(15):
        for key, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
    base = best["fp32", "zo"]
    print(f"\ncpu_adam moment formats, n={size_label(n)}, bf16 grads in, bf16 params out, threads={threads}")
    print(f"  {'state':<6}{'B/param':>9}{'best ms':>10}{'GB/s':>8}{'x fp32':>9}{'of own ceiling':>16}{'bar':>20}")
    for fmt, nbytes in FORMATS.items():
        t, c = best[fmt, "zo"], best[fmt, "ceiling"]
        bar = f"<= {FORMAT_BARS[fmt]}x, >= 0.90" if fmt in FORMAT_BARS else ""
        print(f"  {fmt:<6}{nbytes:>9.2f}{t * 1e3:>10.2f}{nbytes * n / t / 1e9:>8.1f}{t / base:>8.2f}x"
              f"{c / t:>16.2f}{bar:>20}")  # fmt: skip


# --- the sum of gradients on the host (gradient accumulation, selective's window): acc (fp32) += alpha * g (bf16)
ACCUMULATE = {
    "zo": lambda acc, g, t: zk.accumulate(acc, g, alpha=0.5, threads=t),
    "torch_add": lambda acc, g, t: acc.add_(g, alpha=0.5),  # torch's mixed-dtype path (what zo called until 2026-11-26)
    "torch_upcast_add": lambda acc, g, t: acc.add_(g.float(), alpha=0.5),  # an fp32 copy, then the fp32 add
}


@pytest.mark.parametrize("n", SIZES)
def test_accumulate_ratios(n):
    """zo.accumulate against torch's two ways, bf16 into fp32 (10 bytes per element moved), timed interleaved, best of
    7 rounds, at torch's thread count (zo's too)."""
    threads = torch.get_num_threads()
    acc, g = torch.zeros(n), torch.randn(n).to(torch.bfloat16)
    best = dict.fromkeys(ACCUMULATE, float("inf"))
    for fn in ACCUMULATE.values():
        fn(acc, g, threads)
    for _ in range(7):
        for name, fn in ACCUMULATE.items():
            t0 = time.perf_counter()
            fn(acc, g, threads)
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"\naccumulate, n={size_label(n)}, bf16 into fp32, threads={threads}: " + ", ".join(
        f"{k} {v * 1e3:.2f} ms ({10 * n / v / 1e9:.1f} GB/s)" for k, v in best.items())
        + f"; zo {best['torch_add'] / best['zo']:.1f}x faster than torch's add_, "
        f"{best['torch_upcast_add'] / best['zo']:.1f}x than upcast + add")  # fmt: skip
    assert best["zo"] > 0
