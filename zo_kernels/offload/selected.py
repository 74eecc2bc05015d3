"""selective's selected gradient on the device: gathered from each reduced bucket piece as it leaves, summed there.

The selected elements' gradient never crosses PCIe: GradPath._launch gathers it from the packed, reduced bucket on
the device (`gather`), and the micro-batches' gradients are summed on the device in the order the host's landing and
accumulation buffers sum theirs (`accumulate`, `total`), so it equals the host gradient's grad[sel] bitwise.
"""

from __future__ import annotations

import torch


class SelectedGrad:
    """The gradient of a sorted set of partition elements (a selection of at most `capacity`), on the device.

    Args:
        capacity: S, the most elements a selection holds (selection_bound). device: the parameters' device.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.index = torch.zeros(capacity, dtype=torch.int64, device=device)  # the selection, on the device
        self.landing = torch.zeros(capacity, dtype=torch.float32, device=device)  # the last micro-batch's gradient
        self.accum: torch.Tensor | None = None  # the earlier micro-batches' sum (made by the first accumulation)
        self.sel: torch.Tensor | None = None  # the selection (host, sorted partition indices); None: none held
        self._cuts: dict[tuple[int, int], tuple[int, int]] = {}

    def select(self, sel: torch.Tensor) -> None:
        """Hold selection `sel` from the next backward pass on (set between steps: no micro-batch is open)."""
        n = sel.numel()
        assert n <= self.capacity, f"a selection of {n} elements, room for {self.capacity}"
        self.sel = sel
        self.index[:n].copy_(sel)
        self._cuts = {}

    def drop(self) -> None:
        """Hold no selection: nothing is gathered until the next select."""
        self.sel = None
        self._cuts = {}

    def cut(self, a: int, b: int) -> tuple[int, int]:
        """The slice [s0, s1) of the selection inside partition range [a, b): found once per range and selection."""
        c = self._cuts.get((a, b))
        if c is None:
            s0, s1 = torch.searchsorted(self.sel, torch.tensor([a, b], dtype=torch.int64)).tolist()
            c = self._cuts[(a, b)] = (s0, s1)
        return c

    def gather(self, src: torch.Tensor, pa: int) -> None:
        """A reduced bucket piece (partition range [pa, pa + len(src)), on the device) -> its selected elements'
        gradient, in the stream order of the device's compute (after the reduce, before the buffer's reuse)."""
        s0, s1 = self.cut(pa, pa + src.numel())
        if s0 == s1:
            return
        local = self.index[s0:s1] - pa
        dst = self.landing[s0:s1]
        if src.dtype == dst.dtype:
            torch.index_select(src, 0, local, out=dst)
        else:  # a 16-bit gradient: its fp32 value is exact, as the host's conversion of grad[sel] is
            dst.copy_(src.index_select(0, local))

    def accumulate(self, first: bool) -> None:
        """A micro-batch follows: the last one's gradient into the sum, as GradPath sums the host's (`first`: the
        sum starts with it)."""
        n = self.sel.numel()
        if self.accum is None:
            self.accum = torch.zeros_like(self.landing)
        if first:
            self.accum[:n].copy_(self.landing[:n])
        else:
            self.accum[:n].add_(self.landing[:n])

    def scale(self, a: int, b: int, factor: float) -> None:
        """p.grad.mul_(factor) on partition range [a, b) of the sum so far."""
        s0, s1 = self.cut(a, b)
        self.accum[s0:s1] *= factor

    def zero(self, a: int, b: int, summed: bool) -> None:
        """Partition range [a, b)'s gradient cleared: the last micro-batch's, and with `summed` the sum's."""
        s0, s1 = self.cut(a, b)
        self.landing[s0:s1].zero_()
        if summed:
            self.accum[s0:s1].zero_()

    def total(self, n_micro: int) -> torch.Tensor:
        """The step's gradient of the selection (fp32, n elements; the step may scale it in place)."""
        n = self.sel.numel()
        return self.landing[:n] if n_micro == 1 else self.accum[:n].add_(self.landing[:n])
