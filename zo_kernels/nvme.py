"""Optimizer state on NVMe: a partition's fp32 master, exp_avg and exp_avg_sq in files, streamed tile by tile.

The update of tile t runs while tile t+1 is read and tile t-1 is written: three slots of three aligned buffers
(one per state tensor) rotate, so host memory is 9 x tile bytes whatever the partition's size.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import aio
from .cpu_adam import _check_tensor, check_no_overlap
from .scratch import ScratchDir

STATE = ("master", "exp_avg", "exp_avg_sq")
SLOTS = 3  # tile t+1 being read, tile t being updated, tile t-1 being written
TILE_MULTIPLE = aio.ALIGN // 4  # fp32 elements per aligned block: tiles start on block boundaries
DEFAULT_TILE_NUMEL = 1 << 20  # 4 MiB per tensor per tile, a 36 MiB pool; 4 pieces of 1 MiB per request

UpdateFn = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor], Any]


def _release(engine: Any, files: list, scratch: ScratchDir) -> None:
    """Wait for every request, close the files, remove the scratch directory (close() and the finalizer)."""
    engine.drain()
    for f in files:
        f.close()
    scratch.close()


class NvmeSwapper:
    """The fp32 master, exp_avg and exp_avg_sq of one partition, kept in files and streamed through a pool.

    The files live in a scratch directory under `nvme_dir` that close() (or the finalizer) removes; if the
    process dies first, the next swapper on the same `nvme_dir` removes it. They start zero-filled.

    Args:
        numel: elements of the partition (>= 1).
        nvme_dir: an existing directory, on the drive that should hold the state.
        tile_numel: elements per tile, a multiple of 1024 (one 4096-byte block of fp32); capped at the
            partition rounded up to 1024. Host memory: 3 slots x 3 tensors x tile_numel x 4 bytes.
        backend, depth, chunk_bytes: the I/O engine (zo_kernels.aio.make_engine).
        direct: O_DIRECT (True), buffered (False), or O_DIRECT where the filesystem takes it, else buffered
            with a warning (None).
        params_dtype: also keep the partition's 16-bit parameters (torch.bfloat16 or torch.float16) in a fourth
            file (ZeRO-Infinity: the parameter shards on NVMe): passes then give fns a fourth view, of that dtype,
            and `read_params` reads ranges of it. tile_numel must then be a multiple of 2048. None: three files.
    """

    def __init__(self, numel: int, nvme_dir: str, *, tile_numel: int = DEFAULT_TILE_NUMEL,
                 backend: str | None = None, depth: int | None = None,
                 chunk_bytes: int = aio.DEFAULT_CHUNK_BYTES, direct: bool | None = None,
                 params_dtype: torch.dtype | None = None) -> None:  # fmt: skip
        for name, v in (("numel", numel), ("tile_numel", tile_numel)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if numel < 1:
            raise ValueError(f"numel must be >= 1, got {numel}")
        if tile_numel < 1 or tile_numel % TILE_MULTIPLE:
            raise ValueError(f"tile_numel must be a positive multiple of {TILE_MULTIPLE}, got {tile_numel}")
        if direct is not None and not isinstance(direct, bool):
            raise TypeError(f"direct must be True, False or None, got {type(direct).__name__}")
        if params_dtype not in (None, torch.bfloat16, torch.float16):
            raise TypeError(f"params_dtype must be torch.bfloat16, torch.float16 or None, got {params_dtype!r}")
        if params_dtype is not None and tile_numel % (2 * TILE_MULTIPLE):
            raise ValueError(f"tile_numel must be a multiple of {2 * TILE_MULTIPLE} with params_dtype, "
                             f"got {tile_numel}")  # fmt: skip
        self.params_dtype = params_dtype
        names = STATE + (("params",) if params_dtype is not None else ())
        self._elem = [4, 4, 4, 2][: len(names)]  # bytes per element of each file
        self.numel = numel
        multiple = TILE_MULTIPLE * (2 if params_dtype is not None else 1)
        self.tile_numel = min(tile_numel, -(-numel // multiple) * multiple)
        self.tiles = [(lo, min(numel, lo + self.tile_numel)) for lo in range(0, numel, self.tile_numel)]
        engine = aio.make_engine(backend, depth, chunk_bytes)  # checks its arguments before any file exists
        scratch = ScratchDir(nvme_dir)
        files: list = []
        try:
            for name, elem in zip(names, self._elem):
                path = os.path.join(scratch.path, f"{name}.bin")
                files.append(aio.open_file(path, aio.round_up(elem * numel), direct))
                direct = files[0].direct  # one warning for all, and one mode
            self._pool = [[aio.AlignedBuffer(e * self.tile_numel) for e in self._elem] for _ in range(SLOTS)]
        except BaseException:
            _release(engine, files, scratch)
            raise
        self._engine, self._files, self._scratch = engine, files, scratch
        dtypes = [torch.float32] * 3 + [params_dtype] * (params_dtype is not None)
        self._views = [[aio.view(b, d) for b, d in zip(slot, dtypes)] for slot in self._pool]
        self._finalizer = weakref.finalize(self, _release, engine, files, scratch)
        self.torn: str | None = None  # why the files no longer hold one consistent state, if they don't
        # one pass or read at a time: they share the pool's buffers and the engine's requests (a background update
        # streams while the caller reads opt.master: the read waits for the pass)
        self._lock = threading.RLock()

    @property
    def path(self) -> str:
        """The scratch directory holding the files."""
        return self._scratch.path

    @property
    def direct(self) -> bool:
        """Whether the files are read and written with O_DIRECT."""
        return self._files[0].direct

    @property
    def pool_bytes(self) -> int:
        """Host memory of the buffer pool: all the memory the swapper holds, whatever `numel`."""
        return sum(b.nbytes for slot in self._pool for b in slot)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def stream(self, update_fn: UpdateFn) -> None:
        """Call update_fn(lo, hi, master, exp_avg, exp_avg_sq[, params]) on each tile [lo, hi), in order, then save
        it (`params`, the 16-bit parameters, only with params_dtype).

        The three tensors are fp32 views of the tile's pool buffers (hi - lo elements, valid during the call
        only), updated in place: e.g. `cpu_adam_step(master, grad[lo:hi], exp_avg, exp_avg_sq, ...)`. Tile
        t+1 is read and tile t-1 written while update_fn runs on tile t. If update_fn or the I/O fails, the
        tiles before it are already saved: the swapper is then `torn` until write_all restores a state.
        """
        if not callable(update_fn):
            raise TypeError(f"update_fn must be callable(lo, hi, master, exp_avg, exp_avg_sq), got "
                            f"{type(update_fn).__name__}")  # fmt: skip
        self._check_usable()
        self._run(update_fn, read=True, write=True)

    def read(self, read_fn: UpdateFn) -> None:
        """Call read_fn(lo, hi, master, exp_avg, exp_avg_sq) on each tile [lo, hi), in order; nothing is written.

        The tensors are fp32 views of the pool (valid during the call only): copy out what is needed, e.g. the
        ranges of a few parameters; host memory stays the pool's whatever `numel`.
        """
        if not callable(read_fn):
            raise TypeError(f"read_fn must be callable(lo, hi, master, exp_avg, exp_avg_sq), got "
                            f"{type(read_fn).__name__}")  # fmt: skip
        self._check_usable()
        self._run(read_fn, read=True, write=False)

    def fill(self, fill_fn: UpdateFn) -> None:
        """Replace the whole state tile by tile: fill_fn(lo, hi, master, exp_avg, exp_avg_sq) writes every element
        of the three fp32 views (their contents before the call are undefined); no full-size tensor is needed."""
        if not callable(fill_fn):
            raise TypeError(f"fill_fn must be callable(lo, hi, master, exp_avg, exp_avg_sq), got "
                            f"{type(fill_fn).__name__}")  # fmt: skip
        if self.closed:
            raise RuntimeError("the NvmeSwapper is closed")
        self._run(fill_fn, read=False, write=True)
        self.torn = None

    def read_all(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Copy the state into the three given fp32 CPU tensors of `numel` elements (for state_dict)."""
        outs = (master, exp_avg, exp_avg_sq)
        for name, t in zip(STATE, outs):
            _check_tensor(t, name, (torch.float32,), self.numel, like="the swapper's numel")
        check_no_overlap(dict(zip(STATE, outs)))

        def copy_out(lo: int, hi: int, *tile: torch.Tensor) -> None:
            for out, src in zip(outs, tile):
                out.view(-1)[lo:hi].copy_(src)

        self.read(copy_out)

    def write_all(self, master: torch.Tensor, exp_avg: torch.Tensor | None = None,
                  exp_avg_sq: torch.Tensor | None = None) -> None:  # fmt: skip
        """Replace the whole state by the given fp32 CPU tensors of `numel` elements (None: zeros); the 16-bit
        parameters (params_dtype) by the masters' cast."""
        ins = (master, exp_avg, exp_avg_sq)
        for name, t in zip(STATE, ins):
            if t is not None or name == "master":
                _check_tensor(t, name, (torch.float32,), self.numel, like="the swapper's numel")

        def copy_in(lo: int, hi: int, *tile: torch.Tensor) -> None:
            for src, dst in zip(ins, tile):
                if src is None:
                    dst.zero_()
                else:
                    dst.copy_(src.view(-1)[lo:hi])
            if len(tile) > 3:  # the 16-bit parameters: the masters' cast
                tile[3].copy_(tile[0])

        self.fill(copy_in)

    def close(self) -> None:
        """Wait for the I/O in flight, close and remove the files and their directory (idempotent)."""
        with self._lock:
            self._finalizer()

    def __enter__(self) -> NvmeSwapper:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self.closed:
            raise RuntimeError("the NvmeSwapper is closed")
        if self.torn:
            raise RuntimeError(f"the state files are torn ({self.torn}); restore a state with write_all")

    def _io(self, op: Callable, slot: int, lo: int, hi: int) -> list[int]:
        return [op(f, buf, 0, aio.round_up(e * (hi - lo)), e * lo)
                for f, buf, e in zip(self._files, self._pool[slot], self._elem)]  # fmt: skip

    def read_params(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Copy the 16-bit parameters [lo, hi) of the partition into `out` (a CPU tensor of params_dtype and hi - lo
        elements), through the pool's buffers (aligned reads); not during a pass."""
        if self.params_dtype is None:
            raise RuntimeError("this NvmeSwapper keeps no parameters (params_dtype=None)")
        self._check_usable()
        if not (0 <= lo <= hi <= self.numel):
            raise ValueError(f"[lo, hi) = [{lo}, {hi}) is not within the partition's {self.numel} elements")
        _check_tensor(out, "out", (self.params_dtype,), hi - lo, like="hi - lo")
        with self._lock:
            self._check_usable()  # (closed or torn while this thread waited)
            self._read_params(lo, hi, out)

    def _read_params(self, lo: int, hi: int, out: torch.Tensor) -> None:
        block = aio.ALIGN // 2  # 16-bit elements per aligned block
        buf, view, f = self._pool[0][3], self._views[0][3], self._files[3]
        pos = lo
        while pos < hi:
            start = pos // block * block  # aligned, and at most one tile long
            end = min(hi, start + self.tile_numel)
            self._engine.wait(self._engine.read(f, buf, 0, aio.round_up(2 * (end - start)), 2 * start))
            out[pos - lo : end - lo].copy_(view[pos - start : end - start])
            pos = end

    def _wait(self, handles: list[int] | None) -> None:
        for h in handles or ():
            self._engine.wait(h)

    def _run(self, fn: Callable, *, read: bool, write: bool) -> None:
        """One pass at a time (see `_lock`)."""
        with self._lock:
            if self.closed or (read and self.torn):  # (closed or torn while this thread waited)
                self._check_usable()
            self._pipeline(fn, read=read, write=write)

    def _pipeline(self, fn: Callable, *, read: bool, write: bool) -> None:
        """The pipeline: tile t in slot t % 3; reads of t+1 and the write of t-1 in flight while fn(t) runs."""
        eng, tiles = self._engine, self.tiles
        reads: list = [None] * SLOTS
        writes: list = [None] * SLOTS
        t = 0
        try:
            if read:
                reads[0] = self._io(eng.read, 0, *tiles[0])
            for t, (lo, hi) in enumerate(tiles):
                s = t % SLOTS
                if read and t + 1 < len(tiles):
                    nxt = (t + 1) % SLOTS
                    self._wait(writes[nxt])  # the slot's last write (tile t-2) must be out before it is refilled
                    writes[nxt] = None
                    reads[nxt] = self._io(eng.read, nxt, *tiles[t + 1])
                self._wait(reads[s] if read else writes[s])
                reads[s] = writes[s] = None
                n = hi - lo
                fn(lo, hi, *(v[:n] for v in self._views[s]))
                if write:
                    writes[s] = self._io(eng.write, s, lo, hi)
            for w in writes:
                self._wait(w)
        except BaseException as e:
            eng.drain()
            if write:
                self.torn = f"a pass stopped at tile {t} of {len(tiles)} by {type(e).__name__}: {e}"
            raise
