"""The gradient path: hooks -> pack -> reduce -> copy -> landing, accumulation over micro-batches, p.grad placeholders.

Gradients leave the device during backward, bucket by bucket, in bucket order (the same on every rank): each
bucket is packed into a device buffer (or, with one rank on the CPU, straight into the landing buffer), reduced
to the rank that owns each part of it and copied to that rank's host landing buffer. `p.grad` is then a
`MovedGrad` placeholder owned by the GradPath. Several backward passes before a step sum in an fp32 accumulator.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..buckets import plan
from ..cpu_adam import accumulate, sum_squares
from ..param_views import MovedGrad, in_nested_backward
from ..transport import Transport
from .comm import Comm
from .layout import Bucket, FlatLayout
from .report import PhaseTimes
from .scaler import FP32_MAX, LossScaler
from .selected import SelectedGrad

NESTED_OPEN_HELP = (
    "p.grad was read (a norm, a multiplication, zero_) while {n} parameters (the first: param {first}) still hold "
    "part of their gradient on the device and the rest is on the host: this backward's gradients all arrived inside "
    "reentrant checkpointing's nested backwards, which cannot end the optimizer's pass, and {why}. Clipping now "
    "would read and scale part of a gradient. Nothing was changed. Use torch.utils.checkpoint.checkpoint(..., "
    "use_reentrant=False) (HF: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{'use_reentrant': "
    "False}})), or clip with ZeroOffloadAdamW(max_grad_norm=...) instead of clip_grad_norm_"
)

PARTIAL_HELP = (
    "this step's gradients all arrived inside reentrant checkpointing's nested backwards and loss.backward() was "
    "called directly, so the optimizer learns that a backward ended only when the next one, or step(), begins: "
    "until step() some p.grad held only the last part of their gradient (the rest summed on the host: earlier "
    "micro-batches', or before a parameter shared by two checkpointed segments cut the pass), and a clip_grad_norm_ "
    "between backward and step() read and scaled that part alone (torch's own tensors: unseen here; without one the "
    "step is exact). Call opt.backward(loss) instead of loss.backward(), or checkpoint with use_reentrant=False"
)

UNSCALED_BACKWARD_HELP = (
    "a backward pass began outside opt.backward(loss) while the loss scale is {scale:g} (loss_scale was given): "
    "its gradients would be 1/{scale:g} of the true ones. Call opt.backward(loss) (Lightning: override "
    "LightningModule.backward to call it), or build the optimizer with loss_scale=None for a framework that calls "
    "loss.backward() itself (HF Trainer, accelerate). Nothing was accumulated: call opt.backward(loss) again."
)


class Gradients(NamedTuple):
    """What step() consumes: the reduced (averaged over ranks, still loss-scaled) gradient of this rank's partition,
    checked over all ranks."""

    grad: torch.Tensor
    found_inf: bool
    sum_sq: float  # of the reduced gradient
    got: list[bool]  # which params got a gradient on some rank
    n_backward: int  # completed backward passes (stats["micro_batches"])
    factor: list[float]  # per param: p.grad.mul_(f) not yet applied to grad (the update applies it)
    device_grad: torch.Tensor | None = None  # gpu_fraction: the partition's tail [split, part), kept on the device
    landing: torch.Tensor | None = None  # the landing buffer the gradient came in (read once by the update, which
    # may write the new parameters there: grad itself, or with accumulation the last micro-batch's, summed already)
    selected: torch.Tensor | None = None  # selective: the held selection's gradient, gathered on the device (fp32)
    copies: tuple = ()  # events of copies into `grad` not yet waited for (defer_copies): the update waits first


class GradPath:
    """The gradient path of one optimizer: its buffers, its autograd hooks and the gradients of the open step.

    Args:
        layout: the flat layout (params, buckets, this rank's partition).
        dtype, device: the parameters' (and the buckets') dtype and device.
        transport, comm: the copies to the host and the process group.
        scaler: the loss scaler (p.grad norms are reported unscaled).
        times: the phase times ("reduce", "offload", "backward_offload_wait" are added here; "offload" in parts too:
            "offload_wait" ordering after the copies still reading a bucket buffer, "offload_pack", "offload_copy"
            the copies' calls; "hooks" the gradient hooks' own time, outside the buckets' launches; "global_checks"
            reduce's part in step(): the overflow flag and Σg² read, at one rank the wait for backward's last kernels).
        slots: landing buffers (2 under the delayed update: gradient i+1 never overwrites gradient i).
        threads: CPU threads for the sums of squares.
        guard: raises when the optimizer can no longer be used (closed, or failed earlier).
        connected: whether a param is still the optimizer's (not cast or moved since).
        all_connected: whether every param is (a fast check of all at once, or None); False: `connected` one by
            one says which is not.
        all_reduce: every rank gets every reduced bucket (ZeRO-1), not only its own part (ZeRO-2/3).
        on_grad, on_pass_end: told when a param's gradient arrives and when a backward pass (final=True) or a
            part of one ends, and whether a backward is still running then (ZeRO-3 frees the gathered parameters).
        split: gpu_fraction (twin.py): only the partition's head [0, split) lands on the host; the tail's gradients
            never leave the device (`device_landing`, partition offset - split: one buffer, and one fp32
            accumulator, also under DPU: the device's update reads them at once, and the next backward's first write
            waits for it, `tail_free`). None: all of it lands.
        selected: selective (selected.py): the held selection's gradient is also gathered on the device from each
            reduced bucket piece and summed there over micro-batches.
    """

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, transport: Transport, comm: Comm,
                 scaler: LossScaler, times: PhaseTimes, *, slots: int, threads: int, guard: Callable[[], None],
                 connected: Callable[[torch.Tensor], bool], all_connected: Callable[[], bool] | None = None,
                 all_reduce: bool = False,
                 on_grad: Callable[[torch.Tensor], None] | None = None,
                 on_pass_end: Callable[[bool, bool], None] | None = None, split: int | None = None,
                 selected: SelectedGrad | None = None) -> None:  # fmt: skip
        self.layout, self.dtype, self.device, self.transport, self.comm = layout, dtype, device, transport, comm
        self.scaler, self.times, self.threads, self.guard = scaler, times, threads, guard
        self.connected, self.all_connected, self.all_reduce = connected, all_connected, all_reduce
        self.predivide = 1.0 / comm.world  # the reduction sums averages (as DDP does): no overflow the mean has not
        self.on_grad, self.on_pass_end = on_grad, on_pass_end
        self.split = split = layout.part if split is None else split
        self.selected = selected
        self.scaled_backward = False  # inside opt.backward(loss): the loss was multiplied by the loss scale
        assert selected is None or split == layout.part, "selective: no tail"
        # told before a backward writes a landing buffer (and its accumulator): selective's window sum may still be
        # reading it (selective.py, wait_readers)
        self.before_write: Callable[[list[torch.Tensor]], None] | None = None
        # told before a backward or zero_grad writes the device tail's buffers: the device's update of the last step
        # may still be reading them (twin.py: the compute stream waits for its stream)
        self.tail_free: Callable[[], None] | None = None
        # asked at the end of a backward: True leaves its last copies in flight (their events in _copies) for the
        # delayed update to wait for in its background thread, not the host at the end of backward (the optimizer
        # sets it under DPU with one rank and the host update; every host reader of the landing buffer here waits
        # for them first: await_copies)
        self.defer_copies: Callable[[], bool] | None = None
        # called at the start of each bucket's launch, outside its phase times (a benchmark's: the device
        # synchronized there, so the launch's host time is measured with nothing queued ahead of it to block on)
        self.before_launch: Callable[[], None] | None = None
        self._copies: list[Any] = []
        self.landing = [transport.pool.take(split, dtype) if split else torch.zeros(0, dtype=dtype)
                        for _ in range(slots)]  # fmt: skip
        self.device_landing = (torch.zeros(layout.part - split, dtype=dtype, device=device) if split < layout.part
                               else None)  # fmt: skip
        for buf in self.landing:
            buf.zero_()
        self.accum: list[torch.Tensor | None] = [None] * slots
        self.device_accum: torch.Tensor | None = None
        # One rank whose device memory is host memory needs no bucket: gradients pack into the landing buffer.
        self.direct_landing = comm.world == 1 and not transport.needs_staging and split == layout.part
        buf_numel = 0 if self.direct_landing else max(b.hi - b.lo for b in layout.buckets)
        self.bucket_bufs = [torch.empty(buf_numel, dtype=dtype, device=device) for _ in range(2)]
        self.buf_busy: list[list[Any]] = [[], []]  # per buffer: reduce works and copy events still using it
        self.iteration = 0  # step() calls that consumed gradients
        self.last_got: list[bool] = []  # which params had a gradient at the last step (zero_grad(set_to_none=False))
        self.hooks: list[Any] = []
        self._placeholders: list[MovedGrad | None] = [None] * len(layout.params)  # each param's p.grad placeholder
        self._hooks_s = 0.0  # the hooks' own seconds in the open pass (the "hooks" phase at its end)
        self._warned_partial = False  # PARTIAL_HELP said (once per optimizer)
        self.plans: dict[tuple[int, int], Any] = {}  # a launch plan per (bucket, unit): validated and uploaded once
        # the pass's overflow flag and sum of squares, on the device; zeroed by reset(), never reallocated per step
        self._found_inf = torch.zeros((), dtype=torch.bool, device=self.device)
        self._sum_sq = torch.zeros((), dtype=torch.float32, device=self.device)
        self._totals = (self._sum_sq, self._found_inf)  # what each pack adds into (one tuple: pack_step trusts it)
        self._pack_outs: dict[tuple[int, int, int], torch.Tensor] = {}  # each pack's view of its bucket buffer
        self.reset()

    def attach(self, accumulators: dict[torch.Tensor, Any] | None = None) -> None:
        """Register the hooks on the parameters: from now on their gradients leave during backward.
        `accumulators`: each param's AccumulateGrad node, made while the param had its shape (ZeRO-3)."""
        params = self.layout.params
        # each param's AccumulateGrad node: a hook fired by torch.autograd.grad (which accumulates nothing) is ignored
        accumulators = accumulators or {p: p.view_as(p).grad_fn.next_functions[0][0] for p in params}
        self.accumulators = [accumulators[p] for p in params]
        self.hooks = [p.register_hook(self._before_accumulate(p)) for p in params]
        self.hooks += [p.register_post_accumulate_grad_hook(self._after_accumulate(i, p)) for i, p in enumerate(params)]

    def detach(self) -> None:
        """Remove the hooks and the placeholders."""
        for h in self.hooks:
            h.remove()
        for p in self.layout.params:
            if isinstance(p.grad, MovedGrad):
                p.grad = None

    def reset(self) -> None:
        """Forget the gradients since the last step."""
        n = len(self.layout.params)
        self.n_micro = 0  # gradient sets in the landing buffer since the last step (a backward, or a part of one)
        self.n_backward = 0  # completed backward passes since the last step/zero_grad (stats["micro_batches"])
        self.in_backward = False  # a backward pass is open: gradients arriving belong to it
        self._seen: set[int] = set()  # indices of the params whose gradient arrived in the open backward pass
        self._callback_tasks: set[int] = set()  # autograd graph tasks that will close the open pass
        self._nested_tasks: set[int] = set()  # graph tasks of the open pass known to be nested (they cannot close it)
        self._moved: dict[int, torch.Tensor] = {}  # params whose p.grad is a MovedGrad placeholder, by index
        self._got = [False] * n  # which params received a gradient since the last step
        self.factor = [1.0] * n  # p.grad.mul_(f) since the last step (framework clipping)
        self._norm_cache: dict[float, torch.Tensor] = {}  # per-param gradient norms, by order, until it changes
        self._sum_sq_stale = False  # pack's in-pass sum of squares no longer describes the landing buffer
        self._next_bucket = 0
        self._found_inf.zero_()
        self._sum_sq.zero_()
        for b in self.layout.buckets:
            b.ready = 0

    @property
    def slot(self) -> int:
        """Which landing buffer the current iteration's gradients use (alternates under DPU)."""
        return self.iteration % len(self.landing)

    # ------------------------------------------------------------------ checks

    def check_connected(self) -> None:
        """The model's params must still be the optimizer's (e.g. not replaced by model.float() or model.to())."""
        if self.all_connected is not None and self.all_connected():
            return
        for i, p in enumerate(self.layout.params):
            if not self.connected(p):
                raise RuntimeError(f"param {i} (shape {tuple(p.shape)}, {p.dtype} on {p.device}) is no longer the "
                                   f"optimizer's {self.dtype} parameter on {self.device}: the model was "
                                   "cast, moved or resized after ZeroOffloadAdamW was built (model.float()/.to()/"
                                   ".half(), resize_token_embeddings: its data replaced?). Build the optimizer after "
                                   "the last cast, move or resize, or close() it first")  # fmt: skip

    def check_untouched(self) -> None:
        """p.grad is None or our placeholder: a gradient set by hand would otherwise be silently ignored. (In a pass
        left open by nested backwards, a param whose gradient arrived in it holds that gradient until the pass ends.)"""
        open_pass = self._left_open()
        for i, p in enumerate(self.layout.params):
            if p.grad is not None and not isinstance(p.grad, MovedGrad) and not (open_pass and i in self._seen):
                raise RuntimeError(f"param {i} has a p.grad that did not come from backward (set by hand?): "
                                   "ZeroOffloadAdamW takes gradients only from backward passes")  # fmt: skip

    def drop_cleared(self) -> None:
        """p.grad = None (model.zero_grad(), or by hand) since the last backward discards those gradients."""
        cleared = [i for i, p in self._moved.items() if not isinstance(p.grad, MovedGrad)]
        if cleared:
            self.await_copies()
        if cleared and len(cleared) == len(self._moved):
            self.zero_grad()
            return
        s = self.slot
        for i in cleared:
            self._got[i] = False
            del self._moved[i]
            a, b = self.layout.part_range(self.layout.params[i])
            for buf in (self.landing[s], self.accum[s] if self.n_micro > 1 else None):
                if buf is not None and a < b:
                    buf[a:b].zero_()  # out of the norm too
            for buf in (self.device_landing, self.device_accum if self.n_micro > 1 else None):
                self._tail(buf, a, b).zero_()
            if self._gathering():
                self.selected.zero(a, b, summed=self.n_micro > 1)
            self._sum_sq_stale = True

    # ------------------------------------------------------------------ gradients leave during backward

    def _before_accumulate(self, p: torch.Tensor) -> Any:
        """Tensor hook of p, run by autograd before p's gradient is accumulated into p.grad. It holds the path
        weakly, as _after_accumulate's does (the path holds p's AccumulateGrad node, which holds p and its hooks)."""

        i = self.layout.index[p]
        path = weakref.ref(self)

        def hook(grad: torch.Tensor) -> None:
            t0 = time.perf_counter()
            self = path()
            if self is None:  # collected without close(): its hooks outlive it on the model's parameters; a
                if isinstance(p.grad, MovedGrad):  # placeholder it left (dropped between backward and step) goes,
                    p.grad = None  # as torch's accumulation would add into it
                return
            # checked once per pass, on its first gradient (_begin_micro checks every param): not once per tensor
            if not self.in_backward and not self.connected(p):
                self.check_connected()  # raises, naming the first param that was cast or moved
            try:
                accumulates = torch._C._will_engine_execute_node(self.accumulators[i])
            except RuntimeError:  # torch refuses the question inside torch.autograd.grad: nothing accumulates there
                accumulates = False
            if not accumulates:
                return  # torch.autograd.grad(..., inputs=...) or a graph that does not reach p: nothing to send
            if not self.in_backward or i in self._seen:  # a pass begins or is cut: the optimizer must be usable
                self.guard()
            if not self.in_backward and self.scaler.scale != 1.0 and not self.scaled_backward:
                raise RuntimeError(UNSCALED_BACKWARD_HELP.format(scale=self.scaler.scale))
            if self.in_backward and i in self._seen:
                # p got a second gradient: a param shared by two reentrant-checkpoint segments of one backward
                # (an outer backward that will close the pass is still running), or a new backward pass (the
                # last one ran entirely inside nested backwards, which cannot close it, or raised partway, and its
                # end-of-pass callback never ran: its graph task is not this one, and this one is not nested in
                # it). Either way the pass is cut here, which is exact: the parts are summed like micro-batches.
                t1 = time.perf_counter()  # (a pass's end and start are not the hook's own time: their flush,
                self._end_micro(same_backward=self._outer_running(), in_hook=True)  # waits and sums have phases
                t0 += time.perf_counter() - t1  # of their own or are waits orchestration leaves out)
            if not self.in_backward:
                t1 = time.perf_counter()
                self._begin_micro()
                t0 += time.perf_counter() - t1
            task = torch._C._current_graph_task_id()
            # the outermost backward closes the pass when it ends (asked once per graph task: is it nested? a walk
            # up the Python stack, long under a trainer's frames)
            if task not in self._callback_tasks and task not in self._nested_tasks:
                if in_nested_backward():
                    self._nested_tasks.add(task)
                else:
                    self._callback_tasks.add(task)
                    torch.autograd.Variable._execution_engine.queue_callback(self._end_micro_callback)
            if isinstance(p.grad, MovedGrad):
                p.grad = None  # the earlier micro-batches' gradient is on the host; autograd starts afresh
            self._seen.add(i)  # (by index: a tensor's __hash__ is a Python call, three a param a step)
            self._hooks_s += time.perf_counter() - t0

        return hook

    def close_dead_pass(self) -> None:
        """Before a forward outside any backward (stage 3's module hooks): a pass still open whose end-of-pass
        callback a top-level backward registered belongs to a backward that raised partway (a finished one runs
        its callback): it ends here, as a whole, so the next backward starts afresh with the units' gradient
        counts reset, also when its first repeated gradient comes inside a reentrant checkpoint's nested backward
        (which _outer_running cannot tell from the dead one's)."""
        if self.in_backward and self._callback_tasks and torch._C._current_graph_task_id() == -1:
            self._end_micro()

    def _outer_running(self) -> bool:
        """The backward that registered the pass's end-of-pass callback is still running around this hook: this is
        it, or a backward nested in it (a reentrant checkpoint's). Otherwise it raised partway (an out-of-memory,
        a Ctrl-C) and its callback will never run: its pass ends here, as a whole (at stage 3 the units' gradient
        counts start afresh: a stale count freed a unit's parameters before their gradients were accumulated)."""
        if not self._callback_tasks:
            return False
        return torch._C._current_graph_task_id() in self._callback_tasks or in_nested_backward()

    def _after_accumulate(self, i: int, p: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """Post-accumulate-grad hook of p (param i): p.grad holds its gradient; its bucket may be complete. It holds
        the path weakly: torch keeps these hooks where the garbage collector cannot see them, so a closure over the
        path kept an optimizer never closed alive, with its files and memory, until the process exited."""
        bucket = self.layout.bucket_of[p]
        path = weakref.ref(self)

        def on_grad(p: torch.Tensor) -> None:
            t0 = time.perf_counter()
            self = path()
            if self is None:  # (collected without close(): its hooks outlive it on the model's parameters)
                return
            grad = p.grad
            if grad is None or not self.in_backward:
                return
            if grad.is_sparse:
                raise RuntimeError("ZeroOffloadAdamW does not support sparse gradients")
            self._got[i] = True
            if self.on_grad is not None:
                self.on_grad(p)
            bucket.ready += 1
            self._hooks_s += time.perf_counter() - t0  # (into the phase at the pass's end: one add, not one a param)
            self._launch_ready()

        return on_grad

    def landing_free(self, s: int, host: bool = False) -> None:
        """Before landing buffer s is written: the copies still reading it (the writeback of the parameters the
        update wrote there) are done, for the device's copy streams (backward's copies queue after the compute
        stream) or, with host=True, for the host."""
        if self.before_write is not None:
            self.before_write([t for t in (self.landing[s], self.accum[s]) if t is not None])
        if self.tail_free is not None and self.device_landing is not None:
            self.tail_free()
        for ev in self.transport.pool.events(self.landing[s]):
            if host:
                self.transport.wait(ev)
            else:
                self.transport.device_wait(ev)

    def await_copies(self) -> None:
        """The host waits for the copies the last backward left in flight (defer_copies): before it reads or writes
        a landing buffer."""
        copies, self._copies = self._copies, []
        self.transport.wait_all(copies)

    def _begin_micro(self) -> None:
        self.check_connected()
        # refused before anything changes: the gradients so far stay, for step() or zero_grad()
        left = sum(isinstance(q.grad, MovedGrad) for q in self._moved.values()) if self.n_micro else 0
        if self.n_micro and left and left != len(self._moved):
            raise RuntimeError(f"p.grad of {len(self._moved) - left} of {len(self._moved)} parameters was cleared "
                               "between two backward passes: ZeroOffloadAdamW can discard all gradients "
                               "(opt.zero_grad() or model.zero_grad()), not some")  # fmt: skip
        self.landing_free(self.slot, host=self.direct_landing)  # (one CPU rank packs into it from the host)
        self.in_backward = True
        self._seen = set()
        if self.n_micro == 0:
            return
        self.await_copies()  # (accumulation reads the landing buffer on the host)
        if self._moved and left == 0:  # model.zero_grad() since the last backward: discard, as torch would
            self.reset()
            self.in_backward = True
            return
        # accumulation: the previous micro-batches' reduced gradient sits in the landing buffer
        s = self.slot
        if self.accum[s] is None:  # a copy also when dtype is fp32 (.float() would alias the landing buffer)
            self.accum[s] = self.landing[s].to(torch.float32, copy=True)
        elif self.n_micro == 1:
            self.accum[s].copy_(self.landing[s])
        else:  # (a 16-bit landing buffer: torch's mixed-dtype add_ is ~5x slower)
            accumulate(self.accum[s], self.landing[s], threads=self.threads)
        if self.device_landing is not None:  # the device's tail accumulates on the device (one buffer: no slot)
            if self.device_accum is None:
                self.device_accum = self.device_landing.to(torch.float32, copy=True)
            elif self.n_micro == 1:
                self.device_accum.copy_(self.device_landing)
            else:
                self.device_accum.add_(self.device_landing)
        gathering = self._gathering()
        if gathering:  # the selection's gradient accumulates on the device, as the host's does
            self.selected.accumulate(first=self.n_micro == 1)
        for i, f in enumerate(self.factor):  # p.grad.mul_(f) so far applies to the sum so far, not to what follows
            if f != 1.0:
                a, b = self.layout.part_range(self.layout.params[i])
                self._tail(self.device_accum, a, b).mul_(f)
                self.accum[s][a:b] *= f
                if gathering:
                    self.selected.scale(a, b, f)
                self.factor[i] = 1.0
        for b in self.layout.buckets:
            b.ready = 0
        self._next_bucket = 0

    def _launch_ready(self, flush: bool = False) -> None:
        """Pack, reduce and send down the buckets in bucket order (the same order on every rank)."""
        buckets = self.layout.buckets
        while self._next_bucket < len(buckets):
            b = buckets[self._next_bucket]
            if b.ready < len(b.params) and not flush:
                return
            self._launch(b)
            self._next_bucket += 1

    def _launch(self, b: Bucket) -> None:
        if self.before_launch is not None:
            self.before_launch()
        t0 = time.perf_counter()
        if self._norm_cache:  # (norms read in a pass left open by nested backwards: this bucket changes them)
            self._norm_cache = {}
        k = b.index % 2
        lay, comm = self.layout, self.comm
        self._wait_buffer(k, host=False)  # inside a gradient hook: order the device, never block the host
        t_wait = time.perf_counter()
        if self.direct_landing:  # one rank, host memory is the device: pack straight into the landing buffer
            buf = self.landing[self.slot][b.lo : b.hi]  # one rank: partition coordinates are flat ones
        else:
            buf = self.bucket_bufs[k][: b.hi - b.lo]
        has = [p.grad is not None and not isinstance(p.grad, MovedGrad) for p, _, _ in b.params]
        grads = [p.grad if h else torch.zeros(n, dtype=self.dtype, device=self.device)
                 for (p, _, n), h in zip(b.params, has)]  # fmt: skip
        end = 0
        for i, j in zip(b.packs, b.packs[1:] + [len(b.params)]):  # ZeRO-3: one pack per unit in the bucket
            lo = b.params[i][1] - b.lo
            if lo > end:  # a unit's padding (an empty slice's zero_() still costs ~2.5 us of dispatch)
                buf[end:lo].zero_()
            end = lo + self._pack(b.index, i, grads[i:j], buf, lo)  # (Σg², flag: into the totals)
        if end < buf.numel():
            buf[end:].zero_()
        t_pack = time.perf_counter()
        for (p, _, _), i, h in zip(b.params, b.indices, has):
            if h:  # the device gradient is freed as soon as its bucket has left
                self._place_moved_grad(p, i)
        busy = self.buf_busy[k]
        t1 = time.perf_counter()
        if comm.world > 1 and self.all_reduce:  # ZeRO-1: every rank gets the whole reduced bucket
            comm.collective(f"the all-reduce of bucket {b.index}", dist.all_reduce, buf, op=dist.ReduceOp.SUM)
        elif comm.world > 1:  # each part of the bucket is reduced to the rank that owns it
            for r in range(comm.world):
                for a, c, _ in lay.owned(b.lo, b.hi, r):
                    work = dist.reduce(buf[a - b.lo : c - b.lo], dst=comm.global_rank(r), op=dist.ReduceOp.SUM,
                                       group=comm.group, async_op=True)  # fmt: skip
                    if r == comm.rank:
                        comm.wait(work, f"the reduce of bucket {b.index}")  # NCCL: orders the stream only
                    else:
                        busy.append((work, f"the reduce of bucket {b.index} to rank {r}"))
        t2 = time.perf_counter()
        gathering = self._gathering()
        if self.direct_landing and gathering:
            self.selected.gather(buf, b.lo)
        if not self.direct_landing:
            for a, c, pa in lay.owned(b.lo, b.hi, comm.rank):
                src = buf[a - b.lo : c - b.lo]
                head = min(max(self.split - pa, 0), c - a)  # elements of the piece that land on the host
                if head:
                    busy.append(self.transport.d2h(self.landing[self.slot][pa : pa + head], src[:head]))
                if head < c - a:  # gpu_fraction: on the compute stream, after the reduce; never to the host
                    self._tail(self.device_landing, pa, pa + c - a).copy_(src[head:])
                if gathering:  # selective: on the compute stream, after the reduce, before the buffer's reuse
                    self.selected.gather(src, pa)
        t3 = time.perf_counter()
        self.times.add("reduce", t2 - t1)
        self.times.add("offload", (t1 - t0) + (t3 - t2))
        self.times.add("offload_wait", t_wait - t0)
        self.times.add("offload_pack", t_pack - t_wait)
        self.times.add("offload_copy", t3 - t2)

    def _pack(self, bucket: int, unit: int, grads: list[torch.Tensor], buf: torch.Tensor, lo: int) -> int:
        """Pack into buf[lo:] with the unit's launch plan (gradients have their params' sizes and dtype: the plan
        holds while the params do; it checks them on every call), its Σg² and flag added into the pass's totals in
        place (on a GPU by the pack launch itself: no allocation, no further kernel per bucket); the elements
        written. The plan's pack_step trusts the same `out` view and totals from its second call on: each is made
        once, per (bucket buffer, bucket, unit) and per optimizer."""
        key = (bucket, unit)
        p = self.plans.get(key)
        if p is None:
            p = self.plans[key] = plan(grads, dtype=self.dtype, align=self.layout.align)
        view = (buf.data_ptr(), bucket, unit)  # (buf: one of the bucket buffers, or a landing slot's slice)
        out = self._pack_outs.get(view)
        if out is None:
            out = self._pack_outs[view] = buf[lo:]
        p.pack_step(grads, out, self._totals, scale=self.predivide)
        return p.total

    def _place_moved_grad(self, p: torch.Tensor, i: int | None = None) -> None:
        if i is None:
            i = self.layout.index[p]
        ph = self._placeholders[i]
        # one per param, made once (a new one costs ~1.5 us, a param a step); again if it no longer fits p (its shape
        # under ZeRO-3's gathers; a cast model: the next backward says so, as with a new placeholder)
        if ph is None or ph.shape != p.shape or ph.dtype is not p.dtype or ph.device != p.device:
            ph = self._placeholders[i] = MovedGrad(p, self, i)
        p.grad = ph
        self._moved[i] = p

    def _wait_buffer(self, k: int, host: bool = True) -> None:
        """Wait for the reduces and copies still reading bucket buffer k: the host waits for them, or (host=False)
        only the compute stream does (NCCL's work.wait() and transport.device_wait() do not block the host)."""
        for item in self.buf_busy[k]:
            if isinstance(item, tuple):
                self.comm.wait(*item)
            elif host:
                self.transport.wait(item)
            else:
                self.transport.device_wait(item)
        self.buf_busy[k] = []

    def _end_micro_callback(self) -> None:
        if self.in_backward:
            self._end_micro()

    def _end_micro(self, same_backward: bool = False, in_hook: bool = False) -> None:
        """End of a backward pass (or of a part of one): flush buckets with missing gradients (as zeros) and
        wait for the copies. in_hook: ended by a gradient hook, inside a running backward (a new one, if not
        same_backward)."""
        t0 = time.perf_counter()
        self.times.add("hooks", self._hooks_s)
        self._hooks_s = 0.0
        self._launch_ready(flush=True)
        if self.defer_copies is not None and self.defer_copies():
            self._copies = self.transport.record()  # the delayed update (or the next host reader) waits for them
        else:
            self.transport.synchronize()  # every copy: step() reads the landing buffer on the host
        for k in range(2):
            self._wait_buffer(k, host=False)  # the reduces still using the buffers (their copies are done)
        if self.comm.world > 1:  # a param with a gradient on some rank has one on every rank (DDP averages them)
            got = torch.tensor(self._got, dtype=torch.uint8).to(self.comm.device_of_collectives)
            self.comm.collective("the all-reduce of which params got a gradient", dist.all_reduce, got,
                                 op=dist.ReduceOp.MAX)  # fmt: skip
            for i, g in enumerate(got.cpu().tolist()):
                if g and not self._got[i]:
                    self._got[i] = True
                    self._place_moved_grad(self.layout.params[i])
        self.in_backward = False
        if not same_backward:
            self._callback_tasks = set()
            self._nested_tasks = set()
            self.n_backward += 1
        self._norm_cache = {}
        self.n_micro += 1
        if self.on_pass_end is not None:
            self.on_pass_end(not same_backward, in_hook)
        self.times.add("backward_offload_wait", time.perf_counter() - t0)

    def _left_open(self) -> bool:
        """A pass is open and no backward is running: its gradients all arrived in nested (reentrant) backwards."""
        return self.in_backward and torch._C._current_graph_task_id() == -1

    def _held(self) -> list[int]:
        """The params whose gradient is still in p.grad, a real tensor (their buckets not yet sent)."""
        return [self.layout.index[p] for b in self.layout.buckets[self._next_bucket :] for p, _, _ in b.params
                if p.grad is not None and not isinstance(p.grad, MovedGrad)]  # fmt: skip

    def close_pass(self, warn_partial: bool = False) -> None:
        """End the open pass if no backward is running: its gradients all arrived in nested (reentrant) backwards,
        which cannot close it. warn_partial (step()): say once if some p.grad held part of a gradient meanwhile."""
        if self._left_open():
            if warn_partial and self.n_micro and not self._warned_partial and self._held():
                self._warned_partial = True
                warnings.warn(PARTIAL_HELP, stacklevel=6)  # (at the caller of opt.step())
            cleared = bool(self._seen) and all(self.layout.params[i].grad is None for i in self._seen)
            self._end_micro()
            if warn_partial and cleared:  # model.zero_grad() since that backward: its gradients are discarded, as
                self.zero_grad()  # torch discards them (held ones would otherwise be stepped on as zeros)

    # ------------------------------------------------------------------ the step's and the user's calls

    def consume(self) -> Gradients:
        """The gradients since the last step, checked over all ranks (a collective when N > 1); the next backward
        starts afresh. A step whose gradients overflowed does not count as an iteration."""
        s = self.slot
        if self.n_micro > 1 or self.comm.world > 1 or self._sum_sq_stale:  # read on the host here
            self.await_copies()
        copies = tuple(self._copies)  # (the fast checks read the device's sums: the update waits, in its thread)
        self.iteration += 1
        grad, device_grad = self.landing[s], self.device_landing
        if self.n_micro > 1:
            grad = accumulate(self.accum[s], self.landing[s], threads=self.threads)
            if device_grad is not None:
                device_grad = self.device_accum.add_(device_grad)
        selected = self.selected.total(self.n_micro) if self._gathering() else None
        found_inf, sum_sq, got = self._global_checks(grad, device_grad)
        self.last_got = got
        out = Gradients(grad, found_inf, sum_sq, got, self.n_backward, self.factor, device_grad, self.landing[s],
                        selected, copies)  # fmt: skip
        for p in self._moved.values():
            p.grad = None
        self.reset()
        if found_inf:
            self.iteration -= 1
        return out

    def _global_checks(self, grad: torch.Tensor, device_grad: torch.Tensor | None = None,
                       ) -> tuple[bool, float, list[bool]]:  # fmt: skip
        """found_inf, the sum of squares of the reduced (summed over ranks) gradient, and which params got a
        gradient on some rank: all-reduced."""
        t0 = time.perf_counter()
        if self.comm.world == 1 and self.n_micro == 1 and not self._sum_sq_stale:
            # pack's in-pass sum: no extra pass; on a GPU one device-to-host read for both scalars
            if self._sum_sq.is_cuda:
                sum_sq, flagged = torch.stack((self._sum_sq, self._found_inf.float())).tolist()
            else:
                sum_sq, flagged = self._sum_sq.item(), self._found_inf.item()
            nonfinite = False
        else:
            sum_sq, nonfinite = sum_squares(grad, threads=self.threads) if grad.numel() else (0.0, False)
            if device_grad is not None:  # fp64 (finite exactly when every element is), 2**24 elements at a time
                parts = [c.double().square().sum() for c in device_grad.split(1 << 24)]
                sum_sq += torch.stack(parts).sum().item() if parts else 0.0
            flagged = self._found_inf.item()
        found = bool(flagged) or nonfinite or not math.isfinite(sum_sq)
        got = list(self._got)
        if self.comm.world > 1:
            t = torch.tensor([0.0 if math.isnan(sum_sq) else sum_sq, float(found), *map(float, got)],
                             dtype=torch.float64)  # fmt: skip
            t = t.to(self.comm.device_of_collectives)
            self.comm.collective("the all-reduce of the gradient norm and overflow flag", dist.all_reduce, t,
                                 op=dist.ReduceOp.SUM)  # fmt: skip
            t = t.cpu()
            sum_sq, found, got = float(t[0]), bool(t[1] > 0), (t[2:] > 0).tolist()
        self.times.add("reduce", time.perf_counter() - t0)
        self.times.add("global_checks", time.perf_counter() - t0)  # (reduce's part in step(): at one rank all of it)
        return found, sum_sq, got

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients since the last step; set_to_none=False keeps a zero one where there was one."""
        self.close_pass()
        self.await_copies()
        for k in range(2):
            self._wait_buffer(k)
        kept = {} if set_to_none else dict(self._moved)
        if not set_to_none and not self.n_micro:  # after step(): torch still held the step's gradients
            kept = {i: p for i, (p, g) in enumerate(zip(self.layout.params, self.last_got)) if g}
        if set_to_none:
            for p in self._moved.values():
                p.grad = None
            self.last_got = []  # torch holds no gradient now: a later zero_grad(set_to_none=False) keeps none
        self.reset()
        if kept:  # zero gradients: the landing buffer holds zeros until the next backward overwrites it
            self.landing_free(self.slot, host=True)
            self.landing[self.slot].zero_()
            if self.device_landing is not None:
                self.device_landing.zero_()
            if self._gathering():
                self.selected.landing.zero_()
            for i, p in kept.items():
                self._place_moved_grad(p)
                self._got[i] = True
            self.n_micro, self.n_backward = 1, 0  # a gradient set (zeros), from no backward pass

    # ------------------------------------------------------------------ p.grad placeholders (MovedGrad)

    def _gathering(self) -> bool:
        """selective holds a selection: its gradient is gathered on the device (selected.py)."""
        return self.selected is not None and self.selected.sel is not None

    def _tail(self, dev: torch.Tensor | None, a: int, b: int) -> torch.Tensor:
        """Partition range [a, b)'s part in the device tail `dev` (empty where none); the host head's part is
        host[a:b] (a slice stops at split)."""
        if dev is None:
            return torch.empty(0)
        return dev[max(a - self.split, 0) : max(b - self.split, 0)]

    def _host_gradient(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(last micro-batch's reduced gradient, sum of the earlier ones or None) of this rank's partition."""
        self.guard()
        if self._left_open():
            held = self._held()
            if held and not self.n_micro and self.comm.world == 1:
                # (a param without a gradient kept its bucket back) the held gradients are whole: they stay in
                # p.grad, where a norm or a multiplication reads them as torch would, and leave at step(); the
                # sent ones are read where they landed
                self.transport.synchronize()
                return self.landing[self.slot], None
            if held:  # part of a held gradient is on the host already, or not yet reduced over the ranks
                why = ("the gradients are not yet averaged over the ranks" if not self.n_micro else
                       "a parameter shared by two checkpointed segments cut the pass, or earlier micro-batches' "
                       "gradients are summed on the host")  # fmt: skip
                raise RuntimeError(NESTED_OPEN_HELP.format(n=len(held), first=held[0], why=why))
        self.close_pass()
        if self.in_backward or self.n_micro == 0:
            raise RuntimeError("p.grad is read during backward: its gradient is complete only after backward")
        self.await_copies()
        s = self.slot
        return self.landing[s], (self.accum[s] if self.n_micro > 1 else None)

    @torch.no_grad()
    def _host_grad_norms(self, indices: list[int], ord: float) -> list[float]:
        """Norms of the params' gradients as torch would hold them in p.grad (summed over micro-batches,
        averaged over ranks, unscaled, times any factor applied since), of order p >= 1 or inf. A collective
        when N > 1 (every rank must ask, as every rank does in clip_grad_norm_); once per gradient and order."""
        if not (ord >= 1.0):
            raise RuntimeError(f"a norm of order {ord} of p.grad: orders p >= 1 and inf are supported")
        world = self.comm.world
        if ord not in self._norm_cache:
            last, earlier = self._host_gradient()
            last_dev = self.device_landing
            earlier_dev = self.device_accum if earlier is not None else None
            part = torch.zeros(len(self.layout.params), dtype=torch.float64)
            for i, p in enumerate(self.layout.params):
                a, b = self.layout.part_range(p)
                if a < b:
                    g = torch.cat([last[a:b].double(), self._tail(last_dev, a, b).double().cpu()])
                    if earlier is not None:
                        g += torch.cat([earlier[a:b].double(), self._tail(earlier_dev, a, b).double().cpu()])
                    g = g.abs()
                    part[i] = g.max() if ord == math.inf else g.pow(ord).sum()
            if world > 1:
                op = dist.ReduceOp.MAX if ord == math.inf else dist.ReduceOp.SUM
                part = part.to(self.comm.device_of_collectives)
                self.comm.collective("the all-reduce of per-parameter gradient norms", dist.all_reduce, part, op=op)
                part = part.cpu()
            norms = part if ord == math.inf else part.pow(1.0 / ord)
            self._norm_cache[ord] = norms / self.scaler.scale
        factor = torch.tensor(self.factor, dtype=torch.float64).abs()
        return (self._norm_cache[ord] * factor)[indices].tolist()

    @torch.no_grad()
    def _zero_host_grads(self, indices: list[int]) -> None:
        """p.grad.zero_() on placeholders (model.zero_grad(set_to_none=False)): those params keep a zero gradient, as
        in torch, so the next step updates them (decay, moments); after a step, as zero_grad(set_to_none=False)."""
        if self.n_micro == 0 and not self.in_backward:
            self.zero_grad(set_to_none=False)
            return
        last, earlier = self._host_gradient()
        tails = (self.device_landing, self.device_accum if earlier is not None else None)
        for i in indices:
            a, b = self.layout.part_range(self.layout.params[i])
            for buf, dev in zip((last, earlier), tails):
                if buf is not None and a < b:
                    buf[a:b].zero_()
                    self._tail(dev, a, b).zero_()
            if self._gathering() and a < b:
                self.selected.zero(a, b, summed=earlier is not None)
        self._sum_sq_stale = True
        self._norm_cache.clear()

    def _scale_host_grads(self, indices: list[int], factor: float) -> None:
        """p.grad.mul_(factor) on placeholders: the host gradients of those params are scaled at step()
        (or when the next micro-batch starts accumulating). A non-finite factor (the clip coefficient of an
        overflowed gradient) makes the step an overflow, skipped as torch's GradScaler would; so does a finite one
        past fp32 (alone or times the factors before it: the gradient would be inf). A negative factor is refused
        before anything changes (the kernel takes a gradient scale >= 0: step() raised it midway, and the optimizer
        refused everything after)."""
        if factor < 0:
            raise ValueError(f"p.grad.mul_({factor}): a negative factor of a gradient on the host is not supported "
                             "(clipping's factors are in [0, 1]); negate the loss instead")  # fmt: skip
        self._host_gradient()
        if not math.isfinite(factor):
            self._found_inf.fill_(True)
        for i in indices:
            self.factor[i] *= factor if math.isfinite(factor) else 1.0
            if self.factor[i] > FP32_MAX:
                self._found_inf.fill_(True)
                self.factor[i] = 1.0
