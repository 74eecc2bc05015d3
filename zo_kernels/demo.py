"""`zo-kernels demo`: a character-level GPT trained on the Jargon File with ZeroOffloadAdamW, then the same
model and data with plain PyTorch AdamW, side by side: loss curves, step phases, tokens/s and memory."""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TextIO

import torch

from .gpt import GPT, GPTConfig, num_params
from .offload import ZeroOffloadAdamW
from .planner import plan, state_k

STATE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": "8bit"}  # --state-dtype -> state_dtype
PHASES = ("offload", "reduce", "backward_offload_wait", "cpu_update", "writeback", "all_gather", "dpu_wait")
# x86 flags of bf16 dot-product instructions, and Arm's (Linux's /proc/cpuinfo names). Without them torch
# emulates bf16 and fp16 matmuls: the demo ran at 0.9k tokens/s in bf16 against 21.7k in fp32 on an AVX2 EPYC.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU feature flags Linux reports ("flags" on x86, "Features" on Arm); empty where there is no such file."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def native_bf16(device: torch.device, flags: Callable[[], set[str]] = cpu_flags) -> bool:
    """Whether `device` multiplies bf16 in hardware: a GPU of compute capability 8.0 or newer, or a CPU with
    AVX512-BF16/AMX-BF16 (x86) or BF16 (Arm). torch's own probe (cpuinfo, any OS) is asked first where it exists."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # private in torch 2.13: may go away
    return bool(probe is not None and probe()) or bool(flags() & BF16_CPU_FLAGS)


def pick_dtype(device_type: str, has_native_bf16: bool) -> tuple[torch.dtype, str]:
    """The demo's working-copy dtype on this device, and why, in words."""
    if has_native_bf16:
        unit = "GPU" if device_type == "cuda" else "CPU"
        return torch.bfloat16, f"this {unit} computes bf16 natively: the 16-bit copy is the fast one"
    if device_type == "cuda":
        return torch.float16, "this GPU has no native bf16 (compute capability < 8.0); fp16 with dynamic loss scaling"
    return torch.float32, ("this CPU has no native bf16 (no AVX512-BF16 or AMX-BF16): bf16 and fp16 matmuls "
                           "would be emulated, ~20x slower; --dtype bf16 forces it")  # fmt: skip


def load_corpus() -> str:
    """The shipped corpus: an ASCII abridgement of the Jargon File 4.4.7 (public domain), about 240 KB."""
    return resources.files("zo_kernels").joinpath("data/jargon.txt").read_text(encoding="ascii")


@dataclass
class Run:
    """One training run's record."""

    name: str
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    val_loss: float = float("nan")
    device_bytes: float = 0.0
    host_bytes: float = 0.0
    memory: Any = None  # zo: the optimizer's MemoryReport
    step_seconds: list[float] = field(default_factory=list)  # each step's wall time (its loss read included)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def median_tokens_per_s(self) -> float:
        """Tokens per second of the median step: what a run goes at, a pause of the machine left out (a loaded
        2-core VM stalled one run of a new user's demo 6x for a while: 3.47x whole-run, 1.02x quiet)."""
        if not self.step_seconds:
            return 0.0
        steps = sorted(self.step_seconds)
        return self.tokens / len(steps) / steps[len(steps) // 2]


class Progress:
    """A one-line progress bar on a terminal; a line every 10% otherwise (logs, CI)."""

    def __init__(self, name: str, total: int, out: TextIO = sys.stderr) -> None:
        self.name, self.total, self.out = name, total, out
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, tokens: int, scale: float) -> None:
        if not self.tty and step % max(1, self.total // 10) and step != self.total:
            return
        frac = step / self.total
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        rate = tokens / max(1e-9, time.perf_counter() - self.t0)
        line = f"[{self.name:<5}] {bar} step {step:>4}/{self.total} loss {loss:6.3f} "
        line += f"{rate / 1e3:7.1f}k tok/s scale {scale:g}"
        self.out.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and step == self.total:
            self.out.write("\n")
        self.out.flush()


def batches(data: torch.Tensor, steps: int, batch: int, context: int, seed: int) -> list[torch.Tensor]:
    """The same random windows for both runs: [steps, batch, context + 1] token ids."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - context - 1, (steps, batch), generator=g)
    return [torch.stack([data[s : s + context + 1] for s in row]) for row in starts]


@torch.no_grad()
def evaluate(model: GPT, data: torch.Tensor, context: int, device: torch.device, n: int = 8) -> float:
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, data.numel() - context - 1, (n, 16), generator=g)
    losses = []
    for row in starts:
        x = torch.stack([data[s : s + context + 1] for s in row]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            losses.append(model(x[:, :-1], x[:, 1:]).item())
    return sum(losses) / len(losses)


def train_zo(model: GPT, data: list[torch.Tensor], device: torch.device, args: Any, progress: bool) -> Run:
    run = Run("zo")
    stage = getattr(args, "stage", 2)
    offload = getattr(args, "offload_param", "none")
    opt = ZeroOffloadAdamW(model, lr=args.lr, weight_decay=0.01, dtype=args.dtype,
                           loss_scale="dynamic" if args.dtype == torch.float16 else None,
                           delay_update_after=args.delay_update_after, max_grad_norm=1.0, stage=stage,
                           offload_param=None if offload == "none" else offload,
                           state_dtype=STATE_DTYPE[getattr(args, "state_dtype", "fp32")],
                           gpu_fraction=getattr(args, "gpu_fraction", 0.0))  # fmt: skip
    bar = Progress("zo", len(data)) if progress else None
    t0 = time.perf_counter()
    for i, xb in enumerate(data, 1):
        t = time.perf_counter()
        x = xb.to(device, non_blocking=True)
        loss = model(x[:, :-1], x[:, 1:])
        opt.backward(loss)
        opt.step()
        run.losses.append(loss.item())
        run.step_seconds.append(time.perf_counter() - t)
        run.tokens += x[:, 1:].numel()
        for k in PHASES:
            run.phases[k] = run.phases.get(k, 0.0) + opt.stats.get(f"time_{k}", 0.0)
        if bar:
            bar.update(i, run.losses[-1], run.tokens, opt.loss_scale)
    opt.synchronize()
    if device.type == "cuda":
        torch.cuda.synchronize()
    run.seconds = time.perf_counter() - t0
    rep = opt.memory_report()
    run.device_bytes, run.host_bytes, run.memory = rep.device_bytes, rep.host_bytes, rep
    opt.close()
    return run


def train_torch(model: GPT, data: list[torch.Tensor], device: torch.device, args: Any, progress: bool) -> Run:
    run = Run("torch")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    bar = Progress("torch", len(data)) if progress else None
    t0 = time.perf_counter()
    for i, xb in enumerate(data, 1):
        t = time.perf_counter()
        x = xb.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the grads allocated, as a real loop does (counted below)
        run.losses.append(loss.item())
        run.step_seconds.append(time.perf_counter() - t)
        run.tokens += x[:, 1:].numel()
        if bar:
            bar.update(i, run.losses[-1], run.tokens, 1.0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    run.seconds = time.perf_counter() - t0
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    run.device_bytes = nbytes(params) + nbytes([p.grad for p in params if p.grad is not None]) + nbytes(state)
    return run


def main(args: Any) -> int:
    """Run the demo with parsed CLI arguments; returns the exit status."""
    out = sys.stdout
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    if args.dtype is None:
        args.dtype, why = pick_dtype(device.type, native_bf16(device))
    else:
        why = "set by --dtype"
    out.write(f"working dtype: {str(args.dtype).split('.')[-1]} ({why})\n")
    out.flush()
    args.device_type, args.dtype_name = device.type, str(args.dtype).split(".")[-1]
    text = load_corpus()
    chars = "".join(sorted(set(text)))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * data.numel())
    train, val = data[:split], data[split:]
    cfg = GPTConfig.for_params(args.model_size, vocab=len(chars), context=args.context)
    model = GPT(cfg)
    phi = num_params(model)
    reference = copy.deepcopy(model)
    steps = batches(train, args.steps, args.batch, args.context, args.seed)
    out.write(f"zo_kernels demo: {phi / 1e6:.2f}M-parameter GPT ({cfg.layers} layers, width {cfg.width}), "
              f"character level on the Jargon File ({len(text) / 1e3:.0f} KB, {len(chars)} symbols)\n"
              f"device {device}{' (no GPU: the offload step runs with device = CPU)' if device.type == 'cpu' else ''}, "
              f"{args.steps} steps of {args.batch} x {args.context} tokens, "
              f"{dpu_text(args.delay_update_after)}, ZeRO stage {getattr(args, 'stage', 2)}"
              f"{' (parameter shards in host memory)' if getattr(args, 'offload_param', 'none') == 'cpu' else ''}, "
              f"seed {args.seed}\n\n")  # fmt: skip
    progress = not args.quiet
    zo = train_zo(model.to(device), steps, device, args, progress)
    zo.val_loss = evaluate(model, val, args.context, device)
    ref = train_torch(reference.to(device), steps, device, args, progress)
    ref.val_loss = evaluate(reference, val, args.context, device)
    report(out, zo, ref, phi, args)
    if args.plot:
        save_plot(args.plot, zo, ref)
        out.write(f"\nplot saved to {args.plot}\n")
    return 0


def report(out: TextIO, zo: Run, ref: Run, phi: int, args: Any) -> None:
    every = max(1, len(zo.losses) // 10)
    out.write("\nloss (training batches)      zo      torch     diff\n")
    for i in list(range(0, len(zo.losses), every)) + [len(zo.losses) - 1]:
        a, b = zo.losses[i], ref.losses[i]
        out.write(f"  step {i + 1:>5}            {a:7.4f}  {b:7.4f}  {a - b:+8.4f}\n")
    out.write(f"  validation loss        {zo.val_loss:7.4f}  {ref.val_loss:7.4f}  {zo.val_loss - ref.val_loss:+8.4f}\n")
    torch_math = "bf16 autocast" if args.device_type == "cuda" else "float32"
    why = (f"forward/backward in {args.dtype_name} vs {torch_math} is most of the difference"
           if args.dtype_name != torch_math else f"both forward/backward in {torch_math}")  # fmt: skip
    a, b = zo.median_tokens_per_s, ref.median_tokens_per_s
    out.write(f"\nthroughput (median step of each run, the runs one after the other): zo {a / 1e3:.1f}k tokens/s, "
              f"torch {b / 1e3:.1f}k tokens/s ({a / max(1e-9, b):.2f}x; {why}); whole runs "
              f"{zo.tokens_per_s / 1e3:.1f}k and {ref.tokens_per_s / 1e3:.1f}k (a busy machine moves these)\n")
    step_ms = zo.seconds / len(zo.losses) * 1e3
    out.write(f"\nzo step phases (mean per step, of {step_ms:.1f} ms):\n")
    for k, ms in phase_ms(zo).items():
        out.write(f"  {k:<26}{ms:8.2f} ms  {ms / step_ms:6.1%}\n")
    p = plan(phi, 1, "80GiB", "768GiB", bucket_bytes=0, dpu=args.delay_update_after is not None,
             k=state_k(getattr(args, "state_dtype", "fp32")), gpu_fraction=getattr(args, "gpu_fraction", 0.0))
    stage, offload = getattr(args, "stage", 2), getattr(args, "offload_param", "none")
    row = "ZeRO-3 + offload" if stage == 3 else "ZeRO-2 + offload"
    # torch's AdamW beside it keeps fp32 moments whatever --state-dtype says: DDP at K = 12
    off, ddp = p.row(row), plan(phi, 1, "80GiB", "768GiB", bucket_bytes=0).row("DDP")
    # the planner's ZeRO-3 + offload keeps the p16 shard on the host; without --offload-param it is on the device
    shard = " (the shard: here, not on the host)" if (stage, offload) == (3, "none") else ""
    # at stage 3 under DPU the host keeps the update's 16-bit output apart from the shard the gathers read
    staging = "p16 staging" if stage == 3 and args.delay_update_after is not None else "no p16 staging"
    per = lambda where: " + ".join(f"{t.formula_bytes / phi:.2f} ({t.what})" for t in zo.memory.terms  # noqa: E731
                                   if t.where == where) or "0"  # fmt: skip
    e = torch.empty((), dtype=args.dtype).element_size()
    out.write("\nmemory per parameter (measured from the optimizer's buffers = the formula of each; docs/design.md):\n"
              f"  zo     device {zo.device_bytes / phi:6.2f} B = {per('device')}\n"
              f"           host {zo.host_bytes / phi:6.2f} B = {per('host')}\n"
              f"         planner, {row} on a GPU: device {off.gpu_states / phi:.4g}{shard} + buckets, host "
              f"{off.host / phi:.4g} (16-bit params, {staging}{'; this run: fp32, 4 B' if e == 4 else ''})\n"
              f"  torch  device {ref.device_bytes / phi:6.2f} B (planner DDP {ddp.gpu_states / phi:.0f}: "
              f"fp32 training here is 4+4+8 = 16 too)\n")  # fmt: skip
    gap = max(abs(a - b) for a, b in zip(zo.losses, ref.losses))
    verdict = "the curves agree" if gap < 0.1 * max(1.0, math.fabs(ref.losses[-1])) else "the curves DISAGREE"
    out.write(f"\nlargest per-step loss gap {gap:.4f}: {verdict} (zo trains in {args.dtype_name} with fp32 masters, "
              f"torch in fp32{' + bf16 autocast' if args.device_type == 'cuda' else ''})\n")


def dpu_text(delay_update_after: int | None) -> str:
    """The header's words for --delay-update-after."""
    return "no delayed update" if delay_update_after is None else f"delayed update after {delay_update_after} steps"


def phase_ms(zo: Run) -> dict[str, float]:
    """Mean ms per step of each optimizer phase, and of the rest (the model's forward and backward)."""
    steps = len(zo.losses)
    ms = {k: zo.phases[k] / steps * 1e3 for k in PHASES if zo.phases.get(k, 0.0) > 0}
    return {"forward/backward (model)": zo.seconds / steps * 1e3 - sum(ms.values()), **ms}


def save_plot(path: str, zo: Run, ref: Run) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from e
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(range(1, len(zo.losses) + 1), zo.losses, label=f"ZeroOffloadAdamW ({zo.tokens_per_s / 1e3:.1f}k tok/s)")
    a.plot(range(1, len(ref.losses) + 1), ref.losses, label=f"torch AdamW ({ref.tokens_per_s / 1e3:.1f}k tok/s)",
           alpha=0.8)  # fmt: skip
    a.set(xlabel="step", ylabel="training loss", title="loss curves")
    a.legend()
    phases = phase_ms(zo)
    total = sum(phases.values()) or 1.0
    values = [max(v, 1e-3) for v in phases.values()]  # a log axis: one phase at 99% leaves the others visible
    b.barh(list(phases), values)
    b.set_xscale("log")
    for y, v in enumerate(phases.values()):
        b.annotate(f"{v:.2f} ms ({v / total:.1%})", (max(v, 1e-3), y), xytext=(3, 0), textcoords="offset points",
                   va="center", fontsize=8)  # fmt: skip
    b.set_xlim(min(values) / 2, max(values) * 20)
    b.invert_yaxis()  # the phases top-down in the order of the text report
    b.set(xlabel="ms per step (log scale)", title="ZeroOffloadAdamW step phases")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
