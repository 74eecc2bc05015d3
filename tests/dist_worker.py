"""Multi-process training runs for the data-parallel tests (gloo on the CPU, torch.multiprocessing)."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from offload_ref import make_data, make_model

import zo_kernels as zk

BATCH = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(rank: int, world: int, steps: range, dtype, resume: str | None, save: str | None, out: str,
          bucket_numel: int = 7_000, grad_only: bool = False) -> None:  # fmt: skip
    """Train `steps` of the fixed data on this rank's share of each batch; optionally resume/save.

    grad_only: one backward of the first step, then save this rank's reduced gradient (landing buffer).
    """
    model = make_model(seed=5 if resume else 0)  # a resumed run must take everything from the checkpoint
    opt = zk.ZeroOffloadAdamW(model.parameters(), dtype=dtype, lr=2e-3, weight_decay=0.01, bucket_numel=bucket_numel)
    if resume:
        zk.load_checkpoint(resume, model, opt)  # written at another world size
    data = make_data(steps.stop, batch=BATCH)
    per = BATCH // world
    losses = []
    for s in steps:
        x = data[s][0][rank * per : (rank + 1) * per]
        loss = model(x[:, :-1], x[:, 1:])
        opt.backward(loss)
        if grad_only:
            result = {"grad": opt.landing[0].clone(), "lo": opt.part_lo, "report": opt.memory_report(),
                      "cores": sorted(os.sched_getaffinity(0)), "threads": opt.threads}  # fmt: skip
            torch.save(result, f"{out}.{rank}")
            return
        opt.step()
        losses.append(loss.item())
    sd = opt.state_dict()  # a collective: every rank calls it
    view = [opt.state[p] for p in model.parameters()]  # this rank's part of each parameter's state (no collective)
    if save:
        zk.save_checkpoint(save, model, opt, world=world)  # a collective too; rank 0 writes
    torch.save({"state": sd, "view": view, "part": opt.master.numel(), "losses": losses, "flat_numel": opt.flat_numel,
                "model": {k: v.clone() for k, v in model.state_dict().items()}}, f"{out}.{rank}")  # fmt: skip
    opt.close()


def _entry(rank: int, world: int, port: int, args: tuple, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(rank, world, *args, **kwargs)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run(world: int, *args, **kwargs) -> list[dict]:
    """Run `train` on `world` ranks (one process each when world > 1); returns each rank's results."""
    out = args[-1] if len(args) >= 5 else kwargs["out"]
    if world == 1:
        train(0, 1, *args, **kwargs)
    else:
        mp.spawn(_entry, args=(world, free_port(), args, kwargs), nprocs=world, join=True)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def _failing_entry(rank: int, port: int, out: str, timeout_s: float) -> None:
    """Rank 1 raises in its third forward; rank 0 records how it fails (type, message, seconds)."""
    import json
    import time as _time

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model.parameters(), collective_timeout_s=timeout_s)
    data = make_data(6, batch=4)
    t0 = _time.perf_counter()
    try:
        for s in range(6):
            if rank == 1 and s == 2:
                raise RuntimeError("rank 1 fails on purpose")
            x = data[s][0]
            opt.backward(model(x[:, :-1], x[:, 1:]))
            opt.step()
            t0 = _time.perf_counter()
        result = {"type": None, "msg": "finished", "seconds": 0.0}
    except Exception as e:
        result = {"type": type(e).__name__, "msg": str(e), "seconds": _time.perf_counter() - t0}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip destroy_process_group: the peer is gone


def run_failing(out: str, timeout_s: float) -> dict:
    """Two ranks, rank 1 fails mid-run: rank 0's outcome (it must fail clearly within a bounded time)."""
    import json

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_failing_entry, args=(r, port, out, timeout_s)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
            raise AssertionError("a rank hung past 120 s")
    with open(f"{out}/rank0.json") as f:
        return json.load(f)
