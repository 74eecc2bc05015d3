"""The largest model this machine trains (issue 23), beside the planner's prediction: the "scale" rows of
gpu_check.sh's summary.json.

Per setting, each in a process of its own (its own peak host memory; one killed for memory leaves the others), in
this order, each given what the budget leaves, each after the first started only with MIN_SHARE_S left for it:
  s2-8bit-sync  ZeroOffloadAdamW(stage=2, state_dtype="8bit") without DPU: one landing buffer, 8.03 B/param on the
                host (the largest model; the step is forward + backward + CPU Adam)
  s2-8bit       ZeroOffloadAdamW(stage=2, state_dtype="8bit")
  s2-fp32       ZeroOffloadAdamW(stage=2), fp32 moments
  s3-cpu        ZeroOffloadAdamW(stage=3, offload_param="cpu"), fp32 moments
every one but s2-8bit-sync with the delayed parameter update (DPU) after DPU_AFTER synchronous steps (as the
ZeRO-Offload paper starts it after a warm-up: from step 2, with Adam's first steps, the loss jumped, 10.50 -> 13.74
for a 1.3B GPT on the CPU; on a 4-layer GPT of width 1280 zo's delayed update went through the plain-PyTorch oracle's
losses to 4 decimals, its jumps included), bf16 parameters, every block checkpointed (torch.utils.checkpoint) and
the LM head + loss computed over chunks of tokens, each checkpointed.
  machine  device memory (torch.cuda.mem_get_info; on the CPU: host memory), host memory (/proc/meminfo
           MemAvailable, or what this process's memory cgroup still allows where that is less), disk (free space of
           the temporary directory), the bf16 matmul rate (measured here) and the datasheet's (SPEC_TFLOPS)
  tokens   --tokens, or: CPU Adam's seconds per parameter in the setting's format (measured on a 2^28-element slice
           on a GPU machine), scaled to the model; tokens per step such that forward + backward (8 x params x tokens
           at half the matmul rate) take 1.25x that, so that under DPU forward + backward cover CPU Adam (without
           DPU 3x, raised to 4x or 5x where the device has room: the update adds to the step there)
  plan     the largest GPT (width a multiple of 128, layers = width / 128, then layers added while it fits) whose
           planner row fits: zo_kernels.planner.plan(gpu_mem = device memory, host_mem = MemAvailable less
           --host-reserve-gib, k = state_k(format), dpu=(the setting's), activations = activation_bytes(shape, tokens),
           layer_params = one block (stage 3 keeps a checkpointed block's units gathered until its backward ends),
           prefetch_params = the next block's first LayerNorm), at most --max-params
  build    the model on the meta device, ZeroOffloadAdamW(model, init=ParamInit(fn, device)): one parameter's fp32
           values at a time, never a full fp32 copy
  train    --steps steps (DPU settings at least DPU_AFTER + 3) on synthetic tokens (skewed to small ids, so the loss
           can fall); each step synchronized; --lr (default_lr: min(3e-4, 0.075 / width)), reached by a linear
           warm-up over the steps (--warmup-steps); the child processes use
           PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless it is set
  measure  step time (median of the steps after the first two; DPU: of the delayed steps after the first; timed_steps,
           and step_note where none has finished yet), tokens/s, model TFLOPS = 6 x params x tokens / step
           time and its fraction of the measured matmul rate (mfu) and of the datasheet's peak (mfu_peak), step()'s
           wait for the background update (DPU: dpu_wait_s; adam_hidden when it is under 5% of the step) and the
           update's own time (cpu_update_s, cpu_update_ns_per_param beside the slice's adam_ns_per_param), peak device
           memory (torch.cuda.max_memory_allocated since the build began), the optimizer's own device buffers
           (device_states_gib: its DeviceBytes peak) and the rest (activations_gib), peak host memory (VmHWM less
           the RSS before the build, after a warm-up of the setting on a tiny GPT), first and last loss, and the loss
           on one fixed held-out batch (HELD_OUT_TOKENS, or the step's tokens where fewer) before the first step and
           after each (held_out_losses, held_out_falls; outside the timed step): a batch's own noise cannot move it,
           so it says whether an update helped (under DPU: the parameters step() left, one update behind); around
           each synchronous step, bench/update_probe.py's windows of every parameter's master (update_probe: the
           largest move over lr against exact Adam's bound at that step, the windows beyond it, and whether the
           device's parameters are the masters' cast), outside the timed step
  compare  planner_params (the planner's max params for this shape), planner_peak_gib (its GPU total less the
           workspace; on the CPU the device is host memory: None), planner_device_states_gib (its states, gathered
           units and buckets), planner_host_gib (its host bytes; on the CPU plus that GPU total, which lives in host
           memory there); `mismatch` lists each figure more than 10% off (bytes: and more than 8 MiB).

Usage: python bench/scale_check.py OUT.json [--settings s2-8bit-sync,s2-8bit,s2-fp32,s3-cpu] [--device cuda]
       [--budget-s 420]
       [--max-params 1e12] [--steps 5] [--context 2048] [--vocab 32000] [--tokens N] [--host-reserve-gib 10]
       [--lr LR] [--warmup-steps N] [--shape WIDTHxLAYERS] [--head-width 768]
Writes OUT.json (a list of rows) after every setting (a run cut short keeps what finished); prints progress lines.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from summary import describe_probes
from torch.utils.checkpoint import checkpoint
from update_probe import UpdateProbe

import zo_kernels as zk
from zo_kernels.gpt import GPT, GPTConfig
from zo_kernels.planner import default_bucket_bytes, plan, state_k

SETTINGS = {  # in the order they run: the headline (the largest model) first
    "s2-8bit-sync": dict(stage=2, state_dtype="8bit"),  # no DPU: one landing buffer, 8.03 B/param on the host
    "s2-8bit": dict(stage=2, state_dtype="8bit"),
    "s2-fp32": dict(stage=2, state_dtype=torch.float32),
    "s3-cpu": dict(stage=3, offload_param="cpu", state_dtype=torch.float32),
}
FORMAT = {"s2-8bit-sync": "8bit", "s2-fp32": "fp32", "s2-8bit": "8bit", "s3-cpu": "fp32"}
STRATEGY = {"s2-8bit-sync": "ZeRO-2 + offload", "s2-fp32": "ZeRO-2 + offload", "s2-8bit": "ZeRO-2 + offload",
            "s3-cpu": "ZeRO-3 + offload"}  # fmt: skip
DPU = {"s2-8bit-sync": False, "s2-fp32": True, "s2-8bit": True, "s3-cpu": True}  # DPU's second landing buffer: 2 B
DPU_AFTER = 3  # synchronous steps before the delayed update starts; a DPU setting trains at least DPU_AFTER + 3 steps
MISMATCH = 0.10  # a planner figure more than 10% off the measured one is flagged (issue 23)
# ... unless it is a byte figure off by less than this: the peak RSS of identical CPU runs of a 4M-param GPT read 41.4
# to 45.0 MiB (its runtime's libraries, arenas and stacks), 12% apart, where no GB-scale row is near the floor
MISMATCH_FLOOR_GIB = 8 / 1024
HELD_OUT_TOKENS = 8192  # the held-out batch: ~1/4 of a 15B model's training forward at 32768 tokens per step
LOSS_CHUNK = 4096  # tokens per checkpointed LM-head + loss chunk: its fp32 logits stay ~14 x 4096 x vocab bytes
WORKSPACE = 2**30  # the planner's per-GPU workspace (cuBLAS, the allocator's slack): left out of the comparison
GIB = 2**30
MIN_SHARE_S = {"cuda": 150, "cpu": 30}  # a setting after the first is started only with this many seconds left for
# it (on a GPU machine a 12-15B build, the warm-up and its five or six steps take 3-5 minutes: one started with less
# would be killed mid-build); the first, the headline, always runs
SPEC_TFLOPS = (("H200 NVL", 835.0), ("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4),
               ("GH200", 989.4),
               ("A100", 312.0), ("L40S", 362.1))  # dense bf16 tensor-core peaks, datasheet figures, by device name


T0 = time.perf_counter()


def say(tag: str, text: str) -> None:
    """One progress line: the setting and the seconds since start."""
    print(f"[scale {tag} {time.perf_counter() - T0:.0f}s] {text}", flush=True)


# ---------------------------------------------------------------------- the machine


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            parts = value.split()
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat",
                 "inactive_file"),  # v2
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                 "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"))  # v1


def cgroup_available(files: tuple[tuple[str, str, str, str], ...] = CGROUP_FILES) -> int | None:
    """Bytes this process's memory cgroup still allows (its limit less its usage, the inactive page cache not
    counted as used, as MemAvailable does not; v2, else v1), or None when there is no limit: /proc/meminfo shows the
    whole node, which a container's limit may be far below."""
    for limit_path, usage_path, stat_path, inactive_key in files:
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # unlimited (v1 says so with a huge number)
            return None
        inactive = 0
        try:
            with open(stat_path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == inactive_key:
                        inactive = int(value)
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - usage + min(inactive, usage))
    return None


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


class HostPeak:
    """This process's peak resident memory since start(): the kernel's VmHWM, reset through /proc/self/clear_refs
    where allowed, else the largest VmRSS a sampling thread saw (every 5 ms)."""

    def __init__(self) -> None:
        self.base = _status_bytes("VmRSS")
        self.sampled = self.base
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.sampled = max(self.sampled, _status_bytes("VmRSS"))

    def peak_growth(self) -> int:
        """Peak RSS since start() less the RSS at start()."""
        peak = _status_bytes("VmHWM") if self.hwm else max(self.sampled, _status_bytes("VmRSS"))
        return peak - self.base

    def stop(self) -> None:
        self._stop.set()


def fixed_mmap_threshold(nbytes: int = 1 << 16) -> None:
    """glibc's dynamic mmap threshold keeps freed blocks of up to 32 MiB resident, which the peak RSS would count as
    the model's: a fixed threshold returns every block above it to the system when freed (mallopt; glibc only)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def machine(device: torch.device) -> dict:
    """Device memory, host memory, disk of this machine, in bytes."""
    mem = meminfo()
    cgroup = cgroup_available()
    available = mem["MemAvailable"] if cgroup is None else min(mem["MemAvailable"], cgroup)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
    else:
        free = total = available
        name = "CPU"
    return {"device": name, "device_total": total, "device_free": free, "host_total": mem["MemTotal"],
            "host_available": available, "meminfo_available": mem["MemAvailable"], "cgroup_available": cgroup,
            "disk_free": shutil.disk_usage(tempfile.gettempdir()).free, "cores": os.cpu_count()}  # fmt: skip


def spec_tflops(name: str) -> float | None:
    """The device's dense bf16 peak from its datasheet (SPEC_TFLOPS), or None for a device not listed."""
    return next((t for key, t in SPEC_TFLOPS if key in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, n: int) -> float:
    """The measured bf16 matmul rate (n x n x n, best of a few), TFLOP/s."""
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    best = math.inf
    for i in range(6):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        _sync(device)
        if i:  # the first is warm-up
            best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * n**3 / best / 1e12


def adam_seconds_per_param(fmt: str, n: int) -> float:
    """Seconds per parameter of ZeroOffloadAdamW's CPU update (kernel + writeback) in format `fmt`, measured on one
    n-element parameter on the CPU (the host is the same whatever the device)."""
    p = torch.nn.Parameter(torch.zeros(n))
    state = torch.float32 if fmt == "fp32" else fmt
    opt = zk.ZeroOffloadAdamW([p], lr=1e-4, dtype=torch.bfloat16, state_dtype=state, delay_update_after=None)
    try:
        times = []
        for _ in range(3):
            p.float().sum().backward()
            opt.step()
            times.append(opt.stats.get("time_cpu_update") or opt.stats.get("time_kernel") or opt.stats["time_step"])
        return min(times[1:]) / n
    finally:
        opt.close()


# ---------------------------------------------------------------------- the model and its plan


def gpt_params(c: GPTConfig) -> int:
    """Parameters of zo_kernels.gpt.GPT(c): embeddings, blocks (LayerNorms, qkv, proj, fc, out with biases), the
    final LayerNorm and the untied head."""
    h = c.width
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    return c.vocab * h + c.context * h + c.layers * block + 2 * h + c.vocab * h


def gathered_layer(c: GPTConfig) -> int:
    """Stage 3's largest set of parameters gathered at once: a checkpointed block keeps every unit (module) it
    recomputed until their gradients arrive, so one block, or the final LayerNorm and the head (kept across the
    loss chunks), or the token embedding."""
    h = c.width
    return max(12 * h * h + 13 * h, c.vocab * h + 2 * h, c.vocab * h)


def prefetched_unit(c: GPTConfig) -> int:
    """The unit gathered ahead of that layer (prefetch = 1, in the recorded order): the next block's first
    LayerNorm."""
    return 2 * c.width


BLOCK_TH = {"cpu": 30, "cuda": 34}  # bytes per token x width of one block recomputed with its gradients (bf16):
# measured with device = CPU (GPT widths 256-512, 4096-8192 tokens, peak RSS of forward + backward less the other
# terms) 22-28; Korthikanti et al. 2022 count 34 saved per block with dropout masks, ~32 without. On the H200
# (2026-11-27, five rows: 1.9-15.3B params, widths 2560-5376, 8192-32768 tokens) activation_bytes with 34 read
# 1.00-1.04 of the measured activations_gib; the earlier estimate, 40 and the loss chunk's logits added to the block
# rather than the larger of the two, read 1.13-1.48 (the planner's peak 16-19% over at 1.9-2.6B, flagged)


def bucket_bytes(c: GPTConfig) -> int:
    """The optimizer's two bf16 gradient buckets on a GPU: its default bucket for the model, or the largest
    parameter where that is larger (the embedding or the head, vocab x width; a bucket of its own)."""
    return default_bucket_bytes(gpt_params(c), max(c.vocab * c.width, 4 * c.width * c.width))


def activation_bytes(c: GPTConfig, tokens: int, cuda: bool = False) -> int:
    """Device bytes of activations at the peak of backward, every block checkpointed, the head in LOSS_CHUNK chunks
    (bf16): each block's input kept (2 L T h), the residual stream and its gradients (8 T h), autograd's bf16
    gradients of one bucket before it is packed (2 min(params, bucket)), and the larger of what backward recomputes
    at a time: one chunk's logits in bf16 and fp32 with their gradient (14 chunk V; the head's backward, first) or
    one block with its gradients (BLOCK_TH T h; no attention matrix with SDPA; the blocks', after it)."""
    h, t = c.width, tokens
    chunk = min(LOSS_CHUNK, t)
    grads = 2 * min(gpt_params(c), zk.offload.default_bucket_numel(gpt_params(c)))  # (the head's own bucket, its
    # gradient alone, is not at the peak: with it the estimate read 1.055 of the H200's 12B row)
    recomputed = max(BLOCK_TH["cuda" if cuda else "cpu"] * t * h, 14 * chunk * c.vocab)
    return 2 * c.layers * t * h + 8 * t * h + grads + recomputed


def config_for(width: int, layers: int, args: argparse.Namespace) -> GPTConfig:
    """A GPT of this width and depth, heads of 128 (32 below width 1024, or where 128 does not divide the width: the
    CPU's search steps by 32), --vocab and --context."""
    head_dim = 128 if width >= 1024 and width % 128 == 0 else 32
    return GPTConfig(vocab=args.vocab, context=args.context, layers=layers, width=width,
                     heads=max(1, width // head_dim))  # fmt: skip


def parse_shape(text: str) -> tuple[int, int]:
    """--shape WIDTHxLAYERS: (width, layers); width a multiple of 32 (the heads' size below 1024), layers >= 1."""
    try:
        width, layers = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--shape: WIDTHxLAYERS, e.g. 5376x2, got {text!r}") from None
    if width < 32 or width % 32 or layers < 1:
        raise ValueError(f"--shape: width a multiple of 32 and at least 1 layer, got {text!r}")
    return width, layers


def plan_for(c: GPTConfig, setting: str, tokens: int, mach: dict, args: argparse.Namespace) -> tuple[bool, dict]:
    """Whether the planner says shape `c` fits this machine for `setting`, and its figures for it."""
    cuda = args.device.startswith("cuda")
    params = gpt_params(c)
    acts = activation_bytes(c, tokens, cuda)
    host = max(0.0, mach["host_available"] - args.host_reserve_gib * GIB)
    p = plan(params, gpus=1, gpu_mem=mach["device_total"], host_mem=host, k=state_k(FORMAT[setting]),
             activations=acts, workspace=WORKSPACE if cuda else 0, reserve=0.05 if cuda else 0.0,
             bucket_bytes=bucket_bytes(c) if cuda else 0, layer_params=gathered_layer(c), prefetch=1,
             prefetch_params=prefetched_unit(c),
             nvme=mach["disk_free"], dpu=DPU[setting])  # fmt: skip
    row = p.row(STRATEGY[setting])
    device_bytes = row.gpu_total - (WORKSPACE if cuda else 0)
    # the optimizer's own device buffers (its DeviceBytes counter): the states, stage 3's gathered units in flight
    # (the working set less the layer's gradient, which is autograd's), the buckets
    gathered = row.working_set - 2 * p.layer if row.working_set else 0.0
    states = row.gpu_states + gathered + p.bucket_bytes  # (two bf16 buckets on a GPU: bucket_bytes)
    figures = {"planner_params": row.max_params, "planner_strategy": row.strategy,
               "planner_activations_gib": acts / GIB,
               "planner_peak_gib": device_bytes / GIB if cuda else None, "planner_device_states_gib": states / GIB,
               "planner_host_gib": (row.host if cuda else row.host + device_bytes) / GIB}  # fmt: skip
    return row.fits and params <= args.max_params, figures


def choose_model(setting: str, mach: dict, adam_s_per_param: float, tflops: float,
                 args: argparse.Namespace) -> tuple[GPTConfig, int, dict]:  # fmt: skip
    """The largest GPT the planner fits (and its tokens per step and the planner's figures)."""
    step = 128 if args.device.startswith("cuda") else 32

    def tokens_for(c: GPTConfig, cover: float = 1.25 if DPU[setting] else 3.0) -> int:
        if args.tokens:
            return args.tokens
        n = gpt_params(c)
        # forward + backward with every block recomputed: 8 x params x tokens flops at half the matmul rate, `cover`
        # times CPU Adam's time (sync: the update adds to the step, so more tokens dilute it)
        want = cover * adam_s_per_param * n * 0.5 * tflops * 1e12 / (8 * n)
        return max(1, math.ceil(want / args.context)) * args.context

    def fits(c: GPTConfig) -> bool:
        return plan_for(c, setting, tokens_for(c), mach, args)[0]

    if getattr(args, "shape", None):  # --shape: this GPT, whatever the planner says (its figures kept beside it)
        c = config_for(*parse_shape(args.shape), args)
        return c, tokens_for(c), plan_for(c, setting, tokens_for(c), mach, args)[1]
    best = None
    width = step
    while True:
        c = config_for(width, max(2, round(width / 128)), args)
        if not fits(c):
            break
        best, width = c, width + step
    if best is None:
        raise RuntimeError(f"the planner fits no GPT of width {step} on this machine for {setting}")
    while fits(config_for(best.width, best.layers + 1, args)):
        best = config_for(best.width, best.layers + 1, args)
    tokens = tokens_for(best)
    if not DPU[setting] and not args.tokens:
        # sync: the step is forward + backward + CPU Adam, so its MFU is u x 6/8 x cover / (cover + 1) at matmul
        # utilisation u (0.28 at cover 3, u = 0.5; 0.31 at 5): where the device has room (the host bounds this
        # model) and the steps still take at most 60% of the setting's budget (a step is ~(cover + 1) x CPU Adam:
        # ~30 s at 13B and cover 5), more tokens per step, up to cover 5
        adam_s = adam_s_per_param * gpt_params(best)
        steps, budget = getattr(args, "steps", 5), getattr(args, "budget_s", math.inf)
        for cover in (5.0, 4.0):
            if steps * (cover + 1) * adam_s <= 0.6 * budget and plan_for(best, setting, tokens_for(best, cover), mach,
                                                                       args)[0]:  # fmt: skip
                tokens = tokens_for(best, cover)
                break
    return best, tokens, plan_for(best, setting, tokens, mach, args)[1]


HEAD_WIDTH = 768  # GPT-2 small's width: past it the LM head's initial std shrinks as 1 / sqrt(width) (init_fn)


def init_fn(name: str, out: torch.Tensor, gen: torch.Generator, head_width: int = HEAD_WIDTH) -> None:
    """GPT-2's initialization: weights N(0, 0.02), biases 0, LayerNorm weights 1; but the LM head's std is
    0.02 x sqrt(head_width / width) past head_width (768; 0: GPT-2's 0.02 at any width, --head-width), so its initial
    logits keep GPT-2 small's scale (std ~0.55) at any width.
    At 0.02 they grow as sqrt(width): std 1.47 at width 5376, the 15B model's first loss 11.46 against ln 32000 =
    10.37, and Adam's first, sign-like steps overshot: on an H200 the 15.3B and 12.0B rows jumped to 17.90 and 13.28
    at step 2 and came back at step 3. The same on the CPU with torch's AdamW, no zo (12 x 768 GPT, the head scaled
    x 2.65 to that logit scale, lr 0.075 / width with the warm-up, held-out loss after each step): 11.50 -> 11.20 ->
    13.62 -> 11.20; GPT-2's head: 10.55 -> 10.43 -> 10.29 -> 10.23."""
    if out.dim() >= 2:
        wide = name == "head.weight" and 0 < head_width < out.shape[-1]
        out.normal_(0.0, 0.02 * (head_width / out.shape[-1]) ** 0.5 if wide else 0.02, generator=gen)
    elif name.endswith("weight"):
        out.fill_(1.0)


def default_lr(c: GPTConfig) -> float:
    """min(3e-4, 0.075 / width): 3e-5 at width 2500, 1.5e-5 at width 5120 (Adam moves every weight of a matrix by
    about lr, so its outputs by about lr x width), reached by a linear warm-up over the run's steps. On the CPU (one
    run each, 512 tokens a step, 5 steps with the warm-up unless said) a 1.6B GPT of width 2464-2496: 1e-4 without
    warm-up 10.76 -> 11.55 in three steps; 1e-4 10.76 -> 10.49 with a bump; 9.2e-5 10.91 -> 10.87 (up 0.57 at step
    4); 3e-5 10.91 -> 10.57, every step lower. Not zo's doing: on a 4-layer GPT of width 1280 at 3e-4, torch's fp32
    AdamW and zo's bf16 step stayed within 0.031 of each other, bumps at the same steps (8 steps, 4096 tokens each)."""
    return min(3e-4, 0.075 / c.width)


def head_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of one chunk of tokens: final LayerNorm, head, fp32 logits."""
    return F.cross_entropy(model.head(model.ln(x)).float(), y, reduction="sum")


def loss_of(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT's forward with every block checkpointed and the head + loss over checkpointed chunks: the mean loss."""
    x = model.tok(idx) + model.pos(torch.arange(idx.shape[1], device=idx.device))
    for block in model.blocks:
        x = checkpoint(block, x, use_reentrant=False)
    x, targets = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    total = None
    for lo in range(0, x.shape[0], LOSS_CHUNK):
        part = checkpoint(head_loss, model, x[lo : lo + LOSS_CHUNK], targets[lo : lo + LOSS_CHUNK], use_reentrant=False)
        total = part if total is None else total + part
    return total / x.shape[0]


def held_out_loss(model: GPT, batch: tuple) -> float:
    """The loss on a fixed batch, without gradients (the parameters as they are now)."""
    with torch.no_grad():
        return loss_of(model, *batch).item()


def tokens_batch(c: GPTConfig, tokens: int, gen: torch.Generator, device: torch.device) -> tuple:
    """Synthetic tokens skewed to small ids (id = vocab * u^3): a distribution the model can learn in a few steps."""
    u = torch.rand(tokens // c.context, c.context + 1, generator=gen)
    ids = (u**3 * c.vocab).long().clamp_(max=c.vocab - 1).to(device)
    return ids[:, :-1], ids[:, 1:]


# ---------------------------------------------------------------------- one setting (a process of its own)


def run_setting(setting: str, args: argparse.Namespace, out_path: str) -> None:
    """Plan, build, train and measure one setting; its row written to out_path after each phase."""
    device = torch.device(args.device)
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    row: dict = {"setting": setting, "device": None}

    def write() -> None:  # whole or not at all: a child killed mid-write keeps the row written before
        with open(out_path + ".tmp", "w") as f:
            json.dump(row, f, indent=1)
        os.replace(out_path + ".tmp", out_path)

    mach = machine(device)
    row["device"] = mach["device"]
    row["machine"] = {k: v for k, v in mach.items() if k != "device"}
    tflops = matmul_tflops(device, 8192 if device.type == "cuda" else 256)
    # CPU Adam's rate on a slice far past the caches: 2^28 elements on a GPU machine (the H200's 1.3B rows took 2.5-3x
    # the rate a 2^25 slice suggests), 2^18 on the CPU test
    adam = adam_seconds_per_param(FORMAT[setting], 1 << 28 if device.type == "cuda" else 1 << 18)
    row.update(matmul_tflops=tflops, spec_tflops=spec_tflops(mach["device"]), adam_ns_per_param=adam * 1e9)
    say(setting, f"{mach['device']}: device {mach['device_total'] / GIB:.1f} GiB, host available "
                 f"{mach['host_available'] / GIB:.1f} GiB of {mach['host_total'] / GIB:.1f}, disk "
                 f"{mach['disk_free'] / GIB:.0f} GiB free; bf16 matmul {tflops:.1f} TFLOP/s; CPU Adam "
                 f"{adam * 1e9:.2f} ns/param")  # fmt: skip
    c, tokens, figures = choose_model(setting, mach, adam, tflops, args)
    params = gpt_params(c)
    row.update(params=params, max_params=args.max_params, shape=getattr(args, "shape", None), layers=c.layers,
               width=c.width, heads=c.heads, vocab=c.vocab, context=c.context, tokens_per_step=tokens,
               adam_s_est=adam * params, head_width=getattr(args, "head_width", HEAD_WIDTH), **figures)  # fmt: skip
    write()
    say(setting, f"planner: largest GPT {params / 1e9:.3f}B params ({c.layers} layers x {c.width}), planner max "
                 f"{figures['planner_params'] / 1e9:.3f}B; {tokens} tokens/step; predicted host "
                 f"{figures['planner_host_gib']:.2f} GiB, device {figures['planner_peak_gib'] or 0:.2f} GiB"
                 )  # fmt: skip

    try:
        measure_setting(setting, args, device, c, tokens, mach, tflops, row, write, deadline)
    except BaseException as e:  # the row says what failed (the parent adds how the process ended)
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        write()
        raise


def measure_setting(setting: str, args: argparse.Namespace, device: torch.device, c: GPTConfig, tokens: int,
                    mach: dict, tflops: float, row: dict, write: Callable[[], None],
                    deadline: float) -> None:  # fmt: skip
    """Build the model of shape c on the meta device, train it, measure: into `row`, written after every step."""
    params = gpt_params(c)
    warm_up(setting, device, args)
    gc_collect(device)
    fixed_mmap_threshold()
    host = HostPeak()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(c)
    lr = args.lr or default_lr(c)
    steps = max(args.steps, DPU_AFTER + 3) if DPU[setting] else args.steps  # (two steady delayed steps at least)
    # the steps timed: after the synchronous one(s) and, under DPU, the first delayed one (which waits for nothing)
    first_timed = DPU_AFTER + 1 if DPU[setting] else min(2, steps - 1)
    warmup = steps if args.warmup_steps is None else args.warmup_steps
    row["lr"], row["warmup_steps"] = lr, warmup
    if DPU[setting]:
        row["dpu_after_steps"] = DPU_AFTER
    fill = functools.partial(init_fn, head_width=getattr(args, "head_width", HEAD_WIDTH))
    opt = zk.ZeroOffloadAdamW(model, lr=lr, weight_decay=0.0, dtype=torch.bfloat16,
                              delay_update_after=DPU_AFTER if DPU[setting] else None,
                              init=zk.ParamInit(fill, device=device, seed=0), **SETTINGS[setting])  # fmt: skip
    _sync(device)
    row["build_s"] = time.perf_counter() - t0
    say(setting, f"built in {row['build_s']:.1f}s; host +{host.peak_growth() / GIB:.2f} GiB so far")
    gen = torch.Generator().manual_seed(1)
    losses, times, waits, updates = [], [], [], []  # (waits, updates: step()'s wait for the DPU update, its time)
    probe, probes = UpdateProbe(opt, model), []  # (the synchronous steps: how far they moved the masters)
    held_batch = tokens_batch(c, min(tokens, HELD_OUT_TOKENS), torch.Generator().manual_seed(2), device)
    held = [held_out_loss(model, held_batch)]
    row["held_out_tokens"] = held_batch[0].numel()
    report = opt.memory_report()
    measured = dict(host_buffers_gib=report.host_bytes / GIB, device_buffers_gib=report.device_bytes / GIB)

    def record() -> None:  # the row as of now, written: a run killed later keeps it
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        timed = times[first_timed:]
        row["timed_steps"] = len(timed)
        if timed:
            row.pop("step_note", None)
        else:  # (a row written before a steady step finished, kept if the run is killed: flagged, never silent)
            timed = times
            row["step_note"] = "no steady step finished yet: step_s is the median of every step so far"
        step_s = statistics.median(timed)
        model_tflops = 6 * params * tokens / step_s / 1e12
        row.update(device_states_gib=opt.device_bytes.peak / GIB)
        if peak is not None:  # the rest of the device's peak: activations, autograd's gradients, temporaries
            row["activations_gib"] = (peak - opt.device_bytes.peak) / GIB
        spec = row.get("spec_tflops")
        row.update(steps=len(times), step_times_s=times, losses=losses, peak_gib=None if peak is None else peak / GIB,
                   host_gib=host.peak_growth() / GIB, step_s=step_s, tokens_per_s=tokens / step_s,
                   tflops=model_tflops, mfu=model_tflops / tflops, mfu_peak=model_tflops / spec if spec else None,
                   loss_first=losses[0], loss_last=losses[-1], loss_falls=losses[-1] < losses[0],
                   held_out_losses=held, held_out_falls=held[-1] < held[0],
                   **measured)  # fmt: skip
        median = statistics.median
        if updates:  # the update's own rate in the run, beside the slice's that sized the tokens
            row.update(cpu_update_s=median(updates), cpu_update_ns_per_param=median(updates) / params * 1e9)
        if waits:  # DPU hides CPU Adam when step() hardly waits for the background update
            row.update(dpu_wait_s=median(waits), adam_hidden=median(waits) < 0.05 * step_s)
        if row["host_gib"] < 0.9 * row["host_buffers_gib"]:
            row["host_note"] = ("the peak RSS is below the optimizer's own host buffers: this system does not count "
                                "(all of) its pinned memory in the RSS; compare host_buffers_gib")  # fmt: skip
        row["mismatch"] = mismatches(row)
        write()

    try:
        for i in range(steps):
            if i >= min(steps, max(5, first_timed + 2)) and time.perf_counter() + times[-1] > deadline:
                row["cut_short"] = f"the {args.budget_s:.0f}s budget ended after {i} steps"
                break
            step_lr = lr * min(1.0, (i + 1) / max(1, warmup))  # linear warm-up: Adam's first steps move every
            for g in opt.param_groups:  # parameter by about lr
                g["lr"] = step_lr
            row.setdefault("lr_per_step", []).append(step_lr)
            synchronous = not (DPU[setting] and i >= DPU_AFTER)
            if synchronous:
                probe.before()
            _sync(device)
            t0 = time.perf_counter()
            retry = False
            try:
                losses.append(train_step(model, opt, c, tokens, gen, device))
            except torch.OutOfMemoryError:
                if i or tokens <= c.context:
                    raise
                retry = True
            if retry:
                # the activations outgrew their estimate: the first step retries with half the tokens (what the
                # planner's figures are then for is recomputed), once the optimizer has dropped the gradients. Out of
                # the except block: its traceback holds the failed step's frames (the graph, its activations)
                opt.zero_grad()
                gc_collect(device)
                tokens = max(c.context, tokens // 2 // c.context * c.context)
                row.update(tokens_per_step=tokens, tokens_halved=row.get("tokens_halved", 0) + 1,
                           **plan_for(c, setting, tokens, mach, args)[1])  # fmt: skip
                say(setting, f"out of device memory in step 1: retrying with {tokens} tokens per step")
                losses.append(train_step(model, opt, c, tokens, gen, device))
            _sync(device)
            times.append(time.perf_counter() - t0)
            if i >= first_timed:
                if DPU[setting]:  # (without DPU nothing is waited for: the update is the step's own)
                    waits.append(opt.stats.get("time_dpu_wait", 0.0))
                if opt.stats.get("time_cpu_update") is not None:
                    updates.append(opt.stats["time_cpu_update"])
            wait = f", waited {opt.stats.get('time_dpu_wait', 0.0):.2f}s for the DPU update" if not synchronous else ""
            moved = ""
            if synchronous:
                group = opt.param_groups[0]
                probes.append(probe.after(step=i + 1, lr=step_lr, betas=group["betas"],
                                          weight_decay=group["weight_decay"],
                                          device_params=SETTINGS[setting].get("stage") != 3))  # fmt: skip
                row["update_probe"] = probes
                moved = ", " + describe_probes(probes[-1:])
            held.append(held_out_loss(model, held_batch))
            say(setting, f"step {i + 1}: loss {losses[-1]:.4f} (held-out {held[-1]:.4f}), {times[-1]:.2f}s{wait}"
                         f"{moved}")
            record()
        opt.synchronize()
        _sync(device)
        record()
    finally:
        host.stop()
        opt.close()


def train_step(model: GPT, opt: zk.ZeroOffloadAdamW, c: GPTConfig, tokens: int, gen: torch.Generator,
               device: torch.device) -> float:  # fmt: skip
    """One training step; its loss."""
    x, y = tokens_batch(c, tokens, gen, device)
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    return loss.item()


def warm_up(setting: str, device: torch.device, args: argparse.Namespace) -> None:
    """Three steps of a tiny GPT in the setting, before the host baseline: the runtime's one-time host memory
    (thread pools and their malloc arenas, CUDA's and the kernels' first-use state) is then not counted as the
    model's."""
    c = config_for(64, 2, args)
    with torch.device("meta"):
        model = GPT(c)
    opt = zk.ZeroOffloadAdamW(model, lr=args.lr or 3e-4, dtype=torch.bfloat16,
                              delay_update_after=1 if DPU[setting] else None,
                              init=zk.ParamInit(init_fn, device=device), **SETTINGS[setting])  # fmt: skip
    try:
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            train_step(model, opt, c, c.context, gen, device)
    finally:
        opt.close()


def gc_collect(device: torch.device) -> None:
    """Free what is unreachable, and the device allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def mismatches(row: dict) -> list[str]:
    """Each planner figure more than MISMATCH off the measured one: params (the planner's max against the params
    built), device and host bytes (these only when also more than MISMATCH_FLOOR_GIB off)."""
    out = []
    # --max-params or --shape chose the size, not the planner
    capped = row.get("planner_params", 0) > row.get("max_params", math.inf) or bool(row.get("shape"))
    pairs = (("params", None if capped else row.get("planner_params"), row.get("params")),
             ("peak_gib", row.get("planner_peak_gib"), row.get("peak_gib")),
             ("device_states_gib", row.get("planner_device_states_gib"), row.get("device_states_gib")),
             ("host_gib", row.get("planner_host_gib"), row.get("host_gib")))  # fmt: skip
    for name, predicted, measured in pairs:
        if predicted is None or measured is None or not measured:
            continue
        off = predicted / measured - 1
        if abs(off) > MISMATCH and (name == "params" or abs(predicted - measured) > MISMATCH_FLOOR_GIB):
            out.append(f"{name}: planner {predicted:.4g}, measured {measured:.4g} ({off:+.0%})")
    return out


def summary_line(row: dict) -> str:
    """One row as a line: the figures beside the planner's, the mismatches, the error."""
    error = f"; ERROR {row['error']}" if row.get("error") else ""
    if "step_s" not in row:
        return f"{row['setting']}: no step finished{error}"
    peak = f"{row['peak_gib']:.1f}" if row.get("peak_gib") is not None else "-"
    planned = f"{row['planner_peak_gib']:.1f}" if row.get("planner_peak_gib") is not None else "-"
    return (f"{row['setting']}: {row['params'] / 1e9:.3f}B params (planner max {row['planner_params'] / 1e9:.3f}B), "
            f"{row['step_s']:.2f} s/step, {row['tokens_per_s']:.0f} tokens/s, {row['tflops']:.1f} TFLOPS = "
            f"{row['mfu']:.0%} of bf16 matmul; device peak {peak} GiB (planner {planned}), host {row['host_gib']:.2f}"
            f" GiB (planner {row['planner_host_gib']:.2f}); loss {row['loss_first']:.3f} -> {row['loss_last']:.3f}"
            + (f" (held-out {row['held_out_losses'][0]:.3f} -> {row['held_out_losses'][-1]:.3f})"
               if row.get("held_out_losses") else "")
            + f"; mismatch: {'; '.join(row['mismatch']) or 'none'}{error}")  # fmt: skip


# ---------------------------------------------------------------------- the parent


def child_command(args: argparse.Namespace, setting: str, part: str, budget_s: float) -> list[str]:
    """The command line of one setting's process: this run's options, its own budget and output."""
    cmd = [sys.executable, os.path.abspath(__file__), part, "--child", setting, "--device", args.device,
           "--budget-s", f"{budget_s:.0f}", "--max-params", str(args.max_params), "--steps", str(args.steps),
           "--context", str(args.context), "--vocab", str(args.vocab), "--tokens", str(args.tokens),
           "--lr", str(args.lr), "--host-reserve-gib", str(args.host_reserve_gib),
           "--head-width", str(args.head_width)]  # fmt: skip
    if args.shape is not None:
        cmd += ["--shape", args.shape]
    if args.warmup_steps is not None:
        cmd += ["--warmup-steps", str(args.warmup_steps)]
    return cmd


def main(argv: list[str]) -> int:
    """Run the settings (each in its own process unless --in-process); 0 when every one trained."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--max-params", type=float, default=1e13)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=0, help="tokens per step (default: enough to cover CPU Adam)")
    ap.add_argument("--lr", type=float, default=0.0, help="learning rate (default: default_lr, by the width)")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help="steps of linear warm-up to --lr (default: all of them, step k at k/steps of it)")
    ap.add_argument("--host-reserve-gib", type=float, default=10.0)
    ap.add_argument("--shape", default=None, help="WIDTHxLAYERS: train this GPT instead of the largest that fits "
                    "(a narrow proxy of a large row; the planner's figures are still given beside it)")
    ap.add_argument("--head-width", type=int, default=HEAD_WIDTH, help="the width past which the LM head's initial "
                    "std shrinks as 1/sqrt(width) (default 768, GPT-2 small's; 0: N(0, 0.02) at any width)")
    ap.add_argument("--min-share-s", type=float, default=None, help="start a setting after the first only with this "
                    "many seconds left (default: 150 on a GPU, 30 on the CPU)")
    ap.add_argument("--in-process", action="store_true",
                    help="run the settings in this process (no isolation; for the CPU test)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    settings = args.settings.split(",")
    for s in settings:
        if s not in SETTINGS:
            ap.error(f"--settings: unknown setting {s!r} (known: {', '.join(SETTINGS)})")
    if args.steps < 1 or args.context < 1 or args.vocab < 2 or args.tokens < 0 or args.tokens % args.context:
        ap.error("--steps >= 1, --context >= 1, --vocab >= 2, --tokens a multiple of --context")
    if args.head_width < 0:
        ap.error(f"--head-width: 0 or more, got {args.head_width}")
    if args.min_share_s is not None and not args.min_share_s >= 0:
        ap.error(f"--min-share-s: 0 or more seconds, got {args.min_share_s}")
    if args.shape is not None:
        try:
            parse_shape(args.shape)
        except ValueError as e:
            ap.error(str(e))
    if args.child:
        run_setting(args.child, args, args.out)
        return 0
    start, rows = time.perf_counter(), []
    least = args.min_share_s if args.min_share_s is not None else MIN_SHARE_S["cuda" if args.device.startswith("cuda")
                                                                               else "cpu"]  # fmt: skip
    for i, s in enumerate(settings):
        share = args.budget_s - (time.perf_counter() - start)  # in order of priority: each takes what it needs of
        if i and share < least:  # what is left; a later one starts only with `least` left for it (the first always)
            rows.append({"setting": s, "error": f"NOT RUN: the {args.budget_s:.0f}s budget is spent (a setting "
                                                f"needs {least}s)"})  # fmt: skip
            continue
        part = f"{args.out}.{s}.part"
        cmd = child_command(args, s, part, share * 0.75)
        say(s, f"starting (budget {share:.0f}s)")
        error = None
        if args.in_process:
            try:
                run_setting(s, argparse.Namespace(**{**vars(args), "budget_s": share * 0.75}), part)
            except Exception as e:  # the row says what failed; the next setting still runs
                error = f"{type(e).__name__}: {e}"
        else:
            try:
                # expandable segments: a step's activations near the device's capacity fragment it less
                env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                                               "expandable_segments:True")}
                rc = subprocess.run(cmd, timeout=share, env=env).returncode
                error = None if rc == 0 else f"exited with {rc}" + (" (killed: out of memory?)" if rc == -9 else "")
            except subprocess.TimeoutExpired:
                error = f"timed out after {share:.0f}s"
            except KeyboardInterrupt:  # (gpu_check.sh's limit: SIGINT) the rows so far, this one's steps, are kept
                error = "interrupted"
        try:
            with open(part) as f:
                row = json.load(f)
            os.remove(part)
        except (OSError, ValueError):
            row = {"setting": s}
        if error and not (args.in_process and row.get("error")):  # (in process: the row's own error is the same)
            row["error"] = f"{error}: {row['error']}" if row.get("error") else error
        rows.append(row)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        say(s, summary_line(row))
        if error == "interrupted":
            rows += [{"setting": later, "error": "NOT RUN: interrupted"} for later in settings[i + 1 :]]
            break
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if all("error" not in r and r.get("steps") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
