"""What the optimizer reports: the bytes it holds (MemoryReport) and the seconds per phase of a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .optimizer import ZeroOffloadAdamW

K_ADAM = 12  # bytes of fp32 optimizer state per parameter: master, exp_avg, exp_avg_sq (K = 4 + the moments' bytes
# per parameter in other state_dtype formats: 8 with bf16, 6.06 with 8-bit)


@dataclass
class MemoryReport:
    """Bytes held by the optimizer on this rank, measured from its buffers, next to DESIGN.md's formulas.

    Args:
        params: trainable parameters (Φ). world_size: data-parallel ranks (N).
        device_params, device_buckets: the flat 16-bit parameter buffer and the gradient buckets.
        host_state, host_landing, host_staging, host_accumulator: p32/m/v, gradient landing, p16 staging (and
            the stage-3 parameter shard when it is offloaded), fp32 accumulation buffer (only while accumulating).
        formula_device, formula_host: 2Φ + buckets and (2 + K)Φ/N + 2Φ/N (DESIGN.md, ZeRO-2 + offload; K = 4 + the
            moments' bytes per parameter: 12 fp32, 8 bf16, 6.06 8-bit); at stage
            3 the device holds 2Φ/N (none with offload_param) + buckets, the host 2Φ/N more with offload_param.
    """

    params: int
    world_size: int
    device_params: int
    device_buckets: int
    host_state: int
    host_landing: int
    host_staging: int
    host_accumulator: int
    formula_device: int
    formula_host: int
    device_formula: str = "2Φ + buckets"
    host_formula: str = "(2+K)Φ/N + 2Φ/N"

    @property
    def device_bytes(self) -> int:
        return self.device_params + self.device_buckets

    @property
    def host_bytes(self) -> int:
        return self.host_state + self.host_landing + self.host_staging + self.host_accumulator

    def __str__(self) -> str:
        p = max(1, self.params)
        return (f"params {self.params:,} x {self.world_size} rank(s)\n"
                f"  device: {self.device_bytes:,} B ({self.device_bytes / p:.2f} B/param); "
                f"formula {self.device_formula} = {self.formula_device:,} B\n"
                f"  host:   {self.host_bytes:,} B ({self.host_bytes / p:.2f} B/param); "
                f"formula {self.host_formula} = {self.formula_host:,} B")  # fmt: skip


def measure(opt: ZeroOffloadAdamW) -> MemoryReport:
    """The optimizer's MemoryReport on this rank, measured from its buffers. At stage 3 the device parameters are
    this rank's shard (none when offload_param is set) and the host holds the shard when it is offloaded; the
    gathered units in flight are the working set, in opt.device_bytes (now and peak), not here."""
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
    phi, n = opt.layout.numel, opt.comm.world
    buckets = nbytes(opt.grads.bucket_bufs)
    shards = opt.shards
    device_params = nbytes([opt.flat]) if shards is None else (nbytes([shards.shard]) if not shards.offload else 0)
    host_shard = nbytes([shards.shard]) if shards is not None and shards.offload else 0
    staging = 0 if opt.update.staging_in_place else nbytes([opt.update.staging_buf])
    p16 = 2 * phi if shards is None else (0 if shards.offload else 2 * phi // n)
    k = opt.update.state_bytes_per_param  # K: the masters and the moments in their format
    return MemoryReport(
        params=phi, world_size=n, device_params=device_params, device_buckets=buckets,
        host_state=opt.update.host_state_bytes, host_landing=nbytes(opt.grads.landing),
        host_staging=staging + host_shard, host_accumulator=nbytes(opt.grads.accum),
        formula_device=p16 + buckets,
        formula_host=int((2 + k) * phi) // n + 2 * phi // n + (2 * phi // n if host_shard else 0),
        device_formula={None: "2Φ + buckets", False: "2Φ/N + buckets (+ gathered units)",
                        True: "buckets (+ gathered units)"}[None if shards is None else bool(shards.offload)],
        host_formula="(2+K)Φ/N + 2Φ/N" + (" + 2Φ/N (the shard)" if host_shard else ""),
    )  # fmt: skip


class PhaseTimes(dict):
    """Seconds per phase of the step since the last step (stats["time_<phase>"]), shared by the parts."""

    def add(self, name: str, seconds: float) -> None:
        """Add `seconds` to phase `name`."""
        self[name] = self.get(name, 0.0) + seconds
