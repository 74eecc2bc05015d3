"""Copy streams and the tiled writeback.

Host (runs here): the tiled pipeline's orchestration overhead against the bare kernel. Providers:
`kernel` (one cpu_adam_step writing bf16 params, untiled), `pipeline` (tiled_writeback with a transport
whose copies are no-ops: what tiling and Python cost), `pipeline+copy` (the host transport's real
memcpy of each tile, 4 more bytes per parameter). Bar: pipeline <= 1.05x kernel at 100M parameters.
CUDA (skipped without a GPU; NOT MEASURED): H2D/D2H GB/s against the pinned copy peak, and the fraction
of the writeback hidden behind the CPU update.
Run: pytest bench/test_bench_transport.py   (sizes: $ZO_BENCH_SIZES, default 1e7,1e8)
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
from common import sizes

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
    benchmark.group = f"writeback host n={n:.0e} tile={TILE}"
    benchmark.extra_info.update(provider=provider, numel=n, bytes=28 * n, tile_numel=TILE)
    if provider == "pipeline":
        benchmark.extra_info["bar"] = {"vs": "kernel", "max_vs_baseline": 1.05}
    benchmark.pedantic(run, warmup_rounds=1, rounds=20 if n <= 10_000_000 else 7, iterations=1)
    benchmark.extra_info["GB/s"] = 28 * n / benchmark.stats.stats.min / 1e9


# ---------------------------------------------------------------- CUDA (skipped here)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; not measured (no GPU here)")


@cuda
@pytest.mark.parametrize("direction", ["h2d", "d2h", "peak"])
@pytest.mark.parametrize("n", [1 << 24, 1 << 28])
def test_cuda_copy_bandwidth(benchmark, n, direction):
    from zo_kernels.transport import CudaTransport

    tr = CudaTransport()
    host = tr.pool.take(n, torch.bfloat16)
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    if direction == "peak":  # torch's own pinned copy: the reference peak
        fn = lambda: dev.copy_(host, non_blocking=True)  # noqa: E731
    else:
        fn = (lambda: tr.h2d(dev, host)) if direction == "h2d" else (lambda: tr.d2h(host, dev))

    def run():
        fn()
        torch.cuda.synchronize()

    benchmark.group = f"cuda copy n={n}"
    benchmark.extra_info.update(provider=direction, numel=n, bytes=2 * n)
    benchmark.pedantic(run, warmup_rounds=2, rounds=10, iterations=1)
    benchmark.extra_info["GB/s"] = 2 * n / benchmark.stats.stats.min / 1e9


@cuda
def test_cuda_writeback_hidden_fraction(benchmark):
    from zo_kernels.transport import CudaTransport

    n, tile = 1 << 27, 1 << 22
    tr = CudaTransport()
    b = buffers(n)
    staging = Staging(tr.pool.take(n, torch.bfloat16), tile)
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    compute = timed(lambda: zk.cpu_adam_step(b["p"], b["g"], b["m"], b["v"], step=1, lr=1e-4, param_out=staging.buf))
    copy = timed(lambda: tr.h2d(dst, staging.buf))
    both = timed(lambda: tiled_writeback(tr, b["p"], b["g"], b["m"], b["v"], dst=dst, staging=staging, step=2, lr=1e-4))
    benchmark.extra_info.update(provider="zo", numel=n, compute_s=compute, copy_s=copy, writeback_s=both,
                                hidden_fraction=max(0.0, (compute + copy - both) / copy))  # fmt: skip
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
