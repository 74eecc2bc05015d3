"""Where a bucket's host time goes (issue 17): the offload step's calls for one gradient bucket, timed inside
backward's hooks and replayed outside backward.

    python bench/bucket_host.py OUT.json [--sizes 95M,1.3B] [--modes dpu,sync] [--bucket-numels default,16777216]
        [--batch 32] [--steps 4]

On the GPUs' hosts the step spent 0.15-0.3 ms of host time per bucket with the device drained before each bucket
(bench/step_rows.py's isolated phases: 1.3B, 131 buckets, 42 ms a step on the H200, 2026-11-28). This script names
the calls that take it and tells readings apart by replaying the same calls (the same plans, bucket views and
totals; gradients of the same sizes) outside backward:

- `quiet`: each call after a device synchronize, nothing else running.
- `pipelined`: back to back, the device synchronized once a round (nearer a step whose device keeps up: a call
  right after a synchronize is slower).
- `beside_update`: as `quiet`, while a thread runs CPU Adam with the optimizer's background threads, as the delayed
  update does during backward (the cores and the memory bandwidth shared).
- `after_flush`: as `quiet`, each call after 256 MiB of host memory written (the caches cold).

Rows (per size and mode, 8-bit moments, as bench/step_rows.py's batch-32 rows): `in_backward` (the timed steps:
a launch there can block behind a full device queue) and `in_backward_isolated` (the device synchronized before
each bucket, that drain taken out of `launch`), each call's microseconds, the calling thread's CPU microseconds
(`cpu_us`: far below `us`, the thread was off its core), the longest call (`max_us`: one outlier, say a page
fault or a collection, or every call), its context switches per 100 calls (`voluntary`: it
blocked, on the GIL or a lock; `involuntary`: preempted) and calls per step; `replay`, the pack
call and the D2H copy call per condition; `step_ms`, the steps' mean wall time in each. `--bucket-numels
default,16777216`: each row with the optimizer's default buckets and with 2**24 elements (the default until
2026-11-28; now larger for models over 537M parameters), to see what the count costs. A diagnosis, no target.
First run: the H200, 2026-11-28 (bench/results/bucket-host-2026-11-28-H200.json, docs/gpu-runs.md; before
`pipelined`, `step_ms`, `--bucket-numels` and the drain's removal from `launch`).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

try:
    import resource
except ImportError:  # (not on Windows)
    resource = None

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_rows as rows  # noqa: E402

import zo_kernels as zk  # noqa: E402
from zo_kernels.gpt import GPT  # noqa: E402
from zo_kernels.offload.formats import Moments  # noqa: E402


def _switches() -> tuple[int, int]:
    """The calling thread's context switches so far: (voluntary: it blocked, on a lock such as the GIL or in a
    wait; involuntary: the scheduler took its core). (0, 0) where the platform cannot say per thread."""
    if _RUSAGE_THREAD is None:
        return 0, 0
    r = resource.getrusage(_RUSAGE_THREAD)
    return r.ru_nvcsw, r.ru_nivcsw


_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None


class Clock:
    """Seconds, the calling thread's CPU seconds, its context switches and calls per name, of callables wrapped on
    their objects (instance attributes, undone by undo()). A call whose wall time far exceeds its thread's CPU time
    was off its core: descheduled (`involuntary` switches: more runnable threads than cores, e.g. the update's
    OpenMP threads spinning) or blocked (`voluntary`: the GIL held by another thread, a driver lock)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.voluntary: dict[str, int] = {}
        self.involuntary: dict[str, int] = {}
        self.longest: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[object, str, bool, object]] = []

    def wrap(self, obj: object, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        had = attr in getattr(obj, "__dict__", {})

        def timed(*a, **k):
            v0, i0 = _switches()
            c0 = time.thread_time()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t1 = time.perf_counter()
                c1 = time.thread_time()
                v1, i1 = _switches()
                self.seconds[name] = self.seconds.get(name, 0.0) + t1 - t0
                self.longest[name] = max(self.longest.get(name, 0.0), t1 - t0)
                self.cpu[name] = self.cpu.get(name, 0.0) + c1 - c0
                self.voluntary[name] = self.voluntary.get(name, 0) + v1 - v0
                self.involuntary[name] = self.involuntary.get(name, 0) + i1 - i0
                self.calls[name] = self.calls.get(name, 0) + 1

        setattr(obj, attr, timed)
        self._undo.append((obj, attr, had, fn))

    def per_call_us(self, steps: int) -> dict[str, dict]:
        """Per name: wall and thread-CPU microseconds a call, the longest call's (one outlier, or every call?),
        calls a step, context switches per 100 calls."""
        return {n: {"us": self.seconds[n] / self.calls[n] * 1e6, "cpu_us": self.cpu[n] / self.calls[n] * 1e6,
                    "max_us": self.longest[n] * 1e6,
                    "per_step": self.calls[n] / steps,
                    "voluntary_per_100": 100 * self.voluntary[n] / self.calls[n],
                    "involuntary_per_100": 100 * self.involuntary[n] / self.calls[n]}
                for n in sorted(self.seconds)}  # fmt: skip

    def undo(self) -> None:
        for obj, attr, had, fn in reversed(self._undo):
            if had:
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr)
        self._undo = []


def instrument(opt: zk.ZeroOffloadAdamW, clock: Clock) -> None:
    """The bucket's calls: the whole launch, the pack call (its tensor check, tables, kernel launch or host pack;
    and how often it re-uploaded its address table or took pack's full path), the moved-gradient placeholders, the
    buffer wait and the D2H copy call. (On the H200, eighth run, `pack_tables` took 33-157 us a call where a table
    still valid costs ~1: these counts say whether it was uploading.)"""
    g = opt.grads
    for attr, name in (("_launch", "launch"), ("_pack", "pack_call"), ("_place_moved_grad", "moved_grad"),
                       ("_wait_buffer", "wait_buffer")):  # fmt: skip
        clock.wrap(g, attr, name)
    clock.wrap(g.transport, "d2h", "d2h")
    for p in g.plans.values():
        clock.wrap(p, "check", "pack_check")
        clock.wrap(p, "_tables", "pack_tables")
        clock.wrap(p, "_upload", "pack_upload")  # (the address table re-uploaded: the gradients' addresses moved)
        clock.wrap(p, "pack", "pack_full")  # (pack_step's untrusted path: its out or totals not the trusted ones)
        clock.wrap(p, "_pack_host", "pack_host")
        if getattr(p, "_kernels", None) is not None:
            kernels = p._kernels
            p._kernels = SimpleNamespace(pack=kernels.pack, pack_key=kernels.pack_key, unpack=kernels.unpack)
            clock.wrap(p._kernels, "pack", "kernel_launch")


def in_backward(opt, model, x, steps: int, isolated: bool) -> dict:
    """Each call's microseconds and calls per step over `steps` training steps (and `step_ms`, their mean wall time,
    the device synchronized before the first and after the last)."""
    device = x.device
    sync = rows.drain_of(opt, device)
    clock = Clock()
    instrument(opt, clock)
    drain = SimpleNamespace(run=sync)  # (inside "launch": GradPath calls before_launch first)
    clock.wrap(drain, "run", "drain")
    opt.grads.before_launch = drain.run if isolated else None
    try:
        rows._sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = model(x[:, :-1], x[:, 1:])
            opt.backward(loss)
            if isolated:
                sync()
            opt.step()
        rows._sync(device)
        wall = time.perf_counter() - t0
        out = clock.per_call_us(steps)
        out["step_ms"] = wall / steps * 1e3
        if "drain" in out:  # the launch's own figures, the drain's taken out (not from max_us: it holds its drain)
            share = out["drain"]["per_step"] / out["launch"]["per_step"]
            for k in ("us", "cpu_us", "voluntary_per_100", "involuntary_per_100"):
                out["launch"][k] -= out["drain"][k] * share
        return out
    finally:
        opt.grads.before_launch = None
        clock.undo()


def replay(opt, rounds: int, before: Callable[[], None], synced: bool = True) -> dict:
    """The step's pack calls (each plan into its own bucket view and totals, gradients of its sizes) and one D2H
    copy of each bucket's size, each call timed alone, after `before()` and (`synced`) a device synchronize; else
    back to back, the device synchronized once a round (the calls queue behind one another, as in a step whose
    device keeps up)."""
    g, device = opt.grads, opt.device
    sync = rows.drain_of(opt, device)
    outs = {(b, u): out for (_, b, u), out in g._pack_outs.items()}
    calls = [(p, [torch.zeros(n, dtype=d, device=device) for n, d in zip(p.numels, p.dtypes)], outs[key])
             for key, p in g.plans.items() if key in outs]  # fmt: skip
    pack_s, copy_s, n = 0.0, 0.0, 0
    buf = g.bucket_bufs[0] if g.bucket_bufs else None
    for r in range(rounds + 1):  # (the first round: new gradient addresses, pack's full path; not counted)
        sync()
        items = []
        for p, grads, out in calls:
            before()
            if synced:
                sync()
            t0 = time.perf_counter()
            p.pack_step(grads, out, g._totals, scale=g.predivide)
            t1 = time.perf_counter()
            if buf is not None:
                m = min(p.total, buf.numel(), g.landing[g.slot].numel())
                before()
                if synced:
                    sync()
                t2 = time.perf_counter()
                items.append(g.transport.d2h(g.landing[g.slot][:m], buf[:m]))
                t3 = time.perf_counter()
                if synced:
                    g.transport.wait(items.pop())
            else:
                t2 = t3 = 0.0
            if r:
                pack_s, copy_s, n = pack_s + t1 - t0, copy_s + t3 - t2, n + 1
        g.transport.wait_all(items)
    return {"pack_call_us": pack_s / max(n, 1) * 1e6, "d2h_us": copy_s / max(n, 1) * 1e6 if buf is not None else None,
            "calls": n}  # fmt: skip


def beside_update(opt, fn: Callable[[], dict]) -> dict:
    """fn() while a thread runs CPU Adam over 16M elements (8-bit moments) with the optimizer's background threads."""
    n = 1 << 24
    p, out = torch.randn(n) * 0.02, torch.empty(n, dtype=torch.bfloat16)
    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    m, v = Moments("8bit", n).pair
    stop, failed = threading.Event(), []

    def loop() -> None:
        step = 0
        try:
            while not stop.is_set():
                step += 1
                zk.cpu_adam_step(p, grad, m, v, step=step, lr=1e-4, param_out=out, threads=opt.background_threads)
        except BaseException as e:  # raised in the measuring thread
            failed.append(e)

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    try:
        time.sleep(0.05)
        return fn()
    finally:
        stop.set()
        worker.join()
        if failed:
            raise failed[0]


def measure(size: str, mode: str, device: torch.device, batch: int, context: int, steps: int,
            bucket_numel: int | None = None) -> dict:  # fmt: skip
    """One row: the optimizer's default buckets, or `bucket_numel`'s."""
    cfg = rows.config(size, context)
    x = torch.randint(0, cfg.vocab, (batch, context + 1), device=device)
    model = rows._model(cfg, device).to(torch.bfloat16)
    dpu = mode == "dpu"
    transport = rows.copy_engine(25.0) if device.type == "cpu" else None  # (on the CPU: the GPU-shaped data flow)
    opt = zk.ZeroOffloadAdamW(model, lr=1e-4, delay_update_after=0 if dpu else None, state_dtype="8bit",
                              transport=transport, dpu_writeback="per_module" if dpu else "whole",
                              bucket_numel=bucket_numel)  # fmt: skip
    row: dict = {"size": size, "mode": mode, "batch": [batch, context], "params": rows.num_params(model),
                 "buckets": len(opt.layout.buckets), "threads": opt.threads,
                 "background_threads": opt.background_threads}  # fmt: skip
    row["bucket_numel"] = bucket_numel or zk.offload.default_bucket_numel(sum(p.numel() for p in opt.layout.params))
    row["params_per_bucket"] = len(opt.layout.params) / row["buckets"]
    try:
        for _ in range(3):  # warm-up: plans made, views and totals trusted
            opt.backward(model(x[:, :-1], x[:, 1:]))
            opt.step()
        rows._sync(device)
        row["in_backward"] = in_backward(opt, model, x, steps, isolated=False)
        row["in_backward_isolated"] = in_backward(opt, model, x, steps, isolated=True)
        opt.synchronize()
        rows._sync(device)
        flush = torch.empty(64 << 20, dtype=torch.float32)  # 256 MiB
        row["replay"] = {
            "quiet": replay(opt, 3, lambda: None),
            "pipelined": replay(opt, 3, lambda: None, synced=False),
            "beside_update": beside_update(opt, lambda: replay(opt, 3, lambda: None)),
            "after_flush": replay(opt, 3, lambda: flush.fill_(1.0)),
        }
    finally:
        opt.close()
        if transport is not None:
            transport.close()
        opt = model = None
        rows._free(device)
    return row


def bucket_numels(size: str, context: int, asked: list[int | None]) -> list[int | None]:
    """The rows' bucket sizes for a model: each asked one (None: the optimizer's default) once, by the size it
    resolves to (at 95M the default is 2**24: one row, not two)."""
    with torch.device("meta"):
        default = zk.offload.default_bucket_numel(rows.num_params(GPT(rows.config(size, context))))
    seen, out = set(), []
    for n in asked:
        if (n or default) not in seen:
            seen.add(n or default)
            out.append(n)
    return out


def line(row: dict) -> str:
    def us(d: dict, k: str) -> str:  # wall (thread CPU) microseconds a call
        return f"{d[k]['us']:.0f} ({d[k]['cpu_us']:.0f})" if k in d else "-"

    a, b, r = row["in_backward_isolated"], row["in_backward"], row["replay"]
    names = ("launch", "pack_call", "pack_check", "pack_tables", "kernel_launch", "pack_host", "d2h", "moved_grad",
             "wait_buffer")  # fmt: skip
    parts = ", ".join(f"{k} {us(a, k)}/{us(b, k)}" for k in names if k in a)
    for k in ("pack_upload", "pack_full"):
        if k in b:
            parts += f", {k} {b[k]['per_step']:g} a step"
    rep = "; ".join(f"{c}: pack {v['pack_call_us']:.0f}" + (f", d2h {v['d2h_us']:.0f}" if v["d2h_us"] else "")
                    for c, v in r.items())  # fmt: skip
    return (f"  {row['size']} {row['mode']} ({row['buckets']} buckets of <= {row['bucket_numel']:,}, "
            f"{row['params_per_bucket']:.1f} params each; step {b['step_ms']:.1f} ms timed, "
            f"{a['step_ms']:.1f} isolated; us per call (thread CPU), isolated/timed): {parts}; replayed alone, "
            f"{rep}")  # fmt: skip


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--sizes", default="95M,1.3B")
    ap.add_argument("--modes", default="dpu,sync")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--bucket-numels", default="default",
                    help="rows per bucket size: 'default' (the optimizer's for the model) and/or element counts")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    out: list[dict] = []
    numels = [None if n == "default" else int(n) for n in a.bucket_numels.split(",")]
    for size in a.sizes.split(","):
        for mode in a.modes.split(","):
            for numel in bucket_numels(size, a.context, numels):
                row = measure(size, mode, device, a.batch, a.context, a.steps, numel)
                out.append(row)
                print(line(row), flush=True)
                Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
