"""Copy streams and the tiled writeback.

Host (runs here): the tiled pipeline's orchestration overhead against the bare kernel. Providers:
`kernel` (one cpu_adam_step writing bf16 params, untiled), `pipeline` (tiled_writeback with a transport
whose copies are no-ops: what tiling and Python cost), `pipeline+copy` (the host transport's real
memcpy of each tile, 4 more bytes per parameter). Bar: pipeline <= 1.05x kernel at 100M parameters.
CUDA (skipped without a GPU; NOT MEASURED): H2D/D2H GB/s of one copy, pinned (zo's CudaTransport pool,
torch's pin_memory) vs pageable, $ZO_BENCH_COPY_MIB MiB (default 64,256,1024); and the hidden fraction of
the tiled writeback at $ZO_BENCH_SIZES params: CPU Adam alone, H2D copy alone, both overlapped.
Run: pytest bench/test_bench_transport.py   (sizes: $ZO_BENCH_SIZES, default 1e7,1e8)
"""

from __future__ import annotations

import gc

import pytest
import torch
from common import size_label, sizes

import zo_kernels as zk
from zo_kernels.transport import HostTransport, Staging, tiled_writeback

SIZES = sizes([10_000_000, 100_000_000])
TILE = 1 << 21  # 2M elements: ~1.3 ms of CPU Adam per tile at 2 threads on this machine
_buffers: dict = {}


class NoCopyTransport(HostTransport):
    """Host transport whose copies do nothing: isolates the pipeline's own cost."""

    def _copy(self, dst, src):
        pass


def buffers(n: int) -> dict:
    if n not in _buffers:
        _buffers.clear()
        gc.collect()
        g = torch.Generator().manual_seed(0)
        _buffers[n] = dict(p=torch.randn(n, generator=g), g=torch.randn(n, generator=g).to(torch.bfloat16),
                           m=torch.zeros(n), v=torch.zeros(n), dst=torch.empty(n, dtype=torch.bfloat16),
                           staging=torch.empty(n, dtype=torch.bfloat16))  # fmt: skip
    return _buffers[n]


@pytest.mark.parametrize("provider", ["kernel", "pipeline", "pipeline+copy"])
@pytest.mark.parametrize("n", SIZES)
def test_host_writeback(benchmark, n, provider):
    b = buffers(n)
    step = [0]
    if provider == "kernel":

        def run():
            step[0] += 1
            zk.cpu_adam_step(b["p"], b["g"], b["m"], b["v"], step=step[0], lr=1e-4, param_out=b["staging"])

    else:
        tr = NoCopyTransport() if provider == "pipeline" else HostTransport()
        staging = Staging(b["staging"], TILE)

        def run():
            step[0] += 1
            tiled_writeback(tr, b["p"], b["g"], b["m"], b["v"], dst=b["dst"], staging=staging, step=step[0], lr=1e-4)
            tr.synchronize()

    run()
    benchmark.group = f"writeback host n={size_label(n)} tile={TILE}"
    # bytes a parameter: the update's 28 (bf16 gradient 2, fp32 param, m, v read and written 24, bf16 params 2) and
    # with the copy its 4 (staging read, destination written)
    nbytes = (32 if provider == "pipeline+copy" else 28) * n
    benchmark.extra_info.update(provider=provider, numel=n, bytes=nbytes, tile_numel=TILE)
    if provider == "pipeline":
        benchmark.extra_info["bar"] = {"vs": "kernel", "max_vs_baseline": 1.05}
    benchmark.pedantic(run, warmup_rounds=1, rounds=20 if n <= 10_000_000 else 7, iterations=1)
    benchmark.extra_info["GB/s"] = nbytes / benchmark.stats.stats.min / 1e9


# ---------------------------------------------------------------- CUDA (skipped here)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; not measured (no GPU here)")
COPY_MIB = sizes([64, 256, 1024], var="ZO_BENCH_COPY_MIB")


def _cuda_timed(fn):
    """fn, then wait for the whole device (every stream, the transport's included)."""

    def run():
        fn()
        torch.cuda.synchronize()

    return run


@cuda
@pytest.mark.parametrize("provider", ["zo_pinned", "torch_pinned", "pageable"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("mib", COPY_MIB)
def test_cuda_copy_bandwidth(benchmark, mib, direction, provider):
    """One copy of `mib` MiB between host and device: zo's CudaTransport (pinned pool, its own streams),
    torch from `pin_memory()` memory (non_blocking), torch from pageable memory (the driver stages it)."""
    from zo_kernels.transport import CudaTransport

    numel = (mib << 20) // 4
    dev = torch.ones(numel, device="cuda")
    tr = CudaTransport() if provider == "zo_pinned" else None
    if tr is not None:
        host = tr.pool.take(numel, torch.float32)
    else:
        host = torch.ones(numel) if provider == "pageable" else torch.empty(numel).pin_memory()
    host.fill_(1.0)  # every page touched before timing
    dst, src = (dev, host) if direction == "h2d" else (host, dev)
    if tr is not None:
        copy = tr.h2d if direction == "h2d" else tr.d2h
        fn = lambda: copy(dst, src)  # noqa: E731
    else:
        pinned = provider == "torch_pinned"
        fn = lambda: dst.copy_(src, non_blocking=pinned)  # noqa: E731
    benchmark.group = f"cuda copy {direction} fp32 n={size_label(numel)}"  # n= : the dashboard's size axis
    benchmark.extra_info.update(provider=provider, numel=numel, mib=mib, bytes=mib << 20)
    try:
        benchmark.pedantic(_cuda_timed(fn), warmup_rounds=2, rounds=10, iterations=1)
    finally:
        if tr is not None:
            tr.close()
    benchmark.extra_info["GB/s"] = (mib << 20) / benchmark.stats.stats.min / 1e9


@cuda
@pytest.mark.parametrize("provider", ["adam", "h2d", "writeback"])
@pytest.mark.parametrize("n", SIZES)
def test_cuda_writeback(benchmark, n, provider):
    """The hidden fraction of the tiled writeback, from three timings in one group: `adam` (CPU Adam alone
    over n params, new bf16 params into the pinned staging), `h2d` (the copy alone of that staging to the
    device) and `writeback` (tiled_writeback: both, each tile's copy running during the next tile's update,
    through CudaTransport's C tile sink as in the optimizer). hidden = 1 - (writeback - max) / min of the
    two: 1 when the shorter one is entirely hidden, 0 when nothing overlaps (bench/summary.py prints it)."""
    from zo_kernels.transport import CudaTransport

    tr = CudaTransport()
    b = buffers(n)
    staging = Staging(tr.pool.take(n, torch.bfloat16), TILE)  # full size: the C tile sink path
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    step = [0]

    def adam():
        step[0] += 1
        zk.cpu_adam_step(b["p"], b["g"], b["m"], b["v"], step=step[0], lr=1e-4, param_out=staging.buf)

    def writeback():
        step[0] += 1
        tiled_writeback(tr, b["p"], b["g"], b["m"], b["v"], dst=dst, staging=staging, step=step[0], lr=1e-4)

    fn = {"adam": adam, "h2d": lambda: tr.h2d(dst, staging.buf), "writeback": writeback}[provider]
    benchmark.group = f"cuda writeback n={size_label(n)} tile={TILE}"
    # bytes a parameter: the update's 28 (see test_host_writeback), the copy's 2 (over PCIe), the writeback's both
    benchmark.extra_info.update(provider=provider, numel=n, bytes={"adam": 28, "h2d": 2, "writeback": 30}[provider] * n,
                                tile_numel=TILE, threads=torch.get_num_threads())  # fmt: skip
    try:
        benchmark.pedantic(_cuda_timed(fn), warmup_rounds=2, rounds=10 if n <= 10_000_000 else 5, iterations=1)
    finally:
        tr.close()
    benchmark.extra_info["GB/s"] = benchmark.extra_info["bytes"] / benchmark.stats.stats.min / 1e9
