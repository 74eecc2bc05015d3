"""One GPT training step measured in parts, in one process: the "step" rows of gpu_check.sh's summary.json.

Per size and mode (sync, or DPU in steady state), in this order on a fresh model each time (training steps: the mean
of `rounds` steps run back to back, the device synchronized before the first and after the last only, as a training
loop runs; the parts alone: median of calls synchronized one by one):
  torch_fused   the no-offload reference: bf16 working model, fp32 masters, torch.optim.AdamW(fused=True) on the
                same device (ReferenceLoop below, also bench/test_bench_step.py's); step time and peak device memory
  fwd_bwd       forward + backward alone on the bf16 model, no optimizer, no hooks
  zo            ZeroOffloadAdamW(model): step time (forward + opt.backward + opt.step, back to back), its
                phase times (PhaseTimes: stats["time_*"], median over the timed steps) and peak device memory
  cpu_adam      CPU Adam alone over the optimizer's own partition, with its tiled writeback to the device
                (HostUpdate.cpu_update, the copies waited for); and the bare kernel, untiled, no copies
  d2h           the gradient copies alone: every bucket of the flat space device -> the pinned landing buffer
  pack          the pack alone: every bucket's gradients packed where backward packs them (on the CPU: the copy)
  launch_probe  once per size, the bf16 model's forward + backward (no optimizer) alone, right after a CPU Adam call,
                and beside CPU Adam looping on a background thread (launch_probe's docstring): whether the host's
                cores, shared with the update, slow the thread that launches the device's work
  cpu_after_step  one more step, then the CPU ms this process's other threads run in the 30 ms after step()
                returns (before the device is synchronized): an update's worker threads spinning for more work
                (libgomp spins ~8 ms per thread after each parallel region here) hold cores the next forward's
                launches need; under DPU the background update still running counts too (update_pending)
Orchestration = the optimizer's time outside kernels and copies: (offload + reduce + step() - CPU Adam kernel
[- pack alone, device = CPU]) / step (orchestration_ms); the earlier measure, every optimizer phase but the kernel
(packing and the end-of-backward wait included), is optimizer_outside_kernel_of_step. orchestration_isolated_ms: the
same over 3 more steps with the device synchronized before each bucket's launch and before step() (isolated_phases),
so a launch or copy never waits behind queued kernels: the host's own time (the target's measure), where the first
counts what the host spent blocked while it ran ahead of the device.
Peak memory: torch.cuda.max_memory_allocated, reset after construction (None on CPU).
DPU rows show the overlap of the tiled writeback with the next forward (offload/fence.py): the phase
forward_writeback_wait (host seconds the forward's modules waited for their tiles: the wait itself on the CPU, only
the queueing of stream waits on CUDA), writeback_tiles (tiles per writeback) and writeback_in_flight_at_forward
(tiles not yet landed when the forward's first module came: > 0 means forward started before the last tile landed).
On the CPU, --copy-engine-gbps runs the GPU's data flow (CopyEngineTransport: copies on a thread, each delayed as if
it crossed a link of that many GB/s): the only way the writeback overlaps anything there.

gpu_fraction (Twin-Flow): each mode runs once per --gpu-fractions entry: a number, or "auto" (zo_kernels.auto_fraction's
pick from this run's fraction-0 row: its forward+backward time and CPU Adam kernel rate, torch's fused AdamW rate
measured on the device, the device memory that row left); those rows add gpu_fraction, tokens_per_s, tokens_vs_torch
and, for "auto", the pick's reasons. Run on a GPU once (one H200, 2026-11-26:
bench/results/gpu-2026-11-26-H200.json).

--checkpoint: every row (sync, DPU, selective) also trains its steps with each block under torch.utils.checkpoint
(non-reentrant: the block's input saved, its activations recomputed in backward) on the same optimizer: ckpt_fwd_bwd_ms
(forward + backward alone, checkpointed), ckpt_zo_ms, ckpt_zo_peak_gib, ckpt_phases and ckpt_orchestration_ms (DPU and
sync rows), and the same targets against the same torch row
(torch without checkpointing: the no-offload loop a user would otherwise run). Recomputation costs a forward; where
CPU Adam bounds the step it hides under it, and the activations, most of zo's peak, shrink to the blocks' inputs.

Mode "selective" (issue 20): ZeroOffloadAdamW(model, selective=SELECTIVE), an approximation of AdamW: step time,
phases and peak against torch_fused and fwd_bwd (selective_row; targets: >= 0.8x torch's tokens/s at <= 0.35x its
peak device memory).

--state-dtype fp32|bf16|8bit: the moments' format of the sync and DPU rows, on the host and in gpu_fraction's tail
(issue 20 at batch 8: 8-bit moments move ~16 of CPU Adam's 28 bytes per parameter, so a smaller device share hides
the CPU part, and the tail holds 6 bytes per element instead of 12).

Usage: python bench/step_rows.py OUT.json [--sizes 95M,1.3B] [--modes sync,dpu,selective] [--device cuda]
       [--batch 8] [--context 512] [--budget-s 200] [--gpu-fractions 0,auto] [--state-dtype 8bit]
       [--copy-engine-gbps 25] [--tile-numel 2097152]
Writes OUT.json after every row (a run cut short, e.g. by gpu_check.sh's limit, keeps every row that finished);
prints one line per row.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zo_kernels as zk
from zo_kernels.auto_fraction import FractionPick, measure_device_adam_rate, pick_fraction
from zo_kernels.gpt import GPT, GPTConfig, num_params
from zo_kernels.offload.comm import beside_compute
from zo_kernels.offload.formats import Moments
from zo_kernels.offload.twin import split_runs
from zo_kernels.planner import STATE_DTYPES, state_k
from zo_kernels.transport import CopyEngineTransport, Transport

# 1.3B: 26 layers of width 2048 (12 * 26 * 2048^2 = 1.31e9); torch's fused AdamW on fp32 masters with a bf16
# working copy holds ~20 B/param = 26 GB + activations: it fits an 80 GB GPU without offload.
CONFIGS = {
    "95M": lambda vocab, context: GPTConfig.for_params(1e8, vocab=vocab, context=context),
    "1.3B": lambda vocab, context: GPTConfig(vocab=vocab, context=context, layers=26, width=2048, heads=16),
}
VOCAB = 256
PHASES = ("offload", "reduce", "backward_offload_wait", "step", "kernel", "cpu_update", "writeback", "dpu_wait",
          "all_gather", "forward_writeback_wait", "selective", "offload_wait", "offload_pack", "offload_copy",
          "hooks", "global_checks")  # fmt: skip
# (offload_*: parts of offload, the host's time per bucket in backward: 0.40-0.44 ms a bucket on the H200's host at
# 95M and 1.3B, 2026-11-27, where the pack's call is ~0.03 ms; hooks: the gradient hooks' own time beside it)


def config(size: str, context: int) -> GPTConfig:
    """The named size ("95M", "1.3B") or a parameter count ("1e7")."""
    if size in CONFIGS:
        return CONFIGS[size](VOCAB, context)
    return GPTConfig.for_params(float(size), vocab=VOCAB, context=context)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _timed(fn: Callable[[], None], device: torch.device, warmup: int, rounds: int) -> list[float]:
    """Seconds of each timed call of fn (device synchronized after each): an operation alone."""
    for _ in range(warmup):
        fn()
        _sync(device)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _steps(fn: Callable[[], None], device: torch.device, warmup: int, rounds: int) -> list[float]:
    """Seconds of each of `rounds` training steps run back to back, as a training loop runs them: the device is
    synchronized before the first and after the last only (a sync after each step would end every DPU step with its
    writeback landed, leaving nothing for the next forward to overlap). Each is the host's time between step ends,
    the last one's including the final wait; their mean is the loop's time per step."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out, t0 = [], time.perf_counter()
    for _ in range(rounds):
        fn()
        out.append(time.perf_counter())
    _sync(device)
    out[-1] = time.perf_counter()
    return [b - a for a, b in zip([t0, *out], out)]


def _threads_cpu_ns() -> dict[int, int] | None:
    """CPU nanoseconds each thread of this process has run (Linux: /proc/self/task/*/schedstat), None elsewhere. A
    thread that ends while it is read is left out (libgomp ends and starts workers as regions ask for fewer)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out or None


def _update_running(opt: zk.ZeroOffloadAdamW) -> bool:
    """Whether the optimizer's background (DPU) update is still running (gpu_fraction: its host part's)."""
    for u in (opt.update, getattr(opt.update, "host", None)):
        fut = getattr(u, "_pending", None)
        if fut is not None and not fut.done():
            return True
    return False


def cpu_after(fn: Callable[[], None], device: torch.device, window_s: float = 0.03,
              pending: Callable[[], bool] | None = None) -> dict | None:  # fmt: skip
    """What the process's other threads burn once a step is over: fn(), then the CPU ms every thread but this one
    runs while this one sleeps `window_s` (before the device is synchronized: a sync waiting for the writeback's
    copies could outlast the spin). An update's worker threads that spin waiting for more work show here (libgomp's
    spin for ~8 ms per thread after each parallel region on the 2-core development machine): cores the next
    forward's launching thread and backward's autograd thread then share. `pending()` says whether a background
    update (DPU) was still running when the window opened: then its work counts too (`update_pending`). Threads
    that ended inside the window are counted (`threads_ended`), their last CPU time lost."""
    fn()
    busy = bool(pending()) if pending is not None else False
    me = threading.get_native_id()
    a = _threads_cpu_ns()
    time.sleep(window_s)
    b = _threads_cpu_ns()
    _sync(device)
    if a is None or b is None:
        return None
    return {"cpu_ms": sum(v - a.get(t, 0) for t, v in b.items() if t != me) / 1e6, "window_ms": window_s * 1e3,
            "threads": len(b), "threads_ended": len(a.keys() - b.keys()), "update_pending": busy}  # fmt: skip


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _model(cfg: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(cfg)


class ReferenceLoop:
    """The textbook mixed-precision loop: bf16 (or `dtype`) working model, fp32 masters, AdamW(fused=True)."""

    def __init__(self, model: GPT, dtype: torch.dtype = torch.bfloat16) -> None:
        self.work = model
        self.master = [p.detach().float().clone() for p in model.parameters()]
        self.work.to(dtype)
        self.opt = torch.optim.AdamW(self.master, lr=1e-4, fused=True)

    def step(self, x: torch.Tensor) -> None:
        self.work.zero_grad(set_to_none=True)
        self.work(x[:, :-1], x[:, 1:]).backward()
        for m, p in zip(self.master, self.work.parameters()):
            if m.grad is None:  # held from step to step, as zo holds its buckets: no allocation per step
                m.grad = torch.empty_like(m)
            m.grad.copy_(p.grad)  # the upcast
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.work.parameters()):
                p.copy_(m)


def torch_fused(cfg: GPTConfig, x: torch.Tensor, rounds: int) -> dict:
    """The no-offload reference: mean step ms (back to back) and peak device GiB."""
    device = x.device
    loop = ReferenceLoop(_model(cfg, device))
    _reset_peak(device)
    times = _steps(lambda: loop.step(x), device, warmup=2, rounds=rounds)
    out = {"torch_fused_ms": _mean(times) * 1e3, "torch_peak_gib": _peak_gib(device)}
    loop = None  # freed before the next model is built
    _free(device)
    return out


PROBE_MARGIN_S = 60  # launch_probe runs only with this much left before the rows' deadline


class OmpRelease(NamedTuple):
    """libgomp's omp_pause_resource_all(omp_pause_soft), in every libgomp this process loaded (torch's wheels carry
    one; zo's kernels share it where its soname matches, else load their own): ends the calling thread's OpenMP
    worker threads, which otherwise spin for more work after each parallel region (~8 ms each on the 2-core
    development machine); the next region starts new ones."""

    paths: tuple[str, ...]
    fns: tuple[Any, ...]

    @staticmethod
    def find() -> OmpRelease | None:
        """None where no libgomp is loaded (or /proc/self/maps cannot be read)."""
        import ctypes

        try:
            with open("/proc/self/maps") as f:
                paths = tuple(dict.fromkeys(line.split()[-1] for line in f if "libgomp" in line.split()[-1]))
        except OSError:
            return None
        found = []
        for path in paths:
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            found.append((path, fn))
        return OmpRelease(tuple(p for p, _ in found), tuple(f for _, f in found)) if found else None

    def __call__(self) -> list[int]:
        """Each library's return code (0: released)."""
        return [fn(1) for fn in self.fns]


def launch_probe(cfg: GPTConfig, x: torch.Tensor, rounds: int, state_dtype: str = "fp32") -> dict:
    """Forward + backward of the bf16 model (no optimizer) while the host runs CPU Adam, each call synchronized, the
    median: alone (`synced_ms`); right after a CPU Adam call on this thread with the optimizer's `threads`, as a
    synchronous step's next forward comes (`after_update_ms`: its worker threads may still spin), and the same with
    the update's OpenMP threads ended first (`after_update_released_ms`, where libgomp is loaded: `released_by`,
    each library's return code); and while a background thread runs CPU Adam over and over with the DPU update's
    `background_threads`, and with half of them, as a delayed update runs beside forward and backward
    (`beside_update_ms`, by thread count, and the update's own ns per element meanwhile,
    `beside_update_adam_ns_per_param`). The update is over a scratch partition of min(params, 2**24) elements in the
    rows' moment format (`state_dtype`), fp32 master, bf16 gradient and parameters out: the optimizer's threads and
    per-element traffic, not its state. On a GPU, where forward + backward is launched by one host thread, a slower
    step there than alone is the host's CPU shared with the update (the H200's 95M step ran forward + backward in
    16.5 ms inside zo's step against 8.3 alone)."""
    device = x.device
    model = _model(cfg, device).to(torch.bfloat16)
    n = min(num_params(model), 1 << 24)
    p = torch.randn(n) * 0.02
    g = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    m, v = Moments(state_dtype, n).pair  # (the optimizer's own moments, by format name)
    threads = max(1, torch.get_num_threads())
    background = beside_compute(threads)
    steps = iter(range(1, 1 << 62))

    def update(t: int) -> None:
        zk.cpu_adam_step(p, g, m, v, step=next(steps), lr=1e-4, param_out=out, threads=t)

    run = fwd_bwd_call(model, x)
    release = OmpRelease.find()
    codes: list[int] = []

    def after_update(released: bool = False) -> float:
        update(threads)
        if released:
            codes[:] = release()  # the update's worker threads ended: nothing left spinning
        t0 = time.perf_counter()
        run()
        _sync(device)
        return time.perf_counter() - t0

    def beside(t: int) -> tuple[float, float | None]:
        """(median forward + backward seconds, CPU Adam ns per element meanwhile: its calls' median)."""
        stop, calls, failed = threading.Event(), [], []

        def loop() -> None:
            try:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    update(t)
                    calls.append(time.perf_counter() - t0)
            except BaseException as e:  # raised below, in the measuring thread: never a figure beside nothing
                failed.append(e)

        worker = threading.Thread(target=loop, daemon=True)
        worker.start()
        try:
            seconds = _median(_timed(run, device, warmup=1, rounds=rounds))
        finally:
            stop.set()
            worker.join()
        if failed:
            raise failed[0]
        return seconds, _median(calls) * 1e9 / n if calls else None

    try:
        out_row = {"threads": threads, "update_elements": n, "moments": state_dtype,
                   "synced_ms": _median(_timed(run, device, 1, rounds)) * 1e3}  # fmt: skip
        after_update()  # warm-up
        out_row["after_update_ms"] = _median([after_update() for _ in range(rounds)]) * 1e3
        if release is not None:
            out_row["after_update_released_ms"] = _median([after_update(True) for _ in range(rounds)]) * 1e3
            out_row["released_by"] = dict(zip(release.paths, codes))
        counts = dict.fromkeys((background, max(1, background // 2)))  # (one entry where they are equal)
        got = {str(t): beside(t) for t in counts}
        out_row["beside_update_ms"] = {t: s * 1e3 for t, (s, _) in got.items()}
        # the update's own rate meanwhile: with the row's partition, max(forward + backward, partition x ns) is what
        # a delayed step with that many threads would take
        out_row["beside_update_adam_ns_per_param"] = {t: ns for t, (_, ns) in got.items()}
        return out_row
    finally:
        model = p = g = m = v = out = None
        _free(device)


def checkpointed(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT's forward and loss with every block under torch.utils.checkpoint (non-reentrant)."""
    h = model.tok(idx) + model.pos(torch.arange(idx.shape[1], device=idx.device))
    for block in model.blocks:
        h = checkpoint(block, h, use_reentrant=False)
    logits = model.head(model.ln(h))
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def plain(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(idx, targets)


def fwd_bwd_call(model: GPT, x: torch.Tensor, loss_of: Callable = plain) -> Callable[[], None]:
    """One forward + backward of the model alone (gradients dropped first): what fwd_bwd and launch_probe time."""

    def run() -> None:
        model.zero_grad(set_to_none=True)
        loss_of(model, x[:, :-1], x[:, 1:]).backward()

    return run


def fwd_bwd(model: GPT, x: torch.Tensor, rounds: int, loss_of: Callable = plain) -> float:
    """Mean seconds of forward + backward on the (bf16) model alone, back to back."""
    times = _steps(fwd_bwd_call(model, x, loss_of), x.device, warmup=2, rounds=rounds)
    model.zero_grad(set_to_none=True)
    return _mean(times)


def _plans_count(opt: zk.ZeroOffloadAdamW, name: str) -> int:
    """A counter of the optimizer's pack plans, summed: "uploads" (tensor tables uploaded: one per plan, plus one
    per change of address), "full_checks" (calls whose tensors went through the full check: the guard failed)."""
    return sum(getattr(p, name, 0) for p in opt.grads.plans.values())


def phase_times(opt: zk.ZeroOffloadAdamW) -> dict:
    """The last step's phase times, seconds (opt.stats' time_*, without the prefix)."""
    return {k[5:]: v for k, v in opt.stats.items() if k.startswith("time_")}


def median_phases_ms(phases: list[dict]) -> dict:
    """Each of PHASES' median over steps' phase_times, in ms (0 where a step had none)."""
    return {k: _median([p.get(k, 0.0) for p in phases]) * 1e3 for k in PHASES}


ISOLATED_STEPS = 3


def drain_of(opt: zk.ZeroOffloadAdamW, device: torch.device) -> Callable[[], None]:
    """What waits for everything queued: the device on a GPU, the optimizer's transport (its copies) on the CPU."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else opt.transport.synchronize


def isolated_phases(opt: zk.ZeroOffloadAdamW, model: GPT, x: torch.Tensor, steps: int = ISOLATED_STEPS) -> dict:
    """The optimizer's phase times (ms, median of `steps` training steps) with the device synchronized before each
    bucket's launch in backward and before step() (GradPath.before_launch), outside the phases: its host time
    with nothing queued ahead of it. In the timed steps the host runs ahead of the device (at 1.3B it reached
    step() 35-41 ms early on the H100), and a launch or copy queued then can block until the device drains work in
    front of it: that wait is the device's time, counted in the phases there (offload_copy 59 ms a step at 1.3B
    against 49 ms for the copies themselves). orchestration_isolated_* is orchestration_ms over these phases. On
    the CPU the drain is the transport's (its queued copies, with the GPU-shaped one). Two limits: under DPU the
    drains stretch backward, so the background update more often ends before step() and competes less for the
    cores (the figure may understate that contention), and step()'s waits for its own writeback's copies still
    count."""
    device = x.device
    drain = drain_of(opt, device)
    opt.grads.before_launch = drain
    phases = []
    try:
        for _ in range(steps):
            loss = model(x[:, :-1], x[:, 1:])
            opt.backward(loss)
            drain()
            opt.step()
            phases.append(phase_times(opt))
    finally:
        opt.grads.before_launch = None
    return median_phases_ms(phases)


def cpu_adam_alone(opt: zk.ZeroOffloadAdamW, rounds: int) -> tuple[float, float]:
    """(median seconds of the optimizer's CPU Adam with its tiled writeback to the device, copies waited for;
    median seconds of the bare kernel over the partition, untiled, no copies). Moves the optimizer's state."""
    u, n = opt.update, len(opt.layout.params)
    runs = opt.layout.runs([True] * n, u.steps, [1.0] * n)
    if opt.split < opt.part:  # gpu_fraction: the host's part alone
        u, runs = u.host, split_runs(runs, opt.split)[0]
        if u is None:
            return 0.0, 0.0
    hparams = [dict(lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"], weight_decay=g["weight_decay"])
               for g in opt.param_groups]  # fmt: skip
    grad = opt.grads.landing[0]
    device = opt.flat.device

    u.take_out(grad, runs)  # (where the new parameters go over the gradients: into this landing buffer)

    def tiled() -> None:
        u.cpu_update(grad, 1e-3, runs, hparams, True)
        u.transport.synchronize()

    with_writeback = _median(_timed(tiled, device, warmup=1, rounds=rounds))
    if u.fmt == "fp32":
        p, m, v = (torch.empty_like(t).copy_(t) for t in u.state())
    else:  # (the moments in their format: the kernel moves the format's bytes)
        p, (m, v) = u.state()[0].clone(), u.moments.pair
    out = torch.empty(p.numel(), dtype=opt.dtype)
    bare = []
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        zk.cpu_adam_step(p, grad, m, v, step=i + 1, lr=1e-4, grad_scale=1e-3, param_out=out, threads=opt.threads)
        bare.append(time.perf_counter() - t0)
    return with_writeback, _median(bare[1:])


def d2h_alone(opt: zk.ZeroOffloadAdamW, rounds: int) -> float:
    """Median seconds of copying every bucket's bytes from the device to the pinned landing buffer (the copies
    the backward pass makes), nothing else."""
    device, tr, dst = opt.flat.device, opt.transport, opt.grads.landing[0]
    if not dst.numel():  # gpu_fraction 1: nothing lands on the host
        return 0.0
    src = torch.randn(opt.flat_numel, device=device).to(opt.dtype)
    buckets = [(b.lo, min(b.hi, dst.numel())) for b in opt.layout.buckets]

    def run() -> None:
        for lo, hi in buckets:
            tr.d2h(dst[lo:hi], src[lo:hi])
        tr.synchronize()

    return _median(_timed(run, device, warmup=1, rounds=rounds))


def pack_alone(opt: zk.ZeroOffloadAdamW, rounds: int) -> float:
    """Best seconds of packing every bucket's gradients (random, the params' sizes and dtype) where backward packs
    them (the bucket buffer; one rank on the CPU: the landing buffer), nothing else: on the CPU this is the copy of
    the gradients to the host (cast, Σg², inf flag), on a GPU the pack kernels."""
    device, lay, g = opt.flat.device, opt.layout, opt.grads
    jobs = []
    totals = (torch.zeros((), device=device), torch.zeros((), dtype=torch.bool, device=device))
    for b in lay.buckets:
        grads = [torch.randn(n, device=device).to(opt.dtype) for _, _, n in b.params]
        out = g.landing[0][b.lo : b.hi] if g.direct_landing else g.bucket_bufs[b.index % 2][: b.hi - b.lo]
        # a plan per bucket, kept, its Σg² and flag added into running totals by pack_step: as backward packs.
        # Through zk.pack, whose cache keys plans by sizes, the 1.3B GPT's identical blocks shared one plan, which
        # re-uploaded its address table (and waited for the last upload) at every call: 12-22 ms "alone" on the H100
        jobs.append((zk.buckets.plan(grads, dtype=opt.dtype, align=lay.align), grads, out[b.params[0][1] - b.lo :]))

    def run() -> None:
        for plan, grads, out in jobs:
            plan.pack_step(grads, out, totals)

    # the best of the rounds: what orchestration subtracts is then the least it could be (not understated)
    return min(_timed(run, device, warmup=1, rounds=rounds))


def orchestration_ms(phases: dict, pack_ms: float, device: torch.device) -> float:
    """The optimizer's time outside kernels and copies, ms: its host time in backward (offload, reduce) and in step(),
    less the CPU Adam kernel, less (with device = CPU, where packing is the copy to the host) the pack alone. The
    end-of-backward wait (for the copies) is not counted, nor, under DPU, step()'s wait for the background update
    (dpu_wait: CPU Adam's time not hidden, the kernel's own; until 2026-11-27 it was counted, so the H200's 1.3B
    DPU row read 0.80 of its step as orchestration where 0.54 was that wait). The gradient hooks' own time (hooks,
    measured since the H200's fifth run, not in its figures) counts: it is the optimizer's host time in backward.
    Nor the global checks' read of Σg² and the overflow flag (`global_checks`, recorded since the fifth run): at one
    rank a wait for the backward's last kernels (under DPU the end of backward no longer waits for the copies since
    2026-11-27, so that wait moved there), at N an all-reduce; it was counted twice before, in "reduce" and "step"."""
    checks = phases.get("global_checks", 0.0)  # (inside both "reduce" and "step": the read of Σg² and the flag)
    outside = (phases["offload"] + phases["reduce"] - checks + phases["step"] - checks - phases["kernel"]
               - phases.get("dpu_wait", 0.0) + phases.get("hooks", 0.0))  # fmt: skip
    return outside - (pack_ms if device.type == "cpu" else 0.0)


def copy_engine(gbps: float | None) -> Transport | None:
    """The GPU's data flow on the CPU: copies on a thread, each delayed as if it crossed a link of `gbps` GB/s."""
    if gbps is None:
        return None
    return CopyEngineTransport(delay_s=lambda dst, src: dst.numel() * dst.element_size() / (gbps * 1e9))


def zo_step(cfg: GPTConfig, x: torch.Tensor, mode: str, rounds: int, gpu_fraction: float = 0.0,
            gbps: float | None = None, tile_numel: int | None = None, ckpt: bool = False,
            state_dtype: str = "fp32") -> dict:  # fmt: skip
    """fwd_bwd alone, then ZeroOffloadAdamW (sync or DPU steady state): step, phases, peak; CPU Adam alone, D2H
    alone on the same optimizer's buffers. `gbps`: on the CPU, the GPU's data flow (copy_engine); `tile_numel`: the
    optimizer's (None: its default); `ckpt`: the same with every block checkpointed too (ckpt_* keys); `state_dtype`:
    the moments' format, on the host and in gpu_fraction's tail."""
    device = x.device
    model = _model(cfg, device).to(torch.bfloat16)
    params = num_params(model)
    row: dict = {"params": params, "mode": mode, "config": cfg.__dict__, "tokens": x[:, :-1].numel(),
                 "state_dtype": state_dtype}  # fmt: skip
    _reset_peak(device)
    row["fwd_bwd_ms"] = fwd_bwd(model, x, rounds) * 1e3
    # the bf16 model, its gradients and the activations, no optimizer: what any of the three peaks holds anyway
    row["fwd_bwd_peak_gib"] = _peak_gib(device)
    if ckpt:
        _free(device)
        _reset_peak(device)
        row["ckpt_fwd_bwd_ms"] = fwd_bwd(model, x, rounds, checkpointed) * 1e3
        row["ckpt_fwd_bwd_peak_gib"] = _peak_gib(device)
    _free(device)
    transport = copy_engine(gbps)
    dpu = mode == "dpu"  # the DPU rows tile the writeback under the next forward (dpu_writeback="per_module")
    opt = zk.ZeroOffloadAdamW(model, lr=1e-4, delay_update_after=0 if dpu else None, transport=transport,
                              tile_numel=tile_numel, gpu_fraction=gpu_fraction, state_dtype=state_dtype,
                              dpu_writeback="per_module" if dpu else "whole")  # fmt: skip
    row["gpu_fraction"], row["partition"] = gpu_fraction, opt.part
    row["buckets"] = len(opt.layout.buckets)  # (the offload phases are per bucket: 0.4 ms each on the GPUs' hosts)
    fence = getattr(opt.update, "fence", None)  # DPU with real copies: the tiled writeback (None: waited for whole)
    try:
        phases: list[dict] = []
        tiles: list[tuple[int, int]] = []  # (tiles, in flight when the forward's first module came) per step
        uploads = [_plans_count(opt, "uploads")]  # pack tables uploaded so far, after each step
        checks = [_plans_count(opt, "full_checks")]  # pack calls whose tensors were checked in full (guard failed)

        def step() -> None:
            loss = model(x[:, :-1], x[:, 1:])
            if fence is not None and fence.in_flight is not None:
                tiles.append((fence.tiles, fence.in_flight))
            opt.backward(loss)
            opt.step()
            phases.append(phase_times(opt))
            uploads.append(_plans_count(opt, "uploads"))
            checks.append(_plans_count(opt, "full_checks"))

        _reset_peak(device)
        times = _steps(step, device, warmup=3 if mode == "dpu" else 2, rounds=rounds)
        row["zo_peak_gib"] = _peak_gib(device)
        phases = phases[-rounds:]
        zo_s = _mean(times)
        row["zo_ms"] = zo_s * 1e3
        row["tokens_per_s"] = row["tokens"] / zo_s
        row["phases"] = median_phases_ms(phases)
        tiles = tiles[-rounds:]
        row["writeback_tiles"] = _median([t for t, _ in tiles]) if tiles else None
        row["writeback_in_flight_at_forward"] = _median([f for _, f in tiles]) if tiles else None
        row["copy_engine_gbps"] = gbps
        # pack tables rebuilt because a bucket's gradients came at new addresses: 0 when the allocator hands the
        # same blocks every step (each rebuild costs ~4x a pack call's host time: 97 against 23 us for 64 tensors)
        row["pack_table_uploads_per_step"] = (uploads[-1] - uploads[-1 - rounds]) / rounds
        # and pack calls that checked their tensors in full (~4x the guarded call): 0 when the layout guard holds
        row["pack_full_checks_per_step"] = (checks[-1] - checks[-1 - rounds]) / rounds
        row["cpu_after_step"] = cpu_after(step, device, pending=lambda: _update_running(opt))
        row["isolated_phases"] = isolated_phases(opt, model, x)
        if ckpt:  # the same optimizer, every block checkpointed: the activations' share of the peak, the recompute's
            # share of the step

            ckpt_phases: list[dict] = []

            def ckpt_step() -> None:
                opt.backward(checkpointed(model, x[:, :-1], x[:, 1:]))
                opt.step()
                ckpt_phases.append(phase_times(opt))

            _free(device)
            _reset_peak(device)
            times = _steps(ckpt_step, device, warmup=2, rounds=rounds)
            row["ckpt_zo_peak_gib"] = _peak_gib(device)
            row["ckpt_zo_ms"] = _mean(times) * 1e3
            # where the checkpointed step's time goes (the 95M DPU step was 7.2 ms over its forward + backward on
            # the H200, 2.4 without checkpointing, eighth run): its phases, as the timed steps' above
            row["ckpt_phases"] = median_phases_ms(ckpt_phases[-rounds:])
        opt.synchronize()
        _sync(device)
        adam, bare = cpu_adam_alone(opt, max(2, rounds // 2))
        row["cpu_adam_ms"], row["cpu_adam_kernel_ms"] = adam * 1e3, bare * 1e3
        row["d2h_ms"] = d2h_alone(opt, rounds) * 1e3
        row["pack_ms"] = pack_alone(opt, rounds) * 1e3
        ph = row["phases"]
        row["orchestration_ms"] = orchestration_ms(ph, row["pack_ms"], device)
        row["orchestration_of_step"] = row["orchestration_ms"] / row["zo_ms"]
        row["orchestration_isolated_ms"] = orchestration_ms(row["isolated_phases"], row["pack_ms"], device)
        row["orchestration_isolated_of_step"] = row["orchestration_isolated_ms"] / row["zo_ms"]
        if "ckpt_phases" in row:
            row["ckpt_orchestration_ms"] = orchestration_ms(row["ckpt_phases"], row["pack_ms"], device)
        # bench/test_bench_step.py's earlier measure: every optimizer phase but the kernel, packing and wait included
        outside = ph["offload"] + ph["reduce"] + ph["backward_offload_wait"] + ph["step"] - ph["kernel"]
        row["optimizer_outside_kernel_of_step"] = outside / row["zo_ms"]
        row["threads"], row["background_threads"] = opt.threads, opt.background_threads
    finally:
        opt.close()
        if transport is not None:
            transport.close()
        opt = model = None  # freed before the next model is built
        _free(device)
    return row


TARGETS = {  # name: (value of a row, bar, "<=")
    "sync_vs_fwd_bwd_plus_adam": 1.10,
    "dpu_vs_max_fwd_bwd_adam": 1.15,
    "orchestration_of_step": 0.05,
    "orchestration_isolated_of_step": 0.05,  # the same, the host's time alone (isolated_phases)
    "peak_vs_torch": 0.25,
    # issue 20, gpu_fraction rows: >= 0.8x torch fused AdamW's tokens/s (its step time <= 1.25x) at <= 0.35x its peak
    "twin_time_vs_torch": 1.25,
    "twin_peak_vs_torch": 0.35,
}
TARGETS.update({"ckpt_" + k: v for k, v in TARGETS.items() if not k.startswith("orchestration")})  # --checkpoint's


# a configuration bench/convergence.py measured within 2% of exact AdamW when fine-tuning (--finetune 400: 1.005-1.015
# over 3 seeds, both models; README "selective: convergence"); the CPU applies the rest once per 4 steps. (The
# first GPU run's {0.5, 100, apply_every 1} is the one within 2% from scratch, with 100 warm-up steps.)
SELECTIVE = {"fraction": 0.25, "select_every": 100, "apply_every": 4}


def selective_row(cfg: GPTConfig, x: torch.Tensor, rounds: int, ckpt: bool = False) -> dict:
    """fwd_bwd alone, then ZeroOffloadAdamW(selective=SELECTIVE): median step over whole windows (a window's end,
    where the background update lands, included in proportion), phases, peak device memory; `ckpt`: the same with
    every block checkpointed too (ckpt_* keys)."""
    device = x.device
    model = _model(cfg, device).to(torch.bfloat16)
    row: dict = {"params": num_params(model), "mode": "selective", "config": cfg.__dict__, "selective": SELECTIVE,
                 "tokens": x[:, :-1].numel()}  # fmt: skip
    _reset_peak(device)
    row["fwd_bwd_ms"] = fwd_bwd(model, x, rounds) * 1e3
    # the bf16 model, its gradients and the activations, no optimizer: what any of the three peaks holds anyway
    row["fwd_bwd_peak_gib"] = _peak_gib(device)
    row["cpu_adam_ms"] = None  # (the unselected columns' CPU update runs in the background: not measured alone)
    if ckpt:
        _free(device)
        _reset_peak(device)
        row["ckpt_fwd_bwd_ms"] = fwd_bwd(model, x, rounds, checkpointed) * 1e3
        row["ckpt_fwd_bwd_peak_gib"] = _peak_gib(device)
    _free(device)
    opt = zk.ZeroOffloadAdamW(model, lr=1e-4, selective=SELECTIVE)
    try:
        phases: list[dict] = []

        def step() -> None:
            opt.backward(model(x[:, :-1], x[:, 1:]))
            opt.step()
            phases.append(phase_times(opt))

        window = SELECTIVE["apply_every"]
        _reset_peak(device)
        # warm-up: the first selection and two windows (the background update then runs in steady state)
        times = _steps(step, device, warmup=1 + 2 * window, rounds=max(rounds, 1) * window)
        row["zo_peak_gib"] = _peak_gib(device)
        row["zo_ms"] = _mean(times) * 1e3  # a mean: every step of a window counts once
        row["zo_ms_median"] = _median(times) * 1e3
        row["phases"] = median_phases_ms(phases[-len(times) :])
        row["selected_numel"] = opt.update.sel.numel() if opt.update.sel is not None else 0
        row["threads"], row["background_threads"] = opt.threads, opt.background_threads
        if ckpt:  # the same optimizer (its selection held), every block checkpointed, whole windows again

            def ckpt_step() -> None:
                opt.backward(checkpointed(model, x[:, :-1], x[:, 1:]))
                opt.step()

            _free(device)
            _reset_peak(device)
            times = _steps(ckpt_step, device, warmup=window, rounds=max(rounds, 1) * window)
            row["ckpt_zo_peak_gib"] = _peak_gib(device)
            row["ckpt_zo_ms"] = _mean(times) * 1e3
    finally:
        opt.close()
        opt = model = None
        _free(device)
    return row


def selective_targets(row: dict) -> dict:
    """The issue's targets for a selective row: tokens/s >= 0.8x torch fused, peak <= 0.35x torch fused."""
    out = {"tokens_per_s_vs_torch": (row["torch_fused_ms"] / row["zo_ms"], 0.8, True)}
    if row.get("zo_peak_gib") and row.get("torch_peak_gib"):
        out["peak_vs_torch_selective"] = (row["zo_peak_gib"] / row["torch_peak_gib"], 0.35, False)
    if row.get("ckpt_zo_ms"):  # --checkpoint: the same bars, torch's row unchanged (no checkpointing there)
        out["ckpt_tokens_per_s_vs_torch"] = (row["torch_fused_ms"] / row["ckpt_zo_ms"], 0.8, True)
        if row.get("ckpt_zo_peak_gib") and row.get("torch_peak_gib"):
            out["ckpt_peak_vs_torch_selective"] = (row["ckpt_zo_peak_gib"] / row["torch_peak_gib"], 0.35, False)
    return {k: {"value": v, "bar": bar, "met": bool(v >= bar if at_least else v <= bar), "at_least": at_least}
            for k, (v, bar, at_least) in out.items()}  # fmt: skip


def targets(row: dict) -> dict:
    """The issue's targets for one row: {name: {"value", "bar", "met"}} (those the row can be judged on)."""
    out = {}
    if row["mode"] == "sync":
        out["sync_vs_fwd_bwd_plus_adam"] = row["zo_ms"] / (row["fwd_bwd_ms"] + row["cpu_adam_ms"])
    else:
        out["dpu_vs_max_fwd_bwd_adam"] = row["zo_ms"] / max(row["fwd_bwd_ms"], row["cpu_adam_ms"])
    out["orchestration_of_step"] = row["orchestration_of_step"]
    if "orchestration_isolated_of_step" in row:
        out["orchestration_isolated_of_step"] = row["orchestration_isolated_of_step"]
    if row.get("zo_peak_gib") and row.get("torch_peak_gib"):
        out["peak_vs_torch"] = row["zo_peak_gib"] / row["torch_peak_gib"]
    if row.get("gpu_fraction_choice", "0") != "0":
        out["twin_time_vs_torch"] = row["zo_ms"] / row["torch_fused_ms"]
        if "peak_vs_torch" in out:
            out["twin_peak_vs_torch"] = out["peak_vs_torch"]
    if row.get("ckpt_zo_ms"):  # --checkpoint: the same bars, against the checkpointed forward + backward
        fb, adam, zo = row["ckpt_fwd_bwd_ms"], row["cpu_adam_ms"], row["ckpt_zo_ms"]
        if row["mode"] == "sync":
            out["ckpt_sync_vs_fwd_bwd_plus_adam"] = zo / (fb + adam)
        else:
            out["ckpt_dpu_vs_max_fwd_bwd_adam"] = zo / max(fb, adam)
        if row.get("ckpt_zo_peak_gib") and row.get("torch_peak_gib"):
            out["ckpt_peak_vs_torch"] = row["ckpt_zo_peak_gib"] / row["torch_peak_gib"]
        if row.get("gpu_fraction_choice", "0") != "0":
            out["ckpt_twin_time_vs_torch"] = zo / row["torch_fused_ms"]
            if "ckpt_peak_vs_torch" in out:
                out["ckpt_twin_peak_vs_torch"] = out["ckpt_peak_vs_torch"]
    return {k: {"value": v, "bar": TARGETS[k], "met": bool(v <= TARGETS[k])} for k, v in out.items()}


def auto_pick(row: dict, device: torch.device) -> FractionPick:
    """gpu_fraction "auto" from a fraction-0 row: its forward+backward time and CPU Adam kernel rate, the tail's AdamW
    rate measured on the device in the row's moment format, the device memory that row's peak left (unbounded on the
    CPU)."""
    cpu_rate = row["partition"] / (row["cpu_adam_kernel_ms"] / 1e3)
    free = 1e18
    if device.type == "cuda":
        usable = torch.cuda.get_device_properties(device).total_memory * 0.95
        free = usable - row["zo_peak_gib"] * 2**30
    fmt = row.get("state_dtype", "fp32")
    return pick_fraction(row["partition"], cpu_rate, measure_device_adam_rate(device, state_dtype=fmt),
                         row["fwd_bwd_ms"] / 1e3, free, state_k(fmt) + 2)  # fmt: skip


def measure(size: str, modes: list[str], device: torch.device, batch: int, context: int, rounds: int,
            fractions: tuple[str, ...] = ("0",), gbps: float | None = None, tile_numel: int | None = None,
            on_row: Callable[[dict], None] | None = None, deadline: float | None = None,
            ckpt: bool = False, state_dtype: str = "fp32", probe: bool = True) -> list[dict]:  # fmt: skip
    """The rows of one size: the torch reference once, then one row per mode and gpu_fraction (a number or "auto");
    on_row(row) is called as each one is done. No row starts past `deadline` (time.perf_counter()): it says so.
    `state_dtype`: the moments' format of the sync and DPU rows (selective keeps fp32 moments); `probe`: the
    launch_probe first, unless under PROBE_MARGIN_S are left before `deadline`."""
    cfg = config(size, context)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab, (batch, context + 1), generator=g).to(device)
    ref = torch_fused(cfg, x, rounds)
    if probe and deadline is not None and deadline - time.perf_counter() < PROBE_MARGIN_S:  # the rows come first
        ref["launch_probe"] = {"skipped": f"under {PROBE_MARGIN_S} s left for this size's rows"}
    elif probe:
        try:  # (19 forwards + backwards: ~2 s at 1.3B, batch 8, ~5 s at batch 32)
            ref["launch_probe"] = launch_probe(cfg, x, min(rounds, 3), state_dtype)
        except Exception as e:  # a diagnosis: its failure costs no row
            ref["launch_probe"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(probe_line(size, ref["launch_probe"]), flush=True)
    rows = []
    for mode in modes:
        zero = None  # this mode's fraction-0 row: what "auto" picks from
        for choice in ("-",) if mode == "selective" else fractions:
            if deadline is not None and time.perf_counter() > deadline:
                row = {"size": size, "mode": mode, "skipped": "the time budget for rows was spent"}
                if mode != "selective":
                    row["gpu_fraction_choice"] = choice
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                continue
            try:
                if mode == "selective":
                    row = selective_row(cfg, x, rounds, ckpt)
                    row.update(ref, size=size, device=str(device), batch=[batch, context])
                    row["targets"] = selective_targets(row)
                else:
                    pick = None
                    if choice == "auto":
                        zero = zero or zo_step(cfg, x, mode, rounds, 0.0, gbps, tile_numel, state_dtype=state_dtype)
                        pick = auto_pick(zero, device)
                    row = zo_step(cfg, x, mode, rounds, pick.fraction if pick else float(choice), gbps, tile_numel,
                                  ckpt, state_dtype)  # fmt: skip
                    zero = row if choice != "auto" and float(choice) == 0.0 else zero
                    row.update(ref, size=size, device=str(device), batch=[batch, context], gpu_fraction_choice=choice)
                    row["tokens_vs_torch"] = ref["torch_fused_ms"] / row["zo_ms"]
                    if pick is not None:
                        row["gpu_fraction_pick"] = pick.explain()
                    row["targets"] = targets(row)
            except Exception as e:  # (e.g. a path never run on this device) the row says why; the next rows run
                row = {"size": size, "mode": mode, "error": f"{type(e).__name__}: {e}"[:500]}
                if mode != "selective":
                    row["gpu_fraction_choice"] = choice
                _free(device)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def probe_line(size: str, probe: dict) -> str:
    """launch_probe's figures, printed once per size."""
    if "synced_ms" not in probe:
        return f"{size:>5} launch probe: {probe}"
    beside = ", ".join(f"{v:.2f} with {k} threads" for k, v in probe["beside_update_ms"].items())
    released = probe.get("after_update_released_ms")
    released = f" ({released:.2f} with its threads ended)" if released else ""
    return (f"{size:>5} launch probe: fwd+bwd alone {probe['synced_ms']:.2f} ms, right after a CPU Adam of "
            f"{probe['threads']} threads {probe['after_update_ms']:.2f}{released}, beside one {beside}")


def selective_line(row: dict) -> str:
    """The printed line of a selective row."""
    peak = f", peak {row['zo_peak_gib']:.2f} GiB vs {row['torch_peak_gib']:.2f}" if row.get("zo_peak_gib") else ""
    if peak and row.get("fwd_bwd_peak_gib"):
        peak += f" (fwd+bwd alone {row['fwd_bwd_peak_gib']:.2f})"
    t = ", ".join(f"{k} {v['value']:.3f} ({'MET' if v['met'] else 'MISSED'} {'>=' if v['at_least'] else '<='} "
                  f"{v['bar']})" for k, v in row["targets"].items())  # fmt: skip
    if row.get("ckpt_zo_ms"):
        ck_peak = f", peak {row['ckpt_zo_peak_gib']:.2f} GiB" if row.get("ckpt_zo_peak_gib") else ""
        t += f"; checkpointed: zo {row['ckpt_zo_ms']:.2f} ms, fwd+bwd {row['ckpt_fwd_bwd_ms']:.2f}{ck_peak}"
    return (f"{row['size']:>5} {row['params'] / 1e6:8.1f}M selective {row['selective']}: zo {row['zo_ms']:8.2f} ms "
            f"(mean over windows; median {row['zo_ms_median']:.2f}), fwd+bwd {row['fwd_bwd_ms']:7.2f}, torch fused "
            f"{row['torch_fused_ms']:.2f}{peak}; {t}")  # fmt: skip


def line(row: dict) -> str:
    """One printed line per row."""
    if "error" in row:
        choice = f" gpu_fraction {row['gpu_fraction_choice']}" if "gpu_fraction_choice" in row else ""
        return f"{row['size']:>5} {row.get('mode', '')}{choice}: FAILED {row['error']}"
    if "skipped" in row:
        return f"{row['size']:>5} {row.get('mode', '')}: NOT RUN ({row['skipped']})"
    if row["mode"] == "selective":
        return selective_line(row)
    peak = f", peak {row['zo_peak_gib']:.2f} GiB vs {row['torch_peak_gib']:.2f}" if row.get("zo_peak_gib") else ""
    if peak and row.get("fwd_bwd_peak_gib"):
        peak += f" (fwd+bwd alone {row['fwd_bwd_peak_gib']:.2f})"
    t = ", ".join(f"{k} {v['value']:.3f} ({'MET' if v['met'] else 'MISSED'} <= {v['bar']})"
                  for k, v in row["targets"].items())  # fmt: skip
    if row.get("ckpt_zo_ms"):
        ck_peak = f", peak {row['ckpt_zo_peak_gib']:.2f} GiB" if row.get("ckpt_zo_peak_gib") else ""
        t += f"; checkpointed: zo {row['ckpt_zo_ms']:.2f} ms, fwd+bwd {row['ckpt_fwd_bwd_ms']:.2f}{ck_peak}"
        if "ckpt_orchestration_ms" in row:
            t += f", orchestration {row['ckpt_orchestration_ms']:.2f} ms"
    if row.get("writeback_tiles"):
        t += (f"; writeback {row['writeback_tiles']} tiles, {row['writeback_in_flight_at_forward']} in flight at "
              f"forward, forward waited {row['phases']['forward_writeback_wait']:.2f} ms")  # fmt: skip
    if row.get("cpu_after_step"):
        c = row["cpu_after_step"]
        t += f"; after a step the other threads ran {c['cpu_ms']:.1f} ms of CPU in {c['window_ms']:.0f} ms"
    twin = f" gpu_fraction {row['gpu_fraction']:.3f} ({row['gpu_fraction_choice']})" if row.get("gpu_fraction") else ""
    twin += f" {row['state_dtype']} moments" if row.get("state_dtype", "fp32") != "fp32" else ""
    return (f"{row['size']:>5} {row['params'] / 1e6:8.1f}M {row['mode']:<4}{twin}: zo {row['zo_ms']:8.2f} ms, fwd+bwd "
            f"{row['fwd_bwd_ms']:7.2f}, cpu adam {row['cpu_adam_ms']:7.2f} (kernel {row['cpu_adam_kernel_ms']:.2f}), "
            f"d2h {row['d2h_ms']:.2f}, pack {row['pack_ms']:.2f}, orchestration {row['orchestration_ms']:.2f} "
            f"(isolated {row.get('orchestration_isolated_ms', float('nan')):.2f}), "
            f"torch fused {row['torch_fused_ms']:.2f}{peak}; {t}")  # fmt: skip


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--sizes", default="95M,1.3B")
    ap.add_argument("--modes", default="sync,dpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=math.inf, help="start no new size past this many seconds")
    ap.add_argument("--gpu-fractions", default="0", help="gpu_fraction per row: numbers in [0, 1] and/or auto")
    ap.add_argument("--copy-engine-gbps", type=float, default=None,
                    help="device cpu: the GPU's data flow, copies delayed as over a link of this many GB/s")
    ap.add_argument("--tile-numel", type=int, default=None, help="the optimizer's tile_numel (default: its own)")
    ap.add_argument("--state-dtype", choices=STATE_DTYPES, default="fp32",
                    help="the moments' format of the sync and DPU rows (host and gpu_fraction's tail)")
    ap.add_argument("--checkpoint", action="store_true",
                    help="each row also trains with every block checkpointed (ckpt_* keys)")
    ap.add_argument("--no-launch-probe", action="store_true", help="skip launch_probe (a diagnosis, once per size)")
    a = ap.parse_args(argv)
    fractions = tuple(a.gpu_fractions.split(","))
    for f in fractions:
        if f != "auto" and not (f.replace(".", "", 1).isdigit() and 0.0 <= float(f) <= 1.0):
            ap.error(f"--gpu-fractions: numbers in [0, 1] and/or auto, got {a.gpu_fractions}")
    device = torch.device(a.device)
    if a.copy_engine_gbps is not None and (device.type != "cpu" or not a.copy_engine_gbps > 0):
        ap.error("--copy-engine-gbps: a positive rate, with --device cpu")
    modes = a.modes.split(",")
    if set(modes) - {"sync", "dpu", "selective"}:
        ap.error(f"--modes: some of sync, dpu, selective, got {a.modes}")
    t0, rows, status = time.perf_counter(), [], 0

    def keep(row: dict) -> None:  # written at once: a run cut short (gpu_check.sh's time limit) keeps every row
        rows.append(row)
        print(line(row), flush=True)
        _write(a.out, rows)

    for size in a.sizes.split(","):
        if time.perf_counter() - t0 > a.budget_s:
            print(f"{size}: NOT RUN (the {a.budget_s:g} s budget is spent)", flush=True)
            rows.append({"size": size, "skipped": f"the {a.budget_s:g} s budget was spent"})
            status = 1
        else:
            try:
                # (rows of a started size go on to 1.7x the budget: gpu_check.sh gives the stage 2x it)
                measure(size, modes, device, a.batch, a.context, a.rounds, fractions, a.copy_engine_gbps,
                        a.tile_numel, on_row=keep, deadline=t0 + 1.7 * a.budget_s, ckpt=a.checkpoint,
                        state_dtype=a.state_dtype, probe=not a.no_launch_probe)  # fmt: skip
            except Exception as e:  # e.g. out of memory: the row says why, the other sizes still run
                print(f"{size}: FAILED {type(e).__name__}: {e}", flush=True)
                rows.append({"size": size, "error": f"{type(e).__name__}: {e}"[:500]})
                status = 1
                _free(device)
        _write(a.out, rows)
    return 1 if any("error" in r for r in rows) else status


def _write(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
