"""Activation checkpoints offloaded to pinned host memory, prefetched one segment ahead, in constant buffers.

`checkpoint(function, *args, offload=True)` is torch.utils.checkpoint.checkpoint(use_reentrant=False): torch's own
non-reentrant checkpoint runs the function, stashes and restores the RNG and autocast state and checks the
recomputation, so gradients are bit for bit torch's. What differs is where the checkpoint (the segment's tensor
arguments) lives between forward and backward. torch keeps a reference to each argument on the device; here the
floating-point positional arguments are copied into blocks of `ActivationBuffers` and torch is handed an empty
placeholder (same device, so the same RNG states are stashed):

- offload=True: the newest segment keeps its arguments on the device ("held"): backward recomputes it first, right
  after the loss and the layers above the checkpoints, too early for a prefetch to hide. When the next segment is
  stored, the held one queues a D2H copy of each argument to a pinned host block (on the transport's copy stream,
  after its producer) and drops its device reference. Backward recomputes segments in reverse; when segment k starts
  recomputing, the device waits for its H2D copy and the H2D copy of the segment before it (k - 1 in forward order)
  is queued into a free device slot, so it runs under segment k's compute. A device slot is free again when the
  gradient of its segment's inputs has been computed (`_Release`): in a chain two slots are in use at a time (the
  held arguments count as one). The held segment goes to the host then too (a second backward may need it).
- offload=False: each argument is copied into a device block that lives until the graph is freed (one contiguous
  block per checkpoint instead of whatever the allocator left; MD in ZeRO-R).

Blocks are reused by size from step to step: after the first step (or `reserve` / `reserve_for`), `allocations` stays
constant. Host blocks are held until the segment's graph is freed, so retain_graph=True and a second backward work.
The function must not modify its tensor arguments in place (they are leaves during the recomputation). An offloaded
argument changed in place after the call, before its copy was taken (held: until backward), makes backward raise,
as torch's checkpoint does (it would otherwise recompute from the changed values).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch._C import _len_torch_dispatch_stack as _len_dispatch_stack
from torch._ops import _len_torch_dispatch_stack_pre_dispatch as _len_pre_dispatch_stack
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from .transport import Event, Transport, default_transport

_OFFLOADED = (torch.float32, torch.float16, torch.bfloat16)  # what transport.pool can hold
_ORDER = itertools.count()  # segments' creation order (next() is atomic under the GIL)
_ALIGN = 512  # device blocks are rounded up to this many bytes, so a slot fits activations of nearby sizes


class ActivationBuffers:
    """Device and pinned host blocks for activation checkpoints, reused by size, with allocation counters.

    Args:
        device: where the activations live ("cuda", "cuda:1", or "cpu" with a GPU-shaped transport).
        transport: the copy transport (default: `default_transport(device)`); its pool holds the host blocks.
    """

    def __init__(self, device: torch.device | str, transport: Transport | None = None) -> None:
        device = torch.device(device)
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be a CUDA device or the CPU, got {device}")
        if transport is not None and not isinstance(transport, Transport):
            raise TypeError(f"transport must be a zo_kernels Transport, got {type(transport).__name__}")
        self.transport = default_transport(device) if transport is None else transport
        self.device = self.transport.device if device.type == "cuda" else device
        self._free: dict[int, list[torch.Tensor]] = {}  # size -> device blocks (uint8) of that size ready for reuse
        self.device_allocations = 0  # device blocks allocated so far (each once; reused afterwards)
        self.host_allocations = 0  # host blocks the transport's pool allocated for checkpoints
        self.device_bytes = 0  # bytes of device blocks allocated
        self._last: _Link | None = None  # the newest offloaded segment alive: the tail of the forward order
        self._held: list[_Link] = []  # the segments whose arguments may still be on the device, oldest first
        self._lock = threading.RLock()  # (a segment's finalizer gives its blocks back, maybe inside a locked region)
        self._landing: dict[int, Event] = {}  # device block address -> an H2D copy into it no one has waited for
        # device block address -> {(shape, dtype): the block's first bytes as that tensor}: a step asks for the
        # shapes the last one did, and a view made afresh costs three view calls (a third of zo's host time per
        # resident segment on the CPU)
        self._views: dict[int, dict[tuple[torch.Size, torch.dtype], torch.Tensor]] = {}
        # tensors a segment of these buffers has checkpointed, while their objects live: a later segment given one
        # of them again (an encoder's output passed to every decoder layer) keeps it by reference, as torch does
        self._taken = WeakIdKeyDictionary()

    def __deepcopy__(self, memo: dict) -> ActivationBuffers:
        """Shared, not copied: a deep copy of a model whose layers checkpoint through these buffers (HF's
        gradient_checkpointing_enable with a partial of zo_kernels.checkpoint; an EMA's AveragedModel) uses them
        too (their locks and the transport's threads cannot be copied)."""
        return self

    def __copy__(self) -> ActivationBuffers:
        return self

    def __reduce__(self) -> tuple:
        """Pickled (torch.save(model)) as the default buffers of its device in the loading process, or None where
        that device is missing there (a checkpoint given buffers=None takes its arguments' device's at run time)."""
        return (_buffers_for, (str(self.device),))

    @property
    def allocations(self) -> int:
        """Device and host block allocations so far: constant once every size has been seen."""
        return self.device_allocations + self.host_allocations

    def reserve(self, device_blocks: list[int] | tuple[int, ...],
                host_blocks: list[int] | tuple[int, ...] = ()) -> None:  # fmt: skip
        """Allocate blocks of the planned sizes up front: a step that needs no more allocates nothing.

        device_blocks: bytes of each device slot (offload: two for a chain; resident: one per checkpoint).
        host_blocks: the bytes of each offloaded checkpoint (a host block is of its size class, up to 25% more:
            a checkpoint of those bytes, or of any in the same class, reuses it)."""
        for name, sizes in (("device_blocks", device_blocks), ("host_blocks", host_blocks)):
            if not isinstance(sizes, (list, tuple)) or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0
                                                           for n in sizes):  # fmt: skip
                raise ValueError(f"{name} must be a list of positive byte counts, got {sizes!r}")
        if any(n % 2 for n in host_blocks):
            raise ValueError(f"host_blocks: checkpoints are 16- or 32-bit, so their byte counts are even, got "
                             f"{list(host_blocks)}")  # fmt: skip
        blocks: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        try:  # (one that fails, e.g. out of memory: those taken before it are free blocks all the same)
            for n in device_blocks:
                blocks.append(self.take_device(n))
            for n in host_blocks:
                host.append(self.take_host(n // 2, torch.float16))
        finally:
            for b in blocks:
                self.give_device(b)
            for h in host:
                self.transport.pool.give(h)

    def reserve_for(self, seq: int, batch: int, hidden: int, layers: int, *, dtype: torch.dtype = torch.bfloat16,
                    offload: bool = True, segments: int = 1) -> None:  # fmt: skip
        """Reserve what `layers` checkpointed blocks with [batch, seq, hidden] inputs need: the planner's sizes
        (zo_kernels.planner.activation_bytes: offloaded, the last segment's input stays where it was made, the others
        go to the host, two device slots bring them back (one for two segments); resident, every input on the
        device). segments: checkpoints per layer (2: one around the attention, one around the MLP)."""
        for name, v in (("seq", seq), ("batch", batch), ("hidden", hidden), ("layers", layers),
                        ("segments", segments)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if dtype not in _OFFLOADED:
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        if not isinstance(offload, bool):  # ("no" would reserve as True)
            raise TypeError(f"offload must be a bool, got {type(offload).__name__}")
        nbytes = seq * batch * hidden * torch.empty((), dtype=dtype).element_size()
        n = layers * segments
        if offload:
            self.reserve([nbytes] * min(2, n - 1), [nbytes] * (n - 1))
        else:
            self.reserve([nbytes] * n)

    def take_device(self, nbytes: int) -> torch.Tensor:
        """A device block (uint8) of at least `nbytes`: the smallest free one that fits, else a new one."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        block, landing = None, None
        with self._lock:  # (a step asks for the sizes it gave back: the exact size first, one dict lookup)
            fit = size if self._free.get(size) else min((n for n, bs in self._free.items() if n >= size and bs),
                                                        default=None)  # fmt: skip
            if fit is not None:
                block = self._free[fit].pop()
                landing = self._landing.pop(block.data_ptr(), None)
        if block is None:
            block = torch.empty(size, dtype=torch.uint8, device=self.device)  # (out of memory: nothing counted)
            with self._lock:
                self.device_allocations += 1
                self.device_bytes += size
            return block
        if landing is not None:  # a prefetch whose segment was dropped before its restore may still be writing it
            self.transport.device_wait(landing)
        return block

    def typed(self, block: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The first bytes of a device block as a contiguous tensor of `shape` and `dtype` (made once per block and
        shape; a block that has been asked for more than 8 shapes forgets the older ones)."""
        views = self._views.get(block.data_ptr())
        if views is None:
            views = self._views[block.data_ptr()] = {}
        t = views.get((shape, dtype))
        if t is None:
            if len(views) >= 8:
                views.clear()
            t = views[(shape, dtype)] = _view(block, shape, dtype)
        return t

    def give_device(self, block: torch.Tensor) -> None:
        """Return a block from `take_device` (the compute stream orders its next use after the current one)."""
        with self._lock:
            self._free.setdefault(block.numel(), []).append(block)

    def take_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host block of `numel` elements from the transport's pool (counted when the pool grows). The pool
        reuses blocks of one size: the block is of the size class holding numel (a quarter-octave step, at most 25%
        over), so batches of varying length (a collator's dynamic padding) reuse blocks where every new length made
        new ones, without bound."""
        pool = self.transport.pool
        before = pool.reserved
        size = _size_class(numel * dtype.itemsize) // dtype.itemsize  # (in bytes: reserve's fp16 blocks fit any dtype)
        block = pool.take(size, dtype)[:numel]  # (give() finds the block by its start)
        if pool.reserved > before:
            self.host_allocations += 1
        return block

    def _register(self, seg: _Segment) -> None:
        """`seg` is the newest offloaded segment (its function about to run: see `_settle`)."""
        link = seg.link
        with self._lock:
            link.prev, link.linked = self._last, True
            if self._last is not None:
                self._last.next = link
            self._last = link
            self._held.append(link)

    def _unlink(self, link: _Link) -> None:
        """A segment leaves the forward order (it died, or will never be recomputed)."""
        with self._lock:
            if not link.linked:
                return
            if link.prev is not None:
                link.prev.next = link.next
            if link.next is not None:
                link.next.prev = link.prev
            if self._last is link:
                self._last = link.prev
            link.prev = link.next = None
            link.linked = False

    def _settle(self, seg: _Segment, graph: bool) -> None:
        """`seg`'s function has run. graph: its output may need a gradient, so backward will recompute it: the
        segments registered before it go to the host. Otherwise (a graphless forward, a frozen teacher's, say) it is
        never recomputed: it leaves the order, and the held checkpoint of the pending graph stays where it is.
        O(1) per call in a chain: only the segments still holding their arguments are looked at."""
        link = seg.link
        if not graph:
            self._unlink(link)
        with self._lock:
            if not graph or not link.linked:
                self._held = [h for h in self._held if h is not link]
                return
            older = [h for h in self._held if h.order < link.order]
            self._held = [h for h in self._held if h.order >= link.order]
        for h in older:
            s = h.seg()
            if s is not None:
                s.to_host()

    def _previous(self, seg: _Segment) -> _Segment | None:
        """The live segment registered just before `seg` (the next one backward recomputes)."""
        with self._lock:
            p = seg.link.prev if seg.link.linked else None
            while p is not None:
                s = p.seg()
                if s is not None:
                    return s
                p = p.prev  # died, its finalizer not yet run (collected in a cycle): skipped
        return None


class _Link:
    """A segment's place in the forward order (a node of a doubly linked list; the segment itself held weakly)."""

    __slots__ = ("seg", "order", "prev", "next", "linked")

    def __init__(self, seg: _Segment) -> None:
        self.seg, self.order = weakref.ref(seg), next(_ORDER)
        self.prev: _Link | None = None
        self.next: _Link | None = None
        self.linked = False


class _Release(torch.autograd.Function):
    """Identity on a segment's inputs; its backward runs once their gradient is computed: the segment is done."""

    @staticmethod
    def forward(ctx: Any, seg: _Segment, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.seg = weakref.ref(seg)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        seg = ctx.seg()
        if seg is not None:
            if torch.is_grad_enabled():  # create_graph=True: the graph being built reads the restored checkpoint
                seg.kept = True  # later, also after a plain backward: its blocks are freed with the segment only
            else:
                seg.release_device()
        return (None, *grads)


class _Segment:
    """One checkpointed call: its arguments' blocks, and the function torch's checkpoint calls (twice)."""

    def __init__(self, buffers: ActivationBuffers, function: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], offload: bool) -> None:  # fmt: skip
        self.buffers, self.function, self.offload = buffers, function, offload
        # what is kept: positions of floating-point positional arguments, names of keyword ones that need a gradient
        # one checkpoint per tensor: the same tensor passed twice (q, k and v of self-attention) is kept once and
        # given back as one tensor in every place (nn.MultiheadAttention takes its fused path when query is key)
        self.groups: list[list[int | str]] = _groups(args, kwargs, buffers.device, buffers._taken)
        self.slots = [g[0] for g in self.groups]  # where each checkpointed tensor was first passed
        kept = [kwargs[k] if isinstance(k, str) else args[k] for k in self.slots]
        taken = buffers._taken
        for t in kept:
            taken[t] = True
        self.args: tuple[Any, ...] | None = args  # only during the forward call
        self.kwargs: dict[str, Any] | None = kwargs
        self.meta = [(t.shape, t.dtype, t.requires_grad) for t in kept]
        self.orders: list[tuple[int, ...] | None] = []  # per checkpoint: the permutation back from memory order
        self.host: list[torch.Tensor] = []  # offload: the pinned copies
        self.d2h: list[Event] = []
        self.device: list[torch.Tensor] = []  # the device blocks holding the checkpoint now (may be empty)
        self.views: list[torch.Tensor] = []  # those blocks as the checkpointed tensors (shape, dtype)
        self.h2d: Event | None = None  # offload: the prefetch into self.device, not yet waited for
        self.held: list[torch.Tensor] = []  # offload, state held: the arguments themselves, still on the device
        self.versions: list[int] = []  # offload: each held argument's version counter when it was taken
        self.changed: str | None = None  # an argument was changed in place before its copy was taken (raised later)
        self.watched: list[tuple[weakref.ref, int]] = []  # offload: (each argument, its version) while it lives: a
        # change after its copy to the host was queued raced with the copy (refused at backward, as torch does)
        self.kept = False  # a create_graph backward read its restored checkpoint: its blocks stay until it dies
        # forward -> [held ->] stored -> (restoring -> restored -> stored)*   (held: offload, the newest segment)
        self.state = "forward"
        self.link = _Link(self)
        self._fin = weakref.finalize(self, _free_segment, buffers, self.host, self.device, self.link)

    def store(self) -> list[tuple[torch.Tensor, int]]:
        """Copy the arguments into their blocks (host: queued D2H; device: a copy on the compute stream); returns
        each one (detached) with its version counter's value, for the check after the function."""
        assert self.args is not None and self.kwargs is not None
        buffers, args, kwargs = self.buffers, self.args, self.kwargs
        taken = []
        for i, k in enumerate(self.slots):
            arg = kwargs[k] if isinstance(k, str) else args[k]
            x, back = _memory_order(arg.detach())
            self.orders.append(back)
            self.meta[i] = (x.shape, *self.meta[i][1:])  # (the block holds x's memory order: channels_last's NHWC)
            v = _version(x)
            taken.append((x, v))
            if self.offload:
                self.held.append(x)
                self.versions.append(v)
                self.watched.append((weakref.ref(arg), v))
            else:
                block = buffers.take_device(x.numel() * x.element_size())
                self.device.append(block)
                view = buffers.typed(block, x.shape, x.dtype)
                view.copy_(x)
                self.views.append(view)
        self.args = self.kwargs = None
        self.state = "held" if self.offload else "stored"
        if self.offload:
            self.buffers._register(self)
        return taken

    def to_host(self) -> None:
        """A held checkpoint: queue the D2H copies of its arguments and drop the device references. One whose
        memory was freed under it since the call stays held: kept by reference, as torch keeps it (the
        recomputation reads it once it holds its values again: at stage 3, gathered for backward)."""
        if self.state != "held" or any(map(_freed, self.held)):
            return
        self._check_unchanged()
        for x in self.held:
            h = self.buffers.take_host(x.numel(), x.dtype)
            self.host.append(h)
            self.d2h.append(self.buffers.transport.d2h(h, x.reshape(-1)))  # (the transport keeps x until copied)
        self.held, self.versions = [], []
        self.state = "stored"

    def _check_unchanged(self) -> None:
        """A held argument changed in place since the call (its copy not yet taken) would change the gradients
        silently: noted, and raised when backward restores the checkpoint, as torch's checkpoint raises."""
        for i, (x, v) in enumerate(zip(self.held, self.versions, strict=True)):
            if _version(x) != v and self.changed is None:
                self.changed = _changed_help(self.slots[i], v, _version(x))

    def _check_watched(self) -> None:
        """An argument still alive changed in place after its copy to the host was queued: the copy raced with the
        change (a GPU's copy stream reads it while the compute stream writes it): refused, as torch's checkpoint
        refuses an argument changed after the call."""
        for i, (ref, v) in enumerate(self.watched):
            t = ref()
            if t is not None and _version(t) != v:
                raise RuntimeError(_changed_help(self.slots[i], v, _version(t), copying=True))

    def prefetch(self) -> None:
        """Queue the H2D copies of the checkpoint into device blocks (no wait)."""
        if self.state != "stored" or not self.offload:
            return
        tr = self.buffers.transport
        tr.h2d_after(self.d2h)  # written by the D2H copies, read by the H2D ones: ordered on the device while the
        self.d2h = []  # host goes on (it waited for them here: at backward's start the newest may still be queued)
        for h, (shape, dtype, _) in zip(self.host, self.meta, strict=True):
            block = self.buffers.take_device(h.numel() * h.element_size())
            self.device.append(block)
            self.views.append(self.buffers.typed(block, shape, dtype))
            self.h2d = tr.h2d(self.buffers.typed(block, (h.numel(),), dtype), h)
            with self.buffers._lock:
                self.buffers._landing[block.data_ptr()] = self.h2d
        self.state = "restoring"

    def restore(self) -> list[torch.Tensor]:
        """The checkpoint on the device for the recomputation (leaves with the original requires_grad)."""
        if self.state == "held":
            self._check_unchanged()
        if self.changed is not None:
            raise RuntimeError(self.changed)
        self._check_watched()
        if self.state == "held":
            prev = self.buffers._previous(self)
            if prev is not None:
                prev.prefetch()
            return [_ordered(x, back).detach().requires_grad_(rg)
                    for x, back, (_, _, rg) in zip(self.held, self.orders, self.meta, strict=True)]  # fmt: skip
        if self.offload:
            self.prefetch()  # no-op if prefetched
            if self.state == "restoring":
                self.buffers.transport.device_wait(self.h2d)  # the H2D copies are queued in order: the last covers all
                self.h2d, self.state = None, "restored"
                with self.buffers._lock:
                    for b in self.device:
                        self.buffers._landing.pop(b.data_ptr(), None)
            prev = self.buffers._previous(self)
            if prev is not None:
                prev.prefetch()  # one segment ahead, under this segment's compute
        return [_ordered(v, back).detach().requires_grad_(rg)
                for v, back, (_, _, rg) in zip(self.views, self.orders, self.meta, strict=True)]  # fmt: skip

    def release_device(self) -> None:
        """The segment's backward is done: an offloaded checkpoint's device blocks are free again."""
        if self.state == "held":
            self.to_host()
        elif self.offload and self.state == "restored" and not self.kept:
            for b in self.device:
                self.buffers.give_device(b)
            self.device.clear()
            self.views.clear()
            self.state = "stored"

    def __call__(self, *call_args: Any, **call_kwargs: Any) -> Any:
        """torch's checkpoint calls this with placeholders where the checkpoint was taken: in forward they stand for
        the arguments themselves, in the recomputation for the checkpoint restored."""
        if self.state == "forward":
            args, kwargs = list(self.args), dict(call_kwargs)  # (torch's checkpoint took its own keywords out)
            for g in self.groups:
                for k in g:
                    if isinstance(k, str):
                        kwargs[k] = self.kwargs[k]
            grads = [g for g, (_, _, rg) in zip(self.groups, self.meta, strict=True) if rg]
            passed: dict[int, torch.Tensor] = {}  # id of a _Release output -> the argument it stands for
            if self.offload and grads and torch.is_grad_enabled():  # (resident blocks: nothing to release)
                outs = _Release.apply(self, *(_get(args, kwargs, g[0]) for g in grads))
                for g, o in zip(grads, outs, strict=True):
                    passed[id(o)] = _get(args, kwargs, g[0])
                    for k in g:
                        _put(args, kwargs, k, o)
            taken = self.store()
            try:
                out = self.function(*args, **kwargs)
            except RuntimeError as e:
                text = str(e)  # (autograd's own words name _Release, or a view made in a custom Function)
                if self.offload and "_Release" in text:
                    raise RuntimeError(_MODIFIED_HELP) from e
                raise
            graph = not _needs_no_grad(out)
            # an argument changed in place inside (one needing no gradient: no view of _Release to refuse it; or a
            # resident one): the checkpoint holds it as passed, the recomputation would differ; with no graph (a
            # frozen teacher's forward) nothing is recomputed: torch's checkpoint lets it, so does this
            if graph and any(_version(x) != v for x, v in taken):
                raise RuntimeError(_MODIFIED_HELP)
            if passed:  # a function returning an argument as it is (nn.Identity, dropout in eval) returns the
                out = _returned_as_is(out, passed)  # argument itself, as torch's checkpoint does, not our view of it
            if self.offload:
                self.buffers._settle(self, graph=graph)
            return out
        args, kwargs = list(call_args), dict(call_kwargs)
        # the restore's own views and copies are not the function's: a selective checkpointing policy's mode, active
        # for the recomputation, must not see them (with no mode active, torch's context manager is skipped: ~10-15
        # us of host time a block on the 2-core CPU)
        if _no_dispatch_modes():
            restored = self.restore()
        else:
            with _disable_current_modes():
                restored = self.restore()
        for g, t in zip(self.groups, restored, strict=True):
            for k in g:
                _put(args, kwargs, k, t)
        return self.function(*args, **kwargs)


_MODIFIED_HELP = ("zo_kernels.checkpoint: the function modified one of its tensor arguments in place; a checkpoint "
                  "(offloaded or resident) is the argument as it was passed, so the function must leave its arguments "
                  "unchanged (change a copy inside it: x = x.clone(), or x = x + ... instead of x += ...)")


def _changed_help(slot: int | str, version: int, now: int, copying: bool = False) -> str:
    """The error for an argument changed in place after the call, as torch's checkpoint refuses one (copying: once
    its copy to the host was under way, a race with it)."""
    during = ", once its copy to the host was under way" if copying else ""
    mix = ", or a mix" if copying else ""
    return (f"checkpoint: tensor argument {slot} of a checkpointed segment was modified by an inplace operation after "
            f"zo_kernels.checkpoint took it (version {version}, now {now}){during}: the recomputation would read the "
            f"changed values{mix}. Change a copy, or the argument before the call")


def _groups(args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device,
            taken: WeakIdKeyDictionary) -> list[list[int | str]]:  # fmt: skip
    """The arguments a segment keeps a checkpoint of, grouped by tensor (one group per distinct tensor, the places
    it was passed in order): every floating-point positional tensor on `device` (but parameters and tensors not
    dense in memory: `_offloadable`), and the keyword ones that need a gradient (an activation passed by name, as
    HF's layers pass `hidden_states`; a mask or position table passed to every layer is kept by reference, as
    torch keeps it, not copied once per layer). A tensor an earlier segment of the same buffers checkpointed
    (`taken`) is kept by reference too: one given to many segments lives on anyway, and a copy per segment would
    cost a host block and a device slot each."""
    keys: list[int | str] = [i for i, a in enumerate(args) if _offloadable(a, device) and a not in taken]
    kept = {id(args[i]) for i in keys}  # (a tensor kept positionally is one tensor in its keyword places too)
    keys += [k for k, v in kwargs.items()
             if _offloadable(v, device) and (v.requires_grad or id(v) in kept) and v not in taken]  # fmt: skip
    groups: dict[int, list[int | str]] = {}
    for k in keys:
        groups.setdefault(id(_get(args, kwargs, k)), []).append(k)
    return list(groups.values())


def _get(args: Any, kwargs: dict[str, Any], key: int | str) -> Any:
    return kwargs[key] if isinstance(key, str) else args[key]


def _put(args: list[Any], kwargs: dict[str, Any], key: int | str, value: Any) -> None:
    if isinstance(key, str):
        kwargs[key] = value
    else:
        args[key] = value


def _memory_order(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """A dense x (_dense) as a contiguous tensor of its elements in memory order, and the permutation that gives x's
    strides back: a tensor of permuted strides (channels_last) is kept as it lies, so the recomputation reads it
    with the strides the forward read (a kernel may take another path, and round otherwise)."""
    if x.is_contiguous():
        return x, None
    order = _by_stride(x)
    xp = x.permute(order)
    back = [0] * x.dim()
    for i, d in enumerate(order):
        back[d] = i
    return xp, tuple(back)


def _ordered(x: torch.Tensor, back: tuple[int, ...] | None) -> torch.Tensor:
    return x if back is None else x.permute(back)


def _returned_as_is(out: Any, passed: dict[int, torch.Tensor]) -> Any:
    """`out` with each of _Release's outputs in it (a tensor, or in a list, tuple or dict) replaced by the argument
    it stands for."""
    if isinstance(out, torch.Tensor):
        return passed.get(id(out), out)
    if isinstance(out, (list, tuple)) and any(id(o) in passed for o in out):
        got = [passed.get(id(o), o) for o in out]
        return type(out)(*got) if hasattr(out, "_fields") else type(out)(got)
    if isinstance(out, dict) and any(id(o) in passed for o in out.values()):
        return type(out)((k, passed.get(id(o), o)) for k, o in out.items())
    return out


def _needs_no_grad(out: Any) -> bool:
    """Whether a segment's output is known to need no gradient (tensors, and lists, tuples, dicts of them or of
    plain values); an object of any other type counts as needing one."""
    if isinstance(out, torch.Tensor):
        return not out.requires_grad
    if isinstance(out, (list, tuple)):
        return all(_needs_no_grad(o) for o in out)
    if isinstance(out, dict):
        return all(_needs_no_grad(o) for o in out.values())
    return out is None or isinstance(out, (bool, int, float, str))


def _free_segment(buffers: ActivationBuffers, host: list[torch.Tensor], device: list[torch.Tensor],
                  link: _Link) -> None:  # fmt: skip
    buffers._unlink(link)
    for h in host:
        buffers.transport.pool.give(h)  # fenced: not handed out again before its copies are done
    for b in device:
        buffers.give_device(b)


def _buffers_for(device: str) -> ActivationBuffers | None:
    d = torch.device(device)
    if d.type == "cuda" and (not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count()):
        return None
    return default_buffers(d)


def _size_class(nbytes: int) -> int:
    """The smallest of 2^k, 1.25, 1.5 and 1.75 x 2^k bytes (k >= 9) holding nbytes (a multiple of 64 bytes)."""
    if nbytes <= 512:
        return 512
    top = 1 << (nbytes - 1).bit_length()  # the power of two at or above nbytes
    return next(c for c in (top * 5 // 8, top * 3 // 4, top * 7 // 8, top) if c >= nbytes)


def _view(block: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    return block[: numel * dtype.itemsize].view(dtype).view(shape)


def _version(x: torch.Tensor) -> int:
    """x's version counter (an inference tensor has none: it cannot be changed in place outside inference mode)."""
    return -1 if x.is_inference() else x._version


def _no_dispatch_modes() -> bool:
    """No torch dispatch mode is active (pre-dispatch or Python key): nothing for _disable_current_modes to pop."""
    return _len_dispatch_stack() == 0 and _len_pre_dispatch_stack() == 0


def _offloadable(a: Any, device: torch.device) -> bool:
    """A tensor argument kept as a checkpoint in the buffers; any other is kept by reference, as torch keeps it: a
    parameter or a view of one (it lives on anyway, and at stage 3 its storage is freed once its unit's forward is
    over: a copy queued later read freed memory) and a tensor whose elements do not fill their memory densely (a
    slice, a chunk: a block holding only its elements gives the recomputation other strides, a kernel another
    path, and torch's check of the recomputed tensors refuses them)."""
    return (isinstance(a, torch.Tensor) and a.dtype in _OFFLOADED and a.device == device and a.numel() > 0
            and not isinstance(a, torch.nn.Parameter) and not isinstance(a._base, torch.nn.Parameter)
            and _dense(a))  # fmt: skip


def _freed(x: torch.Tensor) -> bool:
    """x's storage no longer holds its elements: resized under it since the call (stage 3 frees a unit's
    parameters after its forward: a tensor sharing their memory that _offloadable could not tell, a detach())."""
    return x.untyped_storage().nbytes() < (x.storage_offset() + x.numel()) * x.element_size()


def _dense(x: torch.Tensor) -> bool:
    """x's elements fill their memory in some order of its dimensions: contiguous, or permuted (channels_last)."""
    return x.is_contiguous() or x.permute(_by_stride(x)).is_contiguous()


def _by_stride(x: torch.Tensor) -> list[int]:
    return sorted(range(x.dim()), key=lambda d: -x.stride(d))


_DEFAULT: dict[torch.device, ActivationBuffers] = {}
_PLACEHOLDERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def default_buffers(device: torch.device | str) -> ActivationBuffers:
    """The buffers `checkpoint` uses for `device` when none are given (created on first use)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _DEFAULT:
        _DEFAULT[device] = ActivationBuffers(device)
    return _DEFAULT[device]


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    key = (t.device, t.dtype)
    if key not in _PLACEHOLDERS:  # one per device and dtype: no allocation per call
        _PLACEHOLDERS[key] = torch.empty(0, dtype=t.dtype, device=t.device)
    return _PLACEHOLDERS[key]


@torch.compiler.disable
def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    offload: bool = True,
    buffers: ActivationBuffers | None = None,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """torch.utils.checkpoint.checkpoint(use_reentrant=False) whose checkpoints live in `buffers` (host if offload)."""
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be a bool, got {type(offload).__name__}")
    if use_reentrant not in (None, False):
        raise ValueError("use_reentrant: zo_kernels.checkpoint is non-reentrant only (use_reentrant=False or None)")
    if buffers is not None and not isinstance(buffers, ActivationBuffers):
        raise TypeError(f"buffers must be an ActivationBuffers, got {type(buffers).__name__}")
    floats = [a for a in args if isinstance(a, torch.Tensor) and a.dtype in _OFFLOADED and a.numel() > 0]
    if buffers is None and not floats:  # keyword activations choose the default buffers only on a CUDA device
        floats = [v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.dtype in _OFFLOADED
                  and v.numel() > 0 and v.requires_grad and v.device.type == "cuda"]  # fmt: skip
    if buffers is None:
        if not floats or not torch.is_grad_enabled():
            return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
        if floats[0].device.type not in ("cuda",) and offload:
            raise ValueError(f"args: offload=True needs CUDA tensors (got {floats[0].device}); on the CPU pass "
                             "buffers=ActivationBuffers('cpu', transport) with a GPU-shaped transport, e.g. "
                             "zo_kernels.transport.CopyEngineTransport()")  # fmt: skip
        buffers = default_buffers(floats[0].device)
    elif floats and not any(a.device == buffers.device for a in floats):
        raise ValueError(f"args: no floating-point tensor argument is on the buffers' device {buffers.device}")
    if not torch.is_grad_enabled():  # nothing is saved for a backward: no checkpoint to keep
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    seg = _Segment(buffers, function, args, kwargs, offload)
    kept = {k for g in seg.groups for k in g}
    call_args = [_placeholder(a) if i in kept else a for i, a in enumerate(args)]
    call_kwargs = {k: _placeholder(v) if k in kept else v for k, v in kwargs.items()}
    try:
        return torch_checkpoint.checkpoint(seg, *call_args, use_reentrant=False, **call_kwargs)
    finally:
        seg.args = seg.kwargs = None
