"""tests/matmul16.py, where conftest installed it: 16-bit products within one rounding of float64's, every other
dtype torch's own kernel bit for bit, torch's errors kept."""

import matmul16
import pytest
import torch

pytestmark = pytest.mark.skipif(not matmul16.installed(), reason="not installed (the CPU computes bf16 natively, or "
                                "ZO_TEST_TORCH_MATMUL16=1): torch's own kernels run")  # fmt: skip


def _within_one_rounding(got: torch.Tensor, want64: torch.Tensor, magnitude: torch.Tensor, k: int) -> None:
    """got (16-bit) is want64 rounded once, up to one unit in the last place of the 16-bit format, plus the error of
    k fp32 additions of terms whose absolute values sum to `magnitude` (where the sum cancels, that is the larger)."""
    bound = torch.finfo(got.dtype).eps * want64.abs() + k * torch.finfo(torch.float32).eps * magnitude
    err = (got.double() - want64).abs()
    assert got.dtype in (torch.bfloat16, torch.float16) and (err <= bound).all(), (err - bound).max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_products_are_float64_rounded_once(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 96, generator=g).to(dtype)
    b = torch.randn(80, 96, generator=g).to(dtype).t()  # (transposed: the weight-gradient layout)
    c = torch.randn(80, generator=g).to(dtype)
    a64, b64, c64 = a.double(), b.double(), c.double()
    ab, mag = a64 @ b64, a64.abs() @ b64.abs()
    _within_one_rounding(a @ b, ab, mag, 96)
    _within_one_rounding(torch.mm(a, b), ab, mag, 96)
    got = torch.addmm(c, a, b, beta=0.5, alpha=2.0)
    _within_one_rounding(got, 0.5 * c64 + 2.0 * ab, 0.5 * c64.abs() + 2.0 * mag, 97)
    _within_one_rounding(torch.nn.functional.linear(a, b.t(), c), ab + c64, mag + c64.abs(), 97)
    native = torch.mm(a, b, out=torch.empty(0, dtype=dtype))  # torch's emulated kernel (its out= overload is kept)
    _within_one_rounding(native, ab, mag, 96)  # holds it to the same bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_other_dtypes_are_torchs_kernel_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(s, generator=g, dtype=dtype) for s in ((33, 70), (70, 17), (17,)))
    want = torch.empty(0, dtype=dtype)
    torch.ops.aten.mm.out(a, b, out=want)
    assert torch.equal(torch.mm(a, b), want)
    want_add = torch.empty(0, dtype=dtype)
    torch.ops.aten.addmm.out(c, a, b, beta=0.5, alpha=3.0, out=want_add)
    assert torch.equal(torch.addmm(c, a, b, beta=0.5, alpha=3.0), want_add)


def test_torchs_errors_stay():
    a = torch.ones(2, 3, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        torch.mm(a, torch.ones(4, 2, dtype=torch.bfloat16))  # shapes
    with pytest.raises(RuntimeError):
        torch.mm(a, torch.ones(3, 2))  # dtypes
    x = torch.ones(2, 3, dtype=torch.bfloat16, requires_grad=True)
    (x @ torch.ones(3, 2, dtype=torch.bfloat16)).sum().backward()  # autograd's formulas above the kernel
    assert torch.equal(x.grad, torch.full((2, 3), 2.0, dtype=torch.bfloat16))
