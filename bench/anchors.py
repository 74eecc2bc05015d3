"""The systems a user would pick instead, on the same device, model (zo_kernels.gpt.GPT), batch and dtype (bf16
compute, fp32 masters and Adam state): the "anchors" rows of gpu_check.sh's summary.json.

  torch_fused     no offload: bf16 working model, fp32 masters, torch.optim.AdamW(fused=True), all on the device
  deepspeed       DeepSpeed ZeRO-Offload: ZeRO stage 2, offload_optimizer cpu (its DeepSpeedCPUAdam, built with
                  ninja on first use), bf16; one process, no launcher (env-var rendezvous)
  torchao         torchao.optim.CPUOffloadOptimizer(torch.optim.AdamW, fused=True): fp32 params on the device under
                  autocast(bf16) (its documented use; its CPU copies are the fp32 masters)
  fsdp2           FSDP2 (fully_shard) on one rank with CPUOffloadPolicy and MixedPrecisionPolicy(bf16): the sharded
                  fp32 params, grads and AdamW state in host memory, the step on the CPU
  zo, zo_dpu      ZeroOffloadAdamW(model), synchronous and with the delayed parameter update (steady state)
  zo_dpu_8bit     zo_dpu with state_dtype="8bit" (block-wise 8-bit moments: about half the bytes CPU Adam moves per
                  parameter; an approximation of AdamW, last: the others are the same optimizer)
Each system runs in a fresh process (host memory is its own, a crash or a hang is its row's note): step ms (the mean
of 5 steps run back to back, the device synchronized before and after them only), tokens/s, peak device GiB
(torch.cuda.max_memory_allocated over the steps, model included), host GiB (resident-set growth from before the
model was built to after the last step, the CUDA context excluded). A system that cannot be imported or run gets a
row with the reason.

Usage: python bench/anchors.py OUT.json [--size 95M] [--systems all] [--batch 8] [--context 512]
       [--timeout-s 120] [--device cuda]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

SYSTEMS = ("torch_fused", "zo", "zo_dpu", "deepspeed", "torchao", "fsdp2", "zo_dpu_8bit")
LR = 1e-4
ADAMW = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _rss() -> int:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # count what is held, not what the allocator keeps for reuse
    except OSError:
        pass
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s*(\d+)", f.read()).group(1)) * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step: Callable[[], None], device: torch.device, warmup: int, rounds: int) -> float:
    """Seconds per step: the mean of `rounds` steps run back to back (the device synchronized before the first and
    after the last only, as a training loop runs them: a system's overlap across steps counts, as it would)."""
    for _ in range(warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(rounds):
        step()
    _sync(device)
    return (time.perf_counter() - t0) / rounds


def _rendezvous() -> None:
    """One rank, no launcher: the env-var rendezvous torch.distributed and DeepSpeed read."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")  # fmt: skip


def build(cfg, device: torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
    from zo_kernels.gpt import GPT

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    return model.to(dtype) if dtype is not None else model


# ---------------------------------------------------------------------- one function per system: (step, note)


def sys_torch_fused(cfg, x):
    from step_rows import ReferenceLoop

    loop = ReferenceLoop(build(cfg, x.device))
    return (lambda: loop.step(x)), "bf16 working model, fp32 masters + AdamW(fused=True) state on the device"


def _zo(cfg, x, dpu: bool, state_dtype: str = "fp32"):
    import zo_kernels as zk

    model = build(cfg, x.device)
    opt = zk.ZeroOffloadAdamW(model, **ADAMW, delay_update_after=0 if dpu else None, state_dtype=state_dtype)

    def step():
        opt.backward(model(x[:, :-1], x[:, 1:]))
        opt.step()

    note = "ZeroOffloadAdamW(model), bf16, " + ("delayed parameter update (k=0)" if dpu else "synchronous")
    if state_dtype != "fp32":  # (not AdamW bit for bit: block-wise 8-bit moments, as bitsandbytes' 8-bit Adam)
        note += f", state_dtype={state_dtype!r} (moments in 8 bits: an approximation of AdamW)"
    return step, note


def sys_zo(cfg, x):
    return _zo(cfg, x, dpu=False)


def sys_zo_dpu(cfg, x):
    return _zo(cfg, x, dpu=True)


def sys_zo_dpu_8bit(cfg, x):
    return _zo(cfg, x, dpu=True, state_dtype="8bit")


def sys_deepspeed(cfg, x):
    if x.device.type != "cuda":
        raise Unavailable("DeepSpeed ZeRO-Offload offloads from a CUDA device (tried on its CPU accelerator: "
                          "initialize() did not finish within 10 minutes on a loaded 2-core machine)")  # fmt: skip
    import deepspeed

    _rendezvous()
    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
    model = build(cfg, x.device)
    config = {
        "train_micro_batch_size_per_gpu": x.shape[0],
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "contiguous_gradients": True, "overlap_comm": True},
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }  # fmt: skip
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step():
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()

    return step, f"deepspeed {deepspeed.__version__}: ZeRO-2, offload_optimizer cpu, {type(opt).__name__} over " \
                 f"{type(getattr(opt, 'optimizer', opt)).__name__}, bf16"  # fmt: skip


def sys_torchao(cfg, x):
    if x.device.type != "cuda":
        raise Unavailable("torchao's CPUOffloadOptimizer offloads from a CUDA (or XPU) device only")
    import torchao
    from torchao.optim import CPUOffloadOptimizer

    model = build(cfg, x.device)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, **ADAMW)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, f"torchao {torchao.__version__}: fp32 params on the device under autocast(bf16), fp32 on the host"


def sys_fsdp2(cfg, x):
    if x.device.type != "cuda":
        raise Unavailable("FSDP2's CPUOffloadPolicy offloads from a CUDA device (one rank on the CPU has nothing "
                          "to offload)")  # fmt: skip
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _rendezvous()
    store = dist.FileStore(tempfile.mktemp(prefix="zo-anchor-fsdp2-"), 1)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    model = build(cfg, x.device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=True)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mp_policy=mp, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)  # on the host (the offloaded shards)

    def step():
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    return step, "FSDP2 fully_shard per block + root, CPUOffloadPolicy(pin_memory), bf16 params / fp32 reduce, " \
                 "torch.optim.AdamW on the host"  # fmt: skip


class Unavailable(RuntimeError):
    """This system cannot run here (the message says why)."""


def run_one(system: str, size: str, batch: int, context: int, device: str, rounds: int) -> dict:
    """One system in this process: its row."""
    from step_rows import config

    from zo_kernels.gpt import num_params

    device = torch.device(device)
    cfg = config(size, context)
    row = {"system": system, "size": size, "batch": [batch, context], "device": str(device)}
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context is not the system's host memory
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab, (batch, context + 1), generator=g).to(device)
    base = _rss()
    try:
        step, note = globals()[f"sys_{system}"](cfg, x)
    except Unavailable as e:
        return {**empty_row(system, f"NOT RUN: {e}"), **row}
    except ImportError as e:
        return {**empty_row(system, f"NOT INSTALLED: {e}"), **row}
    ms = _time_steps(step, device, warmup=3, rounds=rounds) * 1e3
    row.update(params=num_params(build(cfg, "meta")), ms=ms, tokens_per_s=batch * context / ms * 1e3,
               peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
               host_gib=(_rss() - base) / 2**30, note=note)  # fmt: skip
    return row


def empty_row(system: str, note: str) -> dict:
    """A row without figures (not run, not installed, failed): issue 17's keys all present."""
    return {"system": system, "params": None, "ms": None, "peak_gib": None, "host_gib": None, "note": note}


try:  # resolved here: between fork and exec the child only calls it (no dlopen there, other threads may hold locks)
    _PRCTL = ctypes.CDLL(None).prctl
except (OSError, AttributeError):
    _PRCTL = None


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies (Linux's PR_SET_PDEATHSIG), so a parent killed outright
    (gpu_check.sh's SIGKILL 5 s after its SIGINT; a session of its own no longer gets that from `timeout`) leaves no
    system running on the GPU."""
    if _PRCTL is not None:
        _PRCTL(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


def run_child(cmd: list[str], env: dict, timeout_s: float) -> tuple[int, str]:
    """(exit status, stderr) of cmd run in a session of its own. On its timeout (subprocess.TimeoutExpired, raised)
    or an interrupt (gpu_check.sh's limit) the whole session is killed: a child's children too, such as the ninja and
    compilers of DeepSpeed's first-use build, which would otherwise run on under the next systems' measurements."""
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, preexec_fn=_die_with_parent) as p:  # fmt: skip
        try:
            _, err = p.communicate(timeout=timeout_s)
        except BaseException:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()
            raise
    return p.returncode, err


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--size", default="95M")
    ap.add_argument("--systems", default="all")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per system, its start and build included")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="start no system past this many seconds")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: run one system here
    a = ap.parse_args(argv)
    if a.one:
        try:
            row = run_one(a.systems, a.size, a.batch, a.context, a.device, a.rounds)
        except BaseException as e:
            tb = traceback.format_exc(limit=3)
            row = {**empty_row(a.systems, f"FAILED: {type(e).__name__}: {e}"[:400]), "traceback": tb[-1500:]}
        with open(a.out, "w") as f:
            json.dump(row, f)
        return 0
    systems = SYSTEMS if a.systems == "all" else tuple(a.systems.split(","))
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"--systems: unknown {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    rows, t0 = [], time.perf_counter()
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])}

    def write() -> None:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)

    try:
        for system in systems:
            left = a.budget_s - (time.perf_counter() - t0)
            if left < 15:
                rows.append(empty_row(system, f"NOT RUN: the {a.budget_s:g} s budget was spent"))
            else:
                with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                    cmd = [sys.executable, os.path.abspath(__file__), tmp.name, "--one", "--systems", system,
                           "--size", a.size, "--batch", str(a.batch), "--context", str(a.context),
                           "--rounds", str(a.rounds), "--device", a.device]  # fmt: skip
                    t1 = time.perf_counter()
                    try:
                        rc, err = run_child(cmd, env, min(a.timeout_s, left))
                        row = json.loads(open(tmp.name).read() or "null") or {}
                        if not row:
                            row = empty_row(system, f"FAILED: exit {rc}: {err.strip()[-400:]}")
                    except subprocess.TimeoutExpired:
                        row = empty_row(system, f"FAILED: did not finish within {min(a.timeout_s, left):.0f} s")
                    row["wall_s"] = round(time.perf_counter() - t1, 1)
                rows.append({**empty_row(system, ""), **row})
            r = rows[-1]
            shown = (f"{r['ms']:9.2f} ms, {r.get('tokens_per_s', 0):9.0f} tok/s, peak "
                     f"{r['peak_gib'] if r['peak_gib'] is None else round(r['peak_gib'], 2)} GiB, host "
                     f"{r['host_gib']:.2f} GiB" if r.get("ms") else "")  # fmt: skip
            print(f"{system:<12} {shown} {r['note']}", flush=True)
            write()
    except KeyboardInterrupt:  # gpu_check.sh's time limit: the systems without a row say so
        done = {r["system"] for r in rows}
        rows += [empty_row(s, "NOT RUN: interrupted (the stage's time limit)") for s in systems if s not in done]
        write()
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
