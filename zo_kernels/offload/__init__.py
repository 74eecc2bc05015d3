"""ZeroOffloadAdamW: ZeRO-1/2/3 with the optimizer state and the update offloaded to the CPU (ZeRO-Offload).

One concept per module; the data of one step walks through them in order:
- layout.py: the flat layout (params in flat order, 16-byte aligned offsets, segments and partitions, buckets, runs).
- params.py: ZeRO-3's parameter shards (gather around each module's forward and backward, prefetch, free).
- grads.py: the gradient path (hooks -> pack -> reduce -> copy -> landing, accumulation, p.grad placeholders).
- scaler.py: the loss scaler.
- update.py: the host update (masters and moments, CPU Adam, tiled writeback, staging, the DPU worker).
- comm.py: the process group (bounded collectives, all-gather of the parameters, gather of the state).
- state.py: state-dict conversion. report.py: MemoryReport. checks.py: argument checks.
- formats.py: the moments' formats (state_dtype: fp32, bf16, 8-bit blockwise).
- materialize.py: ParamInit, a model built on the meta device filled parameter by parameter (init=).
- optimizer.py: ZeroOffloadAdamW, which composes them. adafactor.py: ZeroOffloadAdafactor (its own host update).
"""

from .adafactor import ZeroOffloadAdafactor
from .checks import DTYPES, MAX_THREADS
from .comm import COLLECTIVE_TIMEOUT_S, GATHER_CHUNK_NUMEL, backend_for_device
from .layout import DEFAULT_BUCKET_NUMEL, MAX_DEFAULT_BUCKET_NUMEL, PARAM_ALIGN_BYTES, default_bucket_numel
from .materialize import ParamInit, tensor_seed
from .optimizer import ZeroOffloadAdamW
from .report import K_ADAM, MemoryReport
from .scaler import SCALE_BACKOFF, SCALE_GROWTH, SCALE_INIT, SCALE_INTERVAL
from .update import DEFAULT_TILE_NUMEL, UPDATE_TIMEOUT_S

__all__ = [
    "COLLECTIVE_TIMEOUT_S", "DEFAULT_BUCKET_NUMEL", "DEFAULT_TILE_NUMEL", "DTYPES", "GATHER_CHUNK_NUMEL", "K_ADAM",
    "MAX_DEFAULT_BUCKET_NUMEL", "MAX_THREADS", "PARAM_ALIGN_BYTES", "ParamInit", "SCALE_BACKOFF", "SCALE_GROWTH",
    "SCALE_INIT", "SCALE_INTERVAL", "UPDATE_TIMEOUT_S", "MemoryReport", "ZeroOffloadAdafactor", "ZeroOffloadAdamW",
    "backend_for_device", "default_bucket_numel", "tensor_seed",
]
