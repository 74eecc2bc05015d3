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
    model = make_model()
    if resume:
        ckpt = torch.load(resume, weights_only=False)
        model.load_state_dict(ckpt["model"])
    opt = zk.ZeroOffloadAdamW(model.parameters(), dtype=dtype, lr=2e-3, weight_decay=0.01, bucket_numel=bucket_numel)
    if resume:
        opt.load_state_dict(ckpt["optim"])
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
    if save and rank == 0:
        torch.save({"model": model.state_dict(), "optim": sd}, save)
    torch.save({"state": sd, "part": opt.master.numel(), "losses": losses, "flat_numel": opt.flat_numel,
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
