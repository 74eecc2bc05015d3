"""ZeRO-3: the 16-bit parameters partitioned. Each rank keeps its shard of every unit (a module's own parameters);
a unit is gathered just before its module's forward and again before its backward, and freed after; the next
units are prefetched in the order recorded on the first iteration (forward, then backward). Each unit's lifecycle is
the state machine of offload/unit.py; ParamShards drives it from the module hooks and owns the shard.

Between uses a parameter is an empty tensor of the model's dtype (p.shape == (0,), as in DeepSpeed's ZeRO-3):
`opt.gathered()` gathers every unit for code that reads the weights outside forward (saving, evaluation). A forward
that reads another module's parameter (a parent reading a child's weight) gathers it on demand, as DeepSpeed does.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..cpu_adam import bump_version
from ..param_views import alias
from ..transport import Event, Transport
from .comm import Comm, _all_gather_single
from .layout import FlatLayout
from .report import PhaseTimes
from .unit import Unit, UnitState, tensors_in

Uses = list[tuple[torch.nn.Module, list[int]]]  # (module, the units it uses)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # what a bare Module holds: parameters, buffers, hooks
_PLAIN = (int, float, bool, str, type(None))  # attributes that hold no tensor (nn.Linear's in_features...)


class _EveryStorage:
    """`viewed` for Unit.reshard after a forward that raised: every buffer is let go, none freed."""

    def __contains__(self, storage: object) -> bool:
        return True


_EVERY_STORAGE = _EveryStorage()


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


class _Hook:
    """A hook of the optimizer's on a module; a deepcopy of the module gets a no-op (the copy is not the
    optimizer's)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        return _no_op

    def __reduce__(self) -> tuple:  # (torch.save(model): the saved model's hook does nothing either)
        return (_no_op_hook, ())


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _no_op_hook() -> Any:
    return _no_op


_CALL_CODE = torch.nn.Module._call_impl.__code__  # the frame of a module call (it calls the forward hooks)


class _Parameters(dict):
    """A module's `_parameters` at stage 3 (what `module.weight` reads): an empty parameter of the optimizer's read
    while a forward runs is gathered on demand for the running module; a deepcopy holds whole parameters."""

    def __init__(self, items: dict, shards: ParamShards) -> None:
        super().__init__(items)
        self.shards = shards

    def __getitem__(self, name: str) -> Any:
        p = dict.__getitem__(self, name)
        if p is not None and p.numel() == 0 and self.shards.running:
            self.shards.fetch(p)
        return p

    def __deepcopy__(self, memo: dict) -> dict:
        return {k: self.shards.whole_copy(p, memo) for k, p in self.items()}

    def __reduce_ex__(self, protocol: Any) -> Any:  # (torch.save(model), pickle: whole parameters, a plain dict)
        return dict, ({k: self.shards.pickled_copy(p) for k, p in self.items()},)


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
            ps = [(p, layout.offset[p] - lo, layout.shape[p]) for p in layout.flat_order if lo <= layout.offset[p] < hi]
            self.units.append(Unit(i, ps, lo, hi, layout.pieces[comm.rank][i], dtype, device, self._fill, self._wait,
                                   counter))  # fmt: skip
        self.unit_of = {p: u for u in self.units for p in u.params}
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.shard: torch.Tensor | None = None
        self.swapper: Any = None  # offload="nvme": the NvmeSwapper whose parameters' file holds the shard
        self.fence: Any = None  # DPU: the TileFence of the shard's tiled writeback (a gather waits for its tiles)
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
        self.forward_uses: int | None = None  # how many of the recorded uses are the forward's (the rest backward's)
        self._first: dict[int, int] = {}  # unit -> its first place in the order (an eval forward's prefetch)
        self._evaluating = False  # the outermost running forward began without gradients, outside backward
        self.hooks: list[Any] = []
        self.running: list[torch.nn.Module] = []  # the modules whose forward runs now, innermost last
        self._patched: list[torch.nn.Module] = []  # modules whose `_parameters` is a _Parameters
        self._saving: list[Unit] = []  # units kept for a state_dict() in progress
        self._in_root_save = False  # the model's own state_dict() is running
        self.probing = False  # a state_dict() read for its keys and dtypes only (load_checkpoint's checks): no gather
        self._root: torch.nn.Module | None = None  # the model (attach)
        self._pickled: dict[int, Any] = {}  # id(param) -> (param, writes, its copy) for a pickle (pickled_copy)
        self._writes = 0  # writes of the weights so far (invalidate)
        self.owner: Any = None  # the optimizer (held: the model's module hooks hold this, the optimizer the weights)
        self.before_forward: Any = None  # called before a forward outside any backward (GradPath.close_dead_pass)
        self._loading: list[Unit] = []  # units kept for a load_state_dict() in progress
        self._loader: torch.nn.Module | None = None  # the outermost of our modules that load visits
        self._load_keys: list | None = None  # that load's missing_keys list (one per load_state_dict() call)

    # ------------------------------------------------------------------ construction

    @torch.no_grad()
    def take(self, p: torch.Tensor, values: torch.Tensor | None) -> None:
        """Store this rank's part of p's values (all of p, on this device; None: stored already) in the shard; p
        becomes empty."""
        off, n = self.layout.offset[p], p.numel()
        for a, b, pa in self.layout.owned(off, off + n, self.comm.rank) if values is not None else []:
            if self.shard is not None:  # (NVMe: the swapper's fill writes the masters' cast)
                self.shard[pa : pa + b - a].copy_(values.reshape(-1)[a - off : b - off])
        p.data = self._empty

    def accumulators(self) -> dict[torch.Tensor, Any]:
        """Each param's AccumulateGrad node, made while its unit is gathered (autograd records the param's shape
        in it), one unit at a time."""
        out = {}
        for u in self.units:
            u.finish()
            out.update({p: p.view_as(p).grad_fn.next_functions[0][0] for p in u.params})
            u.reshard()
        return out

    def attach(self, root: torch.nn.Module) -> None:
        """Register the module hooks: from now on units are gathered around their modules' forward and backward.
        `root`: the model; a root.state_dict() keeps the units it gathers until it ends (tied parameters stay one
        tensor)."""
        self._root = root
        self.uses: dict[torch.nn.Module, list[Unit]] = {}
        for module, idx in self.modules:
            self.use(module, [self.units[i] for i in idx])
        for module in root.modules():  # the parents run too: a forward reading a child's weight fetches it for them
            if module not in self.uses and any(m in self.uses for m in module.modules()):
                self.use(module, [])
        for module in self.uses:
            module._parameters = _Parameters(module._parameters, self)
            self._patched.append(module)
        self._hook(root.register_state_dict_pre_hook, lambda *a: setattr(self, "_in_root_save", True))
        self._hook(root.register_state_dict_post_hook, lambda *a: self._release_saved(root_done=True))
        # root.load_state_dict(): the units whole while it copies, then each rank's shard of them kept
        # model.load_state_dict(), a submodule's or a wrapper's (the root loaded as a child): its pre-hooks run for
        # every module the load visits, outermost first, whose post-hook runs last
        for module in root.modules():
            self._hook(module.register_load_state_dict_pre_hook, self._load_pre_hook)
            self._hook(module.register_load_state_dict_post_hook, lambda m, keys: self._store_loaded(m))

    def _hook(self, register: Any, fn: Any, **kw: Any) -> None:
        self.hooks.append(register(_Hook(fn), **kw))

    def use(self, module: torch.nn.Module, units: list[Unit]) -> None:
        """`module`'s forward (and backward) needs these units gathered (besides the ones it needed already)."""
        if module in self.uses:
            self.uses[module] += [u for u in units if u not in self.uses[module]]  # (in place: the hooks hold it)
            return
        self.uses[module] = units = list(units)
        self._hook(module.register_forward_pre_hook, lambda m, a, units=units: self._pre_forward(m, units))
        self._hook(module.register_forward_hook, lambda m, a, out, units=units: self._post_forward(m, units, out),
                   always_call=True)  # fmt: skip
        # module.state_dict() (save_pretrained, safetensors, Trainer) sees whole parameters
        self._hook(module.register_state_dict_pre_hook, lambda m, *a, units=units: self._keep_for_save(units))
        self._hook(module.register_state_dict_post_hook,
                   lambda m, sd, prefix, *a, units=units: self._after_save(m, sd, prefix, units))  # fmt: skip

    def detach(self) -> None:
        """Remove the hooks; every parameter handed back whole, on the device, for good (close())."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for m in self._patched:
            m._parameters = dict(m._parameters)
        self._patched = []
        for u in self.units:
            u.hand_back()

    # ------------------------------------------------------------------ gathers

    def connected(self, p: torch.Tensor) -> bool:
        """p is still the optimizer's: empty between uses, or its range of the unit's gathered buffer."""
        return self.unit_of[p].owns(p)

    def _fill(self, u: Unit, buf: torch.Tensor) -> tuple[Event | None, Any, torch.Tensor | None]:
        """This rank's shard of u copied into its slice of buf, the all-gather into buf started; what to wait for
        (the copy's event, the collective, the pinned block an NVMe read went through)."""
        t0 = time.perf_counter()
        a, b, pa = u.piece
        mine = buf[a - u.lo : b - u.lo]
        event = bounce = None
        if self.fence is not None:  # this rank's piece of the unit, as the step's writeback left it
            self.fence.wait([(pa, pa + b - a)])
        if self.offload == "nvme":  # read into a pinned block, then copy it up
            bounce = self.transport.pool.take(b - a, self.dtype)
            self.swapper.read_params(pa, pa + b - a, bounce)
            event = self.transport.h2d(mine, bounce)
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
        self.times.add("gather", time.perf_counter() - t0)
        return event, work, bounce

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

    def _wait(self, u: Unit, pending: tuple[Event | None, Any, torch.Tensor | None]) -> None:
        t0 = time.perf_counter()
        event, work, bounce = pending
        if work is not None:
            self.comm.wait(work, f"the all-gather of unit {u.index}")
        self.transport.device_wait(event)
        if bounce is not None:  # the pinned block goes back once its copy is done
            self.transport.wait(event)
            self.transport.pool.give(bounce)
        self.times.add("gather_wait", time.perf_counter() - t0)

    def _use(self, u: Unit) -> None:
        """u is about to be used: gather it, record the order (first iteration) and prefetch what follows. A forward
        begun without gradients outside backward (an evaluation: the outermost module's forward decides, so a
        reentrant checkpoint's forward, run without gradients inside a training forward, is no evaluation) records
        nothing and keeps the iteration's place in the order: it prefetches the forward's next units from u's own
        place."""
        if self._evaluating and torch._C._current_graph_task_id() == -1:
            i = self._first.get(u.index)
            if self.prefetch and i is not None:
                for j in self.order[i + 1 : min(i + 1 + self.prefetch, self.forward_uses or 0)]:
                    self.units[j].start()
            u.finish()
            return
        if self.recording:
            self.order.append(u.index)
        elif self.prefetch and self.pos < len(self.order) and self.order[self.pos] == u.index:
            for i in self.order[self.pos + 1 : self.pos + 1 + self.prefetch]:
                self.units[i].start()
        self.pos += 1
        u.finish()

    def fetch(self, p: torch.Tensor) -> None:
        """A forward reads p, another module's empty parameter: its unit is gathered now, and from now on around
        the running module too (as register_external_parameter does)."""
        u = self.unit_of.get(p)
        if u is None:  # (not the optimizer's: a frozen parameter, or one of another model)
            return
        self.use(self.running[-1], [u])
        self._use(u)
        u.users += 1

    def whole_copy(self, p: Any, memo: dict) -> Any:
        """copy.deepcopy(p), with its values whole: an empty parameter of the optimizer's is gathered for it."""
        u = self.unit_of.get(p) if isinstance(p, torch.Tensor) else None
        if u is None or p.numel() or id(p) in memo:
            return copy.deepcopy(p, memo)
        if self.comm.world > 1:
            raise RuntimeError("ZeRO-3 with several ranks: copy.deepcopy(model) would gather the parameters (a "
                               "collective); call it inside `with opt.gathered():` on every rank")  # fmt: skip
        kept = u.state is not UnitState.KEPT
        u.keep()
        try:
            return copy.deepcopy(p, memo)
        finally:
            if kept:
                u.unkeep()

    def pickled_copy(self, p: Any) -> Any:
        """A whole copy of p for a pickle of the model (torch.save): the same copy for p while it lives and no write
        of the weights came since, so tied parameters stay one tensor (the pickler holds its copies until the dump
        ends; then they go). A copy kept longer (by a failed save's traceback) is not handed to a later save."""
        entry = self._pickled.get(id(p))
        if entry is not None:
            owner, writes, ref = entry
            c = ref()
            if c is not None and owner() is p and writes == self._writes:
                return c
        c = self.whole_copy(p, {})
        if isinstance(p, torch.Tensor) and isinstance(c, torch.Tensor):
            self._pickled[id(p)] = (weakref.ref(p), self._writes, weakref.ref(c))
        return c

    # ------------------------------------------------------------------ state_dict and load_state_dict

    def _keep_for_save(self, units: list[Unit]) -> None:
        """Before module.state_dict(): its units gathered into buffers of their own (one rank); with several ranks
        that would be a collective inside a call often made on one rank only: refused unless already whole."""
        missing = [u for u in units if u.whole is None]
        if not missing or self.probing:
            return
        self._check_not_torn()
        if self.comm.world > 1:
            self._release_saved(root_done=True)  # (the root's post-hook will not run)
            raise RuntimeError("ZeRO-3 with several ranks: the parameters are partitioned, so state_dict() would be a "
                               "collective; call it inside `with opt.gathered():` on every rank (or use "
                               "zo_kernels.save_checkpoint, which does)")  # fmt: skip
        for u in missing:
            u.keep()
            self._saving.append(u)

    def _after_save(self, module: torch.nn.Module, sd: dict, prefix: str, units: list[Unit]) -> None:
        """After module.state_dict(): what it holds is copied out of storage that forward/backward will release,
        and the buffers kept for it are let go (the tensors in `sd` keep theirs alive)."""
        for name, p in dict.items(module._parameters):
            u, t = self.unit_of.get(p), sd.get(prefix + name)
            if u is not None and u.state is UnitState.GATHERED and isinstance(t, torch.Tensor) and t.numel():
                sd[prefix + name] = t.clone()
        if not self._in_root_save:  # a submodule's own state_dict() call
            self._release_saved()

    def _release_saved(self, root_done: bool = False) -> None:
        if root_done:
            self._in_root_save = False
        for u in self._saving:
            u.unkeep()
        self._saving = []

    def _load_pre_hook(self, module: torch.nn.Module, state_dict: Any, prefix: str, local_metadata: Any, strict: Any,
                       missing_keys: list, *rest: Any) -> None:  # fmt: skip
        if missing_keys is not self._load_keys:  # the first of a load (its one `missing_keys` list: a new one a call,
            if local_metadata.get("assign_to_params_buffers"):  # (refused before anything is loaded)
                mine = [n for n, p in module.named_parameters(prefix=prefix[:-1], remove_duplicate=False)
                        if p in self.unit_of and n in state_dict]  # fmt: skip
                if mine:
                    raise RuntimeError(
                        f"stage 3: load_state_dict(assign=True) would replace the optimizer's parameter {mine[0]!r} "
                        "with the state dict's tensor, which the optimizer would never see (it would train the one it "
                        "holds, and the model would not change): load without assign=True (the values are copied "
                        "in), or before building the optimizer or after close(); nothing of the optimizer's model was "
                        "changed")  # fmt: skip
            self._load_keys = missing_keys  # so a load that raised midway leaves nothing behind for the next)
            self._keep_for_load(module)

    def _keep_for_load(self, module: torch.nn.Module) -> None:
        """Before model.load_state_dict() (or a submodule's, `module`): every unit whole (a collective with several
        ranks: all load)."""
        for u in self._loading:  # kept by a load that raised before its end (its post-hook never ran)
            u.unkeep()
        self._loader = module
        self._loading = [u for u in self.units if u.whole is None or (u.state is UnitState.GATHERED and u.idle)]
        for u in self._loading:
            u.keep()

    def _store_loaded(self, module: torch.nn.Module) -> None:
        """After model.load_state_dict() (the post-hook of `_loader`, the outermost of our modules it visited): what
        it wrote becomes the shards (the masters follow with the optimizer's load_state_dict or
        refresh_masters_from_model, as at stage 2)."""
        if module is not self._loader:
            return
        loading, self._loading, self._loader, self._load_keys = self._loading, [], None, None
        try:  # (a write that fails, a full disk at ZeRO-Infinity: the units are let go all the same)
            self.write_back()
        finally:
            for u in loading:
                u.unkeep()

    def write_back(self) -> None:
        """Each rank's piece of the whole units (every rank holds the same values) into its shard; then the one
        invalidation path: gathered copies of the old values are dropped."""
        if self.fence is not None:  # a tile of the step's writeback must not land over what is written here
            self.fence.wait_all()
        whole = [u for u in self.units if u.whole is not None]
        if self.offload == "nvme":
            self.swapper.stream(self._put_params)
        else:
            for u in whole:
                a, b, pa = u.piece
                dst, src = self.shard[pa : pa + b - a], u.whole[a - u.lo : b - u.lo]
                if self.offload is not None:
                    self.transport.wait(self.transport.d2h(dst, src))
                else:
                    dst.copy_(src)
        self.invalidate(written=whole)

    def _put_params(self, lo: int, hi: int, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                    params: torch.Tensor) -> None:  # fmt: skip
        """A swapper pass over tile [lo, hi): this rank's pieces of the whole units into the parameters' file."""
        for u in self.units:
            a, b, pa = u.piece
            x, y = max(pa, lo), min(pa + b - a, hi)
            src = u.whole
            if x < y and src is not None:  # (a unit not gathered keeps what the file holds)
                params[x - lo : y - lo].copy_(src[a - u.lo + x - pa : a - u.lo + y - pa])

    def invalidate(self, written: list[Unit]) -> None:
        """The shard holds new values (every write of the weights ends here): gathered copies are dropped, kept
        buffers that did not make the change refilled; graphs that saved the old values must fail."""
        for u in self.units:
            u.invalidate(refill_kept=u not in written)
        bump_version(*self.layout.params)
        self._writes += 1

    @contextlib.contextmanager
    def gathered(self, write: bool = False) -> Iterator[None]:
        """Every unit gathered inside the block (e.g. to save or evaluate the model), freed after. With write=True
        what the block wrote into the parameters is kept: each rank stores its shard of them (every rank must
        have written the same values). The parameters alias buffers of their own (each its own storage), so what the
        block takes from them (a state_dict) stays valid after it; a unit in use by forward/backward stays as is."""
        kept = [u for u in self.units if u.state not in (UnitState.KEPT, UnitState.HANDED_BACK)]
        for u in kept:
            u.keep()
        try:
            yield
            if write:
                self._check_written_in_place(kept)
                self.write_back()
        finally:
            for u in kept:
                u.unkeep()

    def _check_written_in_place(self, units: list[Unit]) -> None:
        """A write block changed the parameters' values in place (copy_, load_state_dict): one whose data was
        replaced (`p.data = ...`, resize_token_embeddings) would be lost by write_back, and the model left holding a
        tensor of its own: refused before anything is stored."""
        for u in units:
            for p in u.params:
                if not u.owns(p):
                    now = f"{tuple(p.shape)}, {p.dtype} on {p.device}"
                    if u.whole is not None:  # the model gets the parameter back as it was: nothing is changed
                        off, shape = u._where[p]
                        p.data = alias(u.whole, off, shape.numel(), shape)
                    raise RuntimeError(
                        f"inside gathered(write=True) the data of a stage-3 parameter of shape "
                        f"{tuple(u._where[p][1])} was replaced (now {now}): "
                        "the optimizer's parameters keep their shapes and memory; write values in place (p.copy_(), "
                        "model.load_state_dict()). Resize (resize_token_embeddings) or replace parameters before "
                        "building the optimizer, or after close(); nothing was stored")  # fmt: skip

    # ------------------------------------------------------------------ hooks

    def _check_not_torn(self) -> None:
        """ZeRO-Infinity: the parameters' file torn by a write that stopped partway holds old and new weights mixed:
        a forward or a state_dict() would read them silently (a load gathers them to write over, and close() to hand
        them back, as they are)."""
        torn = self.swapper.torn if self.offload == "nvme" and self.swapper is not None else None
        if torn:
            raise RuntimeError(f"the parameters' NVMe file is torn ({torn}): it holds old and new weights mixed; load "
                               "a checkpoint (zo_kernels.load_checkpoint) before using the model")  # fmt: skip

    def forget_interrupted_forward(self) -> None:
        """A forward stopped by Ctrl-C (a BaseException, not an Exception: torch then runs no forward hook) left its
        modules "running": every later read of a weight outside forward was gathered for them, and their units were
        never freed (the whole model on the device). Called where no forward can run (the optimizer's step and
        zero_grad) and when the model's forward begins while modules are "running" that no call on the stack runs
        (_stale). A first iteration's recorded order starts again (its interrupted part is no use order)."""
        self.running.clear()
        for u in self.units:
            if u.users:
                u.users = 0
                if u.idle and u.state in (UnitState.GATHERING, UnitState.GATHERED):
                    u.reshard(_EVERY_STORAGE)  # (the traceback's frames may hold views: let go to them)
        self.pos = 0  # (the interrupted forward's uses are no iteration's)
        if self.recording:
            self.order, self.forward_uses, self._first = [], None, {}

    def _stale(self, module: torch.nn.Module) -> bool:
        """The modules "running" are not: no module call on the Python stack runs the innermost (a Ctrl-C stopped
        it). A model that calls itself (a Siamese pair, a recursion) has its outer call on the stack; `module`'s
        own call, the one beginning now, is the first on the stack and does not count."""
        inner, f, skip = self.running[-1], sys._getframe(1), self.running[-1] is module
        while f is not None:
            if f.f_code is _CALL_CODE and f.f_locals.get("self") is inner:
                if not skip:
                    return False
                skip = False
            f = f.f_back
        return True

    @torch.compiler.disable  # run eagerly: dynamo would trace `p.data = ...` as an in-place write of p
    def _pre_forward(self, module: torch.nn.Module, units: list[Unit]) -> None:
        if self.running and module is self._root and torch._C._current_graph_task_id() == -1 and self._stale(module):
            self.forget_interrupted_forward()
        if not self.running:  # the outermost forward: an evaluation if begun without gradients outside backward
            self._check_not_torn()
            top = torch._C._current_graph_task_id() == -1
            self._evaluating = not torch.is_grad_enabled() and top
            if top and self.before_forward is not None:
                self.before_forward()
        self.running.append(module)
        for u in units:
            u.check_untouched()
            self._use(u)
            u.users += 1

    @torch.compiler.disable  # run eagerly: dynamo would trace `p.data = ...` as an in-place write of p
    def _post_forward(self, module: torch.nn.Module, units: list[Unit], out: Any) -> None:
        if self.running and self.running[-1] is module:
            self.running.pop()
        if not units:  # (a parent with no parameters of its own, nor read from others: nothing to hook or free)
            return
        for u in units:
            u.users = max(0, u.users - 1)
        handed = [out] if isinstance(out, torch.Tensor) else tensors_in(out)  # (also in a dataclass or set)
        if torch.is_grad_enabled():
            for t in handed:
                if t.requires_grad:
                    t.register_hook(lambda g, units=units: self._pre_backward(units))
        if torch._C._current_graph_task_id() == -1:  # (a forward recomputed inside backward keeps its units)
            ids = {id(t) for t in handed}  # (a unit whose parameter itself is handed out, `return self.queries`,
            idle = [u for u in units if u.idle and not any(id(p) in ids for p in u.params)]  # stays whole for now)
            if idle:
                # a forward that raised (torch calls this hook from its `except`, with no output): the frames of
                # the traceback may hold views of the buffers (`w = self.weight.t()`), which a traceback printed with
                # its locals or a debugger's post-mortem reads: the buffers are let go to them, not freed under them
                raised = out is None and sys.exc_info()[0] is not None
                viewed = _EVERY_STORAGE if raised else self._viewed(out, module)
                for u in idle:
                    u.reshard(viewed)

    def _viewed(self, out: Any, module: torch.nn.Module) -> set[int]:
        """The storages that a forward's output and its module's own attributes (`self.cache = w[:n]`, also in a
        list or an object there) hold on the device: a unit's buffer among them is let go to them, not freed."""
        attrs = [v for k, v in vars(module).items() if k not in _MODULE_INTERNALS and not isinstance(v, _PLAIN)]
        found = [out] if isinstance(out, torch.Tensor) and not attrs else tensors_in((out, attrs), objects=True)
        return {t.untyped_storage().data_ptr() for t in found if t.layout == torch.strided and t.device == self.device}

    @torch.compiler.disable  # run eagerly: dynamo would trace `p.data = ...` as an in-place write of p
    def _pre_backward(self, units: list[Unit]) -> None:
        if self.recording and self.forward_uses is None:
            self.forward_uses = len(self.order)
        for u in units:
            if not u.held or u.state in (UnitState.SHARDED, UnitState.GATHERING):
                self._use(u)
            u.held = True

    def on_grad(self, p: torch.Tensor) -> None:
        """p's gradient arrived: a unit held for backward is freed once all its parameters' have."""
        u = self.unit_of[p]
        u.arrived.add(p)
        if u.held and u.users == 0 and len(u.arrived) == len(u.params):
            u.reshard()
            u.held = False

    def on_pass_end(self, final: bool, running: bool = False) -> None:
        """A backward pass ended: free every unit still gathered (no forward is running). running: another backward
        is (the pass of one whose gradients all arrived in nested backwards ends only at the next one's first repeated
        gradient, inside that one's recomputation): its units stay gathered until a pass ends with none running."""
        if not final:
            return
        for u in self.units:
            u.arrived = set()
            if u.users == 0 and not running:
                u.reshard()
                u.held = False
        self.pos = 0

    def on_update(self) -> None:
        """The step wrote new parameters into the shard: the one invalidation path; the next iteration uses the
        recorded order."""
        self.invalidate(written=[])
        if self.recording:
            if self.forward_uses is None:  # (no backward reached a unit: every recorded use is the forward's)
                self.forward_uses = len(self.order)
            for i, index in enumerate(self.order[: self.forward_uses]):
                self._first.setdefault(index, i)
        self.recording, self.pos = False, 0


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

