"""Activation memory and step time per way of keeping activations: the "activations" rows of gpu_check.sh's summary.

Providers, one model (a stack of pre-norm transformer blocks, bf16 on CUDA, fp32 on the CPU), one run:
  none          no checkpointing: every block's activations stay on the device
  torch         torch.utils.checkpoint.checkpoint(use_reentrant=False) around every block
  save_on_cpu   torch.autograd.graph.save_on_cpu(pin_memory=True): every saved tensor to the host, no prefetch
  torch_offload torch's checkpoint inside save_on_cpu(pin_memory=True): the checkpoints (the blocks' inputs) to the
                host on the compute stream, back at their recomputation, no prefetch (what transformers 5's
                `activation_checkpointing_enable(offload=True)` does): zo's offloaded checkpoint's nearest rival
  zo            zo_kernels.checkpoint(offload=True): block inputs to pinned host blocks, prefetched one block ahead
  zo_resident   zo_kernels.checkpoint(offload=False): torch's checkpoint with the inputs in constant device blocks
  torch_half    torch's checkpoint around each half block (attention, MLP): twice the checkpoints, half the recompute
                working set
  zo_half       zo's offloaded checkpoint around each half block: the checkpoints leave the device, so halving the
                working set is free there (what offload is for: the finer the segments, the less device memory)
Per provider at --seq: the median step (forward + backward, device synchronized; the providers' steps interleaved
round by round) and the host's parts of it (host_forward_ms, host_backward_ms, final_sync_ms: where a host-bound
step's time goes; zo's rows add host_copy_wait_ms and host_copy_waits, the host blocked on copies), the peak device
activation memory
(torch.cuda.max_memory_allocated above the memory before the step, plus the zo blocks allocated before it), the
allocations per step of checkpoint blocks (zo's counters) and of CUDA segments (memory_stats "segment.all.allocated")
after a warm-up step; then, on CUDA, the longest sequence whose step fits --cap-gib of device memory above the
model's parameters and gradients (doubling from --seq, then bisecting, each provider with its share of --budget-s: a
search cut short says so, the providers of issue 21's targets weighted first); with --profile, one step each of
torch, zo, zo_resident and zo_half under torch.profiler (wall vs device busy time, the longest idle spans of the
device with the host op running then, the CUDA runtime calls by total time).
The gradients are allocated once and zeroed in place every step, as an optimizer's zero_grad(set_to_none=False)
leaves them: with `p.grad = None` each step frees them first, so torch's checkpoint peaked at the start of backward
before any gradient existed, zo's offload at its end with all of them: the H200's 1 GiB cap on the whole process
(params 0.19 GiB, gradients 0.19) held 11264 tokens for torch and 16384 for zo, a ratio the model's size set, not
the activations.
On the CPU (no GPU) the device is the CPU and zo runs on the GPU-shaped CopyEngineTransport: step time, zo's
counters and cpu_peak_activation_units (the peak bytes of a step from torch.profiler's memory events, in activations
of [batch, seq, hidden]), labelled so; the longest sequence is searched on CUDA only. Each row's step and peak are
also given as ratios to torch's checkpoint (step_vs_torch_checkpoint, peak_vs_torch_checkpoint).

Usage: python bench/activation_rows.py OUT.json [--device cuda] [--layers 32] [--hidden 512] [--heads 8]
       [--batch 1] [--seq 4096] [--rounds 5] [--cap-gib 1] [--budget-s 45] [--profile]
Writes OUT.json after every row; prints one line per row. Run on a GPU once (one H200, 2026-11-27: five providers,
the whole-process cap); the half-block rows, the cap above the model, --profile and the CPU units never.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import zo_kernels as zk
from zo_kernels.activations import ActivationBuffers

PROVIDERS = ("none", "torch", "save_on_cpu", "torch_offload", "zo", "zo_resident", "torch_half", "zo_half")


class Block(torch.nn.Module):
    """Pre-norm attention (scaled_dot_product_attention, causal) and a 4h GELU MLP, residual."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        return x + self.proj(a)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attention(x))


class Stack(torch.nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.wrap: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x) if self.wrap is None else self.wrap(b, x)
        return x


def provider_setup(name: str, device: torch.device,
                   transport) -> tuple[Callable | None, Callable, ActivationBuffers | None]:  # fmt: skip
    """(the block wrapper, a context factory around forward, zo's buffers or None)."""
    nothing = contextlib.nullcontext
    if name == "none":
        return None, nothing, None

    def on_host():  # every tensor autograd saves, to pinned host memory (the CPU's is the host's)
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")

    if name == "save_on_cpu":
        return None, on_host, None
    torch_ck = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    if name == "torch_offload":
        def offloaded(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            with on_host():
                return torch_ck(block, x)

        return offloaded, nothing, None
    buf = None
    if name.startswith("torch"):
        ck = torch_ck
    else:
        buf = ActivationBuffers(device, transport)
        ck = functools.partial(zk.checkpoint, offload=name != "zo_resident", buffers=buf)
    if name.endswith("_half"):
        return (lambda block, x: ck(block.mlp, ck(block.attention, x))), nothing, buf
    return ck, nothing, buf


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(model: Stack, device: torch.device, dtype: torch.dtype, batch: int, seq: int, hidden: int,
              ctx: Callable, parts: list | None = None) -> Callable[[], None]:  # fmt: skip
    """One training step of `model` on a random input; with `parts`, each step appends the host's seconds in it
    (forward, backward until backward() returned, the final device synchronize: what of the step the device still
    had queued when the host was done), with no synchronize added between them."""
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype, generator=None)

    def step() -> None:
        for p in model.parameters():  # allocated once, zeroed in place (the module docstring says why)
            if p.grad is not None:
                p.grad.zero_()
        inp = x.detach().requires_grad_()
        t0 = time.perf_counter()
        with ctx():
            y = model(inp)
        t1 = time.perf_counter()
        y.float().square().mean().backward()
        t2 = time.perf_counter()
        sync(device)
        if parts is not None:
            parts.append((t1 - t0, t2 - t1, time.perf_counter() - t2))

    return step


class WaitClock:
    """The host's seconds blocked in a transport's waits (`wait`, and so `wait_all` and a pool block's drain), and
    how many: the part of zo's step spent waiting for copies rather than working. Installed on the transport
    object, in front of its own method; `close()` takes it off."""

    def __init__(self, transport) -> None:
        self.transport, self.seconds, self.calls = transport, 0.0, 0
        own = transport.wait  # the bound method, before this one stands in front of it

        def wait(event) -> None:
            t0 = time.perf_counter()
            try:
                own(event)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        self._own = own
        transport.wait = wait
        transport.pool._wait = wait  # (the pool took the bound method when the transport was made)

    def close(self) -> None:
        del self.transport.wait
        self.transport.pool._wait = self._own


def measure(names: list[str], model: Stack, device: torch.device, dtype: torch.dtype, a: argparse.Namespace,
            new_transport: Callable) -> list[dict]:  # fmt: skip
    """Every provider at a.seq: a warm-up step each (zo's blocks are allocated there, once), a.rounds timed steps
    interleaved round by round (every provider sees the same machine state), then one step each for the memory.
    Each zo row has a transport of its own: its host_blocks are its own checkpoints, not what another row's left
    in a shared pool."""
    transports = {n: new_transport() for n in names if n.startswith("zo")}
    try:
        return _measure(names, model, device, dtype, a, transports)
    finally:
        for t in transports.values():
            t.close()


def _measure(names: list[str], model: Stack, device: torch.device, dtype: torch.dtype, a: argparse.Namespace,
             transports: dict) -> list[dict]:  # fmt: skip
    setups = {n: provider_setup(n, device, transports.get(n)) for n in names}
    parts: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    steps = {n: make_step(model, device, dtype, a.batch, a.seq, a.hidden, ctx, parts[n])
             for n, (_, ctx, _) in setups.items()}  # fmt: skip
    rows = {n: {"provider": n, "seq": a.seq} for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    clocks = {n: WaitClock(t) for n, t in transports.items()}
    waits: dict[str, list[tuple[float, int]]] = {n: [] for n in clocks}
    allocs0 = {}
    try:
        for rnd in range(a.rounds + 1):
            for n in names:
                model.wrap = setups[n][0]
                clock = clocks.get(n)
                if clock is not None:
                    clock.seconds, clock.calls = 0.0, 0
                try:
                    t0 = time.perf_counter()
                    steps[n]()
                    if rnd:
                        times[n].append(time.perf_counter() - t0)
                        if clock is not None:
                            waits[n].append((clock.seconds, clock.calls))
                except Exception as e:  # noqa: BLE001 - a provider that fails is a row that says why
                    rows[n]["error"] = f"{type(e).__name__}: {e}"[:300]
                buf = setups[n][2]
                if not rnd and buf is not None:
                    allocs0[n] = buf.allocations
    finally:
        for clock in clocks.values():
            clock.close()
    names = [n for n in names if "error" not in rows[n]]
    for n in names:
        rows[n]["step_ms"] = statistics.median(times[n]) * 1e3
        # where the host's time went, per step (medians of the timed steps): forward, backward until it returned,
        # the final synchronize (the device's queue left when the host was done); zo: its waits for copies
        timed = parts[n][-len(times[n]):]
        for i, key in enumerate(("host_forward_ms", "host_backward_ms", "final_sync_ms")):
            rows[n][key] = statistics.median(p[i] for p in timed) * 1e3
        if n in waits:
            rows[n]["host_copy_wait_ms"] = statistics.median(w for w, _ in waits[n]) * 1e3
            rows[n]["host_copy_waits"] = statistics.median(c for _, c in waits[n])
        buf = setups[n][2]
        if buf is not None:
            rows[n]["checkpoint_allocations_per_step"] = (buf.allocations - allocs0[n]) / a.rounds
            rows[n]["device_blocks"], rows[n]["host_blocks"] = buf.device_allocations, buf.host_allocations
        if device.type == "cuda":
            model.wrap = setups[n][0]
            segs0 = torch.cuda.memory_stats(device).get("segment.all.allocated", 0)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            held = buf.device_bytes if buf is not None else 0  # zo's blocks, allocated before `before`
            steps[n]()
            rows[n]["peak_activation_gib"] = (torch.cuda.max_memory_allocated(device) - before + held) / 2**30
            rows[n]["cuda_segments_per_step"] = torch.cuda.memory_stats(device).get("segment.all.allocated", 0) - segs0
    model.wrap = None
    return list(rows.values())


HOST_PROVIDERS = ("none", "torch", "zo_resident", "zo")


def host_overhead(device: torch.device, dtype: torch.dtype, new_transport: Callable, layers: int = 32,
                  rounds: int = 20) -> dict:  # fmt: skip
    """The host time each provider adds per checkpointed block: the bench's block at hidden 32, batch 1, sequence
    8, so small that the device's work is negligible and a step's wall time is the host's (forward, recomputation,
    backward). Each provider's best step of `rounds` (interleaved round by round, after two warm-up rounds), in
    microseconds per block; zo's overhead is its figure above torch's checkpoint, torch's own above no
    checkpointing. On a host-bound model (the main rows' on the H200: the device busy 24 of 93 ms) the step ratio
    to torch's checkpoint is about 1 + blocks x zo's overhead / torch's step. `new_transport` makes zo's transport:
    on the CPU a synchronous HostTransport (the copy runs inline, where a GPU's queued copy is a C call), not the
    GPU-shaped one, whose copy thread's handoffs are no part of zo's host cost on a GPU."""
    torch.manual_seed(0)
    model = Stack(layers, 32, 2).to(device, dtype)
    transports = {n: new_transport() for n in HOST_PROVIDERS if n.startswith("zo")}
    best = dict.fromkeys(HOST_PROVIDERS, float("inf"))
    try:
        setups = {n: provider_setup(n, device, transports.get(n)) for n in HOST_PROVIDERS}
        steps = {n: make_step(model, device, dtype, 1, 8, 32, ctx) for n, (_, ctx, _) in setups.items()}
        for rnd in range(rounds + 2):
            for n in HOST_PROVIDERS:
                model.wrap = setups[n][0]
                t0 = time.perf_counter()
                steps[n]()
                if rnd >= 2:
                    best[n] = min(best[n], time.perf_counter() - t0)
        top = {}
        for n in ("torch", "zo"):  # where the host time goes, function by function (cProfile inflates small calls)
            model.wrap = setups[n][0]
            top[n] = _top_functions(steps[n], layers)
    finally:
        model.wrap = None
        for t in transports.values():
            t.close()
    us = {n: best[n] / layers * 1e6 for n in HOST_PROVIDERS}
    row = {"provider": "host_overhead", "layers": layers, "hidden": 32, "heads": 2, "batch": 1, "seq": 8,
           "us_per_block": us, "torch_over_none_us": us["torch"] - us["none"],
           "zo_resident_over_torch_us": us["zo_resident"] - us["torch"], "zo_over_torch_us": us["zo"] - us["torch"],
           "profiled_top_us_per_block": top}  # fmt: skip
    if device.type == "cuda":  # an offloaded block's two copies: what one transport call costs the host, in parts
        try:
            row["copy_host_us"] = copy_host_us(new_transport())
        except Exception as e:  # noqa: BLE001 - never run on a GPU: a failure is a note, not a lost row
            row["copy_host_us"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return row


def copy_host_us(transport, calls: int = 200) -> dict:
    """CUDA: host microseconds of one CudaTransport copy of 4 KiB (a pinned pool block <-> device; the mean of
    `calls` calls, the device synchronized before and after each run), and of its parts alone: the endpoint checks,
    ordering the copy stream after the compute stream (the transport's own event, and torch's wait_stream, which it
    used until 2026-11-28: 13.4 us on the H100's host), one event made and recorded, the device side's record_stream,
    the page-locked check, and a pool block taken and given back. The H200's
    host was measured at ~75 us a copy through h2d (transport.h2d_tiles' docstring), the pack call at ~33 us."""
    device = transport.device
    dev = torch.zeros(1024, device=device)
    host = transport.pool.take(1024, torch.float32)

    def mean_us(fn) -> float:
        fn()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        dt = time.perf_counter() - t0
        torch.cuda.synchronize(device)
        return dt / calls * 1e6

    try:
        return {
            "d2h": mean_us(lambda: transport.d2h(host, dev)),
            "h2d": mean_us(lambda: transport.h2d(dev, host)),
            "checks": mean_us(lambda: transport._check_endpoints(dev, host, True)),
            "order": mean_us(lambda: transport._after_compute(transport.h2d_stream)),  # (what a copy orders by)
            "wait_stream": mean_us(lambda: transport.h2d_stream.wait_stream(torch.cuda.current_stream(device))),
            "event": mean_us(lambda: transport._event(transport.h2d_stream)),
            "event_and_device_wait": mean_us(lambda: transport.device_wait(transport._event(transport.h2d_stream))),
            # the rest of a copy's parts, and a checkpoint's pinned block taken and given back
            "record_stream": mean_us(lambda: dev.record_stream(transport.h2d_stream)),
            "pinned_check": mean_us(lambda: transport._cu.pointer_kind(host.data_ptr())),
            "pool_take_give": mean_us(lambda: transport.pool.give(transport.pool.take(1024, torch.float32))),
        }
    finally:
        transport.close()


def _top_functions(step: Callable[[], None], layers: int, steps: int = 3, top: int = 10) -> dict:
    """Own time per block under cProfile over `steps` steps (cProfile inflates small calls: read it for where, not
    how much): the `top` functions overall and zo_kernels' own, each [file:line(function), us], and zo_kernels'
    total. Collected first, then profiled with the garbage collector off: a full collection (~0.1 s with torch
    imported) landing in the profiled steps would be charged to whichever function allocated then (the H200's sixth
    run: 1,617 us a block in torch's pack_hook)."""
    import cProfile
    import gc
    import pstats

    prof = cProfile.Profile()
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
    finally:
        if was_enabled:
            gc.enable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    per_block = 1e6 / (steps * layers)
    rows = sorted(((f, line, name, v[2] * per_block) for (f, line, name), v in stats.items()), key=lambda r: -r[3])
    ours = [r for r in rows if f"{os.sep}zo_kernels{os.sep}" in r[0]]

    def named(rs: list) -> list[list]:
        return [[f"{os.path.basename(f)}:{line}({name})", round(us, 2)] for f, line, name, us in rs[:top]]

    return {"all": named(rows), "zo_kernels": named(ours), "zo_kernels_us": round(sum(r[3] for r in ours), 2)}


class HostFull(Exception):
    """A try ran out of pinned host memory (save_on_cpu's, or zo's pool): the search ends there, bounded by the
    host, not by the device cap."""


def longest_seq(name: str, model: Stack, device: torch.device, dtype: torch.dtype, a: argparse.Namespace,
                transport, deadline: float) -> tuple[int, bool, str | None]:  # fmt: skip
    """(the longest sequence, to 1/8 and a multiple of 256, whose step fits the capped device memory; whether the
    search ended; why it stopped early, or None). Each try at a long sequence costs seconds of attention, so the
    answer is coarse, within the budget: a try is started only if its estimated time still ends before `deadline`
    (the last fitting try's time scaled by the square of the sequence ratio: attention dominates at these lengths;
    one started just before the deadline ran on past it, into the stage's time limit, which kills the script before
    the later providers are searched). A try that fails otherwise (out of pinned host memory, or any error) ends the
    search with what was found, saying why."""
    fit_at = (0, 0.0)  # (sequence, seconds) of the last try that fitted
    last = 0.0  # seconds of the last try

    def fits(seq: int) -> bool:
        nonlocal last, fit_at
        t0 = time.perf_counter()
        model.wrap, ctx, buf = provider_setup(name, device, transport)
        try:
            make_step(model, device, dtype, a.batch, seq, a.hidden, ctx)()
            fit_at = (seq, time.perf_counter() - t0)
            return True
        except torch.OutOfMemoryError:
            return False
        except RuntimeError as e:  # the cap reached inside a library: cuBLAS or cuDNN could not get its workspace
            text = str(e)
            if "cudaHostAlloc" in text or "pinned memory" in text.lower() or "pin_memory" in text:
                raise HostFull(text[:200]) from None
            if "ALLOC_FAILED" in text or "out of memory" in text:
                return False
            raise
        except MemoryError as e:  # zo's host pool at its bound
            raise HostFull(str(e)[:200]) from None
        finally:
            # everything the try allocated goes back before the next one: an out-of-memory try leaves its graph in
            # reference cycles, and without a collection the later tries, the later providers' too, may have run
            # with less memory (zo's resident checkpoints, searched after torch and zo, found 7168 tokens on the
            # H200 against torch's 11264: a suspicion, not shown)
            model.wrap = None
            del buf
            gc.collect()
            torch.cuda.empty_cache()
            getattr(torch._C, "_host_emptyCache", lambda: None)()  # save_on_cpu's pinned blocks (torch caches them)
            last = time.perf_counter() - t0

    def no_time(seq: int) -> bool:  # whether a try at `seq` would end past the deadline (estimated)
        s_ok, t_ok = fit_at
        est = t_ok * (seq / s_ok) ** 2 if s_ok else 4 * last
        return time.perf_counter() + max(est, last) > deadline

    lo, hi = 0, a.seq
    try:
        while fits(hi):
            lo, hi = hi, hi * 2
            if no_time(hi):
                return lo, False, None
        while hi - lo > max(256, hi // 8):
            mid = (lo + hi) // 2 // 256 * 256
            if no_time(mid):
                return lo, False, None
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    except HostFull as e:
        return lo, True, f"host memory: {e}"
    except Exception as e:  # noqa: BLE001 - what was found stands; the row says why the search stopped
        return lo, False, f"{type(e).__name__}: {e}"[:300]
    return lo, True, None


def cpu_peak_units(name: str, model: Stack, a: argparse.Namespace) -> float | None:
    """The CPU's stand-in for the device's activation peak: the most bytes allocated at once during a step above
    its start (torch.profiler's memory events) in units of one [batch, seq, hidden] activation, after two warm-up
    steps (zo's blocks and the gradients allocated), plus zo's device blocks (allocated before the step, held
    through it: as the CUDA rows count them). zo's rows run on a synchronous HostTransport here, so every free
    happens on this thread, where the profiler sees it (a copy thread's frees are not recorded). None for
    save_on_cpu and torch_offload (their host is this memory too) and where this torch's profiler does not expose
    its memory events."""
    from torch.profiler import ProfilerActivity, profile

    from zo_kernels.transport import HostTransport

    if name in ("save_on_cpu", "torch_offload"):
        return None
    cpu = torch.device("cpu")
    transport = HostTransport()
    model.wrap, ctx, buf = provider_setup(name, cpu, transport)
    try:
        step = make_step(model, cpu, torch.float32, a.batch, a.seq, a.hidden, ctx)
        step()
        step()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        results = getattr(prof.profiler, "kineto_results", None)
        if results is None:
            return None
        events = sorted((e for e in results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    finally:
        model.wrap = None
        transport.close()
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return (peak + (buf.device_bytes if buf is not None else 0)) / (a.batch * a.seq * a.hidden * 4)


def profiled_step(name: str, model: Stack, device: torch.device, dtype: torch.dtype, a: argparse.Namespace,
                  transport) -> dict:  # fmt: skip
    """Two steps of `name` at a.seq under torch.profiler after a warm-up step (bench/profile_step.py's analysis):
    wall and device-busy ms per step, the device's 4 longest idle spans with the host op running as each began, the
    6 CUDA runtime calls of most total time. Where zo's step loses to torch's checkpoint: host work or waits."""
    from profile_step import _profiled  # (bench/ is on sys.path: this script's folder)

    model.wrap, ctx, buf = provider_setup(name, device, transport)
    try:
        step = make_step(model, device, dtype, a.batch, a.seq, a.hidden, ctx)
        step()
        analysis, wall = _profiled(step, 2, device)
    finally:
        model.wrap = None
    runtime = dict(list(analysis["runtime"].items())[:6])
    return {"wall_ms": wall, "busy_ms": analysis["busy_ms"], "gaps": analysis["gaps"][:4], "runtime": runtime}


PROFILED = ("torch", "zo", "zo_resident", "zo_half")  # --profile: where zo's step time goes against torch's
SEARCH_ORDER = ("torch", "zo_half", "zo", "torch_offload", "torch_half", "zo_resident", "none",
                "save_on_cpu")  # issue 21's target compares zo's best with torch's best; each search gets its
# weight's share of the time left (unused time rolls on)
SEARCH_WEIGHT = {"torch": 3, "zo_half": 3, "zo": 2, "torch_offload": 2, "torch_half": 2, "zo_resident": 1, "none": 1,
                 "save_on_cpu": 1}  # fmt: skip
# save_on_cpu last: its tries pin every saved tensor in host memory (tens of GiB at the long sequences: slow)


def relate(rows: list[dict]) -> None:
    """Each row's step and peak as ratios to torch's checkpoint of the same shape (the comparison the rows are for)."""
    base = {r["provider"]: r for r in rows if "step_ms" in r}
    if "torch" not in base:
        return
    for r in base.values():
        r["step_vs_torch_checkpoint"] = r["step_ms"] / base["torch"]["step_ms"]
        for key in ("peak_activation_gib", "cpu_peak_activation_units"):
            if r.get(key) is not None and base["torch"].get(key):
                r["peak_vs_torch_checkpoint"] = r[key] / base["torch"][key]


def measure_wide(providers: list[str], shape: dict, device: torch.device, dtype: torch.dtype, a: argparse.Namespace,
                 new_transport: Callable, label: str) -> list[dict]:  # fmt: skip
    """The providers' steps on a second, wide model (shape: layers, hidden, heads, batch, seq), a.wide_rounds
    rounds, rows with shape "wide". The main shape (hidden 512) is host-bound on an H200 (the device busy 24 of
    93 ms for torch's checkpoint), so its step ratios measure Python per block; at hidden 4096 and 8192 tokens the
    device's work is several times the host's, each checkpoint 64 MiB, and a ratio says whether the copies hide
    under compute (issue 21's condition: PCIe covers the checkpoint bytes). Built on the device (no fp32 copy on
    the host), freed before the searches."""
    w = argparse.Namespace(**{**vars(a), **shape, "rounds": a.wide_rounds})
    torch.manual_seed(0)
    with torch.device(device):
        model = Stack(w.layers, w.hidden, w.heads)
    model.to(dtype)
    print(f"activations, wide: {w.layers} blocks x hidden {w.hidden}, batch {w.batch}, seq {w.seq}")
    try:
        rows = [{"device": label, **shape, "dtype": str(dtype).removeprefix("torch."), **r, "shape": "wide"}
                for r in measure(providers, model, device, dtype, w, new_transport)]  # fmt: skip
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    relate(rows)
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="default 32 on CUDA, 4 on the CPU")
    ap.add_argument("--hidden", type=int, default=None, help="default 512 on CUDA, 256 on the CPU")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="default 4096 on CUDA, 256 on the CPU")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cap-gib", type=float, default=1.0,
                    help="CUDA: the longest-seq search's device memory above the model's parameters and gradients")
    ap.add_argument("--profile", action="store_true", help="one step per provider under torch.profiler")
    ap.add_argument("--budget-s", type=float, default=45.0)
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--host-rounds", type=int, default=20,
                    help="rounds of the host-overhead row (tiny blocks: each provider's host time per block); 0: none")
    ap.add_argument("--wide", default=None,
                    help="LAYERS,HIDDEN,HEADS,BATCH,SEQ of a second shape whose step the device, not the host, sets "
                         "(rows with shape 'wide', timed only); default 8,4096,32,2,4096 on CUDA, none on the CPU")
    ap.add_argument("--wide-rounds", type=int, default=3)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    # 32 layers (a 7B model's depth): torch's checkpoint keeps 2 sbh bytes per layer beside one layer's recompute
    # working set W, zo's offload about two checkpoints beside W, zo_half beside the larger half's. Measured on the
    # 2-core CPU (fp32, 16 layers, units of one [s, b, h] tensor, the copies synchronous so every free is seen):
    # torch 36.7 (16 checkpoints + W 20.7), zo 24.7, zo_half 18.8 (each with its two device slots), torch_half
    # 46.8; at 32 layers torch's 52.7 against zo_half's 18.8 would be 2.8x the sequence. Width 512 and a 1 GiB cap
    # keep every try of the search about a second of attention on an H200 (measured once, 2026-11-27)
    a.layers = a.layers or (32 if cuda else 4)
    a.hidden = a.hidden or (512 if cuda else 256)
    a.seq = a.seq or (4096 if cuda else 256)
    providers = a.providers.split(",")
    bad = [p for p in providers if p not in PROVIDERS]
    if bad:
        ap.error(f"--providers: unknown {bad} (known: {', '.join(PROVIDERS)})")
    wide = a.wide if a.wide is not None else "8,4096,32,2,4096" if cuda else "none"
    try:
        wide = None if wide == "none" else dict(zip(("layers", "hidden", "heads", "batch", "seq"),
                                                    map(int, wide.split(",")), strict=True))  # fmt: skip
    except ValueError:
        ap.error(f"--wide: LAYERS,HIDDEN,HEADS,BATCH,SEQ (five ints) or none, got {a.wide!r}")
    start = time.perf_counter()
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = Stack(a.layers, a.hidden, a.heads).to(device, dtype)
    if cuda:
        from zo_kernels.transport import default_transport

        def new_transport():  # a CudaTransport: pinned pool, copy streams
            return default_transport(device)

        label = f"device {torch.cuda.get_device_name(device)}"
    else:
        from zo_kernels.transport import CopyEngineTransport

        new_transport = CopyEngineTransport
        label = ("device = CPU (no GPU): zo on the GPU-shaped CopyEngineTransport; step time, counters and the CPU's "
                 "peak activation units only")  # fmt: skip
    transport = new_transport()  # the profiled steps' (each search has its own)
    common = dict(device=label, layers=a.layers, hidden=a.hidden, heads=a.heads, batch=a.batch,
                  dtype=str(dtype).removeprefix("torch."))  # fmt: skip
    rows: list[dict] = []
    print(f"activations: {label}; {a.layers} blocks x hidden {a.hidden}, batch {a.batch}, seq {a.seq}")

    def write() -> None:  # whole or not at all: the stage's limit may stop the script at any moment
        with open(a.out + ".tmp", "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(a.out + ".tmp", a.out)

    rows += [{**common, **r, "shape": "main"} for r in measure(providers, model, device, dtype, a, new_transport)]
    if not cuda:  # what the CPU can say of the device memory (the longest sequence is only searched on CUDA)
        for r in rows:
            if "step_ms" in r:
                r["cpu_peak_activation_units"] = cpu_peak_units(r["provider"], model, a)
    relate(rows)
    if a.host_rounds > 0:
        from zo_kernels.transport import HostTransport

        try:
            host = host_overhead(device, dtype, new_transport if cuda else HostTransport, rounds=a.host_rounds)
        except Exception as e:  # noqa: BLE001 - a row that says why; the searches still run
            host = {"provider": "host_overhead", "error": f"{type(e).__name__}: {e}"[:300]}
            print(f"  host time per block: failed: {host['error']}")
        else:
            print("  host time per block (hidden 32, seq 8: the host's alone): " + ", ".join(
                f"{n} {v:.1f} us" for n, v in host["us_per_block"].items()) + f"; zo above torch's checkpoint "
                f"{host['zo_over_torch_us']:.1f} us (resident {host['zo_resident_over_torch_us']:.1f}), torch's "
                f"checkpoint above none {host['torch_over_none_us']:.1f} us; under cProfile zo_kernels' own "
                f"functions {host['profiled_top_us_per_block']['zo']['zo_kernels_us']:.1f} us per offloaded "
                "block")  # fmt: skip
        rows.append({**common, **host})
    write()
    if wide is not None:  # a model whose step the device sets: where the checkpoints' copies must hide under compute
        try:
            rows += measure_wide(providers, wide, device, dtype, a, new_transport, label)
        except Exception as e:  # noqa: BLE001 - (building the model, say: out of memory) a row; the searches run
            rows.append({"device": label, **wide, "provider": "wide", "shape": "wide",
                         "error": f"{type(e).__name__}: {e}"[:300]})  # fmt: skip
            print(f"  wide shape failed: {rows[-1]['error']}")
        write()
    if not cuda:
        print("  (cpu_peak_activation_units: the most bytes a step held at once, in [batch, seq, hidden] activations; "
              "None for save_on_cpu and torch_offload, whose host is this memory too)")  # fmt: skip
    for row in (r for r in rows if r["provider"] in PROVIDERS):
        print(f"  {row['provider']:<12} " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in row.items() if k not in common and k != "provider"))
    if a.profile:
        for r in rows:
            if "step_ms" in r and r["provider"] in PROFILED and r["shape"] == "main":
                try:
                    r["profile"] = profiled_step(r["provider"], model, device, dtype, a, transport)
                except Exception as e:  # noqa: BLE001 - never run on a GPU: a failure must not cost the searches
                    r["profile_error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"  {r['provider']:<12} profile failed: {r['profile_error']}")
                    continue
                finally:
                    write()
                p = r["profile"]
                busy = "n/a (no GPU)" if p["busy_ms"] is None else f"{p['busy_ms']:.1f} ms"
                gaps = "; ".join(f"{g['ms']:.2f} ms idle in {g['host_op']}" for g in p["gaps"][:3])
                print(f"  {r['provider']:<12} profiled: {p['wall_ms']:.1f} ms per step, device busy {busy}"
                      + (f"; longest device idle: {gaps}" if gaps else ""))
    if cuda and a.cap_gib > 0:
        total = torch.cuda.get_device_properties(device).total_memory
        gc.collect()
        torch.cuda.empty_cache()  # the measured steps' cached blocks: the cap counts reserved memory
        model_gib = torch.cuda.memory_reserved(device) / 2**30  # parameters and gradients (allocated once)
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index  # the call wants an index, not "cuda"
        torch.cuda.set_per_process_memory_fraction(min(1.0, (model_gib + a.cap_gib) * 2**30 / total), index)
        searched = sorted((r for r in rows if "step_ms" in r and r["shape"] == "main"),
                          key=lambda r: SEARCH_ORDER.index(r["provider"]))
        for i, r in enumerate(searched):
            left = a.budget_s - (time.perf_counter() - start)
            share = SEARCH_WEIGHT[r["provider"]] / sum(SEARCH_WEIGHT[q["provider"]] for q in searched[i:])
            deadline = time.perf_counter() + left * share
            gc.collect()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated(device) / 2**30  # the model alone, if nothing earlier leaked
            own = new_transport()  # its pinned blocks go back when its search ends: none held into the next one's
            try:
                seq, done, why = longest_seq(r["provider"], model, device, dtype, a, own, deadline)
            finally:
                own.close()
            r["longest_seq"], r["longest_seq_cap_gib"], r["longest_seq_search_ended"] = seq, a.cap_gib, done
            r["longest_seq_model_gib"] = model_gib  # the cap is this plus longest_seq_cap_gib
            r["longest_seq_allocated_before_gib"] = before
            if why:
                r["longest_seq_stopped"] = why
            write()
            cut = "" if done else " (at least; cut short)"
            print(f"  {r['provider']:<12} longest seq under {a.cap_gib} GiB above the model's {model_gib:.2f}: "
                  f"{seq}{cut}" + (f" (stopped: {why})" if why else ""))
    write()
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
