"""Asynchronous O_DIRECT file I/O: the Python face of cpu/aio.cpp (buffers, files, an engine of handles)."""

from __future__ import annotations

import errno
import warnings

import torch

from . import _cpu

ALIGN = _cpu.AIO_ALIGN  # buffer addresses, file offsets and lengths are multiples of it (4096)
BACKENDS = ("threads", "uring")
# Measured on this machine's disk (virtio, ext4), bench/test_bench_nvme.py::test_aio_backends: 1 GiB sequential,
# O_DIRECT, rounds interleaved, best of 3: threads x4 wrote 2.73 GB/s and read 0.95, io_uring x32 2.66 and 0.95,
# plain 64 MiB pwritev/preadv 2.87 and 1.14; 0.05-0.09 CPU s/GB for all. A tie (the disk is the limit; timed
# one after another instead of interleaved, either backend "won" by up to 1.8x). Threads win on where they
# run: io_uring is refused by Docker's default seccomp profile and by kernel.io_uring_disabled, and its queued
# pieces only move when the caller enters the engine. backend="uring" stays for drives where it measures ahead.
DEFAULT_BACKEND = "threads"
DEFAULT_DEPTH = {"threads": 4, "uring": 32}  # threads, or ring entries
DEFAULT_CHUNK_BYTES = 1 << 20  # requests are split into pieces this big that run concurrently

AlignedBuffer = _cpu.AlignedBuffer
AioFile = _cpu.AioFile
AioEngine = _cpu.AioEngine


def make_engine(backend: str | None = None, depth: int | None = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> AioEngine:  # fmt: skip
    """An I/O engine: `backend` "threads" (default) or "uring", `depth` threads or ring entries."""
    backend = DEFAULT_BACKEND if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    depth = DEFAULT_DEPTH[backend] if depth is None else depth
    for name, v in (("depth", depth), ("chunk_bytes", chunk_bytes)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    return AioEngine(backend, depth, chunk_bytes)


def open_file(path: str, nbytes: int, direct: bool | None = None) -> AioFile:
    """Open (creating, blocks reserved) a file of `nbytes` for the engine.

    direct=True: O_DIRECT or OSError; False: buffered; None: O_DIRECT where the filesystem takes it, else
    buffered with a warning (the data then also passes through the page cache).
    """
    if direct is False:
        return AioFile(path, nbytes, False)
    try:
        return AioFile(path, nbytes, True)
    except OSError as e:
        if direct or e.errno != errno.EINVAL:
            raise
        warnings.warn(f"the filesystem of {path} refuses O_DIRECT ({e.strerror}); using buffered I/O, through the "
                      "page cache", RuntimeWarning, stacklevel=2)  # fmt: skip
        return AioFile(path, nbytes, False)


def view(buf: AlignedBuffer, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D tensor over the whole buffer (shares its memory)."""
    return torch.frombuffer(buf, dtype=dtype)


def round_up(nbytes: int) -> int:
    """nbytes rounded up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN
