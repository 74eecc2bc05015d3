"""The flat layout: the trainable parameters in one flat buffer, its partition among the ranks, its buckets."""

from __future__ import annotations

import torch

PARAM_ALIGN_BYTES = 16  # every param starts on a 16-byte boundary of the flat buffer: vector loads in pack

Run = tuple[int, int, int, int, float]  # (group, start, end, step, gradient factor), in partition coordinates


class Bucket:
    """A contiguous range [lo, hi) of the flat space and the parameters in it (flat order)."""

    def __init__(self, index: int, params: list[tuple[torch.Tensor, int, int]], hi: int) -> None:
        self.index = index
        self.params = params  # (param, flat offset, numel)
        self.lo = params[0][1]
        self.hi = hi  # the end of the last param's span (its padding included)
        self.ready = 0  # parameters whose gradient has arrived in this backward pass


class FlatLayout:
    """Flat offsets in parameter order, each param starting on a PARAM_ALIGN_BYTES boundary (the pack kernels then
    move 16-byte vectors), padding to a multiple of N aligned partitions, this rank's part, the gradient buckets.

    Args:
        groups: each param group's trainable parameters; the flat order is group by group.
        dtype: the flat buffer's dtype (the alignment is counted in its elements).
        world, rank: the ranks sharing the flat space (N) and this one.
        bucket_numel: the most elements of a gradient bucket (a larger parameter gets a bucket of its own).
    """

    def __init__(self, groups: list[list[torch.Tensor]], dtype: torch.dtype, world: int, rank: int,
                 bucket_numel: int) -> None:  # fmt: skip
        self.params = [p for ps in groups for p in ps]  # flat order, group by group
        self.index = {p: i for i, p in enumerate(self.params)}
        self.pgroup = [gi for gi, ps in enumerate(groups) for _ in ps]
        self.align = PARAM_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
        up = lambda n, k: -(-n // k) * k  # noqa: E731
        self.offset: dict[torch.Tensor, int] = {}
        pos = 0
        for p in self.params:
            pos = up(pos, self.align)
            self.offset[p] = pos
            pos += p.numel()
        self.numel = sum(p.numel() for p in self.params)
        # param i's span: [offset, next offset); the zeros of its padding are updated with it (they stay 0)
        ends = [self.offset[p] for p in self.params[1:]] + [up(pos, self.align)]
        self.span_end = {p: e for p, e in zip(self.params, ends)}
        self.flat_numel = up(pos, world * self.align)
        self.part = self.flat_numel // world
        self.part_lo = rank * self.part
        self.part_hi = self.part_lo + self.part
        # each group's flat range, intersected with the partition, in partition coordinates
        self.group_ranges: list[tuple[int, int] | None] = []
        for ps in groups:
            a, b = self._in_part(self.offset[ps[0]], self.span_end[ps[-1]])
            self.group_ranges.append((a, b) if a < b else None)
        self.buckets = self._buckets(bucket_numel)
        self.bucket_of = {p: b for b in self.buckets for p, _, _ in b.params}

    def _in_part(self, lo: int, hi: int) -> tuple[int, int]:
        """The flat range [lo, hi) intersected with this rank's partition, in partition coordinates."""
        return max(lo, self.part_lo) - self.part_lo, min(hi, self.part_hi) - self.part_lo

    def part_range(self, p: torch.Tensor) -> tuple[int, int]:
        """p's elements [offset, offset + numel) in this rank's partition coordinates (empty: a >= b)."""
        return self._in_part(self.offset[p], self.offset[p] + p.numel())

    def _buckets(self, bucket_numel: int) -> list[Bucket]:
        """Contiguous flat ranges taken from the end (backward order)."""
        buckets: list[Bucket] = []
        cur: list[tuple[torch.Tensor, int, int]] = []
        size = 0
        for p in reversed(self.params):
            span = self.span_end[p] - self.offset[p]
            if cur and size + span > bucket_numel:
                buckets.append(Bucket(len(buckets), list(reversed(cur)), self.span_end[cur[0][0]]))
                cur, size = [], 0
            cur.append((p, self.offset[p], p.numel()))
            size += span
        buckets.append(Bucket(len(buckets), list(reversed(cur)), self.span_end[cur[0][0]]))
        return buckets

    def runs(self, got: list[bool], steps: list[int], factor: list[float]) -> list[Run]:
        """(group, start, end, step, gradient factor) ranges of the partition to update: the params that got a
        gradient, cut where the group, the step count or the factor changes (one range per group when nothing
        is skipped or scaled apart)."""
        runs: list[Run] = []
        for i, p in enumerate(self.params):
            a, b = self._in_part(self.offset[p], self.span_end[p])
            if a >= b or not got[i]:
                continue
            key = (self.pgroup[i], steps[i] + 1, factor[i])
            if runs and runs[-1][2] == a and (runs[-1][0], runs[-1][3], runs[-1][4]) == key:
                runs[-1] = (key[0], runs[-1][1], b, key[1], key[2])
            else:
                runs.append((key[0], a, b, key[1], key[2]))
        return runs
