"""ZeroOffloadAdamW: ZeRO-1/2/3 with the optimizer state and the update offloaded to the CPU (ZeRO-Offload), the
state optionally on NVMe and (stage 3) the parameter shards optionally in host memory.

At stages 1 and 2 the device keeps one flat buffer of 16-bit parameters (the model's parameters become views of
it) and two gradient buckets; at stage 3 only this rank's shard (or none) and the modules being gathered. The host
keeps, for this rank's 1/N slice of the flat space, the fp32 masters, Adam's
moments and the landing buffer of the reduced gradients, where CPU Adam writes the new 16-bit parameters over the
gradients it read (a staging buffer of their own only with the state on NVMe, stage 3's host shard under DPU, or
selective).
See docs/design.md, "One step, as data flows". The same code runs with device = CPU (plain copies, the torch
path of `pack`): that is how it is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..cpu_adam import _check_threads, _real, bump_version, check_hparams
from ..optim_contract import check_torch_options, run_load_post_hooks, run_load_pre_hooks, state_dict_with_hooks
from ..param_views import alias, all_aliases, is_alias_of
from ..transport import HostTransport, Transport, default_transport
from . import report, state
from .checks import DTYPES, check_int, check_module_covered, check_offload, check_params, check_stage, check_trainable
from .comm import COLLECTIVE_TIMEOUT_S, Comm, beside_compute, pin_rank_threads
from .fence import ForwardWaits, TileFence
from .formats import block_of, check_state_dtype
from .grads import GradPath
from .layout import FlatLayout, default_bucket_numel
from .materialize import ParamInit, check_init, follower_values, swap_in
from .params import DeviceBytes, ParamShards, units_of
from .report import MemoryReport, PhaseTimes
from .scaler import FP32_MAX, LossScaler
from .selected import SelectedGrad
from .selective import SelectiveUpdate, check_selective, selection_bound
from .twin import TwinUpdate, check_gpu_fraction, device_split
from .update import DEFAULT_TILE_NUMEL, UPDATE_TIMEOUT_S, HostUpdate


def _trainable_only(group: dict[str, Any]) -> dict[str, Any]:
    """The group with its frozen params (and their names) left out: the optimizer keeps only what it trains."""
    keep = [i for i, p in enumerate(group["params"]) if p.requires_grad]
    out = {**group, "params": [group["params"][i] for i in keep]}
    if "param_names" in group:
        out["param_names"] = [group["param_names"][i] for i in keep]
    return out


class _OwnerRef:
    """p._zo_owner: the optimizer that owns p, held weakly (called: it, or None once gone). A pickled or deep-copied
    parameter has none (a weakref could not be pickled: torch.save(model) failed at every stage)."""

    __slots__ = ("_ref",)

    def __init__(self, owner: Any = None) -> None:
        self._ref = None if owner is None else weakref.ref(owner)

    def __call__(self) -> Any:
        return None if self._ref is None else self._ref()

    def __reduce__(self) -> tuple:
        return (_OwnerRef, ())


def _owners(groups: list[dict[str, Any]]) -> list[ZeroOffloadAdamW]:
    """The open optimizers that own these params: a new optimizer over them replaces them (as with torch's), closed
    once it is built (one at stage 3 first: it hands the parameters back whole)."""
    found: list[ZeroOffloadAdamW] = []
    for g in groups:
        for p in g["params"]:
            old = getattr(p, "_zo_owner", lambda: None)()
            if old is not None and not old._closed and p in old._index and old not in found:  # (not a deepcopy's)
                found.append(old)
    return found


def _from(part: str, name: str, doc: str) -> property:
    """A read-only attribute of the optimizer that lives in one of its parts (tests and tools read them)."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class ZeroOffloadAdamW(torch.optim.Optimizer):
    """AdamW with ZeRO-2 partitioning and the optimizer offloaded to the CPU; a torch.optim.Optimizer.

    Usage: build after the model is on its device (all params on one device), passing the model itself
    (`ZeroOffloadAdamW(model, ...)`) or its parameters / param groups with `module=model`; then per iteration
    `opt.backward(loss)` (or `loss.backward()` without a loss scale; with one it is refused) one or more times,
    `opt.step()` (or `opt.step(closure)`, as torch's optimizers: the closure runs first, with grad enabled).

    Semantics:
    - Construction takes the fp32 masters from the params' current values (rank 0's, broadcast), casts the
      params to `dtype` and places them in one flat device buffer (each parameter aliases its range of it
      with a storage of its own, so safetensors and HF/accelerate savers see separate tensors). Frozen params
      passed in `params`, and with `module` every floating-point parameter and buffer of the module, are cast
      to `dtype` too (as `model.to(dtype)` would): the whole model computes in `dtype`.
    - Gradients leave the device during backward, bucket by bucket; afterwards `p.grad` is a `MovedGrad`
      placeholder that raises on any use (a framework clipping p.grad fails loudly: pass `max_grad_norm`).
      Several backward calls before a step accumulate (sum) in fp32 on the host. A reentrant activation
      checkpoint runs one backward per segment inside the outer one: they count as one backward. `step()`
      consumes the gradients (the next backward starts a new accumulation); `zero_grad()` or
      `model.zero_grad()` discards them. `step()` with no backward since the last step is a no-op
      (`stats["skip_reason"] == "no gradients"`).
    - A parameter that received no gradient in a step (on any rank) is skipped as torch.optim.AdamW skips a
      parameter whose grad is None: no decay, no moment update; each parameter counts its own steps.
    - Gradients are averaged over the ranks as DDP averages them: each rank's are divided by N before the
      16-bit reduction (so that the sum cannot overflow where the average does not); `max_grad_norm` clips by the
      global norm of the average; the loss-scale inverse and the clip coefficient are one `grad_scale` of the
      kernel.
    - A step whose gradients hold inf/NaN (or overflow `dtype`) is skipped: nothing but the loss scale
      changes. `loss_scale="dynamic"` follows torch.amp.GradScaler (2**16, x2 after 2000 good steps, /2 on
      overflow); a number is a static scale.
    - Delayed parameter update (`delay_update_after=k`, ZeRO-Offload §5.2). Let P_j be the masters after
      update j. Steps 1..k are synchronous: forward i uses P_{i-1}. The step() of iteration i > k:
      (1) waits for the background update i-1 (if any) and writes P_{i-1} to the device; (2) checks
      overflow and the norm of gradient i; (3) starts update i (gradient i applied to P_{i-1}) in a
      background thread and returns. So for i >= k+2 forward i runs on P_{i-2}, while update i-1 runs on
      the CPU; new parameters reach the device only inside step(), never under a running forward.
      Gradient landing buffers are double so gradient i+1 never overwrites gradient i.
    - `state_dict()` is world-size independent: per parameter `step`, `exp_avg`, `exp_avg_sq` (torch's keys)
      and `master` (fp32), plus the loss scaler. With several ranks it is a collective (all ranks call it).

    Args:
        params: `model.parameters()` or param-group dicts (per-group lr, weight_decay, betas, eps).
        lr, betas, eps, weight_decay: AdamW's hyper-parameters (decoupled weight decay).
        dtype: the device parameters' dtype: torch.bfloat16 (default), torch.float16 or torch.float32 (with
            device = CPU on a CPU without bf16 instructions torch emulates bf16 matmuls: fp32 is ~20x faster there).
        loss_scale: None, a positive number (static) or "dynamic".
        max_grad_norm: clip the averaged gradient to this global L2 norm (None: no clipping).
        delay_update_after: k for the delayed parameter update (None: always synchronous).
        bucket_numel: elements per gradient bucket (default: 2**24, or for a model over 32 x 2**24 elements 1/32 of
            it rounded up to a power of two, at most 2**26: `default_bucket_numel`).
        process_group: None for torch.distributed's default group when initialized, else a single rank.
        transport: copy transport (default: CUDA streams on a GPU, plain copies on the CPU).
        threads: CPU threads for the update (default: this rank's share of the cores; an update running beside
            forward and backward, DPU's or selective's, leaves one of them, from 4 up, to the thread that drives the
            device; ZeroOffloadAdafactor's update is torch ops, on torch's threads).
        tile_numel: elements per tile of the update/writeback pipeline.
        update_timeout_s: the longest step() waits for a background (DPU) update before raising TimeoutError.
        collective_timeout_s: the longest a collective on a CPU (gloo) group may take before this rank raises
            (NCCL groups use their own watchdog, set by init_process_group's timeout).
        module: the model the params belong to: its other floating-point params and buffers follow `dtype`.
        offload_optimizer: where the fp32 master, exp_avg and exp_avg_sq live: "cpu" (host memory) or "nvme"
            (scratch files in `nvme_dir`, the moments in their state_dtype, streamed tile by tile through a
            bounded pool of aligned host buffers; removed by close(), a killed run's reclaimed by the next start).
        nvme_dir: an existing, writable directory (on an NVMe drive) for offload_optimizer="nvme".
        stage: the ZeRO stage. 1: every rank gets the whole reduced gradient (all-reduce), the optimizer state is
            partitioned. 2 (default): each rank receives only its partition's gradient (reduce). 3: the 16-bit
            parameters are partitioned too (needs the module): each module's own parameters are gathered just
            before its forward and again before its backward, and freed after; between uses a parameter is an
            empty tensor (use `with opt.gathered():` to read the weights outside forward). At stage 3 every rank
            must run the same modules in the same order (a rank that does not raises).
        offload_param: stage 3: where this rank's 16-bit shard lives between uses: None (the device), "cpu"
            (pinned host memory; copied to the device for each gather) or "nvme" (ZeRO-Infinity: a file beside the
            optimizer state, which must be on NVMe too; written by the streamed update, read for each gather
            through a pinned block; 16-bit dtype, no DPU).
        prefetch: stage 3: how many units (modules' parameters) to gather ahead of use, in the order recorded on
            the first iteration (0: none).
        maximize: ascend, as torch's maximize (the kernel negates the gradient).
        amsgrad, foreach, fused, capturable, differentiable: torch.optim.AdamW's options, accepted at their defaults
            (and False) so that code written for torch runs; True is refused with the reason.

    The torch.optim contract: named parameters (`model.named_parameters()`) give the groups `param_names`;
    state-dict hooks run as torch's; `opt.state[p]` is a snapshot (copies) of this rank's part of p's state
    (`step`, `exp_avg`, `exp_avg_sq`, `master`; p's shape with one rank, this rank's elements of p flat with
    several); the param groups are fixed at construction (add_param_group and an edited param_groups list are
    refused); it cannot be deep-copied or pickled (it owns the model's storage): save and load its state dict.
        state_dtype: the format of Adam's moments on the host (the masters stay fp32): torch.float32 (default),
            torch.bfloat16 (rounded to nearest even after each step), or "8bit" (blockwise: exp_avg signed and
            exp_avg_sq unsigned codes, one fp32 scale per 256 elements, zo_kernels.Quantized8bit; every parameter
            then starts on a 256-element boundary of the flat buffer). 12, 8 or 6.03 bytes of state per parameter,
            in host memory or (offload_optimizer="nvme") in the files and per step read from and written to them.
            state_dict() still gives fp32 moments per parameter (dequantized) and loads any format's; the exact
            bits travel beside them (see state_dict), so a checkpoint resumes bitwise in the same format.
        init: a zo_kernels.ParamInit for a model built on the meta device (`with torch.device("meta"):`): each
            parameter is made on init.device in fp32 from init.fn with a generator seeded per tensor name, one at a
            time; this rank's part goes into the masters and the 16-bit flat buffer or shard, so no full fp32 copy
            of the model exists (frozen params and buffers left on meta are made whole, in `dtype`). The values do
            not depend on the world size. Needs the model; offload_optimizer="cpu".
        gpu_fraction: Twin-Flow (ZeRO-Offload++): this fraction of each rank's partition (its tail) keeps its fp32
            master and moments, in state_dtype's format, on the device (K = 12, 8 or 6.03 bytes per parameter there,
            that much less on the host) and is updated there on a device stream (a Triton kernel with CPU Adam's
            arithmetic; on a CPU device torch's fused AdamW) while CPU Adam updates the rest; its gradients never
            go to the host. The same AdamW step (one clipping norm, overflow flag and loss scale over both parts;
            the same delay under DPU; bf16 and 8-bit moments stored as the host stores them); checkpoints do not
            depend on it. 0.0 (default): all on the host. Needs the 16-bit shard not on NVMe.
        dpu_writeback: under the delayed parameter update, how the next forward waits for the new parameters'
            copies to the device. "whole" (default): step() makes the device wait for the whole writeback, so any
            read of the parameters after step() (an EMA, a norm, a logger) sees the new values. "per_module"
            (stages 1/2 on one rank, the model passed): the writeback goes in tiles and each module's forward waits
            only for its own tiles, so the forward starts while later tiles are still copied; then a read of the
            parameters between step() and the end of the next forward, other than through the modules' forward,
            model.state_dict() or gathered(), must call opt.synchronize() first. At stage 3 the gathers always wait
            per unit (the parameters are read only through forward or gathered()).
        selective: None (exact AdamW), or ZenFlow's importance-selective update, an approximation of AdamW (see
            zo_kernels/offload/selective.py): {"fraction": 0.1, "select_every": 100, "apply_every": 4,
            "warmup": 0}, any key left out taking that default. Per step the top `fraction` of each parameter's
            columns by gradient norm (0-/1-D parameters: all of them) are updated on the device from fp32 state held
            there; the other columns' gradients are summed on the host and applied by CPU Adam in the background
            every `apply_every` steps; the columns are chosen again every `select_every` steps; the first `warmup`
            steps are plain ZeRO-Offload steps. Stages 1 and 2, fp32 moments in host memory, no
            delay_update_after. fraction=1.0 is exact AdamW.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        dtype: torch.dtype = torch.bfloat16,
        loss_scale: float | str | None = None,
        max_grad_norm: float | None = None,
        delay_update_after: int | None = None,
        bucket_numel: int | None = None,
        process_group: Any = None,
        transport: Transport | None = None,
        threads: int | None = None,
        tile_numel: int | None = None,
        update_timeout_s: float = UPDATE_TIMEOUT_S,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
        module: torch.nn.Module | None = None,
        offload_optimizer: str = "cpu",
        nvme_dir: str | os.PathLike | None = None,
        stage: int = 2,
        offload_param: str | None = None,
        prefetch: int = 1,
        maximize: bool = False,
        amsgrad: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        state_dtype: torch.dtype | str = torch.float32,
        init: ParamInit | None = None,
        gpu_fraction: float = 0.0,
        dpu_writeback: str = "whole",
        selective: dict[str, Any] | None = None,
    ) -> None:
        # Every argument is checked before anything (the model included) is modified.
        if isinstance(params, torch.nn.Module):
            if module is not None and module is not params:
                raise ValueError("params is a module and module= names another one: pass one of them")
            module, params = params, list(params.parameters())
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module or None, got {type(module).__name__}")
        defaults = self._defaults(lr, betas, eps, weight_decay)
        options = dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach, fused=fused, capturable=capturable,
                       differentiable=differentiable)  # fmt: skip
        options = check_torch_options(options, type(self).__name__)
        for key, value in {**options, "decoupled_weight_decay": True}.items():
            defaults.setdefault(key, value)  # (a subclass's own, e.g. Adafactor's maximize, comes first)
        if dtype not in DTYPES:
            raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
        self.state_format = check_state_dtype(state_dtype)
        self.scaler = LossScaler(loss_scale)
        if max_grad_norm is not None and (_real(max_grad_norm, "max_grad_norm") <= 0):
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.delay_update_after = check_int(delay_update_after, "delay_update_after", 0)
        bucket_numel = check_int(bucket_numel, "bucket_numel", 1)
        tile_numel = check_int(tile_numel, "tile_numel", 1)
        if threads is not None:
            _check_threads(threads)  # (at most MAX_THREADS: the kernels' bound)
        if transport is not None and not isinstance(transport, Transport):
            raise TypeError(f"transport must be a zo_kernels Transport or None, got {type(transport).__name__}")
        check_stage(stage, offload_param, module, nvme_dir, delay_update_after is not None, dtype)  # names the stage
        nvme_dir = check_offload(offload_optimizer, nvme_dir)
        self.gpu_fraction = check_gpu_fraction(gpu_fraction)
        if not isinstance(dpu_writeback, str) or dpu_writeback not in ("whole", "per_module"):
            raise ValueError(f"dpu_writeback must be 'whole' or 'per_module', got {dpu_writeback!r}")
        if dpu_writeback == "per_module" and delay_update_after is None:
            raise ValueError("dpu_writeback='per_module' needs the delayed parameter update (delay_update_after)")
        self.dpu_writeback = dpu_writeback
        if self.gpu_fraction:
            if self._update_class is not HostUpdate:
                raise ValueError(f"gpu_fraction is AdamW's: {type(self).__name__} keeps its whole state on the host "
                                 "(use gpu_fraction=0.0)")  # fmt: skip
            if offload_param == "nvme":
                raise ValueError(f"gpu_fraction={gpu_fraction} with offload_param='nvme' is not supported: the "
                                 "16-bit shard's file is written by the host update alone")  # fmt: skip
        prefetch = check_int(prefetch, "prefetch", 0, required=True)
        self.selective = check_selective(selective, stage=stage, offload_optimizer=offload_optimizer,
                                         state_format=self.state_format, delayed=delay_update_after is not None,
                                         rule=self._update_class, gpu_fraction=self.gpu_fraction)  # fmt: skip
        for name, value in (("update_timeout_s", update_timeout_s), ("collective_timeout_s", collective_timeout_s)):
            if _real(value, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if process_group is not None and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, "
                            f"got {type(process_group).__name__}")  # fmt: skip
        groups = check_params(params)
        for g in groups:  # (checked before an optimizer owning these params is touched: a refusal leaves it running)
            self._group_hparams({**defaults, **{k: v for k, v in g.items() if k != "params"}})
        if module is not None:
            check_module_covered(module, groups)
        owners = _owners(groups)
        for old in owners:
            if old.stage == 3:  # it hands the parameters back whole: their shapes are checked next
                old.close()
        trainable, device = check_trainable(groups)
        names = check_init(init, module, trainable, offload_optimizer)
        if init is not None:
            device = init.device
        is_trainable = {id(p) for p in trainable}
        followers = [p for g in groups for p in g["params"] if id(p) not in is_trainable]
        if module is not None:
            followers += [p for p in module.parameters() if id(p) not in is_trainable] + list(module.buffers())

        super().__init__([_trainable_only(g) for g in groups], defaults)
        for group in self.param_groups:
            self._group_hparams(group)

        self.dtype, self.device = dtype, device
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.update_timeout_s, self.collective_timeout_s = float(update_timeout_s), float(collective_timeout_s)
        self._times = PhaseTimes()  # seconds per phase since the last step
        self.comm = Comm(process_group, device, self.collective_timeout_s, self._times)
        self.threads = threads if threads is not None else pin_rank_threads(self.world, self.rank)
        # the update beside forward and backward (DPU, selective) leaves a core to the thread that drives the device
        self.background_threads = threads if threads is not None else beside_compute(self.threads)
        self.tile_numel = tile_numel or DEFAULT_TILE_NUMEL

        self._built = False  # add_param_group is refused once the flat layout exists
        self._closed = False
        self._interrupted: BaseException | None = None  # a step stopped midway (Ctrl-C...): until a state is loaded
        self._forward_waits: ForwardWaits | None = None
        self.stage, self.offload_param, self.prefetch = stage, offload_param, prefetch
        units = uses = None
        if stage == 3:
            units, uses = units_of(module, trainable)
        groups = [g["params"] for g in self.param_groups]
        if bucket_numel is None:
            bucket_numel = default_bucket_numel(sum(p.numel() for ps in groups for p in ps))
        self.layout = FlatLayout(groups, dtype, self.world, self.rank, bucket_numel, units=units,
                                 block=block_of(self.state_format))  # fmt: skip
        self.transport = transport if transport is not None else default_transport(device)
        self._own_transport = transport is None  # close() closes (returns the pinned memory of) what it made
        # frozen params and buffers left on meta: their values first (init's fn may fail on one: nothing swapped yet)
        follow = follower_values(init, module, is_trainable, dtype) if init is not None else []
        for old in owners:  # its last update reaches the parameters this one takes its masters from
            if not old._closed:
                old.synchronize()
        # (touches the model only once nothing else can fail)
        self._allocate(trainable, nvme_dir, uses, None if init is None else (init, names))
        for old in owners:  # replaced once this one is built (a failure above, e.g. a full disk, leaves it running)
            old.close()
        for t, values in follow:
            swap_in(t, values)
        del follow
        self._sync_followers(followers)
        self._cast_followers(followers)
        self._built = True
        self.stats: dict[str, Any] = {}
        if self.shards is None:
            self.grads.attach()
        else:  # autograd's accumulators record their param's shape when made: make them while gathered
            self.grads.attach(self.shards.accumulators())
            self.shards.attach(module)
        self._forward_waits = self._attach_tile_waits(module)
        for p in trainable:
            p._zo_owner = _OwnerRef(self)
        self._group_params = [list(g["params"]) for g in self.param_groups]  # what the layout was built from
        self._module = None if module is None else weakref.ref(module)
        self._named = [] if module is None else [(n, p) for n, p in module.named_parameters(remove_duplicate=False)
                                                 if id(p) in is_trainable]  # fmt: skip
        frozen_names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        self._frozen = {frozen_names.get(id(p), f"frozen param {k} (shape {tuple(p.shape)})"): p
                        for k, p in enumerate(t for t in followers if isinstance(t, torch.nn.Parameter))}  # fmt: skip

    # ------------------------------------------------------------------ construction

    @torch.no_grad()
    def _sync_followers(self, followers: list[torch.Tensor]) -> None:
        """Several ranks: rank 0's frozen params and buffers on every rank, as DDP syncs a module's states (the
        trainable ones are broadcast in _allocate): ranks that built the model with other values (a seed per rank)
        computed with frozen weights of their own, silently. Those on another kind of device than the parameters',
        and those whose elements share memory (an expanded tensor: nothing to write elementwise), are left; what is
        left depends on the model alone, so every rank broadcasts the same list."""
        if self.world == 1:
            return
        src, seen = self.comm.global_rank(0), set()
        for t in followers:
            if (id(t) in seen or t.is_meta or t.device.type != self.device.type or t.numel() == 0
                    or torch._debug_has_internal_overlap(t) == 1):  # fmt: skip  (2: a slice, "too hard": dense)
                continue
            seen.add(id(t))
            buf = t.data if t.is_contiguous() else t.data.contiguous()
            self.comm.collective("the initial broadcast of the frozen parameters and buffers", dist.broadcast, buf,
                                 src=src)  # fmt: skip
            if buf is not t.data:
                t.data.copy_(buf)

    @torch.no_grad()
    def _cast_followers(self, followers: list[torch.Tensor]) -> None:
        """Frozen params and the module's buffers follow `dtype`, so the whole model computes in it."""
        for t in followers:
            if t.is_floating_point() and t.dtype != self.dtype:
                t.data = t.data.to(self.dtype)

    @torch.no_grad()
    def _allocate(self, trainable: list[torch.Tensor], nvme_dir: str | None, uses: Any,
                  init: tuple[ParamInit, dict[torch.Tensor, str]] | None) -> None:  # fmt: skip
        pool_bytes = 8 * self.part * torch.empty((), dtype=self.dtype).element_size() + (1 << 20)
        self.transport.pool.max_bytes = max(self.transport.pool.max_bytes, pool_bytes)
        self.device_bytes = DeviceBytes()
        # NVMe: no full-size fp32 masters here; HostUpdate fills the files tile by tile from the params' values
        master = torch.zeros(self.part, dtype=torch.float32) if nvme_dir is None else None
        values_at = []  # NVMe: (start, end, the param's original values) in partition coordinates
        self.flat, self.shards = None, None
        if self.stage == 3:
            self.shards = ParamShards(self.layout, uses, self.dtype, self.device, self.comm, self.transport,
                                      offload=self.offload_param, prefetch=self.prefetch, counter=self.device_bytes,
                                      times=self._times)  # fmt: skip
        else:
            self.flat = torch.zeros(self.flat_numel, dtype=self.dtype, device=self.device)
            self.device_bytes.add(self.flat.numel() * self.flat.element_size())
        src = self.comm.global_rank(0)
        values_of = {}
        for p in trainable if init is None else []:  # (init: _materialise fills the same buffers)
            if self.world > 1:
                self.comm.collective("the initial broadcast of the parameters", dist.broadcast, p.data, src=src)
            off, n = self._offset[p], p.numel()
            values_of[p] = values = p.detach().reshape(-1)
            for a, b, pa in self.layout.owned(off, off + n, self.rank):
                if master is None:
                    values_at.append((pa, pa + b - a, values[a - off : b - off]))
                else:
                    master[pa : pa + b - a] = values[a - off : b - off].float().cpu()
        shards = self.shards
        if shards is None:
            connected = lambda p: is_alias_of(p, self.flat, self._offset[p])  # noqa: E731
            all_connected = all_aliases(self.layout.params, self.flat, self._offset)
            own, publish, update_transport = self.flat[self.part_lo : self.part_hi], self._publish_flat, self.transport
        else:  # (offload_param="nvme": no `own`; the update writes the parameters' file of the swapper)
            connected, own, publish = shards.connected, shards.shard, shards.on_update
            all_connected = None
            # a shard in host memory is written there by host copies; on the device, through the transport
            update_transport = self.transport if self.offload_param is None else HostTransport()
        self._own_update_transport = update_transport is not self.transport
        self._update_transport = update_transport

        def fill_master(lo: int, hi: int, out: torch.Tensor) -> None:  # out: [lo, hi) of the partition, zeroed
            for x, y, values in values_at:
                s, e = max(x, lo), min(y, hi)
                if s < e:
                    out[s - lo : e - lo] = values[s - x : e - x].float().cpu()

        # gpu_fraction: the partition's tail [split, part) stays on the device (twin.py)
        self.split = device_split(self.part, self.gpu_fraction, self.align) if self.gpu_fraction else self.part
        update_class, extra = self._update_class, {}  # (the update class's own keyword arguments)
        if self.split < self.part:
            update_class, extra = TwinUpdate, dict(split=self.split, device=self.device)
        self.grads = self.update = None
        try:  # everything that can fail (memory, the NVMe files, init's fn) before the model is touched
            if init is not None:
                self._materialise(trainable, *init, master)
            # selective: the selection's gradient is gathered on the device during backward (selected.py)
            selected = None if self.selective is None else SelectedGrad(
                selection_bound(self.layout, self.selective.fraction), self.device)  # fmt: skip
            self.grads = GradPath(self.layout, self.dtype, self.device, self.transport, self.comm, self.scaler,
                                  self._times,  # (a second landing buffer: DPU's update, selective's sum read one)
                                  slots=2 if self.delay_update_after is not None or self.selective is not None else 1,
                                  threads=self.threads, guard=self._check_alive, connected=connected,
                                  all_connected=all_connected,
                                  all_reduce=self.stage == 1, on_grad=shards and shards.on_grad,
                                  on_pass_end=shards and shards.on_pass_end, split=self.split,
                                  selected=selected)  # fmt: skip
            self.device_bytes.add(sum(b.numel() * b.element_size() for b in self.grads.bucket_bufs))
            if self.selective is not None:  # (staging of its own: the rest is updated during forward/backward)
                update_class = SelectiveUpdate
                extra = dict(selective=self.selective, device=self.device, selected=selected)
            self.update = update_class(self.layout, own, fill_master if master is None else master,
                                       update_transport, publish, threads=self.threads, tile_numel=self.tile_numel,
                                       delayed=self.delay_update_after is not None or self.selective is not None,
                                       timeout_s=self.update_timeout_s, times=self._times, nvme_dir=nvme_dir,
                                       params_dtype=self.dtype, state_fmt=self.state_format,
                                       params_over_grads=update_transport is self.transport,
                                       background_threads=self.background_threads, **extra)  # fmt: skip
        except BaseException:
            self._release_transports()
            raise
        if isinstance(self.update, SelectiveUpdate):  # its window sum reads a landing buffer beside the next backward
            self.grads.before_write = self.update.wait_readers
        if isinstance(self.update, TwinUpdate):  # the device's update reads the tail's one gradient buffer
            self.grads.tail_free = self.update.wait_device
        if (self.delay_update_after is not None and self.comm.world == 1 and type(self.update).start is HostUpdate.start
                and self.selective is None):  # fmt: skip
            # a delayed step's gradient: the background update, not the host at the end of backward, waits for its
            # last copies (one rank: the step's checks read the device's sums, nothing on the host)
            grads, after = self.grads, self.delay_update_after
            self.grads.defer_copies = lambda: grads.iteration >= after
        if self.update.params_over_grads:  # a state loaded between a delayed update and its writeback keeps its
            grads, host = self.grads, getattr(self.update, "host", self.update)  # parameters in the landing buffer
            slots = len(grads.landing)  # the next backward does not write (TwinUpdate: its host part)
            host.spare_landing = lambda: (grads.landing[(grads.iteration + 1) % slots], slots > 1)
        if self.split < self.part:  # the tail's p32, m, v, gradient landing (its fp32 accumulators: memory_report)
            tail_grads = self.grads.device_landing.numel() * self.grads.device_landing.element_size()
            self.device_bytes.add(self.update.device_state_bytes + tail_grads)
        if self.selective is not None:  # the selection's p32, m, v, gradient, index (its accumulator: memory_report)
            self.device_bytes.add(self.update.device_state_bytes)
        if shards is not None:
            shards.swapper = self.update.swapper
            # the model holds its optimizer at stage 3 (its module hooks hold the shards, which hold this): the
            # weights live here, so it is collected with the model, not before (a new optimizer over the model
            # finds it and closes it, which hands the weights back)
            shards.owner = self
            shards.before_forward = self.grads.close_dead_pass
        for p in trainable:
            values = values_of.get(p)
            if init is not None:  # (the values are in place already) the meta p becomes a tensor of the device
                swap_in(p, torch.empty(0, dtype=self.dtype, device=self.device))
            if shards is not None:
                shards.take(p, values)
            elif values is None:
                p.data = alias(self.flat, self._offset[p], self.layout.shape[p].numel(), self.layout.shape[p])
            else:
                off, n = self._offset[p], p.numel()
                self.flat[off : off + n].copy_(values)
                p.data = alias(self.flat, off, n, p.shape)
            p.grad = None

    @torch.no_grad()
    def _materialise(self, trainable: list[torch.Tensor], init: ParamInit, names: dict[torch.Tensor, str],
                     master: torch.Tensor) -> None:  # fmt: skip
        """init= (a model on the meta device): each parameter's fp32 values made on the device, one at a time; this
        rank's part into the masters, the 16-bit cast into the flat buffer (stages 1, 2) or this rank's shard."""
        for p in trainable:
            values = init.values(names[p], self.layout.shape[p]).reshape(-1)
            off, n = self._offset[p], values.numel()
            for a, b, pa in self.layout.owned(off, off + n, self.rank):
                master[pa : pa + b - a].copy_(values[a - off : b - off])
                if self.shards is not None and self.shards.shard is not None:
                    self.shards.shard[pa : pa + b - a].copy_(values[a - off : b - off])
            if self.shards is None:
                self.flat[off : off + n].copy_(values)
            del values

    def _release_transports(self) -> None:
        """The transports' host blocks back: those this optimizer took from a transport of the user's (which
        outlives it), every one of those it made (closed)."""
        if not self._own_transport:
            blocks = [self.shards.shard if self.shards is not None and self.offload_param == "cpu" else None]
            blocks += self.grads.landing if self.grads is not None else []
            if self.update is not None and not self.update.staging_in_place:
                blocks.append(self.update.staging_buf)
            if isinstance(self.update, SelectiveUpdate):
                blocks.append(self.update.shuttle)
            self.transport.synchronize()
            for t in blocks:
                if t is not None and self.transport.pool.holds(t):
                    self.transport.pool.give(t)
        if self._own_update_transport:
            self._update_transport.close()
        if self._own_transport and hasattr(self.transport, "close"):
            self.transport.synchronize()
            self.transport.close()

    def _attach_tile_waits(self, module: torch.nn.Module | None) -> ForwardWaits | None:
        """DPU with real copies: the writeback is tiled and each reader waits only for its tiles (fence.py): ZeRO-3's
        gathers, or (ZeRO-1/2, one rank, the model known, dpu_writeback="per_module") each module's forward. Else it
        is waited for whole (with N ranks at ZeRO-1/2 the all-gather of the partitions reads all of it at once; with
        gpu_fraction the tail is written by the device update)."""
        u = self.update
        if (self.delay_update_after is None or not isinstance(u, HostUpdate) or u.staging_in_place
                or not self._update_transport.needs_staging):  # fmt: skip
            return None
        if self.shards is not None:
            u.fence = self.shards.fence = TileFence(self._update_transport, self._times)
            return None
        if self.world > 1 or module is None or self.dpu_writeback == "whole":
            return None
        u.fence = TileFence(self.transport, self._times)
        return ForwardWaits(u.fence, self.layout, module)

    _update_class = HostUpdate  # the host update's rule (ZeroOffloadAdafactor: its own)

    def _defaults(self, lr: Any, betas: Any, eps: Any, weight_decay: Any) -> dict[str, Any]:
        """The param groups' defaults, checked (a subclass with another update rule has its own)."""
        check_hparams(lr, betas, eps, weight_decay)
        return dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)

    def _group_hparams(self, group: dict[str, Any]) -> dict[str, Any]:
        """A param group's hyper-parameters as the update takes them, checked, as numbers: a tensor lr (or beta)
        is read now, not when a delayed update runs, after the scheduler has changed it in place."""
        lr, beta1, beta2, eps, weight_decay = check_hparams(group["lr"], group["betas"], group["eps"],
                                                            group["weight_decay"])  # fmt: skip
        return dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                    maximize=bool(group.get("maximize")))  # fmt: skip

    def register_external_parameter(self, module: torch.nn.Module, param: torch.Tensor) -> None:
        """Stage 3: `module`'s forward reads `param`, a parameter of another module (e.g. a parent reading a child's
        weight, `F.linear(h, self.emb.weight)`): gather it around `module` too. Without this such a read finds an
        empty tensor. A no-op at stages 1 and 2."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(param, torch.Tensor) or param not in self._index:
            raise ValueError("param must be one of this optimizer's trainable parameters")
        self._check_alive()
        if self.shards is not None:
            self.shards.use(module, [self.shards.unit_of[param]])
        elif self._forward_waits is not None:  # its forward waits for param's tiles of the writeback too
            self._forward_waits.add(module, [param])

    def _publish_flat(self) -> None:
        """ZeRO-1/2: every rank's partition to every rank; autograd must refuse graphs that saved the old values."""
        self.comm.all_gather_flat(self.flat, self.part_lo, self.part_hi)
        bump_version(*self.layout.params)

    @contextlib.contextmanager
    def gathered(self, write: bool = False) -> Iterator[None]:
        """ZeRO-3: every parameter gathered (whole, on the device) inside the block, e.g. to save or evaluate the
        model outside forward; freed after. With write=True what the block writes into the parameters (e.g.
        model.load_state_dict; every rank the same values) is kept; call refresh_masters_from_model() after
        to make it the fp32 masters too. At stages 1 and 2 the parameters are always whole: the block only waits
        for the last writeback. Under the delayed update, write=True first lands the pending update, at every
        stage, as synchronize() does (the block's write is not overwritten by it, nor is it dropped): so a write
        block is `opt.synchronize()` then the block, and the trajectory goes on one step less stale, even if the
        block writes nothing. With several ranks every rank enters the block, at every stage (landing the update
        all-gathers the parameters; ZeRO-3's gathers are collectives too)."""
        if not isinstance(write, bool):  # ("no" would land the pending update)
            raise TypeError(f"write must be a bool, got {type(write).__name__}")
        if write:  # (load_checkpoint's way to the model's weights: after an interrupted step too)
            self._check_loadable()
            self.update.finish_pending(write=True)  # a pending (delayed) update must not overwrite the block's write
        else:
            self._check_alive()
        if self.shards is None:
            self.update.wait_written()
            yield
            return
        with self.shards.gathered(write):
            yield

    def _check_loadable(self) -> None:
        """load_state_dict's guard: an interrupted step does not stop it (loading a state is the way on)."""
        self._check_open()
        self._check_not_failed()

    def _check_between_steps(self) -> None:
        """load_state_dict's guard: not between backward and step (those gradients are of the state it replaces);
        zero gradients kept by zero_grad(set_to_none=False) are no backward's: a load goes on, as in torch."""
        if self.grads.n_backward or self.grads.in_backward:
            what = "zero_grad()" if self._interruption() is not None else "step() or zero_grad()"  # (step is refused)
            raise RuntimeError(f"load_state_dict() between backward and step(): call {what} first")

    def _interruption(self) -> BaseException | None:
        """What stopped a step midway (Ctrl-C, an exception in its update, synchronous or in the background), if one
        did since the last state was loaded; or a write of the weights into NVMe files (ZeRO-Infinity's
        model.load_state_dict, gathered(write=True), refresh_masters_from_model) that stopped partway: the files
        are torn as by a step, and only a whole state replaces them (load_checkpoint then loads it first)."""
        swapper = getattr(self.update, "swapper", None)
        torn = getattr(swapper, "torn", None)
        return self._interrupted or self.update.stopped or (RuntimeError(f"the NVMe files are torn: {torn}")
                                                             if torn else None)  # fmt: skip

    @contextlib.contextmanager
    def _midway(self) -> Iterator[None]:
        """A block that changes the state in parts (a step, a load): an exception inside (Ctrl-C...) leaves it part
        old, part new, so the optimizer is interrupted until a whole state is loaded."""
        try:
            yield
        except BaseException as e:
            self._interrupted = e
            raise

    def _loaded(self) -> None:
        """A whole state was loaded: an interrupted step is forgotten."""
        self._interrupted = self.update.stopped = None

    def _check_usable(self) -> None:
        interrupted = self._interruption()
        if interrupted is not None:
            raise RuntimeError("an earlier step() (or load_state_dict(), or a write of the weights into NVMe files) "
                               "stopped midway (see the chained exception): part of the state is new, part old; load "
                               "a checkpoint with the optimizer's state (zo_kernels.load_checkpoint, "
                               "opt.load_state_dict) to go on") from interrupted  # fmt: skip
        self._check_not_failed()

    def _check_not_failed(self) -> None:
        failed = self.comm.failed or self.update.failed
        if failed is not None:
            raise RuntimeError("this optimizer is unusable after an earlier failure (see the chained exception): "
                               "close it, build a new one and load a checkpoint into that") from failed  # fmt: skip

    # ------------------------------------------------------------------ the user's calls

    _params = _from("layout", "params", "The trainable parameters in flat order.")
    _index = _from("layout", "index", "{param: its position in the flat order}.")
    _offset = _from("layout", "offset", "{param: its flat offset}.")
    _pgroup = _from("layout", "pgroup", "Each parameter's group index.")
    _buckets = _from("layout", "buckets", "The gradient buckets, in backward order.")
    align = _from("layout", "align", "Elements per PARAM_ALIGN_BYTES.")
    numel = _from("layout", "numel", "Trainable elements (Φ).")
    flat_numel = _from("layout", "flat_numel", "Elements of the flat buffer (padding included).")
    part = _from("layout", "part", "Elements of this rank's partition.")
    part_lo = _from("layout", "part_lo", "Where this rank's partition starts in the flat buffer.")
    part_hi = _from("layout", "part_hi", "Where it ends.")

    master = _from("update", "master", "fp32 masters of this rank's partition.")
    exp_avg = _from("update", "exp_avg", "Adam's first moment of this rank's partition.")
    exp_avg_sq = _from("update", "exp_avg_sq", "Adam's second moment of this rank's partition.")
    staging_buf = _from("update", "staging_buf", "The new 16-bit parameters of this rank's partition, on the host "
                        "(None where they go over the gradients in the landing buffer).")

    landing = _from("grads", "landing", "The host buffers of this rank's reduced gradients (two under DPU).")

    group = _from("comm", "group", "The process group (None: a single rank).")
    world = _from("comm", "world", "Ranks in the process group (N).")
    rank = _from("comm", "rank", "This rank in the process group.")

    def group_rank_to_global(self, r: int) -> int:
        """Global rank of rank r of the optimizer's process group."""
        return self.comm.global_rank(r)

    def _collective(self, what: str, collective: Any, *args: Any, **kwargs: Any) -> None:
        """Run a torch.distributed collective on the optimizer's group and wait for it (bounded on gloo)."""
        self.comm.collective(what, collective, *args, **kwargs)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        return self.scaler.scale

    @torch.compiler.disable  # a compiled train step calls it eagerly: it runs hooks, copies, threads
    def backward(self, loss: torch.Tensor, *, retain_graph: bool | None = None) -> None:
        """loss * loss_scale, then backward (retain_graph as in loss.backward: keep the graph for another)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a tensor, got {type(loss).__name__}")
        if retain_graph is not None and not isinstance(retain_graph, bool):
            raise TypeError(f"retain_graph must be a bool or None, got {type(retain_graph).__name__}")
        if loss.numel() != 1:
            raise ValueError(f"loss must be a scalar tensor (one element), got shape {tuple(loss.shape)}")
        if not loss.requires_grad:
            raise ValueError("loss does not require grad: nothing to backpropagate")
        self._check_alive()
        self.grads.scaled_backward = True
        try:
            (loss.float() * self.scaler.scale if self.scaler.scale != 1.0 else loss).backward(retain_graph=retain_graph)
        finally:
            self.grads.scaled_backward = False
        self.grads.close_pass()  # a backward whose gradients all arrived in nested (reentrant) backwards

    @torch.compiler.disable  # a compiled train step calls it eagerly: it runs hooks, copies, threads
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients accumulated since the last step. With set_to_none=False the params that had a
        gradient keep a zero one, as in torch: the next step updates them (decay, moments) even if no new
        gradient arrives for them."""
        self._check_open()
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("zero_grad() was called during backward")
        if self.shards is not None and self.shards.running:  # (no forward runs now: one was interrupted)
            self.shards.forget_interrupted_forward()
        self.grads.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: the flat buffer and the partitions are laid out once."""
        if getattr(self, "_built", False):
            raise RuntimeError("ZeroOffloadAdamW cannot take new parameters after construction (its flat buffer "
                               "and partitions are laid out once): build a new optimizer over all of them")  # fmt: skip
        super().add_param_group(param_group)

    @torch.compiler.disable
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run the closure if given (with grad enabled, as torch's optimizers: Lightning's forward and backward),
        then consume the accumulated gradients; returns the closure's result."""
        if closure is not None and not callable(closure):
            raise TypeError(f"closure must be callable or None, got {type(closure).__name__}")
        self._check_alive()
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("step() was called during backward")
        if self.shards is not None and self.shards.running:  # (no forward runs now: one was interrupted)
            self.shards.forget_interrupted_forward()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._step()
        return loss

    def _step(self) -> None:
        """Consume the accumulated gradients: overflow check, clip, CPU update, parameters back to the device."""
        self.grads.check_untouched()
        self.grads.check_connected()
        self._check_groups()
        self._check_still_frozen()
        for gi, group in enumerate(self.param_groups):
            self._group_hparams(group)
            check_torch_options(group, f"param group {gi}")
        self.grads.close_pass(warn_partial=True)  # the last backward ran entirely inside nested (reentrant) backwards
        self.grads.drop_cleared()
        if self.max_grad_norm is not None and any(f != 1.0 for f in self.grads.factor):
            raise RuntimeError("the gradients were clipped twice: by p.grad.mul_ (e.g. Trainer's or accelerate's "
                               "clip_grad_norm_) and by max_grad_norm; use one (Trainer: max_grad_norm=0)")  # fmt: skip
        t_step = time.perf_counter()
        if self.grads.n_micro == 0:
            self._check_not_replaced()  # (the model's replaced parameters got the gradients)
            self.stats = {"skipped": True, "skip_reason": "no gradients", "loss_scale": self.scaler.scale,
                          "grad_norm": None}
            return None
        # this step is iteration grads.iteration + 1: delayed once it is past delay_update_after
        delayed = self.delay_update_after is not None and self.grads.iteration >= self.delay_update_after
        if delayed:
            self.update.finish_pending(write=True)
        with self._midway():  # (Ctrl-C in its checks) the gradients half consumed: a retry would sum them twice
            c = self.grads.consume()
        scale = self.scaler.scale
        norm = math.sqrt(c.sum_sq) / scale if math.isfinite(c.sum_sq) else float("inf")
        n_micro, got = c.n_backward, c.got
        if c.found_inf:
            self.scaler.update(found_inf=True)
            self._record_stats(t_step, skip_reason="overflow", grad_norm=norm, micro_batches=n_micro)
            return None
        clip = 1.0
        if self.max_grad_norm is not None:
            clip = min(1.0, self.max_grad_norm / (norm + 1e-6))
        grad_scale = clip / scale
        if grad_scale * max(c.factor, default=1.0) > FP32_MAX:  # (a dynamic scale halved that far): the kernel's
            self.scaler.update(found_inf=True)  # gradient scale would overflow fp32, the gradient be inf: an overflow
            self._record_stats(t_step, skip_reason="overflow", grad_norm=norm, micro_batches=n_micro)
            return None
        runs = self.layout.runs(got, self.update.steps, c.factor)
        with self._midway():  # the step counts move and part of the partition may come to hold the new step
            for i, g in enumerate(got):
                self.update.steps[i] += g
            self._set_group_steps()
            # the hyper-parameters as they are now: a scheduler may change them before a background update runs
            hparams = [self._group_hparams(g) for g in self.param_groups]
            extra = {} if c.device_grad is None else {"device_grad": c.device_grad}  # gpu_fraction's (twin.py)
            if self.update.params_over_grads:  # the new parameters go over the gradients (update.py)
                extra["out"] = c.landing
            if delayed:
                if c.copies:  # (defer_copies: the background thread waits for the gradient's copies)
                    extra["before"] = functools.partial(self.transport.wait_all, c.copies)
                self.update.start(c.grad, grad_scale, runs, hparams, **extra)
            elif self.selective is not None:
                self.update.selective_step(c.grad, grad_scale, runs, hparams, got, c.selected)
            else:
                self.update.run(c.grad, grad_scale, runs, hparams, **extra)
        self.scaler.update(found_inf=False)
        self._record_stats(t_step, skip_reason=None, grad_norm=norm, clip=clip, micro_batches=n_micro,
                           delayed=delayed, skipped_params=len(got) - sum(got))  # fmt: skip
        return None

    def _check_still_frozen(self) -> None:
        """A param frozen at construction is outside the flat layout: unfrozen, it would never be updated."""
        for name, p in self._frozen.items():
            if p.requires_grad:
                raise RuntimeError(f"{name} was frozen (requires_grad=False) when ZeroOffloadAdamW was built and now "
                                   "requires grad: it would get gradients but never be updated (the flat layout is "
                                   "fixed at construction). Freeze it again (p.requires_grad_(False); p.grad = None), "
                                   "or close() the optimizer and build a new one after unfreezing")  # fmt: skip

    def _check_not_replaced(self) -> None:
        """The model's trainable parameters are still the optimizer's: one replaced by another Parameter of its name
        trains nothing, silently (every step finds no gradient). Checked at load_state_dict and at a step with no
        gradient (not at every step: a walk over the model's parameters)."""
        m = self._module() if self._module is not None else None
        if m is None:
            return
        now = dict(m.named_parameters(remove_duplicate=False))
        for name, p in self._named:
            q = now.get(name)
            if q is not None and q is not p and q.requires_grad and q not in self.layout.index:  # (re-tied: fine)
                raise RuntimeError(
                    f"the model's parameter {name!r} is not the one {type(self).__name__} was built with: it was "
                    "replaced by another Parameter since (PEFT's load_adapter, which HF Trainer's "
                    "resume_from_checkpoint calls, upcasts 16-bit adapters into new fp32 Parameters), and the "
                    "optimizer would train the one it holds, never the model's. Build the optimizer after the "
                    "replacement; with Trainer + PEFT, resume with dtype=torch.float32 (fp32 adapters are not "
                    "recast) or through accelerate's save_state/load_state (it loads in place)")  # fmt: skip

    def _set_group_steps(self) -> None:
        """Each group's "step" is the count of its most-stepped parameter (each parameter counts its own)."""
        for gi, group in enumerate(self.param_groups):
            group["step"] = max(self.update.steps[i] for i, pg in enumerate(self._pgroup) if pg == gi)

    def _record_stats(self, t_step: float, skip_reason: str | None, **kw: Any) -> None:
        self._times.add("step", time.perf_counter() - t_step)
        self.stats = {"skipped": skip_reason is not None, "skip_reason": skip_reason, "loss_scale": self.scaler.scale,
                      **kw, **{f"time_{k}": v for k, v in self._times.items()}}  # fmt: skip
        self._times.clear()

    def _check_alive(self) -> None:
        """Raises when this optimizer was closed or failed earlier (the gradient path's guard)."""
        self._check_open()
        self._check_usable()

    def _check_groups(self) -> None:
        """The param groups must be those the flat layout was built from (torch's code may edit the list)."""
        groups = self.param_groups
        if len(groups) != len(self._group_params) or any(
                len(g["params"]) != len(ps) or any(a is not b for a, b in zip(g["params"], ps))
                for g, ps in zip(groups, self._group_params)):  # fmt: skip
            raise RuntimeError(f"param_groups was changed after construction ({len(groups)} groups of "
                               f"{[len(g['params']) for g in groups]} params, built with "
                               f"{[len(ps) for ps in self._group_params]}): ZeroOffloadAdamW lays its parameters out "
                               "once; build a new optimizer over all of them")  # fmt: skip

    def __deepcopy__(self, memo: dict) -> None:
        raise TypeError("ZeroOffloadAdamW cannot be copied: it owns the model's parameter storage, threads and "
                        "files; save opt.state_dict() and load it into a new ZeroOffloadAdamW")  # fmt: skip

    def __getstate__(self) -> None:
        raise TypeError("ZeroOffloadAdamW cannot be pickled or copied: it owns the model's parameter storage, "
                        "threads and files; save opt.state_dict() (or zo_kernels.save_checkpoint) instead")  # fmt: skip

    @property
    def state(self) -> state.StateView:  # type: ignore[override]
        """torch's per-parameter view, read-only: opt.state[p] is a snapshot of this rank's part of p's state."""
        return state.StateView(self)

    def _param_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return state.param_state(self, p)

    @state.setter
    def state(self, value: Any) -> None:
        # torch's Optimizer.__init__ assigns an empty dict, before the layout exists; the state lives in the host
        # update. After that an assignment raises (`opt.state = {}` to reset it did nothing), unless it hands back
        # this optimizer's own view (accelerate's wrapper forwards its `state` setter)
        if getattr(self, "_built", False) or value:
            if isinstance(value, state.StateView) and value._opt is self:
                return
            raise AttributeError("ZeroOffloadAdamW.state is read-only: use load_state_dict() (a fresh optimizer "
                                 "for a reset)")  # fmt: skip

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ZeroOffloadAdamW was closed: build a new one to go on training")

    def synchronize(self) -> None:
        """Finish a pending delayed update and send its parameters to the device (e.g. before evaluation). Under the
        delayed update this lands the update a step early: the next forward reads it, so training goes on along
        another trajectory than without the call (as exact as it, one step less stale)."""
        self._check_open()
        self.update.finish_pending(write=True)
        self.update.wait_written()

    # ------------------------------------------------------------------ state

    @torch.compiler.disable  # a compiled train step calls it eagerly: it runs hooks, copies, threads
    def state_dict(self) -> dict[str, Any]:
        """torch.optim layout, world-size independent: per param step/exp_avg/exp_avg_sq/master (fp32, CPU)."""
        return state_dict_with_hooks(self, lambda: state.state_dict(self))

    def check_state_dict(self, state_dict: dict[str, Any]) -> list[tuple[int, torch.Tensor, dict, int]]:
        """Check a state dict against this optimizer (groups, counts, shapes, values); change nothing.

        Returns the per-parameter entries to load as (group index, param, state, step).
        """
        return state.check_state_dict(self, state_dict)

    @torch.no_grad()
    @torch.compiler.disable  # a compiled train step calls it eagerly: it runs hooks, copies, threads
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class (any world size) or of torch.optim.AdamW.

        Without `master` entries (a plain AdamW state dict) the fp32 masters are kept if the model's device
        parameters are still their cast, else refreshed from the model (with a warning): load the model's
        weights before constructing the optimizer to keep full precision, and call synchronize() first while a
        delayed update is pending (its writeback has not reached the model: its update would be dropped).
        Everything is checked first.
        Every param-group key is restored (e.g. a scheduler's `initial_lr`); a parameter without saved state
        starts afresh (step 0, zero moments), as in torch.
        A state saved between a delayed update and its writeback restores that writeback as pending (the
        device parameters are then the model's, as saved with it: use zo_kernels.load_checkpoint).
        """
        self._check_not_replaced()
        state.load_state_dict(self, run_load_pre_hooks(self, state_dict))
        run_load_post_hooks(self)

    @torch.no_grad()
    def refresh_masters_from_model(self) -> None:
        """Take the fp32 masters from the model's current (device) parameters, e.g. after model.load_state_dict."""
        self._check_open()
        self.update.refresh_from_model()

    def memory_report(self) -> MemoryReport:
        """Every buffer this rank holds (device, host, NVMe), measured, each next to its formula (docs/design.md)."""
        self._check_open()
        return report.measure(self)

    def close(self) -> None:
        """Finish a pending update, remove the hooks, stop the background worker; using it afterwards raises.
        At stage 3 the model gets its parameters back whole (with several ranks a collective: all ranks close)."""
        if self._closed:
            return
        failed = None
        try:  # (a failed background update raises here: everything is released all the same, then it is raised)
            self.update.finish_pending(write=True)
            self.update.wait_written()
        except TimeoutError:  # the update may still run: nothing it writes is released under it
            raise
        except Exception as e:  # noqa: BLE001 (Ctrl-C stops the close: the update goes on, a second close finishes)
            failed = e
        if self._forward_waits is not None:
            self._forward_waits.detach()
        self.grads.detach()
        if self.shards is not None:
            self.shards.detach()
        self.update.close()
        self._release_transports()
        # Our reference to the process group goes: a gloo group kept alive by this object (which scripts keep until
        # exit) is destroyed in interpreter finalization, where its worker threads, releasing the tensors of the last
        # collectives, abort the process ("terminate called without an active exception"; tests/test_exit.py).
        self.comm.group = None
        self._closed = True
        if failed is not None:
            raise failed
