"""gpu_fraction chosen by the planner (`zo-kernels plan --auto`): from the CPU-Adam rate, the device AdamW rate, the
forward+backward time and the device memory left.

The rule. Per rank, P = params / N elements are updated per step; with gpu_fraction f, CPU Adam updates (1 - f) P at
`cpu_rate` params/s while the device updates f P at `device_rate` after the backward. The CPU part is hidden when it
takes no longer than forward+backward (the delayed update overlaps it with the next forward and backward; without it,
that is where the step's floor lies), so the smallest such f is f_time = 1 - T_fb * cpu_rate / P, clamped to [0, 1];
more would only add device time. The device must also hold K + 2 bytes per element of the tail (fp32 master, the
moments in their format and the 16-bit gradient landing: 14 with fp32 moments, `DEVICE_BYTES_PER_ELEMENT`; 10 bf16,
8.03 8-bit): f_mem = free device bytes / ((K + 2) P). The pick is min(f_time, f_mem). Both rates are measured in the
moments' format (compressed moments move fewer bytes on the host; on the device they add the decode and encode).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

# Bytes the device moves per element of the tail per step: torch's fused AdamW reads p32, m, v and the fp32 gradient
# (16) and writes p32, m, v (12); the gradient's fp32 scaled copy (2 read + 4 written) and the cast into the 16-bit
# parameters (4 + 2): 40 bytes.
DEVICE_STEP_BYTES = 40
# H100 SXM: 3.35e12 B/s of HBM3, of which an elementwise kernel reaches about 60%: 3.35e12 * 0.6 / 40 = 5e10 params/s.
# A default, not a measurement (no GPU measured it here): pass --device-adam-rate measured on yours.
DEFAULT_DEVICE_ADAM_RATE = 5e10
DEVICE_BYTES_PER_ELEMENT = 14  # on the device per element of the tail: p32, m, v (12) + the 16-bit gradient landing


@dataclass
class FractionPick:
    """What `pick_fraction` chose and why (all times per step, per rank)."""

    fraction: float
    by_time: float  # the smallest fraction whose CPU part takes no longer than forward+backward
    by_memory: float  # the largest fraction whose state fits the device memory left
    cpu_s: float  # CPU Adam's time on the host part at the pick
    device_s: float  # the device update's time at the pick
    fwd_bwd_s: float

    @property
    def tokens_to_cover(self) -> float:
        """How many times this step's tokens make forward+backward as long as CPU Adam over the whole partition
        (gpu_fraction 0), forward+backward taken as proportional to the tokens: at that batch the delayed update
        hides CPU Adam with nothing on the device (<= 1: it does already)."""
        cpu_all = self.cpu_s / (1.0 - self.fraction) if self.fraction < 1.0 else math.inf
        return cpu_all / self.fwd_bwd_s

    def explain(self) -> str:
        """One paragraph: the pick, its two bounds, the times, and the batch at which no device part is needed."""
        limit = "the device memory left" if self.by_memory < self.by_time else "forward+backward's time"
        cover = self.tokens_to_cover
        batch = ("forward+backward covers CPU Adam over the whole partition already" if cover <= 1.0 else
                 f"forward+backward would cover CPU Adam over the whole partition (gpu_fraction 0) at {cover:.1f}x "
                 "this step's tokens, if its time grows with them" if math.isfinite(cover) else "")  # fmt: skip
        return (f"gpu_fraction {self.fraction:.3f} (bounded by {limit}): the CPU part must take <= "
                f"forward+backward {self.fwd_bwd_s * 1e3:.1f} ms -> fraction >= {self.by_time:.3f}; the device memory "
                f"left holds at most {self.by_memory:.3f}. At {self.fraction:.3f}: CPU Adam {self.cpu_s * 1e3:.1f} ms, "
                f"device AdamW {self.device_s * 1e3:.2f} ms per step" + (f". {batch}" if batch else ""))  # fmt: skip


def pick_fraction(params_per_rank: float, cpu_rate: float, device_rate: float, fwd_bwd_s: float,
                  free_device_bytes: float, bytes_per_element: float = DEVICE_BYTES_PER_ELEMENT) -> FractionPick:
    """The fraction by the module's rule (all arguments > 0 except free_device_bytes >= 0); bytes_per_element: the
    device's per element of the tail, K + 2."""  # fmt: skip
    for name, v in (("params_per_rank", params_per_rank), ("cpu_rate", cpu_rate), ("device_rate", device_rate),
                    ("fwd_bwd_s", fwd_bwd_s), ("bytes_per_element", bytes_per_element)):  # fmt: skip
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    if not (isinstance(free_device_bytes, (int, float)) and math.isfinite(free_device_bytes)):
        raise ValueError(f"free_device_bytes must be a finite number, got {free_device_bytes!r}")
    by_time = min(1.0, max(0.0, 1.0 - fwd_bwd_s * cpu_rate / params_per_rank))
    by_memory = min(1.0, max(0.0, free_device_bytes / (bytes_per_element * params_per_rank)))
    f = min(by_time, by_memory)
    return FractionPick(f, by_time, by_memory, (1 - f) * params_per_rank / cpu_rate, f * params_per_rank / device_rate,
                        fwd_bwd_s)  # fmt: skip


def measure_cpu_adam_rate(numel: int = 1 << 22, repeats: int = 3, threads: int | None = None,
                          state_dtype: str = "fp32") -> float:  # fmt: skip
    """CPU Adam's rate on this host, params/s: the best of `repeats` steps over `numel` elements with the moments in
    `state_dtype` ("fp32", "bf16", "8bit")."""
    from .cpu_adam import cpu_adam_step
    from .offload.formats import Moments

    p, g = torch.randn(numel), torch.randn(numel) * 1e-3
    m, v = Moments(state_dtype, numel).pair
    kw = {} if threads is None else {"threads": threads}
    best = math.inf
    for step in range(1, repeats + 2):  # (the first warms the pages up)
        t0 = time.perf_counter()
        cpu_adam_step(p, g, m, v, step=step, lr=1e-3, **kw)
        if step > 1:
            best = min(best, time.perf_counter() - t0)
    return numel / best


def measure_device_adam_rate(device: torch.device, numel: int | None = None, repeats: int = 3,
                             state_dtype: str = "fp32") -> float:  # fmt: skip
    """The rate of gpu_fraction's tail update on `device`, params/s, as the tail runs it (offload/device_adam.py:
    the Triton kernel on a GPU, in every format; elsewhere torch's fused AdamW, with bf16 / 8-bit moments decoded
    and encoded around it in torch ops; a 16-bit gradient): the best of `repeats` steps over `numel` elements
    (default 2**24 on a GPU, 2**20 on the CPU)."""
    from .offload.device_adam import DeviceState

    device = torch.device(device)
    numel = numel or (1 << 24 if device.type == "cuda" else 1 << 20)
    tail = DeviceState(state_dtype, torch.rand(numel, device=device))
    g = torch.rand(numel, device=device).to(torch.bfloat16)
    hparams = [dict(lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8, maximize=False)]
    best = math.inf
    for i in range(repeats + 1):  # (the first warms up)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        tail.step(g, 1.0, [(0, 0, numel, i + 1, 1.0)], hparams)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return numel / best
