"""zo_kernels: hand-written kernels for ZeRO-Offload style training on one GPU plus the host CPU."""

from .buckets import Packed, cast, pack, unpack
from .cpu_adam import CPUAdam, available_isas, best_isa, cpu_adam_step, stream_pass

__version__ = "0.1.0"

__all__ = [
    "CPUAdam", "Packed", "available_isas", "best_isa", "cast", "cpu_adam_step", "pack", "stream_pass", "unpack",
]  # fmt: skip
