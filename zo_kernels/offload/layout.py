"""The flat layout: the trainable parameters in one flat buffer, its partition among the ranks, its buckets."""

from __future__ import annotations

import bisect
import math
import operator

import torch

PARAM_ALIGN_BYTES = 16  # every param starts on a 16-byte boundary of the flat buffer: vector loads in pack

Run = tuple[int, int, int, int, float]  # (group, start, end, step, gradient factor), in partition coordinates

# The default gradient bucket (bucket_numel=None): DEFAULT_BUCKET_NUMEL elements (32 MiB of bf16 gradients, two such
# buckets on the device), or for a model of more than BUCKETS_PER_MODEL of those, its elements / BUCKETS_PER_MODEL
# rounded up to a power of two, at most MAX_DEFAULT_BUCKET_NUMEL (two buckets: 256 MiB of bf16). Each bucket costs
# the step's host ~0.3 ms (a pack call, a D2H copy call, their checks: bench/bucket_host.py, 60-95 us each even
# alone on the H200's host, twice that inside backward): the 1.3B GPT had 131 buckets of 2**24, 37.8 ms of host
# time a step with the device drained before each (docs/gpu-runs.md, eighth run); at 2**26 it has one per block.
DEFAULT_BUCKET_NUMEL = 1 << 24
MAX_DEFAULT_BUCKET_NUMEL = 1 << 26
BUCKETS_PER_MODEL = 32


def default_bucket_numel(numel: int) -> int:
    """The gradient bucket's elements for a model (its trainable elements) when none is given."""
    if isinstance(numel, bool) or not hasattr(type(numel), "__index__"):
        raise TypeError(f"numel must be an int, got {type(numel).__name__}")
    numel = operator.index(numel)  # (numpy's and torch's integers too)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    want = -(-numel // BUCKETS_PER_MODEL)
    return min(MAX_DEFAULT_BUCKET_NUMEL, max(DEFAULT_BUCKET_NUMEL, 1 << max(want - 1, 0).bit_length()))


class Bucket:
    """A contiguous range [lo, hi) of the flat space and the parameters in it (flat order)."""

    def __init__(self, index: int, params: list[tuple[torch.Tensor, int, int]], hi: int, align: int) -> None:
        self.index = index
        self.params = params  # (param, flat offset, numel)
        self.lo = params[0][1]
        self.hi = hi  # the end of the last param's span (its padding included)
        self.ready = 0  # parameters whose gradient has arrived in this backward pass
        self.indices: list[int] = []  # each param's index in the layout (FlatLayout sets them)
        # runs of params that one `pack` lays out (each at the previous end rounded up to `align`), by start index;
        # ZeRO-3 pads each unit to N shards: a bucket across units has one run per unit
        self.packs: list[int] = [0]
        for i in range(1, len(params)):
            _, off, n = params[i - 1]
            if params[i][1] != -(-(off + n) // align) * align:
                self.packs.append(i)


class FlatLayout:
    """Flat offsets, each param starting on a PARAM_ALIGN_BYTES boundary (the pack kernels then move 16-byte vectors),
    the flat space cut into segments that the ranks share evenly, this rank's partition, the gradient buckets.

    Without `units` (ZeRO-1/2) the flat order is group by group and the whole flat space is one segment: rank r owns
    [r * part, (r + 1) * part). With `units` (ZeRO-3: the parameters each module gathers) the flat order is unit by
    unit and each unit is a segment padded to N aligned shards: rank r owns the r-th shard of every unit, and its
    partition is those shards one after the other. Partition coordinates index the host state, the landing buffer
    and (ZeRO-3) the persistent parameter shard.

    Args:
        groups: each param group's trainable parameters (their indices: group by group).
        dtype: the flat buffer's dtype (the alignment is counted in its elements).
        world, rank: the ranks sharing the flat space (N) and this one.
        bucket_numel: the most elements of a gradient bucket (a larger parameter gets a bucket of its own).
        units: lists of parameters covering `groups` exactly once, in gather order; None: one segment.
        block: every param (and so every partition) also starts on a multiple of `block` elements (the 8-bit
            moments' blocks: formats.py).
    """

    def __init__(self, groups: list[list[torch.Tensor]], dtype: torch.dtype, world: int, rank: int,
                 bucket_numel: int, units: list[list[torch.Tensor]] | None = None,
                 block: int = 1) -> None:  # fmt: skip
        self.params = [p for ps in groups for p in ps]  # the optimizer's order (param indices), group by group
        self.index = {p: i for i, p in enumerate(self.params)}
        self.pgroup = [gi for gi, ps in enumerate(groups) for _ in ps]
        self.world, self.rank = world, rank
        self.shape = {p: p.shape for p in self.params}  # (ZeRO-3 empties the params between uses)
        self.align = math.lcm(PARAM_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size(), block)
        up = lambda n, k: -(-n // k) * k  # noqa: E731
        self.offset: dict[torch.Tensor, int] = {}
        self.segments: list[tuple[int, int]] = []  # flat ranges shared evenly by the ranks
        pos = 0
        for unit in units if units is not None else [self.params]:
            lo = pos
            for p in unit:
                pos = up(pos, self.align)
                self.offset[p] = pos
                pos += p.numel()
            self.segments.append((lo, up(pos, world * self.align)))
            pos = self.segments[-1][1] if units is not None else pos
        self.flat_order = sorted(self.params, key=self.offset.__getitem__)
        self.numel = sum(p.numel() for p in self.params)
        # param i's span: [offset, next offset); the zeros of its padding are updated with it (they stay 0)
        ends = [self.offset[p] for p in self.flat_order[1:]] + [up(pos, self.align)]
        self.span_end = {p: e for p, e in zip(self.flat_order, ends)}
        self.flat_numel = self.segments[-1][1]
        # rank r's pieces: (flat lo, flat hi, partition offset), one per segment
        self.pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
        for r in range(world):
            off = 0
            for lo, hi in self.segments:
                shard = (hi - lo) // world
                self.pieces[r].append((lo + r * shard, lo + (r + 1) * shard, off))
                off += shard
        self.part = sum((hi - lo) // world for lo, hi in self.segments)
        # ZeRO-1/2: this rank's partition is one flat range
        self.part_lo = rank * self.part if units is None else None
        self.part_hi = self.part_lo + self.part if units is None else None
        self._seg_starts = [lo for lo, _ in self.segments]
        # each group's range of the partition if it is one range, else None
        self.group_ranges: list[tuple[int, int] | None] = []
        for ps in groups:
            spans = sorted(self._in_part(self.offset[p], self.span_end[p]) for p in ps)
            spans = [(a, b) for a, b in spans if a < b]
            joined = all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
            self.group_ranges.append((spans[0][0], spans[-1][1]) if spans and joined else None)
        self.buckets = self._buckets(bucket_numel)
        self._uniform_runs: list[tuple[int, int, int]] | None = None  # runs() of the usual step, once computed
        self.bucket_of = {p: b for b in self.buckets for p, _, _ in b.params}
        for b in self.buckets:  # (each param's index, where the hot path would hash the tensor: a Python call)
            b.indices = [self.index[p] for p, _, _ in b.params]

    def owned(self, lo: int, hi: int, r: int) -> list[tuple[int, int, int]]:
        """The parts of the flat range [lo, hi) that rank r owns: (flat a, flat b, partition offset of a)."""
        out = []
        k = 0 if len(self._seg_starts) == 1 else max(0, bisect.bisect_right(self._seg_starts, lo) - 1)
        for a, b, off in self.pieces[r][k:]:
            if a >= hi:
                break
            x, y = max(a, lo), min(b, hi)
            if x < y:
                out.append((x, y, off + x - a))
        return out

    def _in_part(self, lo: int, hi: int) -> tuple[int, int]:
        """The flat range [lo, hi) (within one segment) intersected with this rank's partition, in partition
        coordinates (empty: a >= b)."""
        got = self.owned(lo, hi, self.rank)
        if not got:
            return 0, 0
        assert len(got) == 1, "a range across segments"
        a, b, off = got[0]
        return off, off + b - a

    def part_range(self, p: torch.Tensor) -> tuple[int, int]:
        """p's elements [offset, offset + numel) in this rank's partition coordinates (empty: a >= b)."""
        return self._in_part(self.offset[p], self.offset[p] + self.shape[p].numel())

    def _buckets(self, bucket_numel: int) -> list[Bucket]:
        """Contiguous flat ranges taken from the end (backward order)."""
        buckets: list[Bucket] = []
        cur: list[tuple[torch.Tensor, int, int]] = []
        size = 0
        for p in reversed(self.flat_order):
            span = self.span_end[p] - self.offset[p]
            if cur and size + span > bucket_numel:
                buckets.append(Bucket(len(buckets), list(reversed(cur)), self.span_end[cur[0][0]], self.align))
                cur, size = [], 0
            cur.append((p, self.offset[p], p.numel()))
            size += span
        buckets.append(Bucket(len(buckets), list(reversed(cur)), self.span_end[cur[0][0]], self.align))
        return buckets

    def runs(self, got: list[bool], steps: list[int], factor: list[float]) -> list[Run]:
        """(group, start, end, step, gradient factor) ranges of the partition to update: the params that got a
        gradient, cut where the group, the step count or the factor changes (one range per group when nothing
        is skipped or scaled apart)."""
        n = len(self.params)
        if n and all(got) and steps.count(steps[0]) == n and factor.count(1.0) == n:
            # the usual step (every param has a gradient, one step count, no factor): its ranges depend on the
            # layout alone, so they are computed once, not per parameter per step
            if self._uniform_runs is None:
                self._uniform_runs = [(g, a, b) for g, a, b, _, _ in self._runs([True] * n, [0] * n, [1.0] * n)]
            return [(g, a, b, steps[0] + 1, 1.0) for g, a, b in self._uniform_runs]
        return self._runs(got, steps, factor)

    def _runs(self, got: list[bool], steps: list[int], factor: list[float]) -> list[Run]:
        runs: list[Run] = []
        for p in self.flat_order:
            i = self.index[p]
            a, b = self._in_part(self.offset[p], self.span_end[p])
            if a >= b or not got[i]:
                continue
            key = (self.pgroup[i], steps[i] + 1, factor[i])
            if runs and runs[-1][2] == a and (runs[-1][0], runs[-1][3], runs[-1][4]) == key:
                runs[-1] = (key[0], runs[-1][1], b, key[1], key[2])
            else:
                runs.append((key[0], a, b, key[1], key[2]))
        return runs
