"""What the optimizer reports: the bytes it holds (MemoryReport) and the seconds per phase of a step."""

from __future__ import annotations

from dataclasses import dataclass

K_ADAM = 12  # bytes of fp32 optimizer state per parameter: master, exp_avg, exp_avg_sq


@dataclass
class MemoryReport:
    """Bytes held by the optimizer on this rank, measured from its buffers, next to DESIGN.md's formulas.

    Args:
        params: trainable parameters (Φ). world_size: data-parallel ranks (N).
        device_params, device_buckets: the flat 16-bit parameter buffer and the gradient buckets.
        host_state, host_landing, host_staging, host_accumulator: p32/m/v, gradient landing, p16 staging,
            fp32 accumulation buffer (only while accumulating).
        formula_device, formula_host: 2Φ + buckets and (2 + K)Φ/N + 2Φ/N (DESIGN.md, ZeRO-2 + offload).
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
                f"formula 2Φ + buckets = {self.formula_device:,} B\n"
                f"  host:   {self.host_bytes:,} B ({self.host_bytes / p:.2f} B/param); "
                f"formula (2+K)Φ/N + 2Φ/N = {self.formula_host:,} B")  # fmt: skip


class PhaseTimes(dict):
    """Seconds per phase of the step since the last step (stats["time_<phase>"]), shared by the parts."""

    def add(self, name: str, seconds: float) -> None:
        """Add `seconds` to phase `name`."""
        self[name] = self.get(name, 0.0) + seconds
