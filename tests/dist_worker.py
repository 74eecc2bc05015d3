"""The two-process harness (gloo on the CPU, spawned processes) and the data-parallel tests' training runs.

`spawn_ranks(fn, world, tmp_dir, *args)` runs fn(rank, world, *args) on `world` ranks and is what every
multi-process test uses. Its start and teardown are made to survive a loaded machine:
- rendezvous through a FileStore in the test's own directory: no port is picked, so none can be taken between
  picking it and binding it;
- generous bounds (TIMEOUT_S for the rendezvous and every collective, JOIN_TIMEOUT_S for the whole run): a
  2-core machine running other work can take tens of seconds for what takes one when it is idle;
- teardown: garbage collected, a barrier (no rank destroys gloo while its peer still talks),
  destroy_process_group, then the process ends through os._exit after flushing its output. That skips the
  interpreter's finalization, where a thread still running C++ code (a gloo worker, a copy thread) is stopped
  by pthread_exit when it next takes the GIL and the forced unwind through a noexcept frame aborts the
  process ("terminate called without an active exception"). bench/stress_two_ranks.py exercises the normal
  exit path instead.
- the parent joins every rank with a deadline and fails with each rank's exit status, naming a signal.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from offload_ref import make_data, make_model

import zo_kernels as zk

BATCH = 8
TIMEOUT_S = 300.0  # rendezvous and collectives: a bound for a dead peer, far above a loaded machine's slowness
JOIN_TIMEOUT_S = 900.0  # the whole multi-process run


def free_port() -> int:
    """A free TCP port (kept for callers outside the harness; spawn_ranks does not use ports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_file(store_path: str, rank: int, world: int, timeout_s: float = TIMEOUT_S) -> None:
    """Join the default gloo group through a FileStore at `store_path` (no port: nothing to race for)."""
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def finish_rank(code: int = 0) -> None:
    """Barrier (when the group is up and the rank succeeded), destroy the group, flush, end the process now.

    gc.collect() first: an optimizer left in a reference cycle (hooks on the model) still holds its process
    group and tensors; freed here, while the interpreter is whole, not by a collection during its finalization.
    """
    gc.collect()
    try:
        if dist.is_initialized():
            if code == 0:
                dist.barrier()  # neither rank tears gloo down while the other still talks
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_main(fn: Callable[..., Any], rank: int, world: int, store_path: str, args: tuple, timeout_s: float) -> None:
    code = 0
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks, asked for by spawn_ranks
    try:
        init_from_file(store_path, rank, world, timeout_s)
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        code = 1
    finish_rank(code)


def spawn_ranks(fn: Callable[..., Any], world: int, tmp_dir: str | os.PathLike, *args: Any,
                timeout_s: float = TIMEOUT_S, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:  # fmt: skip
    """Run fn(rank, world, *args) in `world` spawned processes joined in one gloo group; raise if any fails.

    fn must be importable (a module-level function) and its arguments picklable; results go through files.
    """
    ctx = mp.get_context("spawn")
    store_path = os.path.join(os.fspath(tmp_dir), f"store-{uuid.uuid4().hex}")
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, store_path, args, timeout_s), daemon=False)
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    deadline = time.monotonic() + join_timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:  # where each one is stuck: every thread's stack on its stderr, then it is killed
        os.kill(procs[r].pid, signal.SIGUSR1)
    if hung:
        time.sleep(1.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        raise AssertionError(f"{fn.__name__}: rank(s) {hung} still running after {join_timeout_s:g} s (killed; "
                             "their stacks are on stderr)")  # fmt: skip
    bad = {r: _describe_exit(p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0}
    if bad:
        raise AssertionError(f"{fn.__name__}: " + "; ".join(f"rank {r} {why}" for r, why in bad.items()))


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


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


def resume_two_steps(rank: int, model: torch.nn.Module, opt: Any, ckpt_in: str | None, ckpt_out: str, out: str, *,
                     vocab: int, batch: int, seq: int, seed: int) -> None:  # fmt: skip
    """A rank of a two-rank checkpoint test: load ckpt_in (if any), two steps on its half of the batch, save
    ckpt_out; rank 0 writes {"loaded", "saved"} (the state dicts after the load and after the steps) to out."""
    if ckpt_in is not None:
        zk.load_checkpoint(ckpt_in, model, opt)
    loaded = opt.state_dict()
    data = torch.randint(0, vocab, (2, 2, 2 * batch, seq), generator=torch.Generator().manual_seed(seed))
    for s in range(2):
        x, y = (data[s, k, rank * batch : (rank + 1) * batch] for k in (0, 1))
        opt.backward(model(x, y))
        opt.step()
    zk.save_checkpoint(ckpt_out, model, opt)
    saved = opt.state_dict()  # (a collective: every rank calls it)
    if rank == 0:
        torch.save({"loaded": loaded, "saved": saved}, out)
    opt.close()


def _train_rank(rank: int, world: int, args: tuple, kwargs: dict) -> None:
    train(rank, world, *args, **kwargs)


def run(world: int, *args, **kwargs) -> list[dict]:
    """Run `train` on `world` ranks (one process each when world > 1); returns each rank's results."""
    out = args[-1] if len(args) >= 5 else kwargs["out"]
    if world == 1:
        train(0, 1, *args, **kwargs)
    else:
        spawn_ranks(_train_rank, world, os.path.dirname(out) or ".", args, kwargs)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def _failing_entry(rank: int, store_path: str, out: str, timeout_s: float) -> None:
    """Rank 1 raises in its third forward; rank 0 records how it fails (type, message, seconds)."""
    import json
    import time as _time

    init_from_file(store_path, rank, 2)
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
    store_path = os.path.join(out, f"store-{uuid.uuid4().hex}")
    procs = [ctx.Process(target=_failing_entry, args=(r, store_path, out, timeout_s)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=JOIN_TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            raise AssertionError(f"a rank hung past {JOIN_TIMEOUT_S:g} s")
    with open(f"{out}/rank0.json") as f:
        return json.load(f)
