"""Memory planner: bytes per device for DDP, ZeRO-1/2/3 and ZeRO-2 + offload (DESIGN.md's table).

Model states follow the ZeRO paper: 2 bytes of fp16/bf16 parameters, 2 of gradients and K of optimizer
state per parameter (K = 12 for mixed-precision Adam: fp32 master, momentum, variance). On top of the model
states every GPU needs activations and workspace (options), and only part of its memory is usable (the
allocator's fragmentation reserve). The offload strategy keeps 2 bytes of parameters and two gradient
buckets on the GPU and (2 + K)/N + 2/N bytes per parameter (gradients, optimizer state, staging) on the host.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-2 + offload")
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9, "T": 1e12, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
MAX_GPUS = 10**9  # beyond it the per-GPU shares underflow to 0 and big ints overflow float division
_COUNTS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def _parse(text: str | float, name: str, units: dict[str, float], example: str, kind: str) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).upper() not in units:
            raise ValueError(f"{name}: cannot read {text!r} as a {kind} (e.g. {example})")
        value, unit = float(m.group(1)), m.group(2).upper()
    value *= units[unit]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite {kind} >= 0, got {text!r}")
    return value


def parse_bytes(text: str | float, name: str = "size") -> float:
    """'32GiB', '32GB', '1.5TB', '768 GiB', 3.2e10 -> bytes (GB = 1e9, GiB = 2**30)."""
    return _parse(text, name, _UNITS, "32GiB, 32GB, 1.5TB", "size")


def parse_count(text: str | float, name: str = "params") -> float:
    """'13e9', '13B', '1.4B', '350M' -> a count (> 0)."""
    value = _parse(text, name, _COUNTS, "13e9, 13B, 350M", "count")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {text!r}")
    return value


@dataclass
class StrategyPlan:
    """One strategy's bytes per device (GPU and host) and whether they fit.

    Args:
        strategy: one of STRATEGIES. gpu_states: model-state bytes on each GPU (the ZeRO table's column).
        gpu_total: gpu_states + activations + workspace (+ buckets for offload). host: host bytes per GPU.
        fits_gpu, fits_host: against the usable GPU memory and the host memory per GPU.
        max_params: the largest model this strategy can train on this hardware.
    """

    strategy: str
    gpu_states: float
    gpu_total: float
    host: float
    fits_gpu: bool
    fits_host: bool
    max_params: float

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host


@dataclass
class Plan:
    """The planner's answer for a model on some hardware, per strategy, with its assumptions."""

    params: float
    gpus: int
    gpu_mem: float
    host_mem: float
    k: float
    activations: float
    workspace: float
    reserve: float
    bucket_bytes: float
    strategies: list[StrategyPlan] = field(default_factory=list)

    @property
    def usable_gpu(self) -> float:
        """GPU memory left after the fragmentation reserve, activations and workspace."""
        return self.gpu_mem * (1 - self.reserve) - self.activations - self.workspace

    def row(self, strategy: str) -> StrategyPlan:
        return next(s for s in self.strategies if s.strategy == strategy)


def _per_param(strategy: str, k: float, n: int) -> tuple[float, float]:
    """(GPU bytes, host bytes) per parameter per device."""
    return {
        "DDP": (2 + 2 + k, 0.0),
        "ZeRO-1": (2 + 2 + k / n, 0.0),
        "ZeRO-2": (2 + (2 + k) / n, 0.0),
        "ZeRO-3": ((2 + 2 + k) / n, 0.0),
        "ZeRO-2 + offload": (2.0, (2 + k) / n + 2 / n),
    }[strategy]


def plan(
    params: float | str,
    gpus: int = 1,
    gpu_mem: float | str = "32GiB",
    host_mem: float | str = "768GiB",
    *,
    k: float = 12,
    activations: float | str = "4GiB",
    workspace: float | str = "1GiB",
    reserve: float = 0.05,
    bucket_bytes: float | str = "64MiB",
    gpus_per_host: int | None = None,
) -> Plan:
    """Bytes per device for each strategy, whether it fits, and the largest trainable model per strategy.

    Defaults: activations 4 GiB and workspace 1 GiB per GPU, 5% of GPU memory lost to fragmentation, two
    32 MiB offload buckets; all GPUs on one host unless `gpus_per_host` says otherwise.
    """
    params = parse_count(params, "params")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be an int >= 1, got {gpus!r}")
    if gpus > MAX_GPUS:
        raise ValueError(f"gpus must be <= {MAX_GPUS:.0e}, got {str(gpus)[:20]}")
    per_host = gpus if gpus_per_host is None else gpus_per_host
    if isinstance(per_host, bool) or not isinstance(per_host, int) or not 1 <= per_host <= gpus:
        raise ValueError(f"gpus_per_host must be an int in [1, gpus], got {gpus_per_host!r}")
    if not (isinstance(k, (int, float)) and math.isfinite(k) and k >= 0):
        raise ValueError(f"k must be a number >= 0, got {k!r}")
    if not (isinstance(reserve, (int, float)) and 0 <= reserve < 1):
        raise ValueError(f"reserve must be a fraction in [0, 1), got {reserve!r}")
    p = Plan(
        params=params, gpus=gpus, gpu_mem=parse_bytes(gpu_mem, "gpu_mem"), host_mem=parse_bytes(host_mem, "host_mem"),
        k=float(k), activations=parse_bytes(activations, "activations"), workspace=parse_bytes(workspace, "workspace"),
        reserve=float(reserve), bucket_bytes=parse_bytes(bucket_bytes, "bucket_bytes"),
    )  # fmt: skip
    if p.gpu_mem <= 0:
        raise ValueError(f"gpu_mem must be > 0, got {gpu_mem!r}")
    host_per_gpu = p.host_mem / per_host
    for s in STRATEGIES:
        g, h = _per_param(s, p.k, gpus)
        fixed = p.bucket_bytes if s == "ZeRO-2 + offload" else 0.0
        gpu_total = g * params + p.activations + p.workspace + fixed
        room = p.usable_gpu - fixed
        max_gpu = room / g if room > 0 else 0.0
        max_host = host_per_gpu / h if h else math.inf
        fits_gpu = gpu_total <= p.gpu_mem * (1 - p.reserve)
        row = StrategyPlan(s, g * params, gpu_total, h * params, fits_gpu, h * params <= host_per_gpu,
                           max_params=min(max_gpu, max_host))  # fmt: skip
        p.strategies.append(row)
    return p


def _fmt_bytes(b: float) -> str:
    return f"{b / 1e9:,.1f} GB"


def _fmt_count(n: float) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.0f}M"


def format_plan(p: Plan, show_max: bool = False) -> str:
    """The planner's table as text (GB = 1e9 bytes, as in the ZeRO paper)."""
    lines = [f"model {_fmt_count(p.params)} params, {p.gpus} GPU(s) x {_fmt_bytes(p.gpu_mem)}, host "
             f"{_fmt_bytes(p.host_mem)}, K = {p.k:g}",
             f"assumed per GPU: activations {_fmt_bytes(p.activations)}, workspace {_fmt_bytes(p.workspace)}, "
             f"{p.reserve:.0%} fragmentation reserve, offload buckets {_fmt_bytes(p.bucket_bytes)} "
             f"(usable for model states: {_fmt_bytes(max(0.0, p.usable_gpu))})", ""]  # fmt: skip
    head = f"{'strategy':<18}{'GPU states':>12}{'GPU total':>12}{'host/GPU':>12}  fits"
    if show_max:
        head += f"{'max params':>14}"
    lines.append(head)
    for s in p.strategies:
        fits = "yes" if s.fits else ("no (GPU)" if not s.fits_gpu else "no (host)")
        row = f"{s.strategy:<18}{_fmt_bytes(s.gpu_states):>12}{_fmt_bytes(s.gpu_total):>12}"
        row += f"{_fmt_bytes(s.host):>12}  {fits:<9}"
        if show_max:
            row += f"{_fmt_count(s.max_params):>13}"
        lines.append(row.rstrip())
    return "\n".join(lines)
