"""Memory planner: bytes per device for DDP, ZeRO-1/2/3, ZeRO-2/3 + CPU offload and ZeRO-Infinity (NVMe).

Model states follow the ZeRO paper: 2 bytes of fp16/bf16 parameters, 2 of gradients and K of optimizer
state per parameter (K = 12 for mixed-precision Adam: fp32 master, momentum, variance). On top of the model
states every GPU needs activations and workspace (options), and only part of its memory is usable (the
allocator's fragmentation reserve). Each row's formula, with its source, is in `_per_param`.

Activations are either given (`activations`) or derived from the model's shape (`seq`, `batch`, `hidden`, `layers`;
`activation_bytes`) for one of four modes: no checkpointing, checkpointing (each layer's input kept on the GPU),
checkpointing + offload (zo_kernels.checkpoint: the layer inputs in pinned host memory, two in flight on the GPU) and
the same with a checkpoint around each half layer (attention, MLP).

Stage 3 rows also hold a working set on the GPU (`working_set`): the largest gathered layer's 16-bit
parameters, (1 + prefetch) of them in flight, and that layer's 16-bit gradient before it is reduce-scattered,
plus the gradient buckets. ZeroOffloadAdamW prefetches units (a module's own parameters), not layers: with
`prefetch_params` (the largest unit gathered ahead) the layer in flight is one and the prefetch is of units.
Modelled: model states, that working set, buckets, the NVMe rows' host I/O pool, and activations + workspace (per
GPU). Not modelled: memory-centric tiling of a layer too large to gather, the
allocator's behaviour beyond a fixed reserve, pinned-memory limits and NVMe bandwidth (only capacity).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .offload.layout import BUCKETS_PER_MODEL, DEFAULT_BUCKET_NUMEL, MAX_DEFAULT_BUCKET_NUMEL, default_bucket_numel

STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-2 + offload", "ZeRO-3 + offload", "ZeRO-Inf (opt)",
              "ZeRO-Infinity", "zo Infinity")  # fmt: skip
STAGE3 = frozenset({"ZeRO-3", "ZeRO-3 + offload", "ZeRO-Inf (opt)", "ZeRO-Infinity", "zo Infinity"})
NVME_ROWS = frozenset({"ZeRO-Inf (opt)", "ZeRO-Infinity", "zo Infinity"})
LAYERS_GUESS = 32  # without layer_params the largest gathered layer is params / 32: one block of a 32-block model
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9, "T": 1e12, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
MAX_GPUS = 10**9  # beyond it the per-GPU shares underflow to 0 and big ints overflow float division
_COUNTS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
UNITS = {"GB": 1e9, "TB": 1e12, "GiB": 2**30, "TiB": 2**40}  # the printed table's units
STATE_DTYPES = ("fp32", "bf16", "8bit")  # ZeroOffloadAdamW's state_dtype: the Adam moments' format
# no checkpointing, checkpointing, checkpointing + offload (a checkpoint per layer, or per half layer)
ACTIVATION_MODES = ("none", "checkpoint", "offload", "offload_half")
MODE_NAMES = {"none": "no checkpointing", "checkpoint": "checkpointing", "offload": "checkpointing + offload",
              "offload_half": "half layers + offload"}  # fmt: skip


def state_k(state_dtype: str) -> float:
    """K (optimizer bytes per parameter) of mixed-precision Adam with the moments in `state_dtype`: the fp32 master
    (4) + both moments: fp32 8, bf16 4, 8-bit 2 + two fp32 scales per 256 elements (0.03125)."""
    moments = {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 8 / 256}
    if state_dtype not in moments:
        raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
    return 4.0 + moments[state_dtype]


@dataclass(frozen=True)
class ActivationShape:
    """The transformer shape activations are derived from (per GPU: `batch` is the micro-batch of one GPU).

    Args:
        seq, batch: tokens per sequence and sequences per micro-batch. hidden, layers: the model's width and depth.
        heads: attention heads (only counted with attention="eager"). vocab: 0, or the logits' width.
        attention: "flash" (no s x s scores kept) or "eager" (scores, softmax and its dropout kept).
    """

    seq: int
    batch: int
    hidden: int
    layers: int
    heads: int = 0
    vocab: int = 0
    attention: str = "flash"

    def layer_bytes(self) -> float:
        """One layer's activations kept for backward, 16-bit: 34 sbh (+ 5 a s^2 b with eager attention).

        Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022), eq. (1)
        without tensor parallelism: a GPT layer keeps sbh(34 + 5as/h) bytes; memory-efficient (flash) attention
        keeps no s x s scores, which leaves 34 sbh."""
        s, b, h = self.seq, self.batch, self.hidden
        return 34.0 * s * b * h + (5.0 * self.heads * s * s * b if self.attention == "eager" else 0.0)

    def half_bytes(self) -> float:
        """The larger half of a layer checkpointed apart: attention with its layernorm keeps 13 sbh (+ 5 a s^2 b
        eager), the MLP with its own 21 sbh (the same source's 11 + 19 sbh and 2 sbh per layernorm)."""
        s, b, h = self.seq, self.batch, self.hidden
        return max(13.0 * s * b * h + (5.0 * self.heads * s * s * b if self.attention == "eager" else 0.0),
                   21.0 * s * b * h)  # fmt: skip

    def checkpoint_bytes(self) -> float:
        """One layer's checkpoint: its 16-bit input, 2 sbh."""
        return 2.0 * self.seq * self.batch * self.hidden

    def logits_bytes(self) -> float:
        """The output layer's 16-bit logits and their fp32 copy for the loss: 6 sbV (0 without vocab)."""
        return 6.0 * self.seq * self.batch * self.vocab


def activation_bytes(shape: ActivationShape, mode: str) -> tuple[float, float]:
    """(GPU, host) activation bytes per GPU for a mode of ACTIVATION_MODES.

    none: every layer's activations. checkpoint: every layer's input, plus the layer being recomputed.
    offload: the recomputed layer plus two inputs in flight on the GPU (the one in use, the one prefetched; the
    last layer's input stays there, as it is recomputed first); every other layer's input in pinned host memory.
    offload_half: the same with a checkpoint around each half layer (attention, MLP): the larger half recomputed,
    two half-layer inputs (2 sbh each) in flight, the other 2 L - 1 on the host."""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"activation_mode must be one of {ACTIVATION_MODES}, got {mode!r}")
    layer, ckpt, logits = shape.layer_bytes(), shape.checkpoint_bytes(), shape.logits_bytes()
    if mode == "none":
        return shape.layers * layer + logits, 0.0
    if mode == "checkpoint":
        return shape.layers * ckpt + layer + logits, 0.0
    if mode == "offload_half":
        return min(2, 2 * shape.layers) * ckpt + shape.half_bytes() + logits, (2 * shape.layers - 1) * ckpt
    return min(2, shape.layers) * ckpt + layer + logits, (shape.layers - 1) * ckpt


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
    value = _parse(text, name, _UNITS, "32GiB, 32GB, 1.5TB", "size")
    if isinstance(text, str) and 0 < value < 2**20 and not text.strip()[-1:].isalpha():
        raise ValueError(f"{name}: {text.strip()!r} has no unit, so it reads as {value:g} bytes: give a unit, e.g. "
                         f"{text.strip()}GB or {text.strip()}GiB")  # fmt: skip
    return value


def parse_count(text: str | float, name: str = "params") -> float:
    """'13e9', '13B', '1.4B', '350M' -> a count (> 0)."""
    value = _parse(text, name, _COUNTS, "13e9, 13B, 350M", "count")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {text!r}")
    return value


@dataclass
class StrategyPlan:
    """One strategy's bytes per device (GPU, host and NVMe) and whether they fit.

    Args:
        strategy: one of STRATEGIES. gpu_states: model-state bytes on each GPU (the ZeRO table's column).
        gpu_total: gpu_states + working set (stage 3) + buckets (offload, stage 3) + activations + workspace.
        host: host bytes per GPU (model states + the NVMe rows' I/O pool).
        fits_gpu, fits_host: against the usable GPU memory and the host memory per GPU.
        max_params: the largest model this strategy can train on this hardware.
        nvme: NVMe bytes per GPU. fits_nvme: against the NVMe capacity per GPU.
        working_set: the stage-3 GPU bytes of gathered layers in flight and the gathered layer's gradient.
    """

    strategy: str
    gpu_states: float
    gpu_total: float
    host: float
    fits_gpu: bool
    fits_host: bool
    max_params: float
    nvme: float = 0.0
    fits_nvme: bool = True
    working_set: float = 0.0

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host and self.fits_nvme


@dataclass
class Plan:
    """The planner's answer for a model on some hardware, per strategy, with its assumptions.

    Args:
        layer_params: the largest gathered layer's parameters (stage 3); 0 means params / LAYERS_GUESS.
        prefetch: layers (or units of prefetch_params) gathered ahead of the one computing. io_pool: host I/O
            buffers per GPU (NVMe rows).
        prefetch_params: the largest unit gathered ahead of the layer computing; 0 means a whole layer.
        nvme_mem: NVMe capacity per host (shared like host_mem by the GPUs of one host).
    """

    params: float
    gpus: int
    gpu_mem: float
    host_mem: float
    k: float
    activations: float
    workspace: float
    reserve: float
    bucket_bytes: float
    nvme_mem: float = 0.0
    gpus_per_host: int = 1
    layer_params: float = 0.0
    prefetch: int = 1
    io_pool: float = 0.0
    prefetch_params: float = 0.0
    strategies: list[StrategyPlan] = field(default_factory=list)
    shape: ActivationShape | None = None  # activations derived from it (else given)
    activation_mode: str = "checkpoint"
    activation_host: float = 0.0  # host bytes per GPU of offloaded checkpoints
    buckets_by_size: bool = False  # bucket_bytes is ZeroOffloadAdamW's default for `params` (`default_bucket_bytes`)
    largest_param: int = 0  # with it: the embedding's vocab x hidden (a bucket of its own where it is larger)

    @property
    def usable_gpu(self) -> float:
        """GPU memory left after the fragmentation reserve, activations and workspace."""
        return self.gpu_mem * (1 - self.reserve) - self.activations - self.workspace

    @property
    def layer(self) -> float:
        """The largest gathered layer's parameter count for this model (given, or params / LAYERS_GUESS)."""
        return self.layer_params or self.params / LAYERS_GUESS

    @property
    def working_set(self) -> float:
        """Stage 3's GPU bytes of gathered parameters and the layer's gradient: working_set_per_layer_param x layer,
        or with prefetch_params 2 + 2 B per layer parameter and 2 x prefetch B per prefetched unit parameter."""
        if not self.prefetch_params:
            return working_set_per_layer_param(self.prefetch) * self.layer
        return 4.0 * self.layer + 2.0 * self.prefetch * self.prefetch_params

    def row(self, strategy: str) -> StrategyPlan:
        return next(s for s in self.strategies if s.strategy == strategy)

    def longest_seq(self, mode: str, strategy: str) -> int:
        """The longest sequence (at this batch and shape) whose activations in `mode` fit beside `strategy`'s other
        GPU bytes and, offloaded, in its host memory; 0 if none."""
        return self.longest_seq_bound(mode, strategy)[0]

    def longest_seq_bound(self, mode: str, strategy: str) -> tuple[int, str]:
        """(longest_seq, what bounds it: "GPU" or "host", the memory one more token would overflow)."""
        if self.shape is None:
            raise ValueError("longest_seq needs the activation shape (plan(..., seq=, batch=, hidden=, layers=))")
        r = self.row(strategy)
        gpu_left = self.gpu_mem * (1 - self.reserve) - (r.gpu_total - self.activations)
        host_left = self.host_mem / self.gpus_per_host - (r.host - self.activation_host)

        def sizes(seq: int) -> tuple[float, float]:
            return activation_bytes(ActivationShape(**{**self.shape.__dict__, "seq": seq}), mode)

        def fits(seq: int) -> bool:
            g, h = sizes(seq)
            return g <= gpu_left and h <= host_left

        lo, hi = 0, 1
        while fits(hi) and hi < 1 << 40:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo, "GPU" if sizes(lo + 1)[0] > gpu_left else "host"


def _per_param(strategy: str, k: float, n: int) -> tuple[float, float, float]:
    """(GPU, host, NVMe) bytes of model states per parameter per device.

    Sources (docs/design.md, "The planner's formulas"; the papers by title):
    - DDP (2+2+K), ZeRO-1 P_os (2+2+K/N), ZeRO-2 P_os+g (2+(2+K)/N), ZeRO-3 P_os+g+p (2+2+K)/N: ZeRO (Rajbhandari
      et al., 2020), Figure 1 and §5 (7.5B, N = 64, K = 12: 120, 31.4, 16.6, 1.9 GB).
    - ZeRO-2 + offload: ZeRO-Offload (Ren et al., 2021), §4: p16 stays on the GPU (2), the partition's g16, p32,
      m, v move to the host ((2+K)/N). No p16 staging: CPU Adam writes each new p16 over the g16 it has just read
      and the writeback copies from there (zo_kernels/offload/update.py, params_over_grads).
    - ZeRO-3 + offload (offload_param=cpu, offload_optimizer=cpu): no persistent state on the GPU; the host keeps
      the p16 shard, the g16 landing, p32, m, v: (2+2+K)/N. The p16 shard is the writeback's destination, so no
      separate staging.
    - ZeRO-Inf (opt) (offload_param=cpu, offload_optimizer=nvme) and ZeRO-Infinity (both on NVMe): ZeRO-Infinity
      (Rajbhandari et al., 2021), §3 and §5, which offloads every model state; the host keeps only an I/O pool
      (+ the p16 shard). So the NVMe holds the partition's g16 and p32, m, v ((2+K)/N), and with
      offload_param=nvme the p16 shard too. The paper counts 20 bytes per parameter: 2 + 2 + K with K = 16 (an
      fp32 gradient copy as well).
    - zo Infinity: what ZeroOffloadAdamW(stage=3, offload_param="nvme", offload_optimizer="nvme") holds (read
      from its buffers, zo_kernels/offload/): the g16 landing buffer stays in host memory (2/N); the p16 shard
      and p32, m, v are files on NVMe ((2+K)/N).
    """
    return {
        "DDP": (2 + 2 + k, 0.0, 0.0),
        "ZeRO-1": (2 + 2 + k / n, 0.0, 0.0),
        "ZeRO-2": (2 + (2 + k) / n, 0.0, 0.0),
        "ZeRO-3": ((2 + 2 + k) / n, 0.0, 0.0),
        "ZeRO-2 + offload": (2.0, (2 + k) / n, 0.0),
        "ZeRO-3 + offload": (0.0, (2 + 2 + k) / n, 0.0),
        "ZeRO-Inf (opt)": (0.0, 2 / n, (2 + k) / n),
        "ZeRO-Infinity": (0.0, 0.0, (2 + 2 + k) / n),
        "zo Infinity": (0.0, 2 / n, (2 + k) / n),
    }[strategy]


def _host_extra(strategy: str, n: int, accumulation: bool, dpu: bool) -> float:
    """Host bytes per parameter that ZeroOffloadAdamW adds to an offload row (docs/design.md, "Memory model"): with
    gradient accumulation an fp32 accumulator per landing buffer (4/N, two under DPU); under DPU a second g16
    landing buffer (2/N) and, where the writeback has no staging of its own (ZeRO-3 + offload), a p16 staging
    buffer (2/N). zo Infinity refuses DPU; the paper's ZeRO-Inf rows keep gradients on NVMe."""
    if strategy not in ("ZeRO-2 + offload", "ZeRO-3 + offload", "zo Infinity"):
        return 0.0
    dpu = dpu and strategy != "zo Infinity"
    extra = (4 / n) * (2 if dpu else 1) if accumulation else 0.0
    if dpu:
        extra += 2 / n + (2 / n if strategy == "ZeRO-3 + offload" else 0.0)
    return extra


def _selective_extra(f: float, n: int, accumulation: bool) -> tuple[float, float]:
    """(GPU, host) bytes per parameter that selective (fraction f) adds to the ZeRO-2 + offload row, S = f P the
    selected elements of a partition P = params / N (zo_kernels/offload/selective.py and selected.py; a model's
    0/1-dim params, selected whole, not counted). GPU: the selection's p32, m, v (12S), its index (8S), its gathered
    fp32 gradient (4S, + 4S with accumulation). Host: two fp32 window sums (8P), the p16 staging the writeback
    copies from (2P), the selection's index (8S) and the pinned shuttle of its state (12S). (Its second gradient
    landing buffer and accumulator are DPU's: `_host_extra`.)"""
    return (24 + (4 if accumulation else 0)) * f / n, (10 + 20 * f) / n


def working_set_per_layer_param(prefetch: int) -> float:
    """Stage-3 GPU bytes per parameter of the largest layer: 2 (1 + prefetch) gathered p16 + 2 of its g16.

    With prefetch = 0 this is the ZeRO-Infinity paper's model-state working memory (§3: the parameters and
    gradients of the largest operator in 16 bits, 4 bytes per parameter; 16 hd^2 for a Transformer).
    """
    return 2.0 * (1 + prefetch) + 2.0


def default_bucket_bytes(params: float, largest_param: int = 0) -> int:
    """The device bytes of ZeroOffloadAdamW's two default gradient buckets (bf16) for a model of `params` whose
    largest parameter has `largest_param` elements (a parameter larger than the bucket is a bucket of its own, and
    the two buffers are the largest bucket's size; a model smaller than the bucket is one bucket of its size).
    Autograd's gradients of the bucket being filled, up to one more bucket's bytes, are not counted here: they belong
    with the activations."""
    n = int(min(params, 2**62))
    return 2 * 2 * max(min(default_bucket_numel(n), n), largest_param)


def _largest_by_size(cap: float, per_param: float, fixed: float, largest_param: int = 0) -> float:
    """The largest params with per_param * params + fixed + default_bucket_bytes(params, largest_param) <= cap: the
    largest fit over each default bucket size's range of models (the bucket grows with the model, in steps)."""
    best, lo, size = 0.0, 0.0, DEFAULT_BUCKET_NUMEL
    while size <= MAX_DEFAULT_BUCKET_NUMEL:
        hi = BUCKETS_PER_MODEL * size if size < MAX_DEFAULT_BUCKET_NUMEL else math.inf
        m = min(hi, _largest(cap, per_param, fixed + 4.0 * max(size, largest_param)))
        if m > lo or (size == DEFAULT_BUCKET_NUMEL and m > 0):
            best = max(best, m)
        lo, size = hi, 2 * size
    return best


def _largest(cap: float, per_param: float, fixed: float) -> float:
    """The largest params with per_param * params + fixed <= cap."""
    if fixed > cap:
        return 0.0
    return (cap - fixed) / per_param if per_param > 0 else math.inf


def _int_at_least(value: object, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def plan(
    params: float | str,
    gpus: int = 1,
    gpu_mem: float | str = "32GiB",
    host_mem: float | str = "768GiB",
    *,
    k: float = 12,
    activations: float | str | None = None,
    workspace: float | str = "1GiB",
    reserve: float = 0.05,
    bucket_bytes: float | str | None = None,
    gpus_per_host: int | None = None,
    nvme: float | str = 0,
    layer_params: float | str | None = None,
    prefetch: int = 1,
    io_pool: float | str = "1GiB",
    accumulation: bool = False,
    dpu: bool = False,
    seq: int | None = None,
    batch: int = 1,
    hidden: int | None = None,
    layers: int | None = None,
    heads: int = 0,
    vocab: int = 0,
    attention: str = "flash",
    activation_mode: str = "checkpoint",
    prefetch_params: float | str | None = None,
    gpu_fraction: float = 0.0,
    selective: float = 0.0,
) -> Plan:
    """Bytes per device for each strategy, whether it fits, and the largest trainable model per strategy.

    Defaults: activations 4 GiB and workspace 1 GiB per GPU, 5% of GPU memory lost to fragmentation, two
    gradient buckets of ZeroOffloadAdamW's default size for the model (`default_bucket_bytes`: 64 MiB up to 537M
    params, 128 MiB to 1.07B, 256 MiB above, or two of the embedding where `vocab` x `hidden` is larger;
    `max_params` grows them with the model); all GPUs on one host unless
    `gpus_per_host` says otherwise; no NVMe; the largest gathered layer params / 32 unless `layer_params` gives it
    (then `max_params` keeps that layer); one layer prefetched; a 1 GiB host I/O pool per GPU for the NVMe rows.
    `accumulation` (several backward passes per step) and `dpu` (the delayed parameter update) add the host buffers
    ZeroOffloadAdamW then holds (`_host_extra`).
    With `seq` (and `hidden`, `layers`) the activations are derived for `activation_mode` (`activation_bytes`)
    instead of given; "offload" and "offload_half" add the offloaded checkpoints to every row's host bytes.
    `prefetch_params`: the largest unit prefetched while a layer computes (ZeroOffloadAdamW prefetches modules; in a
    pre-norm transformer whose blocks are checkpointed the peak is one block, `layer_params`, and the next block's
    first LayerNorm); None: whole layers, as the ZeRO-Infinity paper counts.
    `gpu_fraction` (ZeroOffloadAdamW's Twin-Flow) moves that fraction of the offload rows' partition state and
    gradients (K + 2 bytes per element, and the same fraction of `_host_extra`) from the host; on the GPU the tail
    keeps one landing buffer and one accumulator also under DPU, so DPU's second ones leave the host without
    reaching the GPU.
    `selective` (ZeroOffloadAdamW's selective fraction f, 0: off; stages 1-2, fp32 moments): the ZeRO-2 + offload row
    adds the buffers of `_selective_extra`.
    """
    params = parse_count(params, "params")
    _int_at_least(gpus, "gpus", 1)
    if gpus > MAX_GPUS:
        raise ValueError(f"gpus must be <= {MAX_GPUS:.0e}, got {str(gpus)[:20]}")
    per_host = gpus if gpus_per_host is None else gpus_per_host
    if isinstance(per_host, bool) or not isinstance(per_host, int) or not 1 <= per_host <= gpus:
        raise ValueError(f"gpus_per_host must be an int in [1, gpus], got {gpus_per_host!r}")
    if not (isinstance(k, (int, float)) and math.isfinite(k) and k >= 0):
        raise ValueError(f"k must be a number >= 0, got {k!r}")
    if not (isinstance(reserve, (int, float)) and 0 <= reserve < 1):
        raise ValueError(f"reserve must be a fraction in [0, 1), got {reserve!r}")
    _int_at_least(prefetch, "prefetch", 0)
    shape = _activation_shape(seq, batch, hidden, layers, heads, vocab, attention, activations)
    largest = shape.vocab * shape.hidden if shape else 0  # the embedding (and an untied head): one bucket each
    if activation_mode not in ACTIVATION_MODES:
        raise ValueError(f"activation_mode must be one of {ACTIVATION_MODES}, got {activation_mode!r}")
    act_gpu, act_host = activation_bytes(shape, activation_mode) if shape else (None, 0.0)
    if isinstance(gpu_fraction, bool) or not isinstance(gpu_fraction, (int, float)) or not 0 <= gpu_fraction <= 1:
        raise ValueError(f"gpu_fraction must be a number in [0, 1], got {gpu_fraction!r}")
    if isinstance(selective, bool) or not isinstance(selective, (int, float)) or not 0 <= selective <= 1:
        raise ValueError(f"selective must be a number in [0, 1] (0: off), got {selective!r}")
    if selective and (gpu_fraction or dpu or k != 12):
        raise ValueError("selective is refused with gpu_fraction > 0, dpu and moments other than fp32 (k = 12), "
                         "as ZeroOffloadAdamW refuses them")  # fmt: skip
    layer = 0.0 if layer_params is None else parse_count(layer_params, "layer_params")
    if layer > params:
        raise ValueError(f"layer_params must be <= params ({params:g}), got {layer_params!r}")
    unit = 0.0 if prefetch_params is None else parse_count(prefetch_params, "prefetch_params")
    if unit > params:
        raise ValueError(f"prefetch_params must be <= params ({params:g}), got {prefetch_params!r}")
    p = Plan(
        params=params, gpus=gpus, gpu_mem=parse_bytes(gpu_mem, "gpu_mem"), host_mem=parse_bytes(host_mem, "host_mem"),
        k=float(k), activations=act_gpu if shape else parse_bytes("4GiB" if activations is None else activations,
                                                                  "activations"),
        workspace=parse_bytes(workspace, "workspace"),
        reserve=float(reserve), buckets_by_size=bucket_bytes is None, largest_param=largest,
        bucket_bytes=(default_bucket_bytes(params, largest) if bucket_bytes is None
                      else parse_bytes(bucket_bytes, "bucket_bytes")),  # fmt: skip
        nvme_mem=parse_bytes(nvme, "nvme"), layer_params=layer, prefetch=prefetch,
        io_pool=parse_bytes(io_pool, "io_pool"), gpus_per_host=per_host, shape=shape,
        activation_mode=activation_mode, activation_host=act_host, prefetch_params=unit,
    )  # fmt: skip
    if p.gpu_mem <= 0:
        raise ValueError(f"gpu_mem must be > 0, got {gpu_mem!r}")
    if p.host_mem <= 0:
        raise ValueError(f"host_mem must be > 0, got {host_mem!r}")
    if gpus % per_host:
        raise ValueError(f"gpus_per_host must divide the number of GPUs (hosts of equal size), got {per_host} for "
                         f"{gpus} GPUs")  # fmt: skip
    host_per_gpu, nvme_per_gpu = p.host_mem / per_host, p.nvme_mem / per_host
    # the working set per layer parameter and its fixed part (units of prefetch_params ahead)
    w, w_fixed = (working_set_per_layer_param(prefetch), 0.0) if not unit else (4.0, 2.0 * prefetch * unit)
    for s in STRATEGIES:
        g, h, v = _per_param(s, p.k, gpus)
        # (selective's window sum reads one landing buffer beside the next backward: two, as under DPU)
        extra = _host_extra(s, gpus, accumulation, dpu or (bool(selective) and s == "ZeRO-2 + offload"))
        if s in ("ZeRO-2 + offload", "ZeRO-3 + offload"):  # gpu_fraction moves f of the partition's host buffers
            # to the GPU (p32, m, v, g16 landing and accumulators) except the stage-3 shard, which stays whole, the
            # p16 staging (ZeRO-3 + offload under DPU), which the tail does not need (the GPU casts its masters
            # straight into the parameters), and DPU's second landing buffer and accumulator: the tail has one of
            # each (the device's update reads them at once)
            shard = 2 / gpus if s == "ZeRO-3 + offload" else 0.0
            staging = 2 / gpus if s == "ZeRO-3 + offload" and dpu else 0.0
            second = (2 / gpus + (4 / gpus if accumulation else 0.0)) if dpu else 0.0
            scaled = h + extra - shard
            g, h = g + gpu_fraction * (scaled - staging - second), shard + (1 - gpu_fraction) * scaled
            if selective and s == "ZeRO-2 + offload":
                g_sel, h_sel = _selective_extra(selective, gpus, accumulation)
                g, h = g + g_sel, h + h_sel
        else:
            h += extra
        ws = p.working_set if s in STAGE3 else 0.0
        fixed = p.bucket_bytes if s == "ZeRO-2 + offload" or s in STAGE3 else 0.0
        pool = (p.io_pool if s in NVME_ROWS else 0.0) + act_host
        gpu_total = g * params + ws + p.activations + p.workspace + fixed
        # max_params: a given layer stays fixed as the model grows; the guessed one grows with it
        g_max, ws_fixed = (g, ws) if layer else (g + (w / LAYERS_GUESS if s in STAGE3 else 0.0),
                                                 w_fixed if s in STAGE3 else 0.0)  # fmt: skip
        on_gpu = (_largest_by_size(p.usable_gpu, g_max, ws_fixed, p.largest_param) if fixed and p.buckets_by_size
                  else _largest(p.usable_gpu, g_max, ws_fixed + fixed))  # fmt: skip
        max_params = min(on_gpu, _largest(host_per_gpu, h, pool), _largest(nvme_per_gpu, v, 0.0))
        row = StrategyPlan(s, g * params, gpu_total, h * params + pool, gpu_total <= p.gpu_mem * (1 - p.reserve),
                           h * params + pool <= host_per_gpu, max_params, nvme=v * params,
                           fits_nvme=v * params <= nvme_per_gpu, working_set=ws)  # fmt: skip
        p.strategies.append(row)
    return p


def _activation_shape(seq: object, batch: object, hidden: object, layers: object, heads: object, vocab: object,
                      attention: object, activations: object) -> ActivationShape | None:  # fmt: skip
    if seq is None:
        for name, value, default in (("hidden", hidden, None), ("layers", layers, None), ("heads", heads, 0),
                                     ("vocab", vocab, 0), ("batch", batch, 1)):  # fmt: skip
            if value != default:
                raise ValueError(f"{name} describes the activations: give seq as well")
        return None
    if activations is not None:
        raise ValueError("activations: give either activations or seq (activations derived from the shape)")
    for name, value in (("hidden", hidden), ("layers", layers)):
        if value is None:
            raise ValueError(f"{name}: needed with seq (the activations are derived from the model's shape)")
    if attention not in ("flash", "eager"):
        raise ValueError(f"attention must be 'flash' or 'eager', got {attention!r}")
    if attention == "eager" and heads == 0:
        raise ValueError("heads: needed with attention='eager' (the s x s scores are per head)")
    return ActivationShape(_int_at_least(seq, "seq", 1), _int_at_least(batch, "batch", 1),
                           _int_at_least(hidden, "hidden", 1), _int_at_least(layers, "layers", 1),
                           _int_at_least(heads, "heads", 0), _int_at_least(vocab, "vocab", 0), attention)  # fmt: skip


def _fmt_bytes(b: float, unit: str = "GB") -> str:
    return f"{b / UNITS[unit]:,.{1 if unit == 'GB' else 2}f} {unit}"


def _fmt_count(n: float) -> str:
    if math.isinf(n):
        return "unbounded"
    if n >= 999.5e6:  # (not "1,000M")
        return f"{n / 1e9:,.2f}B"
    if n >= 1e7:
        return f"{n / 1e6:,.0f}M"
    if n >= 1e6:
        return f"{n / 1e6:.3g}M"
    return f"{n:,.0f}" if n >= 1 else f"{n:.3g}"  # (137,000, not 0M)


def _activation_table(p: Plan, unit: str) -> list[str]:
    """Rows per activation mode: GPU and host bytes, and the longest sequence beside the leanest fitting strategy."""
    sh = p.shape
    assert sh is not None
    fitting = [r for r in p.strategies if r.fits_host and r.fits_nvme] or p.strategies
    # the strategy leaving the GPU the most room for activations (this library's row where several tie)
    lean = min(fitting, key=lambda r: (r.gpu_total - p.activations, not r.strategy.startswith("zo"))).strategy
    lines = ["", f"activations: seq {sh.seq}, batch {sh.batch}, hidden {sh.hidden}, {sh.layers} layers, "
                 f"{sh.attention} attention" + (f", vocab {sh.vocab}" if sh.vocab else ""),
             f"{'activations':<31}{'GPU':>12}{'host/GPU':>12}  longest seq beside {lean}"]  # fmt: skip
    for mode in ACTIVATION_MODES:
        g, h = activation_bytes(sh, mode)
        mark = " (used)" if mode == p.activation_mode else ""
        seq, bound = p.longest_seq_bound(mode, lean)
        lines.append(f"{MODE_NAMES[mode] + mark:<31}{_fmt_bytes(g, unit):>12}{_fmt_bytes(h, unit):>12}  "
                     f"{seq:,} ({bound} full)")  # fmt: skip
    return lines


def format_plan(p: Plan, show_max: bool = False, unit: str = "GB") -> str:
    """The planner's table as text, in `unit` (GB = 1e9 bytes, as in the ZeRO paper; GiB, TB, TiB)."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
    small = "GiB" if unit.endswith("iB") else "GB"
    layer = f"{_fmt_count(p.layer)} params" + ("" if p.layer_params else f" (params / {LAYERS_GUESS})")
    ws = p.working_set
    by_size = " (this size's default)" if p.buckets_by_size else ""
    ws_formula = ("4 B per layer parameter + 2 prefetch B per unit parameter" if p.prefetch_params
                  else "2 (1 + prefetch) + 2 B per layer parameter")  # fmt: skip
    b = lambda x: _fmt_bytes(x, small)  # noqa: E731 - (the table's unit family: GB with GB and TB, GiB with GiB, TiB)
    lines = [f"model {_fmt_count(p.params)} params, {p.gpus} GPU(s) x {b(p.gpu_mem)}, host {b(p.host_mem)}, NVMe "
             f"{b(p.nvme_mem)}, K = {p.k:g}",
             f"assumed per GPU: activations {b(p.activations)}, workspace {b(p.workspace)}, {p.reserve:.0%} "
             f"fragmentation reserve, buckets {b(p.bucket_bytes)}{by_size} (usable for model states: "
             f"{b(max(0.0, p.usable_gpu))})",
             f"stage 3: largest gathered layer {layer}, prefetch {p.prefetch}: working set {b(ws)} per GPU "
             f"({ws_formula}); NVMe rows: host I/O pool {b(p.io_pool)} per GPU", ""]  # fmt: skip
    if p.shape is not None:
        used = f"per GPU: activations ({MODE_NAMES[p.activation_mode]})"
        lines[1] = lines[1].replace("assumed per GPU: activations", used)
        lines[-1:-1] = _activation_table(p, unit)
    head = f"{'strategy':<18}{'GPU states':>12}{'GPU total':>12}{'host/GPU':>12}{'NVMe/GPU':>12}  fits"
    if show_max:
        head += f"{'max params':>14}"
    lines.append(head)
    for s in p.strategies:
        fits = "yes" if s.fits else ("no (GPU)" if not s.fits_gpu else "no (host)" if not s.fits_host else "no (NVMe)")
        row = f"{s.strategy:<18}{_fmt_bytes(s.gpu_states, unit):>12}{_fmt_bytes(s.gpu_total, unit):>12}"
        row += f"{_fmt_bytes(s.host, unit):>12}{_fmt_bytes(s.nvme, unit):>12}  {fits:<9}"
        if show_max:
            row += f"{_fmt_count(s.max_params):>13}"
        lines.append(row.rstrip())
    lines += [
        "",
        "ZeRO-3 + offload: params and optimizer on the host; ZeRO-Inf (opt): params on the host, gradients",
        "and optimizer on NVMe; ZeRO-Infinity: all on NVMe. Stage 3's GPU total holds the gathered layers.",
        "zo Infinity: this library's ZeroOffloadAdamW(stage=3, offload_param='nvme', offload_optimizer='nvme'):",
        "gradients in host memory, params and optimizer on NVMe.",
    ]
    if not any(s.fits for s in p.strategies):
        ways = ([f"fewer optimizer bytes per parameter (--state-dtype bf16 or 8bit: K = 8 or 6.03, not {p.k:g})"]
                if p.k > state_k("8bit") else [])  # fmt: skip
        ways += ["an NVMe drive for the last three rows (--nvme SIZE)"] if p.nvme_mem == 0 else []
        lines += ["", f"nothing fits: try {', '.join([*ways, 'more host memory, more GPUs'])}."]
    return "\n".join(lines)
