"""ZeRO-3: the 16-bit parameters partitioned. Each rank keeps its shard of every unit (a module's own parameters);
a unit is gathered just before its module's forward and again before its backward, and freed after; the next
units are prefetched in the order recorded on the first iteration (forward, then backward).

Between uses a parameter is an empty tensor of the model's dtype (p.shape == (0,), as in DeepSpeed's ZeRO-3):
`opt.gathered()` gathers every unit for code that reads the weights outside forward (saving, evaluation).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from ..cpu_adam import bump_version
from ..param_views import alias, is_alias_of
from ..transport import Event, Transport
from .comm import Comm, _all_gather_single
from .layout import FlatLayout
from .report import PhaseTimes

Uses = list[tuple[torch.nn.Module, list[int]]]  # (module, the units it uses)


class DeviceBytes:
    """Bytes of the optimizer's own device buffers (shards, gathered units, gradient buckets): now and at peak.
    Autograd's own tensors (activations, p.grad before it leaves) are not counted."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def sub(self, n: int) -> None:
        self.now -= n

    def reset_peak(self) -> None:
        self.peak = self.now

    def __repr__(self) -> str:
        mib = lambda n: f"{n:,} B ({n / 2**20:.2f} MiB)"  # noqa: E731
        return f"DeviceBytes(now={mib(self.now)}, peak={mib(self.peak)})"


class Unit:
    """One module's own trainable parameters: flat range [lo, hi), this rank's piece of it, its gathered buffer."""

    def __init__(self, index: int, params: list[torch.Tensor], lo: int, hi: int, piece: tuple[int, int, int]) -> None:
        self.index, self.params, self.lo, self.hi, self.piece = index, params, lo, hi, piece
        # the parameters gathered for forward/backward: the params are views of it; between uses its storage is
        # resized to 0, so views autograd saved (e.g. nn.Linear's weight.t()) hold no memory until it is refilled
        self.buf: torch.Tensor | None = None
        self.live = False  # buf's storage holds (or is being filled with) the parameters
        self.kept: torch.Tensor | None = None  # gathered() and close(): a buffer of its own, params alias it
        self.pending: tuple[Event | None, Any] | None = None  # (shard copy, all-gather) still running
        self.users = 0  # forward calls of its modules now running
        self.held = False  # gathered for backward: kept until its parameters' gradients have arrived
        self.bounce: torch.Tensor | None = None  # offload="nvme": the pinned block its shard was read into
        self.arrived: set[torch.Tensor] = set()  # params whose gradient arrived in this backward pass


class ParamShards:
    """The persistent shard of the 16-bit parameters and the gathers of ZeRO-3.

    Args:
        layout: the flat layout with one segment per unit (FlatLayout(units=...)).
        modules: (module, the units it uses) for every module with trainable parameters of its own.
        dtype, device: the parameters' dtype and device.
        comm: the process group.
        transport: the copies of the shard to the device when it lives in host memory.
        offload: None (the shard stays on the device), "cpu" (in pinned host memory) or "nvme" (in the optimizer's
            NvmeSwapper, a fourth file beside the state: set `swapper` before the first gather).
        prefetch: how many units ahead to gather, once the order is known (0: none).
        counter: the device bytes counter.
        times: the step's phase timings ("gather", "gather_wait").
    """

    def __init__(self, layout: FlatLayout, modules: Uses, dtype: torch.dtype,
                 device: torch.device, comm: Comm, transport: Transport, *, offload: str | None, prefetch: int,
                 counter: DeviceBytes, times: PhaseTimes) -> None:  # fmt: skip
        self.layout, self.dtype, self.device, self.comm, self.transport = layout, dtype, device, comm, transport
        self.offload, self.prefetch, self.counter, self.times = offload, prefetch, counter, times
        self.units: list[Unit] = []
        for i, (lo, hi) in enumerate(layout.segments):
            ps = [p for p in layout.flat_order if lo <= layout.offset[p] < hi]
            self.units.append(Unit(i, ps, lo, hi, layout.pieces[comm.rank][i]))
        self.unit_of = {p: u for u in self.units for p in u.params}
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.shard: torch.Tensor | None = None
        self.swapper: Any = None  # offload="nvme": the NvmeSwapper whose parameters' file holds the shard
        if offload is None:
            self.shard = torch.zeros(layout.part, dtype=dtype, device=device)
            counter.add(layout.part * self.elem)
        elif offload == "cpu":  # the shard's host side of every copy: a block of the transport's (pinned) pool
            self.shard = transport.pool.take(layout.part, dtype)
            self.shard.zero_()
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self.modules = modules
        self.order: list[int] = []  # units in the order of their uses in one iteration (forward, then backward)
        self.recording = True  # until the first step
        self.pos = 0  # uses since the last backward pass ended
        self.hooks: list[Any] = []
        self.detached = False  # close(): every unit stays gathered for good
        self._saving: list[Unit] = []  # units kept for a state_dict() in progress
        self._in_root_save = False  # the model's own state_dict() is running
        self._loading: list[Unit] = []  # units kept for a load_state_dict() in progress

    # ------------------------------------------------------------------ construction

    @torch.no_grad()
    def take(self, p: torch.Tensor, values: torch.Tensor) -> None:
        """Store this rank's part of p's values (all of p, on this device) in the shard; p becomes empty."""
        off, n = self.layout.offset[p], p.numel()
        for a, b, pa in self.layout.owned(off, off + n, self.comm.rank):
            if self.shard is not None:  # (NVMe: the swapper's fill writes the masters' cast)
                self.shard[pa : pa + b - a].copy_(values.reshape(-1)[a - off : b - off])
        p.data = self._empty

    def accumulators(self) -> dict[torch.Tensor, Any]:
        """Each param's AccumulateGrad node, made while its unit is gathered (autograd records the param's shape
        in it), one unit at a time."""
        out = {}
        for u in self.units:
            self.gather(u)
            out.update({p: p.view_as(p).grad_fn.next_functions[0][0] for p in u.params})
            self.free(u)
        return out

    def attach(self, root: torch.nn.Module) -> None:
        """Register the module hooks: from now on units are gathered around their modules' forward and backward.
        `root`: the model; a root.state_dict() keeps the units it gathers until it ends (tied parameters stay one
        tensor)."""
        self.uses: dict[torch.nn.Module, list[Unit]] = {}
        for module, idx in self.modules:
            self.use(module, [self.units[i] for i in idx])
        self.hooks.append(root.register_state_dict_pre_hook(lambda *a: setattr(self, "_in_root_save", True)))
        self.hooks.append(root.register_state_dict_post_hook(lambda *a: self._release_saved(root_done=True)))
        # root.load_state_dict(): the units whole while it copies, then each rank's shard of them kept
        self.hooks.append(root.register_load_state_dict_pre_hook(lambda *a: self._keep_for_load()))
        self.hooks.append(root.register_load_state_dict_post_hook(lambda *a: self._store_loaded()))

    def use(self, module: torch.nn.Module, units: list[Unit]) -> None:
        """`module`'s forward (and backward) needs these units gathered (besides the ones it needed already)."""
        if module in self.uses:
            self.uses[module] += [u for u in units if u not in self.uses[module]]
            return
        self.uses[module] = units = list(units)
        self.hooks.append(module.register_forward_pre_hook(lambda m, a, units=units: self._pre_forward(units)))
        self.hooks.append(module.register_forward_hook(lambda m, a, out, units=units: self._post_forward(units, out)))
        # module.state_dict() (save_pretrained, safetensors, Trainer) sees whole parameters
        self.hooks.append(module.register_state_dict_pre_hook(lambda m, *a, units=units: self._keep_for_save(units)))
        self.hooks.append(module.register_state_dict_post_hook(
            lambda m, sd, prefix, *a, units=units: self._after_save(m, sd, prefix, units)))

    def detach(self) -> None:
        """Remove the hooks; every parameter gathered again, on the device, for good (close())."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for u in self.units:
            self.free(u)
            self._keep(u)
        self.detached = True

    # ------------------------------------------------------------------ gathers

    def connected(self, p: torch.Tensor) -> bool:
        """p is still the optimizer's: empty between uses, or its range of the unit's gathered buffer."""
        if p.dtype != self.dtype or p.device != self.device:
            return False
        u = self.unit_of[p]
        if p.numel() == 0:
            return True
        off = self.layout.offset[p] - u.lo
        return (u.live and u.pending is None and is_alias_of(p, u.buf, off)) or (
            u.kept is not None and is_alias_of(p, u.kept, off))

    def _start(self, u: Unit) -> None:
        """Begin gathering u: its buffer, this rank's shard copied into its slice, the all-gather started."""
        if u.live:
            return
        t0 = time.perf_counter()
        n = u.hi - u.lo
        if u.buf is None:
            u.buf = torch.empty(n, dtype=self.dtype, device=self.device)
        else:
            u.buf.untyped_storage().resize_(n * self.elem)
        u.live = True
        self.counter.add(n * self.elem)
        u.pending = self._fill(u, u.buf)
        self.times.add("gather", time.perf_counter() - t0)

    def _fill(self, u: Unit, buf: torch.Tensor) -> tuple[Event | None, Any]:
        """This rank's shard of u copied into its slice of buf, the all-gather into buf started; what to wait for."""
        a, b, pa = u.piece
        mine = buf[a - u.lo : b - u.lo]
        event = None
        if self.offload == "nvme":  # read into a pinned block, then copy it up
            u.bounce = self.transport.pool.take(b - a, self.dtype)
            self.swapper.read_params(pa, pa + b - a, u.bounce)
            event = self.transport.h2d(mine, u.bounce)
        elif self.offload == "cpu":
            event = self.transport.h2d(mine, self.shard[pa : pa + b - a])
        else:
            mine.copy_(self.shard[pa : pa + b - a])
        work = None
        if self.comm.world > 1:
            self._check_same_unit(u)
            if self.comm.device_of_collectives.type != self.device.type:  # e.g. gloo beside a device: via the host
                self.transport.wait(event)
                host = buf.cpu()
                self.comm.collective(f"the all-gather of unit {u.index}", _all_gather_single, host,
                                     host[a - u.lo : b - u.lo])  # fmt: skip
                buf.copy_(host)
                event = None
            else:
                if self.device.type == "cuda":
                    self.transport.device_wait(event)  # the collective's stream waits, the host does not
                else:
                    self.transport.wait(event)
                event = None
                work = _all_gather_single(buf, mine, group=self.comm.group, async_op=True)
        return event, work

    def _check_same_unit(self, u: Unit) -> None:
        """Every rank must gather the same unit now (they run the same modules in the same order): one small
        all-reduce, so that a rank whose forward took another branch fails clearly instead of mismatching the
        all-gathers (a hang or an abort)."""
        t = torch.tensor([u.index, -u.index], dtype=torch.int64, device=self.comm.device_of_collectives)
        self.comm.collective("the check of the unit to gather", dist.all_reduce, t, op=dist.ReduceOp.MAX)
        hi, lo = int(t[0]), -int(t[1])
        if hi != lo:
            self.comm.failed = RuntimeError(
                f"rank {self.comm.rank}: ZeRO-3 ranks gather different modules' parameters (this rank unit "
                f"{u.index}, others units {lo}..{hi}): at stage 3 every rank must run the same modules in the same "
                "order (a branch taken on some ranks only needs stage 1 or 2)")
            raise self.comm.failed

    def _wait(self, u: Unit, pending: tuple[Event | None, Any]) -> None:
        event, work = pending
        if work is not None:
            self.comm.wait(work, f"the all-gather of unit {u.index}")
        self.transport.device_wait(event)
        if u.bounce is not None:  # the pinned block goes back once its copy is done
            self.transport.wait(event)
            self.transport.pool.give(u.bounce)
            u.bounce = None

    def _finish(self, u: Unit) -> None:
        """Wait for u's gather; its (empty) parameters become views of the gathered buffer."""
        if u.pending is not None:
            t0 = time.perf_counter()
            self._wait(u, u.pending)
            u.pending = None
            self.times.add("gather_wait", time.perf_counter() - t0)
        for p in u.params:
            if p.numel() == 0:
                off = self.layout.offset[p] - u.lo
                shape = self.layout.shape[p]  # (between uses a param is empty: the layout keeps its shape)
                p.data = u.buf[off : off + shape.numel()].view(shape)

    def _keep(self, u: Unit) -> None:
        """u gathered into a buffer of its own that its parameters alias (each its own storage, as at stage 2):
        what gathered() hands out stays valid after the block; close() leaves the model whole."""
        if u.kept is not None or any(p.numel() for p in u.params):
            return  # kept already, or in use by forward/backward (views of buf)
        u.kept = torch.empty(u.hi - u.lo, dtype=self.dtype, device=self.device)
        self.counter.add(u.kept.numel() * self.elem)
        self._wait(u, self._fill(u, u.kept))
        for p in u.params:
            shape = self.layout.shape[p]
            p.data = alias(u.kept, self.layout.offset[p] - u.lo, shape.numel(), shape)

    def _keep_for_save(self, units: list[Unit]) -> None:
        """Before module.state_dict(): its units gathered into buffers of their own (one rank); with several ranks
        that would be a collective inside a call often made on one rank only: refused unless already whole."""
        missing = [u for u in units if u.kept is None and any(p.numel() == 0 for p in u.params)]
        if not missing:
            return
        if self.comm.world > 1:
            self._release_saved(root_done=True)  # (the root's post-hook will not run)
            raise RuntimeError("ZeRO-3 with several ranks: the parameters are partitioned, so state_dict() would be a "
                               "collective; call it inside `with opt.gathered():` on every rank (or use "
                               "zo_kernels.save_checkpoint, which does)")  # fmt: skip
        for u in missing:
            if u.live:  # prefetched, not yet in use: wait, and read it as forward would
                self._finish(u)
            else:
                self._keep(u)
                self._saving.append(u)

    def _after_save(self, module: torch.nn.Module, sd: dict, prefix: str, units: list[Unit]) -> None:
        """After module.state_dict(): what it holds is copied out of storage that forward/backward will release,
        and the buffers kept for it are let go (the tensors in `sd` keep theirs alive)."""
        for name, p in module.named_parameters(recurse=False):
            u, t = self.unit_of.get(p), sd.get(prefix + name)
            if u is not None and u.live and isinstance(t, torch.Tensor) and t.numel():
                sd[prefix + name] = t.clone()
        if not self._in_root_save:  # a submodule's own state_dict() call
            self._release_saved()

    def _keep_for_load(self) -> None:
        """Before model.load_state_dict(): every unit whole (a collective with several ranks: all load)."""
        self._loading = [u for u in self.units if u.kept is None and not any(p.numel() for p in u.params)]
        for u in self._loading:
            self._keep(u)

    def _store_loaded(self) -> None:
        """After model.load_state_dict(): what it wrote becomes the shards (the masters follow with the optimizer's
        load_state_dict or refresh_masters_from_model, as at stage 2)."""
        loading, self._loading = self._loading, []
        self._write_back(loading)
        for u in loading:
            self._unkeep(u)

    def _write_back(self, units: list[Unit]) -> None:
        """Each rank's piece of these units' whole parameters into its shard (every rank holds the same values)."""
        if self.offload == "nvme":
            self.swapper.stream(self._put_params)
            return
        for u in units:
            a, b, pa = u.piece
            full = u.kept if u.kept is not None else u.buf
            dst, src = self.shard[pa : pa + b - a], full[a - u.lo : b - u.lo]
            if self.offload is not None:
                self.transport.wait(self.transport.d2h(dst, src))
            else:
                dst.copy_(src)

    def _release_saved(self, root_done: bool = False) -> None:
        if root_done:
            self._in_root_save = False
        for u in self._saving:
            self._unkeep(u)
        self._saving = []

    def _unkeep(self, u: Unit) -> None:
        if u.kept is None or self.detached:  # (close() inside a gathered() block: the model stays whole)
            return
        for p in u.params:
            if is_alias_of(p, u.kept, self.layout.offset[p] - u.lo):
                p.data = self._empty
        self.counter.sub(u.kept.numel() * self.elem)
        u.kept = None

    def gather(self, u: Unit) -> None:
        """u gathered now (waiting for a prefetch in flight)."""
        self._start(u)
        self._finish(u)

    def free(self, u: Unit) -> None:
        """Release u's gathered storage: its parameters become empty (a graph that saved them, or views of them,
        re-gathers into the same storage first, in the pre-backward hook)."""
        if not u.live or self.detached:  # (a gathered() block around close() ends after it)
            return
        if u.pending is not None:
            self._finish(u)  # its copy and collective must not write freed memory
        for p in u.params:
            if p.numel() == 0 or is_alias_of(p, u.buf, self.layout.offset[p] - u.lo):  # (not gathered()'s)
                p.data = self._empty
        u.buf.untyped_storage().resize_(0)
        self.counter.sub((u.hi - u.lo) * self.elem)
        u.live, u.held, u.users = False, False, 0

    def _use(self, u: Unit) -> None:
        """u is about to be used: gather it, record the order (first iteration) and prefetch what follows."""
        if self.recording:
            self.order.append(u.index)
        elif self.prefetch and self.pos < len(self.order) and self.order[self.pos] == u.index:
            for i in self.order[self.pos + 1 : self.pos + 1 + self.prefetch]:
                self._start(self.units[i])
        self.pos += 1
        self.gather(u)

    # ------------------------------------------------------------------ hooks

    @torch.compiler.disable  # run eagerly: dynamo would trace `p.data = ...` as an in-place write of p
    def _pre_forward(self, units: list[Unit]) -> None:
        for u in units:
            self._use(u)
            u.users += 1

    @torch.compiler.disable  # run eagerly: dynamo would trace `p.data = ...` as an in-place write of p
    def _post_forward(self, units: list[Unit], out: Any) -> None:
        for u in units:
            u.users -= 1
        if torch.is_grad_enabled():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, units=units: self._pre_backward(units))
        if torch._C._current_graph_task_id() == -1:  # (a forward recomputed inside backward keeps its units)
            for u in units:
                if u.users == 0 and not u.held:
                    self.free(u)

    @torch.compiler.disable  # run eagerly: dynamo would trace `p.data = ...` as an in-place write of p
    def _pre_backward(self, units: list[Unit]) -> None:
        for u in units:
            if not u.held or not u.live:
                self._use(u)
            u.held = True

    def on_grad(self, p: torch.Tensor) -> None:
        """p's gradient arrived: a unit held for backward is freed once all its parameters' have."""
        u = self.unit_of[p]
        u.arrived.add(p)
        if u.held and u.users == 0 and len(u.arrived) == len(u.params):
            self.free(u)

    def on_pass_end(self, final: bool) -> None:
        """A backward pass ended: free every unit still gathered (no forward is running)."""
        if not final:
            return
        for u in self.units:
            u.arrived = set()
            if u.users == 0:
                self.free(u)
        self.pos = 0

    def on_update(self) -> None:
        """The shard holds new parameters: gathered copies are stale; graphs that saved the old ones must fail."""
        for u in self.units:
            self.free(u)
            u.arrived = set()
        self.recording, self.pos = False, 0
        bump_version(*self.layout.params)

    def _put_params(self, lo: int, hi: int, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                    params: torch.Tensor) -> None:  # fmt: skip
        """A swapper pass over tile [lo, hi): this rank's pieces of the gathered units into the parameters' file."""
        for u in self.units:
            a, b, pa = u.piece
            x, y = max(pa, lo), min(pa + b - a, hi)
            src = u.kept if u.kept is not None else u.buf if u.live else None
            if x < y and src is not None:  # (a unit not gathered keeps what the file holds)
                params[x - lo : y - lo].copy_(src[a - u.lo + x - pa : a - u.lo + y - pa])

    @contextlib.contextmanager
    def gathered(self, write: bool = False) -> Iterator[None]:
        """Every unit gathered inside the block (e.g. to save or evaluate the model), freed after. With write=True
        what the block wrote into the parameters is kept: each rank stores its shard of them (every rank must
        have written the same values). The parameters alias buffers of their own (each its own storage), so what the
        block takes from them (a state_dict) stays valid after it; a unit in use by forward/backward stays as is."""
        kept = [u for u in self.units if u.kept is None]
        for u in kept:
            self._keep(u)
        try:
            yield
            if write:
                self._write_back(self.units)
        finally:
            for u in kept:
                self._unkeep(u)


def units_of(module: torch.nn.Module, trainable: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], Uses]:
    """ZeRO-3's units: each module's own trainable parameters (a tied parameter belongs to its first module), in
    module order; and for every module, the units of its own parameters (a tied one's unit included)."""
    mine = {id(p) for p in trainable}
    unit_index: dict[int, int] = {}
    units: list[list[torch.Tensor]] = []
    uses: Uses = []
    for m in module.modules():
        own = [p for p in m.parameters(recurse=False) if id(p) in mine]
        new = [p for p in own if id(p) not in unit_index]
        if new:
            for p in new:
                unit_index[id(p)] = len(units)
            units.append(new)
        if own:
            uses.append((m, sorted({unit_index[id(p)] for p in own})))
    missing = [i for i, p in enumerate(trainable) if id(p) not in unit_index]
    if missing:
        raise ValueError(f"stage=3: {len(missing)} trainable parameter(s) (the first: number {missing[0]}) are not "
                         "parameters of the module: pass the model (ZeroOffloadAdamW(model, stage=3) or module=)")
    return units, uses

