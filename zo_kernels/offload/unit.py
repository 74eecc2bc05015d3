"""One ZeRO-3 unit (a module's own trainable parameters) and its gather lifecycle, as an explicit state machine.

    state       the values live in                    the parameters are
    SHARDED     the shard only (buf holds no memory)  empty tensors (shape (0,))
    GATHERING   the shard; a gather into buf runs     empty tensors
    GATHERED    buf, whole                            views of buf
    KEPT        a buffer of their own, whole          aliases of it (each its own storage)
    HANDED_BACK a buffer of their own, for good       aliases of it: the optimizer was closed

Each transition is one method: start (SHARDED -> GATHERING), finish (GATHERING -> GATHERED), reshard (GATHERING,
GATHERED -> SHARDED), keep (-> KEPT), unkeep (KEPT -> SHARDED), hand_back (-> HANDED_BACK). Every write of the
weights (the step's writeback, model.load_state_dict, gathered(write=True), a loaded optimizer state) changes the
shard and then calls `invalidate`, the one path that drops gathered copies: a stale one can never reach a forward.
Apart from the state, a unit is in use (FSDP2's training state): by running forward calls (`users`), or gathered
for backward until its gradients arrive (`held`); an idle one may be resharded or kept at any time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from enum import Enum, auto
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..param_views import alias, is_alias_of


class UnitState(Enum):
    SHARDED = auto()
    GATHERING = auto()
    GATHERED = auto()
    KEPT = auto()
    HANDED_BACK = auto()


Fill = Callable[["Unit", torch.Tensor], Any]  # start a gather of the unit into a buffer: what to wait for
Wait = Callable[["Unit", Any], None]


class Unit:
    """One module's own trainable parameters: flat range [lo, hi) of the layout, this rank's piece of it.

    Args:
        index: its position in the layout's units.
        params: its parameters, with their offsets in the unit and their true shapes.
        lo, hi, piece: its flat range and this rank's (a, b, offset in the shard) piece of it.
        dtype, device: the parameters'.
        fill, wait: start a gather of the unit into a buffer, and wait for it (the owner's collectives and copies).
        counter: the device bytes counter (add, sub).
    """

    def __init__(self, index: int, params: list[tuple[torch.Tensor, int, torch.Size]], lo: int, hi: int,
                 piece: tuple[int, int, int], dtype: torch.dtype, device: torch.device, fill: Fill, wait: Wait,
                 counter: Any) -> None:  # fmt: skip
        self.index, self.lo, self.hi, self.piece = index, lo, hi, piece
        self.params = [p for p, _, _ in params]
        self._where = {p: (off, shape) for p, off, shape in params}
        self.dtype, self.device, self._fill, self._wait, self.counter = dtype, device, fill, wait, counter
        self.nbytes = (hi - lo) * torch.empty((), dtype=dtype).element_size()
        self.state = UnitState.SHARDED
        self.buf: torch.Tensor | None = None  # GATHERING/GATHERED; kept (storage resized to 0) while SHARDED
        self.kept: torch.Tensor | None = None  # KEPT, HANDED_BACK
        self.pending: Any = None  # GATHERING: the gather to wait for
        self.users = 0  # forward calls of its modules now running
        self.held = False  # gathered for backward: kept until its parameters' gradients have arrived
        self.arrived: set[torch.Tensor] = set()  # params whose gradient arrived in this backward pass
        self._empty = torch.empty(0, dtype=dtype, device=device)

    @property
    def idle(self) -> bool:
        """No forward of its modules runs and no backward waits for it."""
        return self.users == 0 and not self.held

    @property
    def live(self) -> bool:
        """buf holds (or is being filled with) the parameters."""
        return self.state in (UnitState.GATHERING, UnitState.GATHERED)

    @property
    def whole(self) -> torch.Tensor | None:
        """The buffer that holds the unit whole now, if any."""
        if self.state is UnitState.GATHERED:
            return self.buf
        if self.state in (UnitState.KEPT, UnitState.HANDED_BACK):
            return self.kept
        return None

    def owns(self, p: torch.Tensor) -> bool:
        """p is still the optimizer's: empty between uses, or its range of the buffer holding the unit."""
        if p.dtype != self.dtype or p.device != self.device:
            return False
        if p.numel() == 0:  # (between uses; or a parameter with no elements)
            return True
        whole = self.whole
        return whole is not None and is_alias_of(p, whole, self._where[p][0])

    # ------------------------------------------------------------------ transitions

    def start(self) -> None:
        """SHARDED -> GATHERING: the buffer's memory back, the gather of this rank's shard into it started."""
        if self.state is not UnitState.SHARDED:
            return
        n = self.hi - self.lo
        if self.buf is None:
            self.buf = torch.empty(n, dtype=self.dtype, device=self.device)
        else:
            self.buf.untyped_storage().resize_(self.nbytes)
        self.counter.add(self.nbytes)
        self.state = UnitState.GATHERING
        try:
            self.pending = self._fill(self, self.buf)
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """A gather that raised (Ctrl-C, a collective's timeout, a read error): back to SHARDED, so that the next use
        gathers afresh (it stayed GATHERING with nothing to wait for, and every later forward, gathered(), close()
        and new optimizer raised a TypeError). The buffer is let go, not freed: a copy or collective started into it
        may still write it (the device's allocator keeps it for the copy streams it was recorded on)."""
        self.pending = None
        self.buf = None
        self.counter.sub(self.nbytes)
        self.state = UnitState.SHARDED

    def finish(self) -> None:
        """-> GATHERED (starting the gather if none runs, waiting for it): the parameters view the buffer. KEPT and
        HANDED_BACK stay: the parameters are whole already."""
        self.start()
        if self.state is not UnitState.GATHERING:
            return
        pending, self.pending = self.pending, None
        try:
            self._wait(self, pending)
        except BaseException:
            self._abandon()
            raise
        for p, (off, shape) in self._where.items():
            if p.numel() == 0:
                p.data = self.buf[off : off + shape.numel()].view(shape)
        self.state = UnitState.GATHERED

    def reshard(self, viewed: Collection[int] = ()) -> None:
        """GATHERING/GATHERED -> SHARDED: the parameters empty, the buffer's storage resized to 0 (views autograd
        saved, e.g. nn.Linear's weight.t(), then hold no memory until a pre-backward finish refills it). If the
        buffer's storage is among `viewed` (storages a forward handed out: a slice of its parameter), it is let go
        to them instead: the view keeps it alive, and the next gather takes a new one."""
        if self.state is UnitState.GATHERING:
            self._wait(self, self.pending)  # its copies and collective must not write freed memory
            self.pending = None
        elif self.state is not UnitState.GATHERED:
            return
        for p, (off, _) in self._where.items():
            if p.numel() == 0 or is_alias_of(p, self.buf, off):  # (one set by hand stays: step() then refuses it)
                p.data = self._empty
        if self.buf.untyped_storage().data_ptr() in viewed:
            self.buf = None
        else:
            self.buf.untyped_storage().resize_(0)
        self.counter.sub(self.nbytes)
        self.state = UnitState.SHARDED
        self.users, self.held = 0, False

    def keep(self) -> None:
        """-> KEPT: the unit gathered into a buffer of its own that its parameters alias (each its own storage, as
        at stage 2), so what is taken from them stays valid after a release. An idle gather (a prefetch) is dropped
        first; a unit in use by forward/backward stays GATHERED."""
        if self.state in (UnitState.KEPT, UnitState.HANDED_BACK):
            return
        if self.state is not UnitState.SHARDED:
            if not self.idle:
                return
            self.reshard()
        self.kept = torch.empty(self.hi - self.lo, dtype=self.dtype, device=self.device)
        self.counter.add(self.nbytes)
        self._wait(self, self._fill(self, self.kept))
        for p, (off, shape) in self._where.items():
            p.data = alias(self.kept, off, shape.numel(), shape)
        self.state = UnitState.KEPT

    def unkeep(self) -> None:
        """KEPT -> SHARDED: the parameters empty, the buffer let go (tensors taken from it keep theirs)."""
        if self.state is not UnitState.KEPT:
            return
        for p, (off, _) in self._where.items():
            if is_alias_of(p, self.kept, off):
                p.data = self._empty
        self.counter.sub(self.nbytes)
        self.kept = None
        self.state = UnitState.SHARDED

    def hand_back(self) -> None:
        """-> HANDED_BACK (close()): the parameters whole in a buffer of their own, for good; no transition leaves
        it."""
        if self.state is UnitState.HANDED_BACK:
            return
        self.users, self.held = 0, False
        self.keep()
        self.state = UnitState.HANDED_BACK

    def invalidate(self, refill_kept: bool) -> None:
        """The shard holds new values: a gathered copy is dropped (GATHERING/GATHERED -> SHARDED); a KEPT buffer is
        refilled in place if it did not make the change (`refill_kept`), so its aliases see the new values."""
        if self.state in (UnitState.GATHERING, UnitState.GATHERED):
            self.reshard()
        elif self.state is UnitState.KEPT and refill_kept:
            self._wait(self, self._fill(self, self.kept))
        self.arrived = set()

    def check_untouched(self) -> None:
        """The parameters still have the optimizer's dtype and device (model.float() or model.to() after
        construction converts the empty tensors behind its back)."""
        for p in self.params:
            if p.dtype != self.dtype or p.device != self.device:
                raise RuntimeError(
                    f"a stage-3 parameter of shape {tuple(self._where[p][1])} was converted to {p.dtype} on {p.device} "
                    f"after the optimizer was built (model.float(), .half(), .to() or .cpu()): at stage 3 the "
                    f"optimizer owns the parameters' dtype ({self.dtype}) and device ({self.device}). Convert the "
                    "model before building the optimizer (e.g. dtype=torch.float32 for fp32 compute), or close() it "
                    "first")  # fmt: skip


_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.nn.Module, torch.dtype, torch.device, type)
MAX_OBJECTS = 10_000  # tensors_in's bound on the objects it opens (an output holding a whole object graph)


def tensors_in(obj: Any, objects: bool = False) -> list[torch.Tensor]:
    """The tensors a forward's output holds: in pytree containers (lists, tuples, dicts, HF's ModelOutput) and in
    the dataclasses and sets among them (a forward returning `MyOutput(hidden=...)` hands its tensors out as a tuple
    does); with `objects`, in any object's attributes too (each object opened once; modules, classes and functions
    are not): the search for views of a unit's buffer. (The pre-backward hooks do not go into objects: an HF cache
    returned by the model holds every layer's keys and values, which are no output of the module's own.)"""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    todo = [obj]
    while todo and len(seen) < MAX_OBJECTS:
        for leaf in tree_leaves(todo.pop()):
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif isinstance(leaf, _ATOMS) or callable(leaf) or id(leaf) in seen:
                continue
            elif isinstance(leaf, (set, frozenset)):
                seen.add(id(leaf))
                todo.append(list(leaf))
            elif dataclasses.is_dataclass(leaf):
                seen.add(id(leaf))
                todo.append([getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)])
            elif objects and (hasattr(leaf, "__dict__") or hasattr(leaf, "__slots__")):
                seen.add(id(leaf))
                todo.append([getattr(leaf, k, None) for k in _fields(leaf)])
    return found


def _fields(obj: Any) -> list[str]:
    """Names of an object's attributes: its __dict__'s and its __slots__."""
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return names
