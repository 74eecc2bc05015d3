"""Copy transport of the offload step: one small interface, two implementations, one tiled writeback.

- `HostTransport` (device = CPU): plain copies, no pinning. Optionally a background copy thread that plays
  the part of a copy engine (copies run in order, asynchronously, optionally slowed down): that is how the
  ordering rules below are tested on a machine without a GPU.
- `CudaTransport`: the `zo_kernels._cuda` extension (cuda/copy.cu): page-locked host buffers, a D2H and an
  H2D stream (torch.cuda.Stream objects, used through their raw handles), events for ordering.

Ordering rules (both implementations): a copy waits for the work already queued on the compute stream
(its producer, or the forward that reads the destination); `device_wait(event)` makes the compute stream
wait for a copy (its consumer); `wait(event)` blocks the host until it is done.
`tiled_writeback` never overwrites a staging slot before the copy that last read it has finished.
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .cpu_adam import TileSink, bump_version, check_memory, check_no_overlap, is_same_place, plan_adam_step

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class HostPool:
    """A bounded pool of host buffers (page-locked on CUDA), allocated on demand and reused by size.

    Every tensor handed out keeps its block's owner alive, so memory whose owner frees it when collected
    (pinned memory) is never freed under a live view. Copies reading or writing a block leave their events
    on it (`fence`); a block is handed out again, or released, only after they are done.

    Args:
        max_bytes: the pool never holds more than this; a request beyond it raises MemoryError.
        allocate: nbytes -> (address, owner); the owner keeps the memory alive until `release`.
        release: (address, owner) -> None.
        wait: blocks the host until an event is done (the transport's `wait`); None: events are ignored.
    """

    def __init__(self, max_bytes: int, allocate: Callable[[int], tuple[int, Any]],
                 release: Callable[[int, Any], None], wait: Callable[[Any], None] | None = None) -> None:  # fmt: skip
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._allocate, self._release, self._wait = allocate, release, wait
        self._free: dict[int, list[tuple[int, Any]]] = {}  # nbytes -> blocks ready for reuse
        self._live: dict[int, tuple[int, Any]] = {}  # address -> (nbytes, owner) handed out
        self._freed: dict[int, int] = {}  # address -> nbytes of blocks given back and not handed out again
        # their addresses, sorted: which block holds an address is a bisection (a pool of activation checkpoints
        # holds a block per checkpoint, and every copy asks)
        self._live_at: list[int] = []
        self._freed_at: list[int] = []
        self._fences: dict[int, dict[Any, Any]] = {}  # address -> {stream key: last event of a copy on it}
        self.reserved = 0  # bytes allocated from the system (live + free)
        self._lock = threading.Lock()

    def fence(self, t: torch.Tensor, key: Any, event: Any) -> None:
        """A copy on stream `key` reads or writes `t` until `event`: its block is not reused before then.
        Copies on one stream finish in order, so the last event per stream covers the earlier ones."""
        with self._lock:
            addr = self._live_block(t.data_ptr())
            if addr is not None:
                self._fences.setdefault(addr, {})[key] = event

    def events(self, t: torch.Tensor) -> list[Any]:
        """The last event of each stream's copies that read or wrote `t`'s block (none: not a block of this pool)."""
        with self._lock:
            addr = self._live_block(t.data_ptr())
            return [] if addr is None else list(self._fences.get(addr, {}).values())

    def _live_block(self, start: int) -> int | None:
        """The address of the live block holding address `start`, or None (blocks never overlap)."""
        return _block_at(self._live_at, lambda addr: self._live[addr][0], start)

    def _set_freed(self, addr: int, nbytes: int | None) -> None:
        """Mark a block given back (nbytes) or no longer so (None: handed out again, or released)."""
        if nbytes is not None:
            self._freed[addr] = nbytes
            bisect.insort(self._freed_at, addr)
        elif self._freed.pop(addr, None) is not None:
            self._freed_at.pop(bisect.bisect_left(self._freed_at, addr))

    def _drain(self, addr: int) -> None:
        for ev in self._fences.pop(addr, {}).values():
            if self._wait is not None:
                self._wait(ev)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host tensor of `numel` elements of `dtype` (contents undefined)."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise ValueError(f"numel must be a positive int, got {numel!r}")
        if dtype not in _FLOATS:
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        nbytes = numel * dtype.itemsize
        with self._lock:
            blocks = self._free.get(nbytes)
            if blocks:
                addr, owner = blocks.pop()
                self._drain(addr)  # copies still reading or writing it (given back early) finish first
            else:
                if self.reserved + nbytes > self.max_bytes:
                    self._trim(self.reserved + nbytes - self.max_bytes)
                if self.reserved + nbytes > self.max_bytes:
                    live = sum(b for b, _ in self._live.values())
                    raise MemoryError(f"host pool bound of {self.max_bytes} bytes exceeded: {live} bytes in use, "
                                      f"{nbytes} more asked for")  # fmt: skip
                addr, owner = self._allocate(nbytes)
                self.reserved += nbytes
            self._live[addr] = (nbytes, owner)
            bisect.insort(self._live_at, addr)
            self._set_freed(addr, None)
        return _wrap(addr, nbytes, owner).view(dtype)

    def give(self, t: torch.Tensor) -> None:
        """Return a tensor obtained from `take`; it must not be used afterwards."""
        with self._lock:
            addr = t.data_ptr()
            if addr not in self._live:
                raise ValueError("give(): this tensor was not handed out by this pool (or was given back already)")
            nbytes, owner = self._live.pop(addr)
            self._live_at.pop(bisect.bisect_left(self._live_at, addr))
            self._free.setdefault(nbytes, []).append((addr, owner))
            self._set_freed(addr, nbytes)

    @property
    def free_bytes(self) -> int:
        """Bytes of blocks given back and kept for reuse (allocated from the system, not handed out)."""
        with self._lock:
            return self.reserved - sum(b for b, _ in self._live.values())

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in a block handed out by this pool and not given back."""
        with self._lock:
            return self._live_block(t.data_ptr()) is not None

    def check_usable(self, t: torch.Tensor, name: str) -> None:
        """Raise if `t` lies in a buffer of this pool that was given back (a copy into freed memory)."""
        with self._lock:
            if _block_at(self._freed_at, self._freed.__getitem__, t.data_ptr()) is not None:
                raise ValueError(f"{name} lies in a pool buffer that was given back (freed): copy refused")

    def _trim(self, need: int) -> None:
        for nbytes in list(self._free):
            while self._free[nbytes] and need > 0:
                addr, owner = self._free[nbytes].pop()
                self._set_freed(addr, None)
                self._drain(addr)
                self._release(addr, owner)
                self.reserved -= nbytes
                need -= nbytes
            if not self._free[nbytes]:
                del self._free[nbytes]

    def close(self) -> None:
        """Release every block: free ones now, live ones when the last tensor viewing them is gone."""
        with self._lock:
            self._trim(self.reserved)
            for addr, (nbytes, owner) in list(self._live.items()):
                self._drain(addr)
                self._release(addr, owner)
                self.reserved -= nbytes
            self._live.clear()
            self._live_at.clear()


def _block_at(starts: list[int], nbytes: Callable[[int], int], addr: int) -> int | None:
    """The start of the block holding `addr` among disjoint blocks starting at the sorted `starts`, or None."""
    i = bisect.bisect_right(starts, addr) - 1
    return starts[i] if i >= 0 and addr < starts[i] + nbytes(starts[i]) else None


def _wrap(addr: int, nbytes: int, owner: Any) -> torch.Tensor:
    if isinstance(owner, torch.Tensor):
        return owner
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    buf._owner = owner  # the tensor keeps buf alive (buffer protocol), buf the owner: views own their memory
    return torch.frombuffer(buf, dtype=torch.uint8)


class PinnedBlock:
    """Owner of one page-locked allocation: freed (cudaFreeHost) when the last reference is gone.

    The pool and every tensor viewing the block hold a reference; the finalizer does not run at interpreter
    exit (the driver may be gone by then; the process's memory goes with it)."""

    def __init__(self, addr: int, free: Callable[[int], None]) -> None:
        self.addr = addr
        weakref.finalize(self, _quietly, free, addr).atexit = False


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a finalizer has no caller to raise to
        pass


class Event:
    """Completion of one copy. `done()` without blocking; Transport.wait blocks."""

    def __init__(self, handle: Any = None, destroy: Callable[[Any], None] | None = None) -> None:
        self.handle = handle
        if destroy is not None:  # a CUDA event: destroyed when no one holds it (allowed while pending)
            weakref.finalize(self, _quietly, destroy, handle).atexit = False

    def done(self) -> bool:
        h = self.handle
        return True if h is None else h.is_set() if isinstance(h, threading.Event) else _cuda_query(h)


def _check_tiles(tiles: list[tuple[int, int]], numel: int) -> None:
    end = 0
    for i, (a, b) in enumerate(tiles):
        if not end <= a < b <= numel:
            raise ValueError(f"tiles[{i}] = ({a}, {b}): tiles must be ascending, disjoint, non-empty ranges within "
                             f"[0, {numel})")  # fmt: skip
        end = b


def _check_pair(dst: torch.Tensor, src: torch.Tensor) -> None:
    _check_tensor_any(dst, "dst")
    _check_tensor_any(src, "src")
    if dst.dtype != src.dtype:
        raise TypeError(f"dst is {dst.dtype} but src is {src.dtype}; a copy does not convert")
    if dst.numel() != src.numel():
        raise ValueError(f"dst has {dst.numel()} elements ({dst.numel() * dst.element_size()} bytes) but src has "
                         f"{src.numel()} ({src.numel() * src.element_size()} bytes)")  # fmt: skip


def _check_tensor_any(t: Any, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{name} is a negated or conjugated view; pass {name}.resolve_neg() / resolve_conj()")


class Transport:
    """The copy interface the offload step talks to."""

    device: torch.device
    pool: HostPool
    needs_staging: bool = True  # False where host memory is the device's: updates may write in place
    closed: bool = False  # close() was called: copies are refused

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Queue dst (device) <- src (host). src must stay unchanged until the event is done."""
        raise NotImplementedError

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Queue dst (host) <- src (device), after the work already queued on the compute stream."""
        raise NotImplementedError

    def h2d_tiles(self, dst: torch.Tensor, src: torch.Tensor, tiles: list[tuple[int, int]],
                  on_tile: Callable[[int, int, Event], None] | None = None) -> list[Event]:  # fmt: skip
        """Queue dst[a:b] <- src[a:b] for each tile (a, b), in order (ascending, disjoint, non-empty, within both):
        one event per tile, given to on_tile(a, b, event) as soon as its copy is queued (so a failure part-way leaves
        the copies already queued known). The same as one h2d per tile; a transport may check and order them once."""
        _check_tiles(tiles, min(dst.numel(), src.numel()))
        events = []
        for a, b in tiles:
            events.append(self.h2d(dst[a:b], src[a:b]))
            if on_tile is not None:
                on_tile(a, b, events[-1])
        return events

    def tile_sink(self, dst: torch.Tensor, src: torch.Tensor) -> TileSink | None:
        """A C tile sink queueing the H2D copy of each finished tile of src to dst, or None (copies from Python)."""
        return None

    def check_h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Raise what h2d(dst, src) would raise for its endpoints, copying nothing (a caller that writes src first
        checks before it writes)."""

    def record_h2d(self) -> Event:
        """An event after every H2D copy queued so far (those queued by a C tile sink included)."""
        return Event()

    def _check_open(self) -> None:
        """A closed transport takes no copy (it would run at once, or through given-back pinned memory)."""
        if self.closed:
            raise RuntimeError("this transport was closed: make a new one")

    def h2d_after(self, events: Iterable[Event]) -> None:
        """The H2D copies queued from now on start only once these copies are done (D2H copies of this transport
        into the host memory they read), without blocking the host where the transport can order its copy streams
        (CUDA: the H2D stream waits for the events). This default blocks the host until they are done."""
        self.wait_all(events)

    def wait(self, event: Event | None) -> None:
        """Block the host until the copy is done."""
        raise NotImplementedError

    def device_wait(self, event: Event | None) -> None:
        """Make the device's compute stream wait for the copy (no host block on CUDA)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for every copy queued so far."""
        raise NotImplementedError

    def record(self) -> list[Event]:
        """Events after every copy queued so far, on every copy stream: waiting for all of them is synchronize(),
        later (and from any thread)."""
        self.synchronize()  # (a transport that cannot record: the copies are done when this returns)
        return []

    def wait_all(self, events: Iterable[Event]) -> None:
        """Block the host until every copy of `events` is done (from any thread)."""
        for ev in events:
            self.wait(ev)


class HostTransport(Transport):
    """device = CPU: copies are plain memcpy. With `copy_thread`, copies run in order on a background
    thread (a stand-in copy engine), each delayed by `copy_delay_s`; that is for tests of ordering.

    Args:
        pool_bytes: bound of the host buffer pool.
        copy_thread: run copies asynchronously on one background thread.
        copy_delay_s: sleep before each copy on that thread (makes transfers dominate compute): seconds,
            or a callable (dst, src) -> seconds.
    """

    def __init__(self, pool_bytes: int = 1 << 40, *, copy_thread: bool = False,
                 copy_delay_s: float | Callable[[torch.Tensor, torch.Tensor], float] = 0.0) -> None:  # fmt: skip
        self.device = torch.device("cpu")
        self.needs_staging = False
        self.pool = HostPool(pool_bytes, _host_alloc, lambda addr, owner: None, wait=self.wait)
        self.copy_delay_s = copy_delay_s if callable(copy_delay_s) else float(copy_delay_s)
        self._queue: queue.Queue | None = None
        self._last: Event = Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if copy_thread:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._worker, args=(self._queue,), name="zo-copy", daemon=True)
            self._thread.start()
            _COPY_THREADS.add(self)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def _worker(self, jobs: queue.Queue) -> None:
        while True:
            item = jobs.get()
            if item is None:
                return
            dst, src, ev = item
            try:
                if isinstance(dst, _After):  # h2d_after: the copies behind it wait for another engine's
                    dst.wait()
                elif dst is not None:  # None: a marker (record_h2d, synchronize)
                    delay = self.copy_delay_s(dst, src) if callable(self.copy_delay_s) else self.copy_delay_s
                    if delay:
                        time.sleep(delay)
                    self._copy(dst, src)
            except BaseException as e:  # surfaced by wait()/synchronize()
                self._error = e
            ev.set()

    def check_h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._check_copy(dst, src)

    def _check_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._check_open()
        _check_pair(dst, src)
        for t, name in ((dst, "dst"), (src, "src")):
            if t.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU tensor for HostTransport, got {t.device}")
            self.pool.check_usable(t, name)
        check_no_overlap({"dst": dst, "src": src})

    def _submit(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        self._check_copy(dst, src)
        if self._queue is None:
            self._copy(dst, src)
            return Event()
        ev = self._enqueue(dst, src)
        for t in (dst, src):
            self.pool.fence(t, "copy", ev)  # one queue: one stream
        return ev

    def _enqueue(self, dst: torch.Tensor | None, src: torch.Tensor | None) -> Event:
        self._last = _put(self._queue, dst, src)
        return self._last

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        return self._submit(dst, src)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        return self._submit(dst, src)

    def record_h2d(self) -> Event:
        self._check_open()
        return Event() if self._queue is None else self._enqueue(None, None)

    def h2d_after(self, events: Iterable[Event]) -> None:
        self._check_open()  # (inline or one queue, in order: every D2H queued before is done before a later H2D)

    def wait(self, event: Event | None) -> None:
        if event is not None and isinstance(event.handle, threading.Event):
            if not event.handle.wait(timeout=60.0):
                raise TimeoutError("a host copy did not finish within 60 s")
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("a queued host copy failed") from err

    def device_wait(self, event: Event | None) -> None:
        self.wait(event)  # the CPU's compute stream is the host thread: it can only wait by blocking

    def synchronize(self) -> None:
        self.wait(self._last)

    def record(self) -> list[Event]:
        if type(self).synchronize is not HostTransport.synchronize:  # a subclass that waits for more than this queue
            return super().record()  # and says nothing of record(): synchronized now
        return [self._last]  # (one queue, run in order: its last copy's event covers every earlier one)

    def close(self, timeout_s: float = 10.0) -> None:
        """Let the queued copies finish (up to `timeout_s`) and stop the copy thread; a later copy is refused (it
        would have run at once, ahead of copies still queued)."""
        self.closed = True
        jobs, self._queue = self._queue, None
        self._thread = _stop_worker(jobs, self._thread, timeout_s)
        if self._thread is None:
            _COPY_THREADS.discard(self)


def _put(jobs: queue.Queue, dst: Any, src: torch.Tensor | None) -> Event:
    """Queue a job to a copy engine's thread (a copy, a marker, an _After): the event it sets when done."""
    ev = Event(threading.Event())
    jobs.put((dst, src, ev.handle))
    return ev


def _stop_worker(jobs: queue.Queue | None, thread: threading.Thread | None,
                 timeout_s: float) -> threading.Thread | None:  # fmt: skip
    """End a copy engine's thread after the copies queued to it (up to `timeout_s`): the thread if still running."""
    if jobs is not None:
        jobs.put(None)
    if thread is not None:
        thread.join(timeout=timeout_s)
        if thread.is_alive():
            return thread
    return None


# A daemon thread still inside a copy (torch releases the GIL there) when the interpreter finalizes is stopped by
# pthread_exit as it takes the GIL back, and that unwind through C++ aborts the process ("terminate called without
# an active exception"; measured: 6 of 6 exits with a copy loop running). So every copy thread still running at
# exit is ended first, by an atexit handler, while the interpreter is whole.
_COPY_THREADS: weakref.WeakSet[HostTransport] = weakref.WeakSet()


@atexit.register
def _end_copy_threads() -> None:
    for transport in list(_COPY_THREADS):
        transport.close(timeout_s=60.0)


class CopyEngineTransport(HostTransport):
    """The GPU's data flow on the CPU: a stand-in for CudaTransport that makes a missing wait observable.

    "Device" tensors are ordinary CPU tensors, but host memory is not device memory here: staging is
    required (`needs_staging`), and the host side of every copy must lie in a block of `pool` (the stand-in
    for page-locked memory; CudaTransport refuses pageable memory the same way), the device side must not.
    Every copy is queued to one background thread (a copy engine) and runs later, in order, after an
    injectable delay: it reads its source and writes its destination only then, as a CUDA copy does. So a
    reader that skips `wait`/`device_wait` sees the old destination, a writer that does not wait for a copy
    still reading its source changes what is copied. `device_wait` blocks the host (on the CPU the host
    thread is the compute stream); `wait` blocks the host; `synchronize` waits for every queued copy.

    With `engines=2` (the default) D2H copies run on a second thread, as a GPU's two copy streams: a D2H and an
    H2D copy are not ordered with each other unless a wait or `h2d_after` orders them (one engine: every copy in
    one queue, in order).

    Args:
        pool_bytes: bound of the host buffer pool.
        delay_s: seconds before each copy runs, or a callable (dst, src) -> seconds.
        engines: 2 (an H2D and a D2H copy engine) or 1 (one for both).
    """

    def __init__(self, pool_bytes: int = 1 << 40, *,
                 delay_s: float | Callable[[torch.Tensor, torch.Tensor], float] = 0.0,
                 engines: int = 2) -> None:  # fmt: skip
        if engines not in (1, 2) or isinstance(engines, bool):
            raise ValueError(f"engines must be 1 or 2, got {engines!r}")
        super().__init__(pool_bytes, copy_thread=True, copy_delay_s=delay_s)
        self.needs_staging = True
        self.engines = engines
        self._d2h_queue: queue.Queue | None = None
        self._d2h_thread: threading.Thread | None = None
        self._d2h_last: Event = Event()
        if engines == 2:
            self._d2h_queue = queue.Queue()
            self._d2h_thread = threading.Thread(target=self._worker, args=(self._d2h_queue,), name="zo-copy-d2h",
                                                daemon=True)  # fmt: skip
            self._d2h_thread.start()

    def _check_sides(self, device_side: torch.Tensor, host_side: torch.Tensor, host_name: str) -> None:
        _check_tensor_any(host_side, host_name)
        _check_tensor_any(device_side, "dst" if host_name == "src" else "src")
        if host_side.numel() and not self.pool.holds(host_side):
            raise ValueError(f"{host_name} must be page-locked (a block of transport.pool), or the copy is "
                             "synchronous")  # fmt: skip
        if device_side.numel() and self.pool.holds(device_side):
            raise ValueError(f"{'dst' if host_name == 'src' else 'src'} must be device memory, not a pool block")

    def check_h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._check_sides(dst, src, "src")
        self._check_copy(dst, src)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        self._check_sides(dst, src, "src")
        return self._submit(dst, src)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        self._check_sides(src, dst, "dst")
        if self._d2h_queue is None:
            return self._submit(dst, src)
        self._check_copy(dst, src)
        ev = self._d2h_last = _put(self._d2h_queue, dst, src)
        for t in (dst, src):
            self.pool.fence(t, "d2h", ev)  # (the other engine's copies fence as "copy")
        return ev

    def h2d_after(self, events: Iterable[Event]) -> None:
        self._check_open()
        if self._d2h_queue is None:  # one engine: in order already
            return
        waits = [ev for ev in events if ev is not None and isinstance(ev.handle, threading.Event)]
        if waits:
            self._enqueue(_After(waits), None)

    def synchronize(self) -> None:
        """Wait for every copy queued so far, on both engines."""
        self.wait(self._last)
        self.wait(self._d2h_last)

    def record(self) -> list[Event]:
        if type(self).synchronize is not CopyEngineTransport.synchronize:  # a subclass that waits for more than
            return Transport.record(self)  # these queues and says nothing of record(): synchronized now
        return [self._last, self._d2h_last]  # (each engine runs its queue in order: its last covers the rest)

    def close(self, timeout_s: float = 10.0) -> None:
        jobs, self._d2h_queue = self._d2h_queue, None  # (its copies first: an H2D engine's job may wait for them)
        self._d2h_thread = _stop_worker(jobs, self._d2h_thread, timeout_s)
        super().close(timeout_s)
        if self._d2h_thread is not None:  # still copying: the exit handler closes it again
            _COPY_THREADS.add(self)


class _After:
    """A job of a stand-in copy engine: the copies queued behind it wait for these events (another engine's)."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events

    def wait(self) -> None:
        for ev in self.events:
            if not ev.handle.wait(timeout=60.0):
                raise TimeoutError("a D2H copy an H2D copy was ordered after did not finish within 60 s")


def _host_alloc(nbytes: int) -> tuple[int, torch.Tensor]:
    t = torch.empty(nbytes, dtype=torch.uint8)
    return t.data_ptr(), t


def _cuda_module():
    try:
        from . import _cuda
    except ImportError as e:
        raise RuntimeError("zo_kernels was built without CUDA support (no CUDA compiler at build time); "
                           "reinstall with nvcc on PATH to get zo_kernels._cuda") from e  # fmt: skip
    return _cuda


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (absent from CPU builds)


def _current_stream(index: int) -> int:
    """The calling thread's current CUDA stream on device `index`, as its raw handle (torch's own accessor, the one
    Triton's launcher uses; torch.cuda.current_stream(...).cuda_stream where it is missing)."""
    return _RAW_STREAM(index) if _RAW_STREAM is not None else torch.cuda.current_stream(index).cuda_stream


def _cuda_query(handle: int) -> bool:
    return _cuda_module().event_query(handle)


class CudaTransport(Transport):
    """Pinned host buffers, a D2H and an H2D stream, events: through zo_kernels._cuda (cuda/copy.cu).

    Run on a GPU twice (an H100 and an H200: tests/test_gpu.py, the step benchmarks); its error paths are also tested
    without a device.
    Every stream, event and allocation is made on the transport's device, whatever the current one.

    Args:
        device: the CUDA device ("cuda" or None: the current one).
        pool_bytes: bound of the page-locked host pool.
    """

    def __init__(self, device: torch.device | str | int | None = None, pool_bytes: int = 1 << 36) -> None:
        cu = _cuda_module()
        if cu.device_count() == 0 or not torch.cuda.is_available():
            raise RuntimeError("CudaTransport needs a CUDA device; none is visible (use HostTransport on the CPU)")
        dev = torch.device("cuda") if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {dev}")
        self.device = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        self._cu, self._index = cu, self.device.index
        self.pool = HostPool(pool_bytes, self._host_alloc, lambda addr, owner: None, wait=self.wait)
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self._order = Event(cu.event_create(self._index), cu.event_destroy)  # see _after_compute
        self._order_lock = threading.Lock()
        self._sink_src: list[torch.Tensor] = []  # staging read by C tile sinks since the last record_h2d
        self._registered: dict[int, Any] = {}  # storage address -> its finalizer (register_host)

    def _host_alloc(self, nbytes: int) -> tuple[int, PinnedBlock]:
        addr = self._cu.host_alloc(nbytes, self._index)
        return addr, PinnedBlock(addr, self._cu.host_free)

    def _event(self, stream: torch.cuda.Stream) -> Event:
        ev = Event(self._cu.event_create(self._index), self._cu.event_destroy)
        self._cu.event_record(ev.handle, stream.cuda_stream, self._index)
        return ev

    def _after_compute(self, stream: torch.cuda.Stream) -> None:
        """Order the copy stream after the work queued so far on the calling thread's current (compute) stream, as
        torch's `stream.wait_stream(torch.cuda.current_stream())` does, through one event of the transport's
        recorded again each time (a wait takes the event's last record when it is queued) instead of a new torch
        Event and its Python calls: they were 13.4 of a copy's 30 us of host time on the H100's host (2026-11-28,
        `copy_host_us`). Locked: another thread's record between this record and its wait would order the copy
        after the wrong stream."""
        cu, i = self._cu, self._index
        with self._order_lock:
            cu.event_record(self._order.handle, _current_stream(i), i)
            cu.stream_wait_event(stream.cuda_stream, self._order.handle, i)

    def _check_endpoints(self, dst: torch.Tensor, src: torch.Tensor, to_device: bool) -> None:
        self._check_open()
        _check_pair(dst, src)
        dev, host = (dst, src) if to_device else (src, dst)
        if dev.device != self.device:
            raise ValueError(f"{'dst' if to_device else 'src'} must be on {self.device}, got {dev.device}")
        name = "src" if to_device else "dst"
        if host.device.type != "cpu":
            raise ValueError(f"{name} must be a host tensor, got {host.device}")
        self.pool.check_usable(host, name)
        if host.numel() and self._cu.pointer_kind(host.data_ptr()) != 1:
            raise ValueError(f"{name} must be page-locked (from transport.pool or pinned), or the copy is synchronous")

    def check_h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._check_endpoints(dst, src, True)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, to_device: bool) -> Event:
        self._check_endpoints(dst, src, to_device)
        dev, host = (dst, src) if to_device else (src, dst)
        stream = self.h2d_stream if to_device else self.d2h_stream
        self._after_compute(stream)  # the producer (D2H) or the forward reading dst
        nbytes = dst.numel() * dst.element_size()
        (self._cu.h2d_async if to_device else self._cu.d2h_async)(dst.data_ptr(), src.data_ptr(), nbytes,
                                                                  stream.cuda_stream, self._index)  # fmt: skip
        dev.record_stream(stream)  # the caching allocator must not reuse it (a gradient bucket) while the copy runs
        ev = self._event(stream)
        self.pool.fence(host, "h2d" if to_device else "d2h", ev)
        return ev

    def register_host(self, t: torch.Tensor) -> None:
        """Page-lock the storage of an existing host tensor in place (cudaHostRegister), cheaper than a pinned
        copy of it; unregistered when the storage is freed (not when this tensor object is)."""
        _check_tensor_any(t, "t")
        if t.device.type != "cpu" or t.numel() == 0:
            raise ValueError(f"t must be a non-empty host tensor, got {t.numel()} elements on {t.device}")
        storage = t.untyped_storage()
        addr = storage.data_ptr()
        if addr in self._registered and self._registered[addr].alive:
            return
        self._cu.host_register(addr, storage.nbytes(), self._index)
        fin = weakref.finalize(storage, _quietly, self._cu.host_unregister, addr)
        fin.atexit = False
        self._registered[addr] = fin

    def tile_sink(self, dst: torch.Tensor, src: torch.Tensor) -> TileSink:
        self._check_endpoints(dst, src, True)  # pageable staging would make every tile's copy synchronous
        self._after_compute(self.h2d_stream)  # after the forward reading dst
        dst.record_stream(self.h2d_stream)
        self._sink_src.append(src)
        capsule = self._cu.h2d_tile_sink(dst.data_ptr(), src.data_ptr(), src.element_size(), src.numel(),
                                         self.h2d_stream.cuda_stream, self._index)  # fmt: skip
        return TileSink(capsule, dst, src)

    def record_h2d(self) -> Event:
        ev = self._event(self.h2d_stream)
        for src in self._sink_src:
            self.pool.fence(src, "h2d", ev)
        self._sink_src = []
        return ev

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        return self._copy(dst, src, True)

    def h2d_tiles(self, dst: torch.Tensor, src: torch.Tensor, tiles: list[tuple[int, int]],
                  on_tile: Callable[[int, int, Event], None] | None = None) -> list[Event]:  # fmt: skip
        """The DPU writeback's tiles: the endpoints checked and the copy stream ordered after the compute stream
        once, then one copy and one event per tile (per tile through h2d: ~75 us of host time each on the H200's
        host, 48 ms for the 1.3B GPT's 626 tiles, on the step's critical path)."""
        _check_tiles(tiles, min(dst.numel(), src.numel()))
        self._check_endpoints(dst, src, True)
        stream = self.h2d_stream
        self._after_compute(stream)  # after the forward reading dst
        dst.record_stream(stream)
        d, h, size, raw = dst.data_ptr(), src.data_ptr(), dst.element_size(), stream.cuda_stream
        events: list[Event] = []
        try:
            for a, b in tiles:
                self._cu.h2d_async(d + a * size, h + a * size, (b - a) * size, raw, self._index)
                events.append(self._event(stream))
                if on_tile is not None:
                    on_tile(a, b, events[-1])
        finally:  # (also after a failure part-way) one stream: the last event covers every copy out of src's block
            if events:
                self.pool.fence(src, "h2d", events[-1])
        return events

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        return self._copy(dst, src, False)

    def h2d_after(self, events: Iterable[Event]) -> None:
        self._check_open()
        stream = self.h2d_stream.cuda_stream
        for ev in events:
            if ev is not None and ev.handle is not None:
                self._cu.stream_wait_event(stream, ev.handle, self._index)

    def wait(self, event: Event | None) -> None:
        if event is not None and event.handle is not None:
            self._cu.event_synchronize(event.handle)

    def device_wait(self, event: Event | None) -> None:
        if event is not None and event.handle is not None:
            self._cu.stream_wait_event(_current_stream(self._index), event.handle, self._index)

    def synchronize(self) -> None:
        """Wait for every copy queued so far on both streams (C tile sinks' included)."""
        self.wait_all(self.record())

    def record(self) -> list[Event]:
        return [self._event(self.h2d_stream), self._event(self.d2h_stream)]

    def close(self) -> None:
        """Wait for the copies, then give every pinned block back (freed once no tensor views it); a later copy is
        refused."""
        self.synchronize()
        self.pool.close()
        self.closed = True


def default_transport(device: torch.device) -> Transport:
    """CudaTransport for a CUDA device, HostTransport for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTransport(device)
    if device.type == "cpu":
        return HostTransport()
    raise ValueError(f"no transport for device type {device.type!r} (cuda or cpu)")


class Staging:
    """Host staging for the 16-bit parameters, with the event of the copy that last read each region.

    Full size (buf.numel() >= the partition): tile t is staged at its own place, [start, end).
    A ring (smaller): `buf.numel() // tile_numel` slots; tile t goes to slot t % slots.
    The events persist across steps, so the next step never overwrites a region still being copied.

    Args:
        buf: 1-D host tensor (from transport.pool for CUDA), dtype of the device parameters.
        tile_numel: elements per tile.
    """

    def __init__(self, buf: torch.Tensor, tile_numel: int) -> None:
        _check_tensor_any(buf, "staging buffer")
        if buf.dim() != 1 or buf.device.type != "cpu":
            raise ValueError(f"staging buffer must be a 1-D host tensor, got shape {tuple(buf.shape)} on {buf.device}")
        if isinstance(tile_numel, bool) or not isinstance(tile_numel, int) or tile_numel < 1:
            raise ValueError(f"tile_numel must be an int >= 1, got {tile_numel!r}")
        self.buf, self.tile_numel = buf, tile_numel
        self.events: dict[int | str, Event] = {}  # per tile/slot, or "all" for a C-sink writeback

    def region(self, t: int, start: int, end: int, numel: int) -> tuple[int, torch.Tensor]:
        """(region key, staging view) for tile t = [start, end) of a partition of `numel` elements."""
        if self.buf.numel() >= numel:
            return t, self.buf[start:end]
        slots = self.buf.numel() // self.tile_numel
        if slots < 1:
            raise ValueError(f"staging buffer of {self.buf.numel()} elements holds neither one tile "
                             f"({self.tile_numel}) nor the whole partition ({numel})")  # fmt: skip
        s = t % slots
        return s, self.buf[s * self.tile_numel : s * self.tile_numel + end - start]


def tiled_writeback(
    transport: Transport,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    dst: torch.Tensor,
    staging: Staging,
    timings: dict[str, float] | None = None,
    **adam: Any,
) -> list[Event]:
    """CPU Adam over the host partition, tile by tile; each tile's new 16-bit params go to `dst` (device).

    Tile t: wait for the copy that last read staging slot t % slots, update the tile with the new
    params written into that slot (one pass), queue its H2D copy, and go on to tile t+1 while it runs.
    Where the staging region is the destination itself (host memory is the device) there is no copy; where
    the transport offers a C tile sink and the staging is full size, the whole loop runs in C++.
    With `timings`, the seconds spent inside the kernel are added to timings["kernel"]. Returns the events
    of the copies (the caller makes the compute stream wait on them before the next forward). `adam` goes to
    `plan_adam_step` (step, lr, betas, eps, weight_decay, adamw, bias_correction, grad_scale, threads, isa).
    """
    if not isinstance(transport, Transport):  # checked first: nothing is written before a bad argument is seen
        raise TypeError(f"transport must be a zo_kernels Transport, got {type(transport).__name__}")
    if not isinstance(dst, torch.Tensor) or dst.dtype not in _FLOATS:
        raise TypeError("dst must be an fp32/fp16/bf16 tensor on the device")
    if not dst.is_contiguous():
        raise ValueError("dst must be contiguous")
    check_memory(dst, "dst", written=dst.device.type == "cpu")
    if not isinstance(staging, Staging):
        raise TypeError(f"staging must be a Staging, got {type(staging).__name__}")
    if staging.buf.dtype != dst.dtype:
        raise TypeError(f"staging is {staging.buf.dtype} but dst is {dst.dtype}")
    plan = plan_adam_step(param, grad, exp_avg, exp_avg_sq, out_dtype=dst.dtype, **adam)
    if dst.numel() != plan.numel:
        raise ValueError(f"dst has {dst.numel()} elements, param has {plan.numel}")
    state = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if is_same_place(staging.buf, grad):  # the new params over the gradients they replace (is_same_place)
        del state["grad"]
    check_no_overlap({"staging": staging.buf, **state})
    if dst.device.type == "cpu":  # dst may be the staging itself (host memory is the device), never part of it
        in_place = dst.data_ptr() == staging.buf.data_ptr() and staging.buf.numel() >= plan.numel
        check_no_overlap({"dst": dst, **state, **({} if in_place else {"staging": staging.buf})})
    tile = staging.tile_numel
    _, first = staging.region(0, 0, min(tile, plan.numel), plan.numel)  # raises on a staging buffer too small to use
    if plan.numel and first.data_ptr() != dst.data_ptr():  # (the transport's own refusals, before tile 0 is written)
        transport.check_h2d(dst[: first.numel()], first)
    full = staging.buf.numel() >= plan.numel
    try:
        return _writeback_tiles(transport, plan, dst, staging, timings, full)
    finally:
        bump_version(param, exp_avg, exp_avg_sq, staging.buf, dst)


def _writeback_tiles(transport: Transport, plan: Any, dst: torch.Tensor, staging: Staging,
                     timings: dict[str, float] | None, full: bool) -> list[Event]:  # fmt: skip
    tile = staging.tile_numel
    sink = transport.tile_sink(dst, staging.buf[: plan.numel]) if full and plan.numel else None
    if sink is not None:  # the transport copies from C++: the whole tile loop runs without Python
        transport.wait(staging.events.get("all"))  # the previous step's copies out of this staging
        t0 = time.perf_counter()
        plan.run_tiled(tile, sink, staging.buf[: plan.numel])
        if timings is not None:
            timings["kernel"] = timings.get("kernel", 0.0) + time.perf_counter() - t0
        staging.events["all"] = ev = transport.record_h2d()
        return [ev]
    events = []
    for t, start in enumerate(range(0, plan.numel, tile)):
        end = min(plan.numel, start + tile)
        key, out = staging.region(t, start, end, plan.numel)
        transport.wait(staging.events.get(key))  # never overwrite a region whose copy is still reading it
        t0 = time.perf_counter()
        plan.run(start, end, out)
        if timings is not None:
            timings["kernel"] = timings.get("kernel", 0.0) + time.perf_counter() - t0
        if out.data_ptr() == dst[start:end].data_ptr():
            continue  # the staging is the destination itself (host memory is the device): nothing to copy
        staging.events[key] = ev = transport.h2d(dst[start:end], out)
        events.append(ev)
    return events
