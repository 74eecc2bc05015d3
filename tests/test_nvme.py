"""Optimizer state on NVMe: cpu/aio.cpp's engine, the scratch directory and NvmeSwapper (zo_kernels/nvme.py).

Files are checked against plain Python reads of the bytes; the streamed Adam against cpu_adam_step on
in-memory tensors, bit for bit.
"""

from __future__ import annotations

import errno
import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import zo_kernels as zk
from zo_kernels import aio
from zo_kernels.nvme import NvmeSwapper


def _backend_works(name: str) -> bool:
    try:
        aio.make_engine(name)
    except OSError:
        return False
    return True


BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not _backend_works(b), reason=f"{b} refused by this kernel"))
            for b in aio.BACKENDS]  # fmt: skip
HPARAMS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def random_bits(n: int, seed: int = 0) -> torch.Tensor:
    """n fp32 values from random bit patterns (NaNs, infs, -0 and subnormals included)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=gen).to(torch.int32).view(torch.float32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def file_floats(path: str, n: int) -> torch.Tensor:
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read(4 * n)), dtype=torch.float32)


def state_files(s: NvmeSwapper) -> list[str]:
    return [os.path.join(s.path, f"{k}.bin") for k in ("master", "exp_avg", "exp_avg_sq")]


# ------------------------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_round_trip(tmp_path, backend):
    eng = aio.make_engine(backend, chunk_bytes=8192)  # 5 blocks: 3 pieces, the last one short
    nbytes = 5 * aio.ALIGN
    f = aio.open_file(str(tmp_path / "x.bin"), 4 * nbytes)
    src, dst = aio.AlignedBuffer(2 * nbytes), aio.AlignedBuffer(nbytes)
    data = random_bits(nbytes // 4)
    aio.view(src)[nbytes // 4 :].copy_(data)
    eng.wait(eng.write(f, src, nbytes, nbytes, 2 * nbytes))
    with open(f.path, "rb") as fh:
        on_disk = fh.read()
    assert on_disk[: 2 * nbytes] == bytes(2 * nbytes) and on_disk[3 * nbytes :] == bytes(nbytes)
    assert same_bits(torch.frombuffer(bytearray(on_disk[2 * nbytes : 3 * nbytes]), dtype=torch.float32), data)
    eng.wait(eng.read(f, dst, 0, nbytes, 2 * nbytes))
    assert same_bits(aio.view(dst), data)
    assert eng.pending() == 0 and not src.busy and not dst.busy
    f.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_refuses_bad_requests_and_writes_nothing(tmp_path, backend):
    eng = aio.make_engine(backend)
    f = aio.open_file(str(tmp_path / "x.bin"), 4 * aio.ALIGN)
    buf = aio.AlignedBuffer(2 * aio.ALIGN)
    aio.view(buf).fill_(1.0)
    bad = {
        "offset 4 of the buffer": lambda: eng.write(f, buf, 4, aio.ALIGN, 0),
        "file offset 512": lambda: eng.write(f, buf, 0, aio.ALIGN, 512),
        "100 bytes": lambda: eng.write(f, buf, 0, 100, 0),
        "0 bytes": lambda: eng.write(f, buf, 0, 0, 0),
        "past the buffer": lambda: eng.write(f, buf, aio.ALIGN, 2 * aio.ALIGN, 0),
        "past the file": lambda: eng.write(f, buf, 0, 2 * aio.ALIGN, 3 * aio.ALIGN),
        "negative file offset": lambda: eng.write(f, buf, 0, aio.ALIGN, -aio.ALIGN),
    }
    for what, call in bad.items():
        with pytest.raises(ValueError, match=r"pwrite of .* to .*x\.bin refused"):
            call()
        assert eng.pending() == 0, what
    with pytest.raises(TypeError):
        eng.write(f, bytearray(aio.ALIGN), 0, aio.ALIGN, 0)  # only AlignedBuffers: no foreign memory
    h = eng.read(f, buf, 0, aio.ALIGN, 0)
    with pytest.raises(ValueError, match="buffer is used by a request not yet waited on"):
        eng.write(f, buf, aio.ALIGN, aio.ALIGN, 0)  # the same buffer while a read into it is in flight
    with pytest.raises(ValueError, match="cannot close .*x.bin: 1 request"):
        f.close()
    eng.wait(h)
    with pytest.raises(ValueError, match=f"unknown request handle {h}"):
        eng.wait(h)
    with open(f.path, "rb") as fh:
        assert fh.read() == bytes(4 * aio.ALIGN)  # nothing was written by any refused request
    f.close()
    with pytest.raises(ValueError, match="the file is closed"):
        eng.write(f, buf, 0, aio.ALIGN, 0)
    for kwargs, exc in [({"backend": "aio"}, ValueError), ({"depth": 0}, ValueError),
                        ({"chunk_bytes": 1000}, ValueError), ({"depth": 1.5}, TypeError)]:  # fmt: skip
        with pytest.raises(exc):
            aio.make_engine(**{"backend": backend, **kwargs})
    for nbytes in (0, 100):
        with pytest.raises(ValueError, match="nbytes must be a positive multiple of 4096"):
            aio.AlignedBuffer(nbytes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_error_names_operation_and_file(tmp_path, backend):
    eng = aio.make_engine(backend)
    f = aio.open_file(str(tmp_path / "short.bin"), 2 * aio.ALIGN)
    os.truncate(f.path, 0)  # the file shrank under the engine: the read hits its end
    h = eng.read(f, aio.AlignedBuffer(2 * aio.ALIGN), 0, 2 * aio.ALIGN, 0)
    with pytest.raises(OSError, match=r"pread of \d+ bytes at offset 0 of .*short\.bin failed: unexpected end") as e:
        eng.wait(h)
    assert e.value.errno == errno.EIO and e.value.filename == f.path
    with pytest.raises(FileNotFoundError, match="open .* of .*missing/x.bin failed"):
        aio.open_file(str(tmp_path / "missing" / "x.bin"), aio.ALIGN)


# ------------------------------------------------------------------------------------------ the swapper

SIZES = [1, 1023, 1025, 10 * 1024 + 7]  # one element; odd, under a tile; odd, two tiles; many tiles


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_bit_exact(tmp_path, n, backend):
    p, m, v = (random_bits(n, seed) for seed in range(3))
    with NvmeSwapper(n, str(tmp_path), tile_numel=1024, backend=backend) as s:
        s.write_all(p, m, v)
        for path, want in zip(state_files(s), (p, m, v)):
            assert same_bits(file_floats(path, n), want)  # the files hold exactly the values, in order
        out = [torch.full((n,), 7.0) for _ in range(3)]
        s.read_all(*out)
        for got, want in zip(out, (p, m, v)):
            assert same_bits(got, want)
        s.write_all(p)  # exp_avg, exp_avg_sq None: zeros
        s.read_all(*out)
        assert same_bits(out[0], p) and not out[1].any() and not out[2].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", SIZES)
def test_streamed_adam_equals_cpu_adam_step(tmp_path, n, backend):
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    grads = [torch.randn(n, generator=gen) for _ in range(4)]
    with NvmeSwapper(n, str(tmp_path), tile_numel=1024, backend=backend) as s:
        s.write_all(p)
        for step, g in enumerate(grads, 1):
            zk.cpu_adam_step(p, g, m, v, step=step, **HPARAMS)

            def update(lo, hi, P, M, V, g=g, step=step):
                zk.cpu_adam_step(P, g[lo:hi], M, V, step=step, **HPARAMS)

            s.stream(update)
            if step == 2:  # a state_dict round trip in the middle
                out = [torch.empty(n) for _ in range(3)]
                s.read_all(*out)
                s.write_all(*out)
        out = [torch.empty(n) for _ in range(3)]
        s.read_all(*out)
    for name, got, want in zip(("master", "exp_avg", "exp_avg_sq"), out, (p, m, v)):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_compressed_moments_stream_as_in_memory(tmp_path, fmt):
    """state_fmt: the moments live in the files in their format (bf16, or 8-bit codes + one scale per 256); a
    streamed Adam over 3 tiles (the last one short) equals cpu_adam_step on in-memory moments of the format, tile by
    tile (bf16's random bits depend on the call's first element), bit for bit; write_all stores fp32 values as the
    format does (bf16: nearest even; 8-bit: each block's max maps to the top code)."""
    n, tile = 2 * 1024 + 700, 1024
    gen = torch.Generator().manual_seed(5)
    p, m0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    v0 = m0.square()
    if fmt == "bf16":
        m, v = m0.bfloat16(), v0.bfloat16()
        tiles = lambda: [(m[lo : lo + tile], v[lo : lo + tile]) for lo in range(0, n, tile)]  # noqa: E731
    else:
        m, v = (zk.Quantized8bit.empty(n, signed=s) for s in (True, False))
        tiles = lambda: [(m.narrow(lo, min(tile, n - lo)), v.narrow(lo, min(tile, n - lo)))  # noqa: E731
                         for lo in range(0, n, tile)]  # fmt: skip
    with NvmeSwapper(n, str(tmp_path), tile_numel=tile, state_fmt=fmt) as s:
        s.write_all(p.clone(), m0, v0)
        out = [torch.empty(n) for _ in range(3)]
        s.read_all(*out)
        if fmt == "bf16":
            assert torch.equal(out[1], m0.bfloat16().float()) and torch.equal(out[2], v0.bfloat16().float())
            m.copy_(m0)
            v.copy_(v0)
        else:
            for got, x, top in ((out[1], m0, 127), (out[2], v0.sqrt(), 255)):
                blocks = x.split(256)
                assert all(x_b.abs().max() > 0 for x_b in blocks)
                r = got if top == 127 else got.sqrt()
                err = (r - x).abs()
                scale = torch.cat([b.abs().max().expand(len(b)) for b in blocks])
                assert bool((err <= scale / top / 2 * 1.001).all())  # within half a code of each block's scale
            for q, x in zip((m, v), (m0, v0)):
                src = zk.Quantized8bit.from_float(x, signed=q.signed)
                q.codes.copy_(src.codes)
                q.scales.copy_(src.scales)
        names = sorted(os.listdir(s.path))
        assert len([f for f in names if f.endswith(".bin")]) == (3 if fmt == "bf16" else 5), names
        mem_p = p.clone()
        for step in (1, 2, 3):
            g = torch.randn(n, generator=gen)
            for (lo, hi), (tm, tv) in zip(s.tiles, tiles()):
                zk.cpu_adam_step(mem_p[lo:hi], g[lo:hi], tm, tv, step=step, seed=lo, **HPARAMS)
            s.stream(lambda lo, hi, P, M, V, g=g, step=step: zk.cpu_adam_step(P, g[lo:hi], M, V, step=step, seed=lo,
                                                                               **HPARAMS))  # fmt: skip
        s.read_all(*out)
    want_m, want_v = (m.float(), v.float()) if fmt == "bf16" else (m.to_float(), v.to_float())
    assert torch.equal(out[0], mem_p) and torch.equal(out[1], want_m) and torch.equal(out[2], want_v)
    with pytest.raises(ValueError, match="state_fmt"):
        NvmeSwapper(n, str(tmp_path), state_fmt="int4")


def test_stream_pipeline_orders_reads_and_writes(tmp_path):
    # Many small tiles, and a callback whose result depends on the tile's previous value and position: a tile
    # read before its last write landed, or updated before its read did, shows up as a wrong value.
    n, tile = 64 * 1024 + 5, 1024
    seen = []
    with NvmeSwapper(n, str(tmp_path), tile_numel=tile, chunk_bytes=aio.ALIGN) as s:
        s.write_all(torch.arange(n, dtype=torch.float32))
        for k in range(3):
            seen.clear()

            def bump(lo, hi, P, M, V, k=k):
                assert P.numel() == hi - lo
                assert torch.equal(P, torch.arange(lo, hi, dtype=torch.float32) + k)
                assert torch.equal(M, torch.full((hi - lo,), float(k)))
                seen.append((lo, hi))
                P.add_(1)
                M.add_(1)

            s.stream(bump)
            assert seen == [(lo, min(n, lo + tile)) for lo in range(0, n, tile)]


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s*(\d+)", f.read()).group(1))


def _rss_peak_of(fn) -> int:
    """High-water mark of resident memory during fn(), above the resident size before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs")
def test_host_memory_bounded_by_the_pool(tmp_path):
    tile = 16 * 1024
    peaks, pools, rss = {}, {}, {}
    for n in (1 << 22, 1 << 16):  # 48 MiB and 768 KiB of state, a 576 KiB pool in both; the first pays the warm-up
        gc.collect()
        aio.AlignedBuffer.reset_peak()
        base = aio.AlignedBuffer.live_bytes()

        def run(n=n):
            with NvmeSwapper(n, str(tmp_path), tile_numel=tile) as s:
                pools[n] = s.pool_bytes
                s.stream(lambda lo, hi, P, M, V: P.add_(M))

        rss[n] = _rss_peak_of(run)
        peaks[n] = aio.AlignedBuffer.peak_bytes() - base
    assert pools[1 << 16] == pools[1 << 22] == 9 * 4 * tile
    assert peaks[1 << 16] == peaks[1 << 22] == 9 * 4 * tile
    # resident memory: the pool plus a little, the same for both sizes, far below the 48 MiB of state
    assert rss[1 << 22] < 9 * 4 * tile + (4 << 20), rss
    assert abs(rss[1 << 22] - rss[1 << 16]) < (4 << 20), rss


_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from zo_kernels.nvme import NvmeSwapper
    root, marker = sys.argv[1], sys.argv[2]
    s = NvmeSwapper(8 * 1024, root, tile_numel=1024)
    s.write_all(torch.ones(8 * 1024))
    def update(lo, hi, P, M, V):
        if lo == 4 * 1024:
            open(marker, "w").write(s.path)
            time.sleep(60)
        P.mul_(2)
    s.stream(update)
    """
)


def test_scratch_reclaimed_after_sigkill(tmp_path):
    root, marker = tmp_path / "nvme", tmp_path / "marker"
    root.mkdir()
    live = NvmeSwapper(1024, str(root), tile_numel=1024)  # another process's swapper, alive: must stay
    live.write_all(torch.full((1024,), 3.0))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text():
            assert child.poll() is None, "the child exited before the kill"
            assert time.monotonic() < deadline, "the child never reached the middle of its stream"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    left = marker.read_text()
    assert os.path.isdir(left) and sorted(os.listdir(left)) == ["exp_avg.bin", "exp_avg_sq.bin", "lock", "master.bin"]
    half_made = root / f".zo-nvme-new-{child.pid}-abc"  # killed between creating and naming its directory
    half_made.mkdir()
    with NvmeSwapper(1024, str(root), tile_numel=1024) as fresh:
        assert sorted(fresh._scratch.reclaimed) == sorted([left, str(half_made)])
        assert not os.path.exists(left) and not half_made.exists()
        assert os.path.isdir(live.path)
        out = [torch.empty(1024) for _ in range(3)]
        live.read_all(*out)
        assert torch.equal(out[0], torch.full((1024,), 3.0))
        assert sorted(os.listdir(root)) == sorted([os.path.basename(live.path), os.path.basename(fresh.path)])
    live.close()
    assert os.listdir(root) == []


def test_close_and_finalizer_remove_the_files(tmp_path):
    s = NvmeSwapper(3000, str(tmp_path))
    path = s.path
    s.stream(lambda lo, hi, P, M, V: P.add_(1))
    s.close()
    s.close()
    assert not os.path.exists(path) and s.closed
    with pytest.raises(RuntimeError, match="closed"):
        s.stream(lambda *a: None)
    with pytest.raises(RuntimeError, match="closed"):
        s.write_all(torch.zeros(3000))
    s = NvmeSwapper(3000, str(tmp_path))
    path = s.path
    del s
    gc.collect()
    assert not os.path.exists(path)


def test_bad_arguments_refused_before_anything_is_written(tmp_path):
    bad = [
        ((0, str(tmp_path)), {}, ValueError, "numel must be >= 1"),
        ((2.0, str(tmp_path)), {}, TypeError, "numel must be an int"),
        ((10, str(tmp_path)), {"tile_numel": 1000}, ValueError, "tile_numel must be a positive multiple of 1024"),
        ((10, str(tmp_path)), {"tile_numel": 0}, ValueError, "tile_numel"),
        ((10, str(tmp_path / "nope")), {}, ValueError, "is not an existing directory"),
        ((10, str(tmp_path)), {"backend": "libaio"}, ValueError, "backend must be one of"),
        ((10, str(tmp_path)), {"depth": 0}, ValueError, "depth must be in"),
        ((10, str(tmp_path)), {"chunk_bytes": 5000}, ValueError, "chunk_bytes must be a positive multiple"),
        ((10, str(tmp_path)), {"direct": "yes"}, TypeError, "direct must be"),
    ]
    for args, kwargs, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            NvmeSwapper(*args, **kwargs)
    assert os.listdir(tmp_path) == []  # no scratch directory was made
    n = 2048 + 3
    p = random_bits(n)
    with NvmeSwapper(n, str(tmp_path), tile_numel=1024) as s:
        s.write_all(p)
        good = torch.zeros(n)
        refused = [
            (lambda: s.write_all(torch.zeros(n), torch.zeros(n), torch.zeros(n + 1)), ValueError, "exp_avg_sq has"),
            (lambda: s.write_all(torch.zeros(n), torch.zeros(n, dtype=torch.float64)), TypeError, "exp_avg must"),
            (lambda: s.write_all(None), TypeError, "master must be a torch.Tensor"),
            (lambda: s.write_all(torch.zeros(2 * n)[::2]), ValueError, "master must be contiguous"),
            (lambda: s.read_all(good, good, torch.zeros(n)), ValueError, "master and exp_avg overlap"),
            (lambda: s.read_all(torch.zeros(n), torch.zeros(n), torch.zeros(n - 1)), ValueError, "exp_avg_sq has"),
            (lambda: s.stream(None), TypeError, "update_fn must be callable"),
        ]
        for call, exc, msg in refused:
            with pytest.raises(exc, match=msg):
                call()
            assert same_bits(file_floats(state_files(s)[0], n), p)  # unchanged
            assert not file_floats(state_files(s)[1], n).any()


def test_failed_update_marks_the_state_torn(tmp_path):
    n = 8 * 1024
    with NvmeSwapper(n, str(tmp_path), tile_numel=1024) as s:
        s.write_all(torch.zeros(n))

        def fail_at_tile_3(lo, hi, P, M, V):
            if lo == 3 * 1024:
                raise KeyError("boom")
            P.add_(1)

        with pytest.raises(KeyError, match="boom"):
            s.stream(fail_at_tile_3)
        assert s._engine.pending() == 0
        assert "tile 3 of 8 by KeyError" in s.torn
        out = [torch.empty(n) for _ in range(3)]
        with pytest.raises(RuntimeError, match="torn"):
            s.stream(lambda *a: None)
        with pytest.raises(RuntimeError, match="torn"):
            s.read_all(*out)
        s.write_all(torch.full((n,), 5.0))
        assert s.torn is None
        s.read_all(*out)
        assert torch.equal(out[0], torch.full((n,), 5.0))


def test_fill_and_read_tile_by_tile(tmp_path):
    """fill: the state from a callback per tile (no full-size tensor); read: a pass that writes nothing back."""
    n = 5 * 1024 + 7
    p, m, v = (random_bits(n, seed) for seed in range(3))
    with NvmeSwapper(n, str(tmp_path), tile_numel=1024) as s:
        seen = []

        def fill(lo, hi, P, M, V):
            seen.append((lo, hi))
            for dst, src in zip((P, M, V), (p, m, v)):
                dst.copy_(src[lo:hi])

        s.fill(fill)
        assert seen == s.tiles
        for path, want in zip(state_files(s), (p, m, v)):
            assert same_bits(file_floats(path, n), want)
        got = []

        def read(lo, hi, P, M, V):
            got.append((lo, hi, P.clone()))
            P.fill_(0.0)  # a read pass writes nothing back, whatever it does to the pool

        s.read(read)
        assert [(lo, hi) for lo, hi, _ in got] == s.tiles
        assert same_bits(torch.cat([t for _, _, t in got]), p)
        assert same_bits(file_floats(state_files(s)[0], n), p)

        def fail_at_tile_2(lo, hi, P, M, V):
            if lo == 2 * 1024:
                raise KeyError("boom")
            fill(lo, hi, P, M, V)

        with pytest.raises(KeyError, match="boom"):
            s.fill(fail_at_tile_2)
        assert "tile 2 of 6" in s.torn
        with pytest.raises(RuntimeError, match="torn"):
            s.read(read)
        s.fill(fill)
        assert s.torn is None
        for bad, name in ((s.fill, "fill_fn"), (s.read, "read_fn")):
            with pytest.raises(TypeError, match=name):
                bad(None)


def _no_direct_file(path, nbytes, direct):
    """A filesystem that refuses O_DIRECT the way tmpfs did before Linux 6.6: open fails with EINVAL."""
    if direct:
        raise OSError(errno.EINVAL, f"open (O_DIRECT) of {path} failed: Invalid argument", path)
    return aio._cpu.AioFile(path, nbytes, False)


def test_fallback_without_o_direct(tmp_path, monkeypatch):
    # No filesystem here refuses O_DIRECT (tmpfs takes it since Linux 6.6), so the refusal is simulated.
    monkeypatch.setattr(aio, "AioFile", _no_direct_file)
    n = 3 * 1024 + 1
    with pytest.raises(OSError, match="O_DIRECT"):
        NvmeSwapper(n, str(tmp_path), direct=True)
    assert os.listdir(tmp_path) == []  # the scratch directory went with the failure
    with pytest.warns(RuntimeWarning, match="refuses O_DIRECT") as record:
        s = NvmeSwapper(n, str(tmp_path), tile_numel=1024)
    assert len(record) == 1 and not s.direct
    with s:
        p = random_bits(n)
        s.write_all(p)
        s.stream(lambda lo, hi, P, M, V: M.copy_(P))
        out = [torch.empty(n) for _ in range(3)]
        s.read_all(*out)
        assert same_bits(out[0], p) and same_bits(out[1], p) and not out[2].any()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)")
def test_on_tmpfs(tmp_path):
    root = "/dev/shm"
    n = 2 * 1024 + 9
    with NvmeSwapper(n, root, tile_numel=1024) as s:  # O_DIRECT or the buffered fallback, whichever tmpfs allows
        p = random_bits(n, 5)
        s.write_all(p, p, p)
        s.stream(lambda lo, hi, P, M, V: V.zero_())
        out = [torch.empty(n) for _ in range(3)]
        s.read_all(*out)
        assert same_bits(out[0], p) and same_bits(out[1], p) and not out[2].any()
        path = s.path
    assert not os.path.exists(path)


def test_a_scratch_dir_that_fails_to_be_made_leaves_nothing(tmp_path, monkeypatch):
    """A bug hunt's find: a full disk while the new scratch directory's lock file got its pid left the half-made
    `.zo-nvme-new-<pid>-*` directory (until another process reclaimed it after this one died) and its lock file
    open. Removed, and the descriptor closed, before the error is raised."""
    from zo_kernels import scratch

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(scratch.os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        scratch.ScratchDir(str(tmp_path))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    fds = [os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{f}")]  # fmt: skip
    assert not [p for p in fds if p.startswith(str(tmp_path))]


def test_a_forked_child_leaves_its_parents_scratch_dir(tmp_path):
    """A bug hunt's find: a child forked from a process holding a scratch directory ran the directory's finalizer
    when it exited normally and removed the parent's live files (the parent trained on unlinked files, and the lock
    that protects them from another process's reclaim meant nothing). Only the process that made it removes it."""
    from zo_kernels import scratch

    d = scratch.ScratchDir(str(tmp_path))
    pid = os.fork()
    if pid == 0:  # the child: what its exit's finalizer does, then out without running the parent's (pytest's) exit
        try:
            d.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.isdir(d.path) and os.listdir(tmp_path) == [os.path.basename(d.path)]
    d.close()
    assert os.listdir(tmp_path) == []


def test_a_child_forked_from_a_process_with_an_nvme_optimizer_exits_cleanly(tmp_path):
    """A review's find: a child forked from a process holding an NVMe optimizer, exiting the normal way, died of
    SIGSEGV: the I/O engine's destructor joined worker threads the child does not have (and the finalizer would
    have waited for the parent's requests and removed the parent's files). The child lets them be; the parent's
    optimizer works on and closes."""
    program = textwrap.dedent(f"""
        import os, sys, torch
        import zo_kernels as zk
        opt = zk.ZeroOffloadAdamW(torch.nn.Linear(8, 8), offload_optimizer="nvme", nvme_dir={str(tmp_path)!r})
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # the normal way: finalizers and destructors run
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert os.listdir({str(tmp_path)!r}), "the parent's scratch directory is gone"
        opt.close()
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split()[-1] == "ok", (run.returncode, run.stderr[-2000:])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_piece_past_one_read_or_write_call_is_refused(backend):
    """A review's find: chunk_bytes of 4 GiB or more were taken; io_uring's 32-bit length made a 4 GiB piece 0
    bytes: a read failed as "unexpected end of file" and a write was queued again for ever (a hang). A piece is at
    most 1 GiB (a read or write call moves at most ~2 GiB), refused at the engine's construction."""
    with pytest.raises(ValueError, match=r"chunk_bytes must be a positive multiple of 4096 up to 1073741824"):
        aio.make_engine(backend, chunk_bytes=1 << 32)
    aio.make_engine(backend, chunk_bytes=1 << 30)


def test_a_forked_child_is_refused_the_parents_engine(tmp_path):
    """A review's find: a forked child's request on its parent's engine was accepted and its wait blocked for ever
    (the workers are the parent's threads). Refused, saying so."""
    eng = aio.make_engine("threads")
    f = aio.open_file(str(tmp_path / "fork.bin"), 1 << 16)
    buf = aio.AlignedBuffer(1 << 16)
    eng.wait(eng.write(f, buf, 0, 1 << 16, 0))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child reports through the pipe and leaves at once, running no cleanup of the parent's)
        said = []
        for call in (lambda: eng.read(f, buf, 0, 1 << 16, 0), eng.drain, eng.pending):
            try:
                call()
                said.append("accepted")
            except RuntimeError as e:
                said.append(str(e)[:100])
        os.write(w, "|".join(said).encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() > deadline:  # (blocked in the wait: the bug)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    said = os.read(r, 1000).decode()
    os.close(r)
    assert said.count("a forked child has none of its threads") == 3, said  # (drain and pending: a review's find)


def test_a_failed_reservation_removes_the_file_it_made(tmp_path):
    """A review's find: AioFile whose block reservation failed (1 PiB: EFBIG or ENOSPC) left the empty file it had
    created. Removed now; a file that was there before is left where it was."""
    path = tmp_path / "huge.bin"
    with pytest.raises(OSError, match="reserving"):
        aio.AioFile(str(path), 1 << 50, False)
    assert os.listdir(tmp_path) == []
    path.write_bytes(b"x" * 4096)
    with pytest.raises(OSError, match="reserving"):
        aio.AioFile(str(path), 1 << 50, False)
    assert path.read_bytes()[:1] == b"x"


def test_a_file_opened_through_a_symbolic_link_creates_its_target(tmp_path):
    """A review's find in this session's change: the create with O_EXCL (so that a failed reservation removes only a
    file it made) does not follow a symbolic link, and a link to a file not yet made failed with ENOENT, where
    O_CREAT made the target before."""
    target, link = tmp_path / "target.bin", tmp_path / "link.bin"
    os.symlink(target, link)
    aio.open_file(str(link), 1 << 16, False).close()
    assert target.stat().st_size == 1 << 16


def test_a_failed_reservation_through_a_link_removes_the_target_it_made(tmp_path):
    """A review's find: through a symbolic link to a missing file, the open made the target, and a failed
    reservation left it (the link is the user's: it stays)."""
    target, link = tmp_path / "target.bin", tmp_path / "link.bin"
    os.symlink(target, link)
    with pytest.raises(OSError, match="reserving"):
        aio.AioFile(str(link), 1 << 50, False)
    assert not target.exists() and link.is_symlink()
