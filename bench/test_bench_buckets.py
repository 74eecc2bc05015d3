"""Triton cast and pack on CUDA: GB/s and the fraction of the device's measured copy bandwidth.

Providers: `zo` (one kernel), `torch` (`torch._utils._flatten_dense_tensors` then `.to()`, or `.to()` alone
for cast), and `copy` (a same-size device memcpy: the ceiling). CUDA only; NOT MEASURED: no GPU has run it.
Run: pytest bench/test_bench_buckets.py   (sizes: $ZO_BENCH_SIZES, default 1M..256M elements)
"""

from __future__ import annotations

import pytest
import torch
from common import sizes

import zo_kernels as zk

if not torch.cuda.is_available():
    pytest.skip("CUDA-only benchmark: this machine has no GPU, so these figures are not measured",
                allow_module_level=True)  # fmt: skip

SIZES = sizes([2**20, 2**24, 2**28])
N_TENSORS = 64  # a bucket of this many gradients, sizes spread around the mean


def _sync(fn):
    def run():
        fn()
        torch.cuda.synchronize()

    return run


def _bucket(n: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.rand(N_TENSORS, generator=g, device="cuda") + 0.5
    counts = (w / w.sum() * n).long().clamp(min=1).tolist()
    counts[-1] += n - sum(counts)
    return [torch.randn(c, device="cuda") for c in counts]


@pytest.mark.parametrize("provider", ["zo", "torch", "copy"])
@pytest.mark.parametrize("n", SIZES)
def test_pack(benchmark, n, provider):
    tensors = _bucket(n)
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    if provider == "zo":
        fn = lambda: zk.pack(tensors, dtype=torch.bfloat16, out=out)  # noqa: E731
    elif provider == "torch":
        fn = lambda: torch._utils._flatten_dense_tensors(tensors).to(torch.bfloat16)  # noqa: E731
    else:
        src = torch.empty(n * 6 // 2, dtype=torch.bfloat16, device="cuda")  # 4 B read + 2 B written per element
        dst = torch.empty_like(src)
        fn = lambda: dst.copy_(src)  # noqa: E731
    benchmark.group = f"pack fp32->bf16 n={n}"
    benchmark.extra_info.update(provider=provider, numel=n, bytes=6 * n)
    benchmark.pedantic(_sync(fn), warmup_rounds=3, rounds=20, iterations=1)
    benchmark.extra_info["GB/s"] = 6 * n / benchmark.stats.stats.min / 1e9


@pytest.mark.parametrize("provider", ["zo", "torch", "copy"])
@pytest.mark.parametrize("n", SIZES)
def test_cast(benchmark, n, provider):
    x = torch.randn(n, device="cuda")
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    if provider == "zo":
        fn = lambda: zk.cast(x, torch.bfloat16, scale=0.5, out=out)  # noqa: E731
    elif provider == "torch":
        fn = lambda: (x * 0.5).to(torch.bfloat16)  # noqa: E731
    else:
        src = torch.empty(n * 3, dtype=torch.int16, device="cuda")
        dst = torch.empty_like(src)
        fn = lambda: dst.copy_(src)  # noqa: E731
    benchmark.group = f"cast fp32->bf16 n={n}"
    benchmark.extra_info.update(provider=provider, numel=n, bytes=6 * n)
    benchmark.pedantic(_sync(fn), warmup_rounds=3, rounds=20, iterations=1)
    benchmark.extra_info["GB/s"] = 6 * n / benchmark.stats.stats.min / 1e9
