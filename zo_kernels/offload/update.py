"""The host update: this rank's masters and moments (in host memory, or in NVMe files streamed tile by tile), CPU
Adam over runs of the partition, the tiled writeback of the new 16-bit parameters (or staging them for later), and
the background (DPU) worker."""

from __future__ import annotations

import bisect
import math
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from ..cpu_adam import bump_version, callers_fp_mode, cpu_adam_step, plan_adam_step
from ..nvme import TILE_MULTIPLE, Moment, NvmeSwapper, UpdateFn, as_float, assign, narrow
from ..transport import Event, Staging, Transport, tiled_writeback
from .fence import TileFence
from .formats import BLOCK_8BIT, Moments, block_of, bytes_per_element, cut_raw, sr_args, sr_pieces
from .layout import FlatLayout, Run
from .report import PhaseTimes

DEFAULT_TILE_NUMEL = 1 << 21  # see bench/test_bench_transport.py: 1.03x the bare kernel at 100M params
UPDATE_TIMEOUT_S = 600.0  # default bound on waiting for the background (DPU) update
# DPU's writeback queues all its tile copies (each with an event) at once. On the H200 a writeback of 626 tiles
# (1.3B params) held step() for 48.4 ms, the whole copy's time (48.5 ms alone), while 46 tiles (95M) returned in
# 0.55 ms with 32 still in flight: queueing that many copies and events blocks the host (a bounded queue of pending
# operations, the likeliest reading). So a writeback is cut into at most this many tiles (whole update tiles; with the
# parameters over the gradients, one more per break between the last update's runs: a skipped parameter's range).
MAX_WRITEBACK_TILES = 32

MasterFill = Callable[[int, int, torch.Tensor], Any]  # (a, b, out): the fp32 masters of partition range [a, b)


HOST_COMPARE_CHUNK = 1 << 22  # elements a compare of the masters with the parameters takes at a time on the host
# ... and the bytes of its temporaries on a GPU (the tail's masters): the cast chunk, the parameters' copy where they
# lie elsewhere and the bool result. 4M elements there (12 MiB) made state_dict() peak 2.7 MiB above an 8-bit tail's
# memory on the H100 (tests/test_gpu.py bounds it at 1 MiB); at 256K elements a 1B-element tail takes ~4000 chunks.
DEVICE_COMPARE_BYTES = 768 << 10


def compare_chunk(master: torch.Tensor, own: torch.Tensor) -> int:
    """Elements per chunk of differing(master, own, ...): HOST_COMPARE_CHUNK on the host, else what keeps the chunk's
    temporaries within DEVICE_COMPARE_BYTES."""
    if master.device.type == "cpu":
        return HOST_COMPARE_CHUNK
    cast = own.element_size() if own.dtype != master.dtype else 0
    moved = own.element_size() if own.device != master.device else 0
    return DEVICE_COMPARE_BYTES // (1 + cast + moved)


def differing(master: torch.Tensor, own: torch.Tensor, ranges: list[tuple[int, int]], at: int,
              chunk: int | None = None) -> list[tuple[int, int]]:  # fmt: skip
    """The ranges (partition coordinates, sorted) in which `own` (parameters, any device) is not the cast of the fp32
    `master`, both starting at partition offset `at`; compared `chunk` elements at a time (default compare_chunk) on
    the masters' device (copies of the chunk, not of the partition)."""
    out: list[tuple[int, int]] = []
    n = own.numel()
    chunk = chunk or compare_chunk(master, own)
    for x in range(0, n, chunk):
        y = min(n, x + chunk)
        ne = master[x:y].to(own.dtype) != own[x:y].to(master.device)  # (on the masters' device: host or the tail's)
        if bool(ne.any()):
            for a, b in ranges[max(0, bisect.bisect_right(ranges, (at + x, math.inf)) - 1) :]:
                if a >= at + y:
                    break
                lo, hi = max(a, at + x) - at - x, min(b, at + y) - at - x
                if lo < hi and bool(ne[lo:hi].any()) and (not out or out[-1] != (a, b)):
                    out.append((a, b))
        del ne  # (kept, it would lie beside the next chunk's temporaries: a third more than compare_chunk counts)
    return out


def param_ranges(layout: FlatLayout) -> list[tuple[int, int]]:
    """Each parameter's non-empty range of this rank's partition (partition coordinates), in order."""
    return sorted(r for r in map(layout.part_range, layout.params) if r[0] < r[1])


def stale_warning(staged: bool) -> str:
    """refresh_stale_masters' warning; `staged`: a delayed update's writeback was pending."""
    text = ("the model's parameters changed since the optimizer took its fp32 masters (e.g. model.load_state_dict "
            "after construction): masters refreshed from the model, losing the bits below its dtype")  # fmt: skip
    if staged:
        text += ("; a delayed update had not reached the model yet, and is dropped: call opt.synchronize() before "
                 "loading a state without masters to keep it")  # fmt: skip
    return text


def stopped_waiting(fut: Future, e: BaseException) -> bool:
    """Whether `e`, raised while waiting for `fut`, stopped the wait (Ctrl-C...) and not the job, which goes on."""
    return not (fut.done() and fut.exception() is e)


class StateViews:
    """master, exp_avg, exp_avg_sq: the three fp32 tensors of the update's state() (the partition's, whole)."""

    def state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def master(self) -> torch.Tensor:
        return self.state()[0]

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.state()[1]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.state()[2]


class HostUpdate(StateViews):
    """fp32 master, exp_avg, exp_avg_sq of this rank's partition and the update that applies a gradient to them.

    Args:
        layout: the flat layout.
        own: where this rank's 16-bit parameters live, in partition coordinates: its range of the device's flat
            buffer (ZeRO-1/2), or its persistent shard (ZeRO-3: on the device, or in host memory).
        master: the partition's fp32 masters (taken from the parameters), or a callable fill_master(a, b, out)
            writing the masters of partition range [a, b) into `out` (fp32, b - a elements, zeros where it writes
            nothing): with NVMe the files are then filled tile by tile, never holding a full-size fp32 tensor.
        transport: the copies to `own`.
        publish: called once `own` holds new parameters (ZeRO-1/2: the all-gather of the partitions).
        threads, tile_numel: CPU threads of the update; elements per tile of the update/writeback pipeline.
        delayed: the delayed parameter update is on (staging is then a buffer of its own).
        timeout_s: the longest finish_pending() waits for the background update.
        times: the step's phase timings.
        nvme_dir: keep master, exp_avg, exp_avg_sq (in their format) in scratch files there (NvmeSwapper: host
            memory bounded by its buffer pool; the update streams them tile by tile); None: in host memory.
        params_dtype: with `own` None (ZeRO-Infinity: the stage-3 shard on NVMe), the 16-bit parameters are a
            fourth file of the swapper, of this dtype, written by the same streamed update.
        state_fmt: the moments' format (formats.py): "fp32", "bf16" or "8bit" (then every run starts on a block).
        numel: the elements of the partition it holds, [0, numel) (default all; gpu_fraction keeps the rest on the
            device: twin.py).
        params_over_grads: the gradient path's landing buffers may take the new parameters (its transport is this
            one): then, where the parameters are copied (not updated in place) and the state is in memory, no
            staging buffer is kept (see below).
    """

    HAS_MOMENTS = True  # Adam's two moments (a subclass with another rule keeps its own state)
    PARAMS_OVER_GRADS = True  # a subclass whose update reads the gradients more than once says False

    def __init__(self, layout: FlatLayout, own: torch.Tensor | None, master: torch.Tensor | MasterFill,
                 transport: Transport, publish: Callable[[], None], *, threads: int, tile_numel: int, delayed: bool,
                 timeout_s: float, times: PhaseTimes, nvme_dir: str | None = None,
                 params_dtype: torch.dtype | None = None, state_fmt: str = "fp32",
                 numel: int | None = None, params_over_grads: bool = False,
                 background_threads: int | None = None) -> None:  # fmt: skip
        self.fmt = state_fmt
        self.numel = numel = layout.part if numel is None else numel
        # each group's range of [0, numel) if it is one range there, else None
        self.group_ranges = [(r[0], min(r[1], numel)) if r is not None and r[0] < numel else None
                             for r in layout.group_ranges]  # fmt: skip
        block = block_of(state_fmt)
        tile_numel = -(-tile_numel // block) * block  # (8-bit) tiles start on block boundaries
        self.layout, self.own, self.transport, self.publish, self.times = layout, own, transport, publish, times
        self.threads, self.tile_numel, self.timeout_s = threads, tile_numel, timeout_s
        # the update's threads in the background, beside forward and backward (DPU, selective's window)
        self.bg_threads = threads if background_threads is None else background_threads
        if isinstance(master, torch.Tensor):
            fill_master: MasterFill = lambda a, b, out: out.copy_(master[a:b])  # noqa: E731
        elif callable(master):
            fill_master = master
        else:
            raise TypeError(f"master must be a tensor or callable(a, b, out), got {type(master).__name__}")
        self.steps = [0] * len(layout.params)  # each parameter's own Adam step count (torch keeps one per param)
        self.failed: BaseException | None = None  # the background update did not finish in time (it may still run)
        self.stopped: BaseException | None = None  # it raised: the state part old, part new, until one is loaded
        self.staged = False  # DPU: staging holds the last update's params, not yet on the device
        self._staging_read: Any = None  # event of the last copy out of staging (the next update writes after it)
        self._pending: Future | None = None
        # params_over_grads: () -> (a landing buffer, whether no backward writes it before the next step), where
        # resume() puts the loaded masters' cast (set by the optimizer)
        self.spare_landing: Callable[[], tuple[torch.Tensor, bool]] | None = None
        # DPU: None, the writeback is waited for as a whole; a TileFence, its tiles are waited for by their readers
        # (the next forward's modules, ZeRO-3's gathers), which the optimizer then hooks up
        self.fence: TileFence | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.params_in_swapper = own is None  # (then nvme_dir and params_dtype are given, and no DPU)
        self.staging_in_place = self.params_in_swapper or not (transport.needs_staging or delayed)
        # Where the new parameters are copied (a GPU, or DPU) and the state is in memory, no staging buffer: the
        # update writes each new parameter over the gradient element it has just read, in the landing buffer the
        # step's gradient came in (run/start's `out`), and the writeback copies from there. The gradient path orders
        # the landing buffer's next writer (backward's copies, zero_grad) after that copy: GradPath.landing_free.
        self.params_over_grads = (params_over_grads and self.PARAMS_OVER_GRADS and self.HAS_MOMENTS
                                  and not self.staging_in_place and nvme_dir is None)  # fmt: skip
        self._out: torch.Tensor | None = None  # params_over_grads: the landing buffer holding the last update's
        self._out_runs: list[tuple[int, int]] = []  # params, and the ranges it wrote there (the rest is not params)
        if self.params_over_grads:
            self.staging_buf = None
        elif not self.staging_in_place:
            self.staging_buf = transport.pool.take(numel, own.dtype)
        else:  # host memory is the device: the update writes the parameters in place (no forward runs meanwhile)
            self.staging_buf = own
        self.swapper: NvmeSwapper | None = None
        self._state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # fp32 format in memory
        self.moments: Moments | None = None  # the other formats in memory
        self._master: torch.Tensor | None = None
        if nvme_dir is not None:
            multiple = TILE_MULTIPLE * (2 if self.params_in_swapper else 1)
            tile = -(-tile_numel // multiple) * multiple  # the pool: 3 tiles of state (+3 of 16 bits), by tile_numel
            try:
                self.swapper = NvmeSwapper(numel, nvme_dir, tile_numel=tile, state_fmt=state_fmt,
                                           params_dtype=params_dtype if self.params_in_swapper else None)
                self.swapper.fill(self._fill_tile(fill_master))  # no full-size fp32 tensor: the pool's tiles only
            except BaseException:
                if self.swapper is not None:
                    self.swapper.close()
                if not self.staging_in_place:
                    transport.pool.give(self.staging_buf)
                raise
        else:
            if not isinstance(master, torch.Tensor):
                master = torch.zeros(numel, dtype=torch.float32)
                fill_master(0, numel, master)
            self._master = master
            self.moments = Moments(state_fmt, numel) if self.HAS_MOMENTS else None
            if state_fmt == "fp32" and self.HAS_MOMENTS:  # the kernel's fp32 path, the tensors themselves
                self._state = (master, *self.moments.pair)
            if self.staging_buf is not None and not self.staging_in_place:
                # staging always holds the current params: a step that skips a param (no gradient) leaves its
                # range as is, and the padding past the last parameter is sent to the device as zeros
                self.staging_buf.copy_(master)
        self._staging = [Staging(self.staging_buf[r[0] : r[1]], tile_numel)
                         if r and own is not None and self.staging_buf is not None else None
                         for r in self.group_ranges]  # fmt: skip

    def _fill_tile(self, fill_master: MasterFill) -> UpdateFn:
        """The swapper's fill of tile [lo, hi): the masters (zeros where no parameter lies), zero moments, and
        the masters' cast into staging (which always holds the current params, as in memory)."""

        def fill(lo: int, hi: int, master: torch.Tensor, exp_avg: Moment, exp_avg_sq: Moment,
                 params: torch.Tensor | None = None) -> None:  # fmt: skip
            master.zero_()
            assign(exp_avg, None)
            assign(exp_avg_sq, None)
            fill_master(lo, hi, master)
            if params is not None:  # the 16-bit shard on NVMe
                params.copy_(master)
            elif not self.staging_in_place:
                self.staging_buf[lo:hi].copy_(master)

        return fill

    def state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of the partition: the tensors themselves in memory; with NVMe, copies read
        from the files (write changes back with save_state)."""
        if self._state is not None:
            return self._state
        if self.moments is not None:
            return (self._master, *self.moments.get(0, self.numel))
        out = tuple(torch.empty(self.numel, dtype=torch.float32) for _ in range(3))
        self.swapper.read_all(*out)
        return out

    def copy_state(self, ranges: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]) -> None:
        """Copy partition range [a, b) of master, exp_avg, exp_avg_sq into the three 1-D fp32 tensors (b - a
        elements each) given with it, for each (a, b, outs) of `ranges` (disjoint). With NVMe, tile by tile from the
        files: host memory beyond the outputs is the swapper's pool."""
        for a, b, outs in ranges:
            for out in outs:
                if out.dtype != torch.float32 or out.dim() != 1 or out.numel() != max(0, b - a):
                    raise ValueError(f"copy_state: the outputs of range [{a}, {b}) must be 1-D fp32 tensors of "
                                     f"{max(0, b - a)} elements, got {out.dtype} {tuple(out.shape)}")  # fmt: skip
        if self.moments is not None:
            for a, b, outs in ranges:
                if a < b:  # (a param's range: a is on a block boundary)
                    for out, src in zip(outs, (self._master[a:b], *self.moments.get(a, b))):
                        out.copy_(src)
            return
        ranges = sorted((r for r in ranges if r[0] < r[1]), key=lambda r: r[0])
        first = 0  # the ranges before it end before the current tile (tiles come in order)

        def copy_out(lo: int, hi: int, *tile: Moment) -> None:
            nonlocal first
            while first < len(ranges) and ranges[first][1] <= lo:
                first += 1
            if first < len(ranges) and ranges[first][0] < hi:
                tile = [as_float(t) for t in tile[:3]]  # (the moments dequantized once per tile)
            for a, b, outs in ranges[first:]:
                if a >= hi:
                    break
                x, y = max(a, lo), min(b, hi)
                for out, src in zip(outs, tile):
                    out[x - a : y - a].copy_(src[x - lo : y - lo])

        self.swapper.read(copy_out)

    def save_state(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Make these the state (a no-op for the in-memory tensors that state() returned)."""
        if self.swapper is not None:
            self.swapper.write_all(master, exp_avg, exp_avg_sq)
        elif self._state is not None:
            for mine, new in zip(self._state, (master, exp_avg, exp_avg_sq)):
                if new is not mine:
                    mine.copy_(new)
        else:
            if master is not self._master:
                self._master.copy_(master)
            self.moments.set(0, self.numel, exp_avg, exp_avg_sq)

    def save_master(self, master: torch.Tensor) -> None:
        """Make `master` (state()'s first tensor, changed) the masters; the moments stay as they are (bit for bit)."""
        if self.swapper is not None:

            def put(lo: int, hi: int, p: torch.Tensor, m: Moment, v: Moment,
                    params: torch.Tensor | None = None) -> None:  # fmt: skip
                p.copy_(master[lo:hi])
                if params is not None:  # the 16-bit parameters: the masters' cast, as write_all
                    params.copy_(p)

            self.swapper.stream(put)
        elif master is not self._master:
            self._master.copy_(master)

    def raw_moments(self) -> list[torch.Tensor]:
        """The tensors holding the partition's moments bit for bit (Moments.tensors(); 8-bit: codes and scales): the
        in-memory ones, or copies read from the NVMe files."""
        if self.swapper is None:
            return self.moments.tensors()
        outs = Moments(self.fmt, self.numel).tensors()
        per = [BLOCK_8BIT if t.numel() != self.numel else 1 for t in outs]  # partition elements per element

        def copy_out(lo: int, hi: int, p: torch.Tensor, m: Moment, v: Moment, *params: torch.Tensor) -> None:
            for out, src, k in zip(outs, Moments(self.fmt, hi - lo, pair=(m, v)).tensors(), per):
                out[lo // k : lo // k + src.numel()].copy_(src)

        self.swapper.read(copy_out)
        return outs

    def set_raw(self, pieces: list[tuple[int, int, dict[str, torch.Tensor]]]) -> None:
        """Partition ranges [a, b) (each on a block boundary) of the moments from Moments.raw() bits: in memory, or
        one pass over the NVMe files."""
        if self.swapper is None:
            for a, b, raw in pieces:
                self.moments.set_raw(a, b, raw)
            return
        block = block_of(self.fmt)

        def put(lo: int, hi: int, p: torch.Tensor, m: Moment, v: Moment, params: torch.Tensor | None = None) -> None:
            tile = Moments(self.fmt, hi - lo, pair=(m, v))
            for a, b, raw in pieces:
                x, y = max(a, lo), min(b, hi)
                if x < y:  # (x - a and x - lo are on block boundaries)
                    tile.set_raw(x - lo, y - lo, cut_raw(raw, x - a, y - a, block))

        self.swapper.stream(put)

    @property
    def host_state_bytes(self) -> int:
        """Host bytes the optimizer state takes: the fp32 masters and the moments in their format (12 per parameter
        with fp32 moments, 8 with bf16, 6.03 with 8-bit) in memory, the swapper's pool with NVMe."""
        if self.swapper is not None:
            return self.swapper.pool_bytes
        return self._master.numel() * 4 + self.moments.nbytes

    @property
    def state_bytes_per_param(self) -> float:
        """K of the host formula: bytes of optimizer state per parameter (the masters' 4 and the moments')."""
        return 4 + bytes_per_element(self.fmt)

    def run(self, grad: torch.Tensor, grad_scale: float, runs: list[Run], hparams: list[dict],
            out: torch.Tensor | None = None) -> None:  # fmt: skip
        """The synchronous update: CPU Adam, the new parameters to the device tile by tile, then the all-gather.
        `out`: the landing buffer `grad` came in (params_over_grads: the new parameters go there)."""
        self.take_out(out, runs)
        kernel_before = self.times.get("kernel", 0.0)
        seconds = self.cpu_update(grad, grad_scale, runs, hparams, True)
        self.times.add("cpu_update", seconds)
        # the part of the tiled update that is not the kernel: queueing copies, waiting for staging slots
        self.times.add("writeback", seconds - (self.times.get("kernel", 0.0) - kernel_before))
        self.publish()

    def start(self, grad: torch.Tensor, grad_scale: float, runs: list[Run], hparams: list[dict],
              out: torch.Tensor | None = None, before: Callable[[], None] | None = None) -> None:  # fmt: skip
        """The delayed update: CPU Adam into staging (or `out`, as run's) in the background thread; finish_pending()
        collects it. `before`: run first in that thread (the wait for the backward's last copies into `grad`, which
        the host left in flight: GradPath.defer_copies)."""
        self.take_out(out, runs)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zo-dpu")
        self._pending = self._executor.submit(callers_fp_mode(self._update_after), before, grad, grad_scale, runs,
                                              hparams)  # fmt: skip

    def _update_after(self, before: Callable[[], None] | None, grad: torch.Tensor, grad_scale: float,
                      runs: list[Run], hparams: list[dict]) -> float:  # fmt: skip
        """The background thread's update: `before`, then CPU Adam (its wall time, without `before`'s)."""
        if before is not None:
            before()
        return self.cpu_update(grad, grad_scale, runs, hparams, False, self.bg_threads)

    def take_out(self, out: torch.Tensor | None, runs: list[Run]) -> None:
        """params_over_grads: the step's landing buffer receives the new parameters of `runs`."""
        if not self.params_over_grads:
            return
        if out is None or out.numel() < self.numel or out.dtype != self.own.dtype:
            raise RuntimeError("internal: the update writes its parameters into the step's landing buffer, "
                               f"got {None if out is None else (out.dtype, out.numel())}")  # fmt: skip
        self._out = out[: self.numel]
        self._out_runs = [(a, b) for _, a, b, _, _ in runs]

    @property
    def out_buf(self) -> torch.Tensor:
        """Where the update writes the new 16-bit parameters: staging, or the step's landing buffer."""
        return self._out if self.params_over_grads else self.staging_buf

    def cpu_update(self, grad: torch.Tensor, grad_scale: float, runs: list[Run], hparams: list[dict],
                   writeback: bool, threads: int | None = None) -> float:  # fmt: skip
        """CPU Adam over the ranges `runs` of this rank's partition; with writeback, tiles go to the device.
        threads: the kernel's (default: self.threads).

        Returns its wall time. Runs in the background thread under DPU: no collectives, no stats here.
        """
        t0 = time.perf_counter()
        threads = self.threads if threads is None else threads
        if self.swapper is not None:
            self._stream_update(grad, grad_scale, runs, hparams, writeback, threads)
            return time.perf_counter() - t0
        if self._state is None:
            self._tile_update(grad, grad_scale, runs, hparams, writeback, threads)
            return time.perf_counter() - t0
        events = []
        master, exp_avg, exp_avg_sq = self._state
        buf = self.out_buf
        for gi, a, b, step, factor in runs:
            staging = self._staging[gi]
            adam = dict(step=step, grad_scale=grad_scale * factor, threads=threads, **hparams[gi])
            if self.params_over_grads:  # the landing buffer: its last reader finished before backward wrote it
                staging = Staging(buf[a:b], self.tile_numel)
            elif (a, b) != self.group_ranges[gi]:  # part of a group (a param was skipped; ZeRO-3: a group in
                # several units): a staging of its own, once the group's earlier copies are done
                for ev in staging.events.values() if staging is not None else ():
                    self.transport.wait(ev)
                staging = Staging(buf[a:b], self.tile_numel)
            if writeback:
                dst = self.own[a:b]
                events += tiled_writeback(self.transport, master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b],
                                          dst=dst, staging=staging, timings=self.times, **adam)  # fmt: skip
            else:  # staging as far as the copies of the last writeback have read it (the kernel is elementwise)
                for x, y in self._staging_free(a, b):
                    cpu_adam_step(master[x:y], grad[x:y], exp_avg[x:y], exp_avg_sq[x:y],
                                  param_out=buf[x:y], **adam)  # fmt: skip
        for ev in events:
            self.transport.device_wait(ev)
        return time.perf_counter() - t0

    def _staging_free(self, a: int, b: int) -> Iterator[tuple[int, int]]:
        """Range [a, b) of staging in spans that no copy of the last writeback reads any more: tile by tile as they
        land with a fence (the update starts under the writeback), else once the whole copy is done. The landing
        buffer (params_over_grads) is free already: backward wrote it after its last copy."""
        if self.params_over_grads:
            yield a, b
        elif self.fence is not None and self.fence.tiles:
            yield from self.fence.landed(a, b)
        else:
            self.transport.wait(self._staging_read)
            yield a, b

    def _tile_update(self, grad: torch.Tensor, grad_scale: float, runs: list[Run], hparams: list[dict],
                     writeback: bool, threads: int) -> None:  # fmt: skip
        """The update of bf16 / 8-bit moments in memory, the new params into staging: the kernel called once per
        span of staging that is free (all of a run, or, under DPU's fence, the spans whose copies of the last
        writeback have landed); with writeback, where the transport has a C tile sink (CUDA's), a run's tiles are
        updated and queued to the device by one C++ loop without the GIL, else tile by tile from Python, each copy
        overlapping the next tile's update; the compute stream waits for the copies at the end. The values do not
        depend on the split (the random bits, bf16's and 8-bit exp_avg's, come from the partition offset: _sr). Before,
        a kernel call per tile from Python: on the H200 (8-bit, 16-core host) each tile cost ~0.4 ms beside its
        kernel's 0.3 ms (1.3B: 570 ms tiled against 182 ms for one call)."""
        send = writeback and not self.staging_in_place
        buf, tile = self.out_buf, self.tile_numel
        events: list = []
        try:
            for gi, a0, b0, step, factor in runs:
                adam = dict(step=step, grad_scale=grad_scale * factor, threads=threads, **hparams[gi])
                for a, b in sr_pieces(a0, b0):
                    sink = self.transport.tile_sink(self.own[a:b], buf[a:b]) if send else None
                    if sink is not None:
                        for _ in self._staging_free(a, b):  # the last writeback's copies out of staging [a, b)
                            pass
                        plan = plan_adam_step(self._master[a:b], grad[a:b], *self.moments.view(a, b),
                                              out_dtype=buf.dtype, **adam, **self._sr(a))  # fmt: skip
                        t0 = time.perf_counter()
                        try:
                            plan.run_tiled(tile, sink, buf[a:b])
                        finally:  # (also part-way: the tiles queued so far are covered, their event kept)
                            events.append(self.transport.record_h2d())
                            bump_version(self._master, buf, *self.moments.tensors())
                        self.times.add("kernel", time.perf_counter() - t0)
                        continue
                    for x, y in self._staging_free(a, b):
                        for u, v in [(u, min(y, u + tile)) for u in range(x, y, tile)] if send else [(x, y)]:
                            t0 = time.perf_counter()
                            cpu_adam_step(self._master[u:v], grad[u:v], *self.moments.view(u, v),
                                          param_out=buf[u:v], **adam, **self._sr(u))  # fmt: skip
                            if writeback:  # (the background thread under DPU leaves the step's timings alone)
                                self.times.add("kernel", time.perf_counter() - t0)
                            if send:
                                events.append(self.transport.h2d(self.own[u:v], buf[u:v]))
        finally:
            self._note_copies(events)
        for ev in events:
            self.transport.device_wait(ev)

    def _note_copies(self, events: list) -> None:
        """The copies out of staging an update queued (also when it failed part-way): they run in order on one
        stream, so the last one's event covers them all; the next writer of staging waits for it."""
        if events:
            self._staging_read = events[-1]

    def _sr(self, x: int) -> dict:
        """The stochastic rounding's seed and index for a kernel call starting at partition offset x, within one
        piece of sr_pieces (formats.sr_args): the same bits at every run and resume of this layout, tiled or not, in
        memory or on NVMe, on the host or in gpu_fraction's tail."""
        return sr_args(self.layout.rank << 40, x)

    def _stream_update(self, grad: torch.Tensor, grad_scale: float, runs: list[Run], hparams: list[dict],
                       writeback: bool, threads: int) -> None:  # fmt: skip
        """The update with the state in NVMe files: the swapper reads tile t+1 and writes tile t-1 while CPU Adam
        updates tile t (each run's part of it) into staging; with writeback, the tile's new params are then queued
        to the device at once (their copy overlaps the next tiles' update) and the compute stream waits for all of
        them at the end. Elementwise (8-bit: by blocks, and tiles start on blocks), so equal bit for bit to the
        in-memory update; bf16's random bits are hashed from each element's partition offset (_sr), as there."""
        # staging is full size: within this update each tile writes its own region, which no copy of this update
        # reads yet; only the last update's copies (or write_staging's) may still read it
        self.transport.wait(self._staging_read)
        send = writeback and not self.staging_in_place
        own = self.own
        events: list = []

        def update(lo: int, hi: int, p: torch.Tensor, m: Moment, v: Moment,
                   params: torch.Tensor | None = None) -> None:  # fmt: skip
            first = last = None
            for gi, a, b, step, factor in runs:
                for x, y in sr_pieces(max(a, lo), min(b, hi)):
                    t0 = time.perf_counter()
                    out = params[x - lo : y - lo] if params is not None else self.staging_buf[x:y]
                    cpu_adam_step(p[x - lo : y - lo], grad[x:y], narrow(m, x - lo, y - lo), narrow(v, x - lo, y - lo),
                                  step=step, grad_scale=grad_scale * factor, threads=threads, param_out=out,
                                  **self._sr(x), **hparams[gi])  # fmt: skip
                    self.times.add("kernel", time.perf_counter() - t0)
                    first, last = x if first is None else first, y
            if send and first is not None:  # one copy per tile: a skipped param between runs holds its current value
                events.append(self.transport.h2d(own[first:last], self.staging_buf[first:last]))

        try:
            self.swapper.stream(update)
        finally:
            self._note_copies(events)
        for ev in events:
            self.transport.device_wait(ev)

    def finish_pending(self, write: bool, keep_model: bool = False) -> None:
        """Wait for the background update (re-raising its exception) and, if asked, send its params down.
        `keep_model`: the caller takes the masters from the model next (refresh_from_model, a load without
        masters); here the parameters are not written without `write` anyway (SelectiveUpdate's drain does)."""
        if self._pending is None:
            if write:
                self.flush_staged()
            return
        fut, self._pending = self._pending, None
        t0 = time.perf_counter()
        try:
            seconds = fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            self.failed = TimeoutError(f"the delayed (background) update did not finish within "
                                       f"{self.timeout_s:g} s (update_timeout_s)")  # fmt: skip
            raise self.failed from None
        except BaseException as e:
            if stopped_waiting(fut, e):  # Ctrl-C in the wait: the update goes on, still pending
                self._pending = fut
                raise
            self.stopped = e  # the worker's own exception, with its traceback
            raise
        self.times.add("cpu_update", seconds)
        self.times.add("dpu_wait", time.perf_counter() - t0)
        self.staged = True
        if write:
            self.flush_staged()

    def flush_staged(self) -> None:
        """Send the parameters of the last (background) update to the device, if not sent yet."""
        if self.staged:
            self.write_staging()
            self.staged = False

    def write_staging(self) -> None:
        """Staging (the 16-bit params of the last update) -> this rank's slice of the device buffer."""
        t0 = time.perf_counter()
        own = self.own
        if not self.staging_in_place:
            if self.fence is None:  # the compute stream waits for the copy
                for a, b in self._pieces(0, self.numel):
                    self._staging_read = self.transport.h2d(own[a:b], self.out_buf[a:b])
                self.transport.device_wait(self._staging_read)
            else:
                self._staging_read = self._write_tiles()
            # (the next update waits for the copies before writing staging)
        self.times.add("writeback", time.perf_counter() - t0)
        self.publish()

    def _write_tiles(self) -> Event:
        """Staging -> the device tile by tile, each copy's event in the fence, nothing waited for here: the next
        forward's readers wait for the tiles they use. Returns the last copy's event (it covers them all)."""
        fence, n = self.fence, self.numel
        fence.reset()
        step = self.tile_numel * max(1, -(-n // (self.tile_numel * MAX_WRITEBACK_TILES)))  # <= MAX_WRITEBACK_TILES
        tiles = [t for x in range(0, n, step) for t in self._pieces(x, min(n, x + step))]
        # each tile in the fence as soon as it is queued: a failure part-way leaves the queued ones waited for
        events = self.transport.h2d_tiles(self.own[:n], self.out_buf[:n], tiles, on_tile=fence.add) if tiles else []
        return events[-1] if events else None

    def _pieces(self, x: int, y: int) -> Iterator[tuple[int, int]]:
        """[x, y) in the pieces holding new parameters: all of it in staging; in the landing buffer, the ranges the
        last update wrote (the rest holds gradients; the device keeps those parameters as they are)."""
        if not self.params_over_grads:
            yield x, y
            return
        for a, b in self._out_runs:
            if a < y and b > x:
                yield max(a, x), min(b, y)

    def wait_written(self) -> None:
        """The compute stream waits for every tile of the last writeback (a read of the device parameters outside
        the readers the fence serves)."""
        if self.fence is not None:
            self.fence.wait_all()

    @torch.no_grad()
    def resume(self, staged: bool) -> None:
        """After a state was loaded: the device params from the masters now, or (a state saved between a delayed
        update and its writeback) by the next step(), as if never stopped."""
        if self.params_over_grads:  # the masters' cast into a landing buffer: under DPU the one the next backward
            buf, spare = self.spare_landing()  # does not write (kept until the next step), else the next backward's
            for ev in (self._staging_read, *self.transport.pool.events(buf)):  # (written now: its writers wait)
                self.transport.wait(ev)
            self._out, self._out_runs = buf[: self.numel], [(0, self.numel)]
            self._out.copy_(self.state()[0])
            staged = staged and spare
        elif not self.params_in_swapper:  # (else save_state wrote the masters' cast into the parameters' file)
            self.transport.wait(self._staging_read)  # a copy of the last writeback may still read staging
            self.staging_buf.copy_(self.state()[0])
        if staged and not self.staging_in_place:
            self.staged = True
        else:
            self.staged = False
            self.write_staging()

    @torch.no_grad()
    def refresh_stale_masters(self, warn: bool = True) -> None:
        """Keep each parameter's fp32 masters if its device values are still their cast; else take that parameter's
        from the model (and into staging, which holds the parameters a skipped range keeps), with a warning
        (stale_warning) if `warn`. With a delayed update's writeback pending the model lags the masters by that
        update: nothing tells that lag from an edit of the model (model.load_state_dict, whose values must win), so
        the model's values are taken and the warning says how to keep the update (synchronize() first)."""
        if self.params_in_swapper:  # the parameters' file holds the masters' cast, unless new weights were stored
            self._refresh_stale_masters_in_swapper(warn)
            return
        stale = self.stale_ranges()
        if stale and warn:
            warnings.warn(stale_warning(self.staged), stacklevel=5)
        self.take_masters(stale)

    def stale_ranges(self) -> set[tuple[int, int]]:
        """The parameters' ranges (partition coordinates) whose device values are not their fp32 masters' cast (not
        with params_in_swapper)."""
        self.wait_written()
        own, ranges, stale = self.own, param_ranges(self.layout), set()
        if self.swapper is not None:  # a read pass compares tile by tile (the pool's memory only)

            def compare(lo: int, hi: int, master: torch.Tensor, *moments: Any) -> None:
                stale.update(differing(master, own[lo:hi], ranges, lo))

            self.swapper.read(compare)
        else:
            master = self._state[0] if self._state is not None else self._master  # (no moment decoded)
            stale.update(differing(master, own, ranges, 0))
        return stale

    def take_masters(self, ranges: set[tuple[int, int]] | list[tuple[int, int]]) -> None:
        """These ranges' fp32 masters (and staging, which holds the parameters a skipped range keeps) from the
        model's values; a range past this update's part is cut at its end (TwinUpdate's head)."""
        if not ranges:
            return
        self.wait_written()
        own = self.own
        master = self.state()[0] if self.swapper is not None else (
            self._state[0] if self._state is not None else self._master)  # fmt: skip
        to_staging = self.staging_buf is not None and not self.staging_in_place
        if to_staging:
            self.transport.wait(self._staging_read)  # (a copy of the last writeback may still read staging)
        for a, b in sorted(ranges):
            values = own[a:b].cpu()
            master[a:b].copy_(values)
            if to_staging:
                self.staging_buf[a:b].copy_(values)
        self.save_master(master)

    def _refresh_stale_masters_in_swapper(self, warn: bool) -> None:
        """refresh_stale_masters with the 16-bit parameters in the swapper's fourth file: one read pass compares,
        one more pass takes the masters from the file if they differ."""
        stale = []

        def compare(lo: int, hi: int, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                    params: torch.Tensor) -> None:  # fmt: skip
            if not stale and not torch.equal(master.to(params.dtype), params):
                stale.append((lo, hi))

        self.swapper.read(compare)
        if stale:
            if warn:
                warnings.warn(stale_warning(self.staged), stacklevel=5)
            self.refresh_from_model()

    @torch.no_grad()
    def refresh_from_model(self) -> None:
        """Take the fp32 masters from the model's current (device) parameters, e.g. after model.load_state_dict."""
        self.finish_pending(write=False)
        if self.params_in_swapper:  # one pass: the masters from the parameters' file

            def take(lo: int, hi: int, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                     params: torch.Tensor) -> None:  # fmt: skip
                master.copy_(params)

            self.swapper.stream(take)
            return
        own = self.own
        self.wait_written()
        master = self.state()[0]
        master.copy_(own.float().cpu())
        self.save_master(master)
        if self.staging_buf is not None and not self.staging_in_place:  # staging holds the params a skipped range
            self.transport.wait(self._staging_read)  # keeps
            self.staging_buf.copy_(own.cpu())
        self.staged = False  # the device parameters are the truth now

    def close(self) -> None:
        """Stop the background worker (after finish_pending); remove the NVMe scratch files."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self.swapper is not None:
            self.swapper.close()
