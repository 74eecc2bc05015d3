"""The test run's 16-bit CPU matmuls, on a CPU without native bf16: fp32 products, rounded once.

Without AVX512-BF16 or AMX (an AVX2-only EPYC, say) torch multiplies bf16 and fp16 matrices on the CPU at ~3 GMAC/s:
the test GPTs' forward + backward took 150 ms, 87% of it in `aten::mm`, and the default run sat at the 10-minute
bound. `install()` registers CPU kernels for `aten::mm` and `aten::addmm` that multiply 16-bit inputs as fp32 (each
product exact: 8- or 11-bit significands) and round the result to the input dtype once, and call torch's own kernel,
through the `out=` overload, for every other dtype (bit for bit torch's). Only the rounding of a 16-bit product may
differ from torch's emulated kernel (it reorders the fp32 sums); nothing under test multiplies matrices (the optimizer
reads gradients, whatever produced them), and the oracle and the offload step run in the same process, so both see
the same products. Subprocesses (torchrun, the CLI, the README's blocks) run torch's own kernels.

conftest.py installs it where `zo_kernels.demo.native_bf16` says the CPU has no native bf16, unless
`ZO_TEST_TORCH_MATMUL16=1`; the run's header says which.
"""

from __future__ import annotations

import torch

_HALF = (torch.bfloat16, torch.float16)
_LIB: torch.library.Library | None = None


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype in _HALF and b.dtype == a.dtype:
        return torch.mm(a.float(), b.float()).to(a.dtype)
    out = torch.empty(0, dtype=a.dtype, device=a.device)  # (torch's out= kernel resizes it, or raises as mm does)
    return torch.mm(a, b, out=out)


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if a.dtype in _HALF and b.dtype == a.dtype == c.dtype:
        return torch.addmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(a.dtype)
    out = torch.empty(0, dtype=a.dtype, device=a.device)
    return torch.addmm(c, a, b, beta=beta, alpha=alpha, out=out)


def installed() -> bool:
    return _LIB is not None


def install() -> None:
    """Register the two kernels for the CPU (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    import warnings

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # ("overriding a previously registered kernel": that is the point)
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("mm", _mm, "CPU")
        lib.impl("addmm", _addmm, "CPU")
    _LIB = lib
