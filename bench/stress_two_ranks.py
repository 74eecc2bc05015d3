"""Stress run of two-rank training: N launches of two gloo processes, each exiting through the interpreter's normal
finalization (no os._exit), optionally beside busy loops; counts the runs whose ranks did not exit 0.

    python bench/stress_two_ranks.py --runs 50 --busy 2 [--workload all] [--cores DIR]

Each launch trains a small model for a few steps with one of the workloads (stage 1/2/3, DPU, copy-engine
transport, NVMe state), calls close(), meets at a barrier, destroys the group and returns; one workload exits
with copies still queued and nothing closed. A rank killed by a
signal (SIGABRT: "terminate called without an active exception") or exiting non-zero counts as a failure; with
--cores the ranks may dump core there (RLIMIT_CORE unlimited) for a backtrace with gdb.
"""

from __future__ import annotations

import argparse
import faulthandler
import multiprocessing as pymp
import os
import resource
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta

WORKLOADS = {
    "stage2": dict(stage=2),
    "stage2-dpu": dict(stage=2, delay_update_after=1),
    "stage1": dict(stage=1),
    "stage3": dict(stage=3),
    "stage3-cpu": dict(stage=3, offload_param="cpu"),
    "copy-engine-dpu": dict(stage=2, delay_update_after=1, transport="copy_engine"),
    "nvme-dpu": dict(stage=2, delay_update_after=1, offload_optimizer="nvme"),
    # copies still queued on the copy-engine thread at exit, nothing closed (aborted before the atexit fix)
    "copy-engine-unclosed": dict(stage=2, delay_update_after=1, transport="copy_engine", unclosed=True),
}


def _busy(stop: float) -> None:
    x = 0
    while time.time() < stop:
        x += 1


def _rank(rank: int, store_path: str, workload: str, scratch: str, cores: str | None, port: int | None) -> None:
    if cores:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        os.chdir(cores)
    faulthandler.enable()  # a fatal signal prints every Python thread's stack
    import torch
    import torch.distributed as dist

    import zo_kernels as zk
    from zo_kernels.transport import CopyEngineTransport

    if port is None:
        store = dist.FileStore(store_path, 2)
    else:  # the TCPStore rendezvous (rank 0 serves it), as MASTER_ADDR/MASTER_PORT give it
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=300))
    kw = dict(WORKLOADS[workload])
    unclosed = kw.pop("unclosed", False)
    transport = CopyEngineTransport(delay_s=0.0005) if kw.pop("transport", None) == "copy_engine" else None
    if kw.get("offload_optimizer") == "nvme":
        kw["nvme_dir"] = scratch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = zk.ZeroOffloadAdamW(model, lr=1e-3, dtype=torch.float32, bucket_numel=200, transport=transport,
                              collective_timeout_s=300.0, **kw)  # fmt: skip
    for _ in range(4):
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.state_dict()
    if unclosed:
        blk = transport.pool.take(1 << 20, torch.float32)
        for _ in range(50):
            transport.h2d(torch.empty(1 << 20), blk)
        dist.barrier()
        dist.destroy_process_group()
        return
    opt.close()
    if transport is not None:
        transport.close()
    dist.barrier()
    dist.destroy_process_group()
    # returns: the process ends through the interpreter's normal finalization


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_launch(workload: str, cores: str | None, rendezvous: str) -> list[int | None]:
    """The two ranks' exit codes of one launch."""
    ctx = pymp.get_context("spawn")
    port = _free_port() if rendezvous == "tcp" else None
    with tempfile.TemporaryDirectory(prefix="zo-stress-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, store, workload, tmp, cores, port)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        return [p.exitcode for p in procs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the runs")
    ap.add_argument("--workload", default="all", choices=["all", *WORKLOADS])
    ap.add_argument("--cores", default=None, help="directory for core dumps (default: none)")
    ap.add_argument("--rendezvous", default="file", choices=["file", "tcp"],
                    help="FileStore (the tests' harness) or TCPStore on a free port (MASTER_PORT's way)")
    args = ap.parse_args(argv)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    busy = [pymp.get_context("spawn").Process(target=_busy, args=(time.time() + 86400,), daemon=True)
            for _ in range(args.busy)]  # fmt: skip
    for b in busy:
        b.start()
    failures, t0 = [], time.perf_counter()
    try:
        for i in range(args.runs):
            name = names[i % len(names)]
            codes = one_launch(name, args.cores, args.rendezvous)
            ok = codes == [0, 0]
            why = ", ".join(f"rank {r}: {signal.Signals(-c).name if c and c < 0 else c}" for r, c in enumerate(codes))
            print(f"run {i + 1:3d} {name:16s} {'ok' if ok else 'FAILED'} ({why})", flush=True)
            if not ok:
                failures.append((i + 1, name, why))
    finally:
        for b in busy:
            b.kill()
    print(f"{args.runs - len(failures)}/{args.runs} runs clean, {len(failures)} failed, {args.busy} busy loops, "
          f"{args.rendezvous} rendezvous, {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")
    for f in failures:
        print("  failed:", *f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
