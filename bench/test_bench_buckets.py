"""Triton cast and pack on CUDA: GB/s and the fraction of the device's measured copy bandwidth.

Providers: `zo` (one kernel; pack also sums squares and flags inf/NaN in the same pass), `torch`
(`torch.cat([t.flatten() ...]).to(dtype)` for pack, `(x * scale).to(dtype)` for cast), and `copy`: a
device-to-device copy moving the same bytes (6 per element: 4 read + 2 written, so a copy of 3 bytes per
element, which reads 3 and writes 3), the device's copy bandwidth measured in the same run; "of ceiling"
= copy time / provider time. GB/s counts the 6 bytes per element the op must move, whatever a provider
moves on the way (torch's cat writes and rereads an fp32 copy). CUDA only; NOT MEASURED: no GPU has run it.
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
    """fn, then wait for the device: host time then spans the kernels (each round ends idle)."""

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


def _copy_same_bytes(n: int):
    """A device copy that moves 6n bytes, as a 4-byte -> 2-byte op over n elements does: 3n read, 3n written."""
    src = torch.ones(3 * n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


@pytest.mark.parametrize("provider", ["zo", "torch", "copy"])
@pytest.mark.parametrize("n", SIZES)
def test_pack(benchmark, n, provider):
    tensors = _bucket(n)
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    if provider == "zo":
        fn = lambda: zk.pack(tensors, dtype=torch.bfloat16, out=out)  # noqa: E731
    elif provider == "torch":
        fn = lambda: torch.cat([t.flatten() for t in tensors]).to(torch.bfloat16)  # noqa: E731
    else:
        fn = _copy_same_bytes(n)
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
        fn = _copy_same_bytes(n)
    benchmark.group = f"cast fp32->bf16 n={n}"
    benchmark.extra_info.update(provider=provider, numel=n, bytes=6 * n)
    benchmark.pedantic(_sync(fn), warmup_rounds=3, rounds=20, iterations=1)
    benchmark.extra_info["GB/s"] = 6 * n / benchmark.stats.stats.min / 1e9
