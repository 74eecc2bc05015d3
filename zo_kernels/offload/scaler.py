"""The loss scaler: none, static, or dynamic with torch.amp.GradScaler's rule."""

from __future__ import annotations

from typing import Any

from ..cpu_adam import _real

# torch.amp.GradScaler's defaults.
SCALE_INIT, SCALE_GROWTH, SCALE_BACKOFF, SCALE_INTERVAL = 2.0**16, 2.0, 0.5, 2000


class LossScaler:
    """The loss scale and, when dynamic, its count of good steps since the last change.

    Args:
        loss_scale: None (1.0, never changes), a positive number (static) or "dynamic" (2**16, x2 after
            SCALE_INTERVAL steps without overflow, /2 on overflow).
    """

    def __init__(self, loss_scale: float | str | None) -> None:
        self.scale, self.dynamic = _check_loss_scale(loss_scale)
        self.good_steps = 0

    def update(self, found_inf: bool) -> None:
        """After a step: back off on overflow, grow after SCALE_INTERVAL good steps (dynamic only)."""
        if not self.dynamic:
            return
        if found_inf:
            self.scale *= SCALE_BACKOFF
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == SCALE_INTERVAL:
                self.scale *= SCALE_GROWTH
                self.good_steps = 0


def _check_loss_scale(loss_scale: Any) -> tuple[float, bool]:
    if loss_scale is None:
        return 1.0, False
    if loss_scale == "dynamic":
        return SCALE_INIT, True
    if isinstance(loss_scale, str):
        raise ValueError(f"loss_scale must be None, a positive number or 'dynamic', got {loss_scale!r}")
    value = _real(loss_scale, "loss_scale")
    if value <= 0:
        raise ValueError(f"loss_scale must be > 0, got {value}")
    check_inverse(value, "loss_scale")
    return value, False


FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max


def check_inverse(value: float, name: str) -> None:
    """A static loss scale whose inverse (the kernel's gradient scale) overflows fp32 is refused where it is given:
    step() found it only inside the update, midway, and the optimizer refused everything after."""
    if 1.0 / value > FP32_MAX:
        raise ValueError(f"{name} must be >= {1 / FP32_MAX:.4g} (its inverse scales the gradients in fp32), "
                         f"got {value}")  # fmt: skip
