"""zo_kernels: hand-written kernels for ZeRO-Offload style training on one GPU plus the host CPU."""

from .versions import require_torch

require_torch()  # first: a torch older than the oldest checked one is refused before anything else is imported

from .activations import ActivationBuffers, checkpoint
from .buckets import Packed, cast, pack, unpack
from .checkpoint_io import load_checkpoint, save_checkpoint
from .cpu_adam import CPUAdam, accumulate, available_isas, best_isa, cpu_adam_step, stream_pass, sum_squares
from .offload import MemoryReport, ParamInit, ZeroOffloadAdafactor, ZeroOffloadAdamW
from .param_views import MovedGrad
from .planner import Plan, plan
from .quant8 import Quantized8bit

__version__ = "0.1.0"

__all__ = [
    "ActivationBuffers",
    "CPUAdam",
    "MemoryReport",
    "MovedGrad",
    "Packed",
    "ParamInit",
    "Plan",
    "Quantized8bit",
    "ZeroOffloadAdafactor",
    "ZeroOffloadAdamW",
    "accumulate",
    "available_isas",
    "best_isa",
    "cast",
    "checkpoint",
    "cpu_adam_step",
    "load_checkpoint",
    "pack",
    "plan",
    "save_checkpoint",
    "stream_pass",
    "sum_squares",
    "unpack",
]
