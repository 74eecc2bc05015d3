"""Optimizer state on NVMe: a partition's fp32 master, exp_avg and exp_avg_sq in files, streamed tile by tile.

The update of tile t runs while tile t+1 is read and tile t-1 is written: three slots of aligned buffers (one per
file) rotate, so host memory is 3 x the bytes of one tile's state whatever the partition's size. The moments are kept
in their format (state_fmt): fp32, bf16, or 8-bit codes with one fp32 scale per 256 elements (zo_kernels.Quantized8bit)
in files of their own, so a compressed format moves fewer bytes to and from the drive.
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
from .quant8 import DEFAULT_BLOCK, Quantized8bit
from .scratch import ScratchDir

STATE = ("master", "exp_avg", "exp_avg_sq")
# the files of each moment format: (name, dtype, partition elements per file element)
FILES = {
    "fp32": (("exp_avg", torch.float32, 1), ("exp_avg_sq", torch.float32, 1)),
    "bf16": (("exp_avg", torch.bfloat16, 1), ("exp_avg_sq", torch.bfloat16, 1)),
    "8bit": (("exp_avg_codes", torch.int8, 1), ("exp_avg_scales", torch.float32, DEFAULT_BLOCK),
             ("exp_avg_sq_codes", torch.uint8, 1), ("exp_avg_sq_scales", torch.float32, DEFAULT_BLOCK)),
}  # fmt: skip
SLOTS = 3  # tile t+1 being read, tile t being updated, tile t-1 being written
TILE_MULTIPLE = aio.ALIGN // 4  # fp32 elements per aligned block: tiles start on block boundaries
DEFAULT_TILE_NUMEL = 1 << 20  # 4 MiB per tensor per tile, a 36 MiB pool; 4 pieces of 1 MiB per request

UpdateFn = Callable[..., Any]  # (lo, hi, master, exp_avg, exp_avg_sq[, params])
Moment = torch.Tensor | Quantized8bit


def as_float(m: Moment) -> torch.Tensor:
    """A moment's values in fp32 (the tensor itself when it is fp32)."""
    return m.to_float() if isinstance(m, Quantized8bit) else m.float()


def assign(dst: Moment, values: torch.Tensor | None) -> None:
    """Store fp32 `values` into a moment in its format (bf16: nearest even; 8-bit: quantized by blocks from dst's
    first element); None: zeros."""
    if not isinstance(dst, Quantized8bit):
        dst.zero_() if values is None else dst.copy_(values)
    elif values is None:
        dst.codes.zero_()
        dst.scales.zero_()
    else:
        q = Quantized8bit.from_float(values.float().contiguous(), signed=dst.signed, block=dst.block)
        dst.codes.copy_(q.codes)
        dst.scales.copy_(q.scales)


def narrow(m: Moment, a: int, b: int) -> Moment:
    """Elements [a, b) of a moment (8-bit: a on a block boundary, b on one or at the end)."""
    return m.narrow(a, b - a) if isinstance(m, Quantized8bit) else m[a:b]


def _release(engine: Any, files: list, scratch: ScratchDir) -> None:
    """Wait for every request, close the files, remove the scratch directory (close() and the finalizer). In a
    forked child (its exit runs the finalizer) only the scratch directory's lock descriptor is closed: the requests,
    files and directory are the parent's."""
    if os.getpid() != scratch.owner:
        scratch.close()
        return
    engine.drain()
    for f in files:
        f.close()
    scratch.close()


class NvmeSwapper:
    """The fp32 master, exp_avg and exp_avg_sq (in format `state_fmt`) of one partition, kept in files and streamed
    through a pool.

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
            and `read_params` reads ranges of it. tile_numel must then be a multiple of 2048. None: no such file.
        state_fmt: the moments' format: "fp32" (two fp32 files), "bf16" (two bf16 files) or "8bit" (exp_avg int8
            codes, exp_avg_sq uint8 codes of sqrt(v), one fp32 scale per 256 elements each: four files; tiles start
            on blocks). Passes give fns the moments in it: fp32 or bf16 views, or Quantized8bit over the codes and
            scales. Each tile is one aligned record per file (record t at t x the record's size).
    """

    def __init__(self, numel: int, nvme_dir: str, *, tile_numel: int = DEFAULT_TILE_NUMEL,
                 backend: str | None = None, depth: int | None = None,
                 chunk_bytes: int = aio.DEFAULT_CHUNK_BYTES, direct: bool | None = None,
                 params_dtype: torch.dtype | None = None, state_fmt: str = "fp32") -> None:  # fmt: skip
        if state_fmt not in FILES:
            raise ValueError(f"state_fmt must be one of {tuple(FILES)}, got {state_fmt!r}")
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
        self.params_dtype, self.state_fmt = params_dtype, state_fmt
        spec = [("master", torch.float32, 1), *FILES[state_fmt]] + [("params", params_dtype, 1)] * (
            params_dtype is not None)
        self.numel = numel
        multiple = TILE_MULTIPLE * (2 if params_dtype is not None else 1)
        self.tile_numel = min(tile_numel, -(-numel // multiple) * multiple)
        self.tiles = [(lo, min(numel, lo + self.tile_numel)) for lo in range(0, numel, self.tile_numel)]
        # per file: (dtype, partition elements per element, element bytes, bytes of a tile's record)
        self._spec = [(d, per, d.itemsize, aio.round_up(d.itemsize * -(-self.tile_numel // per))) for _, d, per in spec]
        engine = aio.make_engine(backend, depth, chunk_bytes)  # checks its arguments before any file exists
        scratch = ScratchDir(nvme_dir)
        files: list = []
        try:
            for (name, *_), nbytes in zip(spec, self._file_bytes()):
                path = os.path.join(scratch.path, f"{name}.bin")
                files.append(aio.open_file(path, nbytes, direct))
                direct = files[0].direct  # one warning for all, and one mode
            self._pool = [[aio.AlignedBuffer(record) for *_, record in self._spec] for _ in range(SLOTS)]
        except BaseException:
            _release(engine, files, scratch)
            raise
        self._engine, self._files, self._scratch = engine, files, scratch
        self._views = [[aio.view(b, d) for b, (d, *_) in zip(slot, self._spec)] for slot in self._pool]
        self.bytes_read = self.bytes_written = 0  # moved to and from the files since construction
        self._finalizer = weakref.finalize(self, _release, engine, files, scratch)
        self.torn: str | None = None  # why the files no longer hold one consistent state, if they don't
        # one pass or read at a time: they share the pool's buffers and the engine's requests (a background update
        # streams while the caller reads opt.master: the read waits for the pass)
        self._lock = threading.RLock()

    @property
    def path(self) -> str:
        """The scratch directory holding the files."""
        return self._scratch.path

    def file_sizes(self) -> dict[str, int]:
        """Each file's size on disk by name ("master.bin", ...); a file unlinked under the swapper (its directory
        deleted while it runs: it still works on the open files) counts its reserved size."""
        sizes = {}
        for f in self._files:
            try:
                sizes[os.path.basename(f.path)] = os.stat(f.path).st_size
            except FileNotFoundError:
                sizes[os.path.basename(f.path)] = f.nbytes
        return sizes

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

        master is an fp32 view of the tile's pool buffer (hi - lo elements, valid during the call only), the
        moments views in their format (fp32 or bf16 tensors, or Quantized8bit), all updated in place: e.g.
        `cpu_adam_step(master, grad[lo:hi], exp_avg, exp_avg_sq, ...)`. Tile
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

        The arguments are views of the pool as in stream() (valid during the call only): copy out what is needed,
        e.g. the ranges of a few parameters; host memory stays the pool's whatever `numel`.
        """
        if not callable(read_fn):
            raise TypeError(f"read_fn must be callable(lo, hi, master, exp_avg, exp_avg_sq), got "
                            f"{type(read_fn).__name__}")  # fmt: skip
        self._check_usable()
        self._run(read_fn, read=True, write=False)

    def fill(self, fill_fn: UpdateFn) -> None:
        """Replace the whole state tile by tile: fill_fn(lo, hi, master, exp_avg, exp_avg_sq) writes every element
        of the views as in stream() (their contents before the call are undefined, `assign` fills a moment); no
        full-size tensor is needed."""
        if not callable(fill_fn):
            raise TypeError(f"fill_fn must be callable(lo, hi, master, exp_avg, exp_avg_sq), got "
                            f"{type(fill_fn).__name__}")  # fmt: skip
        if self.closed:
            raise RuntimeError("the NvmeSwapper is closed")
        self._run(fill_fn, read=False, write=True)
        self.torn = None

    def read_all(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Copy the state into the three given fp32 CPU tensors of `numel` elements (for state_dict; the moments
        dequantized)."""
        outs = (master, exp_avg, exp_avg_sq)
        for name, t in zip(STATE, outs):
            _check_tensor(t, name, (torch.float32,), self.numel, like="the swapper's numel")
        check_no_overlap(dict(zip(STATE, outs)))

        def copy_out(lo: int, hi: int, *tile: Moment) -> None:
            for out, src in zip(outs, tile):
                out.view(-1)[lo:hi].copy_(as_float(src))

        self.read(copy_out)

    def write_all(self, master: torch.Tensor, exp_avg: torch.Tensor | None = None,
                  exp_avg_sq: torch.Tensor | None = None) -> None:  # fmt: skip
        """Replace the whole state by the given fp32 CPU tensors of `numel` elements (None: zeros; the moments
        stored in the format, see `assign`); the 16-bit parameters (params_dtype) by the masters' cast."""
        ins = (master, exp_avg, exp_avg_sq)
        for name, t in zip(STATE, ins):
            if t is not None or name == "master":
                _check_tensor(t, name, (torch.float32,), self.numel, like="the swapper's numel")

        def copy_in(lo: int, hi: int, *tile: Moment) -> None:
            tile[0].copy_(master.view(-1)[lo:hi])
            for src, dst in zip(ins[1:], tile[1:3]):
                assign(dst, None if src is None else src.view(-1)[lo:hi])
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
            raise RuntimeError(f"the state files are torn ({self.torn}); restore a state with write_all (a "
                               "ZeroOffloadAdamW: load a checkpoint, zo_kernels.load_checkpoint or "
                               "opt.load_state_dict)")  # fmt: skip

    def _io(self, op: Callable, slot: int, lo: int, hi: int) -> list[int]:
        t, n = lo // self.tile_numel, hi - lo
        handles = [op(f, buf, 0, aio.round_up(e * -(-n // per)), t * record)
                   for f, buf, (_, per, e, record) in zip(self._files, self._pool[slot], self._spec)]  # fmt: skip
        nbytes = sum(aio.round_up(e * -(-n // per)) for _, per, e, _ in self._spec)
        if op == self._engine.read:
            self.bytes_read += nbytes
        else:
            self.bytes_written += nbytes
        return handles

    def _tile(self, slot: int, n: int) -> list[Moment]:
        """The arguments of a pass's fn for a tile of n elements in `slot`: master, exp_avg, exp_avg_sq[, params]."""
        v = self._views[slot]
        if self.state_fmt != "8bit":
            return [t[:n] for t in v]
        nb, block = -(-n // DEFAULT_BLOCK), DEFAULT_BLOCK
        moments = [Quantized8bit(v[1][:n], v[2][:nb], signed=True, block=block),
                   Quantized8bit(v[3][:n], v[4][:nb], signed=False, block=block)]  # fmt: skip
        return [v[0][:n], *moments, *(t[:n] for t in v[5:])]

    def _file_bytes(self) -> list[int]:
        """Each file's size: a full record per tile, the last one's rounded up to the alignment."""
        lo, hi = self.tiles[-1]
        return [(len(self.tiles) - 1) * record + aio.round_up(e * -(-(hi - lo) // per)) for _, per, e, record in
                self._spec]  # fmt: skip

    @property
    def file_bytes(self) -> int:
        """Bytes of the files together (what the drive holds)."""
        return sum(self._file_bytes())

    @property
    def pass_bytes(self) -> int:
        """Bytes one pass reads (or writes): the whole files."""
        return self.file_bytes

    def read_params(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Copy the 16-bit parameters [lo, hi) of the partition into `out` (a CPU tensor of params_dtype and hi - lo
        elements), through the pool's buffers (aligned reads); not during a pass. Torn files are read too (to hand
        the model back, or gather it to load new weights): each element as the stopped pass left it, old or new."""
        if self.params_dtype is None:
            raise RuntimeError("this NvmeSwapper keeps no parameters (params_dtype=None)")
        if self.closed:
            raise RuntimeError("the NvmeSwapper is closed")
        if not (0 <= lo <= hi <= self.numel):
            raise ValueError(f"[lo, hi) = [{lo}, {hi}) is not within the partition's {self.numel} elements")
        _check_tensor(out, "out", (self.params_dtype,), hi - lo, like="hi - lo")
        with self._lock:
            if self.closed:  # (closed while this thread waited)
                raise RuntimeError("the NvmeSwapper is closed")
            self._read_params(lo, hi, out)

    def _read_params(self, lo: int, hi: int, out: torch.Tensor) -> None:
        block = aio.ALIGN // 2  # 16-bit elements per aligned block
        buf, view, f = self._pool[0][-1], self._views[0][-1], self._files[-1]  # (the parameters' file is the last)
        pos = lo
        while pos < hi:
            start = pos // block * block  # aligned, and at most one tile long
            end = min(hi, start + self.tile_numel)
            self._engine.wait(self._engine.read(f, buf, 0, aio.round_up(2 * (end - start)), 2 * start))
            self.bytes_read += aio.round_up(2 * (end - start))
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
                fn(lo, hi, *self._tile(s, hi - lo))
                if write:
                    writes[s] = self._io(eng.write, s, lo, hi)
            for w in writes:
                self._wait(w)
        except BaseException as e:
            eng.drain()
            if write:
                self.torn = f"a pass stopped at tile {t} of {len(tiles)} by {type(e).__name__}: {e}"
            raise
