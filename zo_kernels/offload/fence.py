"""The delayed update's writeback, tiled under the next forward: each tile's copy to the device carries its event,
and whoever reads a range of the parameters (a module's forward, a ZeRO-3 gather) waits only for the tiles covering
it. So forward t+1 starts once its first module's tiles have landed, while the later tiles are still being copied."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from typing import Any

import torch

from ..transport import Event, Transport
from .layout import FlatLayout
from .params import _Hook  # (a deepcopy of the module gets a no-op hook)
from .report import PhaseTimes

Ranges = list[tuple[int, int]]  # [a, b) ranges of this rank's partition


class TileFence:
    """The copies of the last writeback, in the order they were queued (one copy stream: they land in that order),
    with the partition range each writes. `wait(ranges)` makes the compute stream wait for the last tile covering
    any of the ranges (which covers every earlier one); on CUDA that never blocks the host.

    Args:
        transport: the transport the copies were queued on.
        times: the step's phase times: "forward_writeback_wait" is the host's seconds inside `wait` (on the CPU the
            wait itself; on CUDA only the queueing of stream waits: the device's stall shows in the step time).
    """

    def __init__(self, transport: Transport, times: PhaseTimes) -> None:
        self.transport, self.times = transport, times
        self._lo: list[int] = []  # each tile's first element, ascending (tiles are queued in partition order)
        self._hi: list[int] = []
        self._events: list[Event] = []
        self._first = 0  # tiles before it are waited for already
        self.in_flight: int | None = None  # of the last writeback: tiles not landed when its first reader came

    def reset(self) -> None:
        """A new writeback begins (its copies queue after the last one's on the copy stream)."""
        self._lo, self._hi, self._events, self._first, self.in_flight = [], [], [], 0, None

    def add(self, lo: int, hi: int, event: Event) -> None:
        """Tile [lo, hi) of the partition is being copied until `event`; tiles come in ascending order."""
        self._lo.append(lo)
        self._hi.append(hi)
        self._events.append(event)

    @property
    def tiles(self) -> int:
        """Tiles of the last writeback."""
        return len(self._events)

    @property
    def pending(self) -> int:
        """Tiles no reader has waited for yet."""
        return len(self._events) - self._first

    def wait(self, ranges: Ranges) -> None:
        """The compute stream waits for the tiles covering `ranges` (partition coordinates)."""
        if self._first >= len(self._events):
            return
        t0 = time.perf_counter()
        if self.in_flight is None:  # > 0: the first reader started before the last tile landed (event queries only)
            self.in_flight = sum(not ev.done() for ev in self._events)
        last = -1
        for a, b in ranges:
            k = bisect.bisect_left(self._lo, b) - 1  # the last tile starting before b
            if k >= self._first and self._hi[k] > a and a < b:
                last = max(last, k)
        if last >= 0:
            self.transport.device_wait(self._events[last])
            self._first = last + 1
        self.times.add("forward_writeback_wait", time.perf_counter() - t0)

    def landed(self, a: int, b: int) -> Iterator[tuple[int, int]]:
        """[a, b) in spans whose copies have finished, each given once the host has seen them finish: a writer of
        the copies' source (the next update, into staging) goes as far as they let it, waiting for one tile only
        when none ahead has finished. Host waits: for the background update's thread."""
        x = a
        while x < b:
            k = bisect.bisect_right(self._lo, x) - 1  # the tile holding x
            if k < 0 or self._hi[k] <= x:  # no copy reads x (no tile holds it)
                nxt = k + 1
                y = min(b, self._lo[nxt]) if nxt < len(self._lo) else b
            else:
                self.transport.wait(self._events[k])
                j = k + 1
                while j < len(self._events) and self._lo[j] < b and self._events[j].done():
                    j += 1
                y = min(b, self._hi[j - 1])
            yield x, y
            x = y

    def wait_all(self) -> None:
        """The compute stream waits for every tile (a reader outside forward: state_dict, close, a collective)."""
        if self._first < len(self._events):
            self.wait([(self._lo[-1], self._hi[-1])])


class ForwardWaits:
    """ZeRO-1/2, one rank: a forward pre-hook on every module with trainable parameters of its own waits for the
    tiles of those parameters (and of any registered with `add`); the root's state_dict() and the end of its
    forward wait for every tile, so what is read after them is the new parameters.

    Args:
        fence: the tiles of the writeback.
        layout: the flat layout (partition coordinates of each parameter).
        root: the model.
    """

    def __init__(self, fence: TileFence, layout: FlatLayout, root: torch.nn.Module) -> None:
        self.fence, self.layout = fence, layout
        self.ranges: dict[torch.nn.Module, Ranges] = {}
        self.hooks: list[Any] = []
        mine = set(layout.params)
        for m in root.modules():
            own = [p for p in m.parameters(recurse=False) if p in mine]
            if own:
                self.add(m, own)
        self.hooks.append(root.register_forward_hook(_Hook(lambda *a: fence.wait_all()), always_call=True))
        self.hooks.append(root.register_state_dict_pre_hook(_Hook(lambda *a: fence.wait_all())))

    def add(self, module: torch.nn.Module, params: list[torch.Tensor]) -> None:
        """`module`'s forward reads these parameters: it waits for their tiles first."""
        new = [r for r in (self.layout.part_range(p) for p in params) if r[0] < r[1]]
        if module in self.ranges:
            self.ranges[module] += new  # (in place: the hook holds the list)
            return
        self.ranges[module] = ranges = new
        self.hooks.append(module.register_forward_pre_hook(_Hook(lambda m, a: self._pre_forward(ranges))))

    def _pre_forward(self, ranges: Ranges) -> None:
        # eagerly, nothing pending costs one comparison (a compiler.disable call costs ~5 us per module)
        if torch.compiler.is_compiling() or self.fence.pending:
            self._wait(ranges)

    @torch.compiler.disable  # the wait is an event on the copy stream: run eagerly
    def _wait(self, ranges: Ranges) -> None:
        self.fence.wait(ranges)

    def detach(self) -> None:
        """Remove the hooks."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
