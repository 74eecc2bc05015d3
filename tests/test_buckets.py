"""cast / pack / unpack: the Triton kernels (interpreted on the CPU) and the torch path, both exact.

Exact operations are compared bit for bit (assert_bits_equal: -0.0 and every rounding count; NaN only has
to be NaN) against plain torch: (x.float() * scale).to(dtype) and torch.cat([t.flatten() ...]).
"""

import math
import os

import pytest
import torch
from helpers import FP32_EPS, assert_bits_equal, digest

import zo_kernels as zk

triton = pytest.importorskip("triton")
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# On CPU tensors the kernels run in Triton's interpreter (tests/conftest.py sets it without a GPU); with a GPU
# the interpreter is off, and tests/test_gpu.py checks the compiled kernels on CUDA tensors instead.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
IMPLS = ["triton", "torch"] if INTERPRETED else ["torch"]


def poisoned(n, dtype):
    """An output buffer full of NaN: any element a kernel forgets to write fails the comparison."""
    return torch.full((n,), float("nan"), dtype=dtype)


def awkward(n, dtype, seed=0):
    """Random values with the cases a cast must get right mixed in: fp16 overflow, -0.0, subnormals, ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 20, (n,), generator=g).float())
    special = torch.tensor([-0.0, 0.0, 1e-40, -1e-42, 5.96e-8, 2.98e-8, 1e-6, 65504.0, 65519.0, 65520.0,
                            1.00048828125, 1.0009765625, 1.00390625, 3.0e38])  # fmt: skip
    k = min(n, special.numel())
    x[:k] = special[:k]
    return x.to(dtype)


def expected_pack(tensors, dtype, scale, align):
    offsets, total = zk.buckets.layout(tensors, align)
    flat = torch.zeros(total, dtype=dtype)
    for t, off in zip(tensors, offsets):
        flat[off : off + t.numel()] = (t.flatten().float() * scale).to(dtype)
    return flat, offsets


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("in_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_cast_every_dtype_pair(impl, in_dtype, out_dtype, scale):
    x = awkward(4097, in_dtype)
    out = poisoned(4097, out_dtype)
    y = zk.cast(x, out_dtype, scale=scale, out=out, impl=impl)
    assert y is out
    assert_bits_equal(out, (x.float() * scale).to(out_dtype), f"cast {in_dtype}->{out_dtype}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [0, 1, 3, 4097])
def test_cast_sizes_and_shape(impl, n):
    x = awkward(n, torch.float32).reshape(n, 1)
    y = zk.cast(x, torch.bfloat16, impl=impl)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert_bits_equal(y, x.to(torch.bfloat16), "cast")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("in_dtypes", [[torch.float32], [torch.float16], [torch.bfloat16], FLOATS], ids=str)
@pytest.mark.parametrize("align", [1, 16, 64])
def test_pack_matches_torch_cat(impl, in_dtypes, out_dtype, align):
    sizes = [1, 3, 0, 4097, 17, 1]
    tensors = [awkward(n, in_dtypes[i % len(in_dtypes)], seed=i) for i, n in enumerate(sizes)]
    flat_ref, offsets_ref = expected_pack(tensors, out_dtype, 1.0, align)
    out = poisoned(flat_ref.numel() + 5, out_dtype)
    p = zk.pack(tensors, dtype=out_dtype, out=out, align=align, impl=impl)
    assert p.offsets == offsets_ref and all(o % align == 0 for o in p.offsets)
    assert p.flat.data_ptr() == out.data_ptr() and p.flat.numel() == flat_ref.numel()
    assert_bits_equal(p.flat, flat_ref, "flat (gaps included)")
    assert out[flat_ref.numel() :].isnan().all(), "wrote past the bucket"
    if align == 1 and len(in_dtypes) == 1 and in_dtypes[0] == out_dtype:
        assert_bits_equal(p.flat, torch.cat([t.flatten() for t in tensors]), "torch.cat")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
def test_pack_flag_and_sum_sq(impl, out_dtype):
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=g) * 10 for n in (1, 4097, 300)] + [torch.randn(33).half()]
    scale = 0.37
    p = zk.pack(tensors, dtype=out_dtype, scale=scale, impl=impl)
    assert p.found_inf.dtype == torch.bool and p.found_inf.dim() == 0 and not p.found_inf.item()
    assert p.sum_sq.dtype == torch.float32 and p.sum_sq.dim() == 0
    ref = sum(((t.double() * torch.tensor(scale, dtype=torch.float32).double()) ** 2).sum() for t in tensors)
    # fp32 summation: each partial of a 1024-block tree (10 levels), then one add per block and per tensor.
    n_adds = 10 + sum(math.ceil(t.numel() / 1024) for t in tensors) + len(tensors)
    assert abs(p.sum_sq.item() - ref.item()) <= 2 * n_adds * FP32_EPS * ref.item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "value, out_dtype, flagged",
    [
        (70000.0, torch.float16, True),  # overflows fp16 only
        (70000.0, torch.bfloat16, False),
        (70000.0, torch.float32, False),
        (65519.0, torch.float16, False),  # rounds down to 65504
        (65520.0, torch.float16, True),  # rounds up to inf
        (float("nan"), torch.float32, True),
        (float("inf"), torch.bfloat16, True),
        (-float("inf"), torch.float16, True),
        (3.0e38, torch.bfloat16, False),
    ],
)
def test_found_inf(impl, value, out_dtype, flagged):
    tensors = [torch.randn(2000), torch.tensor([1.0, value, 2.0]), torch.randn(5)]
    p = zk.pack(tensors, dtype=out_dtype, impl=impl)
    assert p.found_inf.item() is flagged
    assert_bits_equal(p.flat, expected_pack(tensors, out_dtype, 1.0, 1)[0], "flat")


@pytest.mark.parametrize("impl", IMPLS)
def test_scale_overflow_sets_flag(impl):
    t = torch.full((10,), 300.0, dtype=torch.float16)
    assert not zk.pack([t], impl=impl).found_inf.item()
    assert zk.pack([t], scale=65536.0, impl=impl).found_inf.item()  # 300 * 2^16 overflows fp16


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_list_and_zero_size(impl):
    p = zk.pack([], impl=impl)
    assert p.flat.numel() == 0 and p.offsets == () and not p.found_inf.item() and p.sum_sq.item() == 0.0
    z = [torch.empty(0), torch.empty(0, 3)]
    p = zk.pack(z, align=16, impl=impl)
    assert p.flat.numel() == 0 and p.offsets == (0, 0) and p.sum_sq.item() == 0.0
    zk.unpack(p.flat, z, offsets=p.offsets, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_thousand_small_tensors_one_call(impl):
    g = torch.Generator().manual_seed(4)
    dtypes = FLOATS
    tensors = [torch.randn(i % 13 + (i % 3 == 0), generator=g).to(dtypes[i % 3]) for i in range(1000)]
    out = poisoned(sum(t.numel() for t in tensors), torch.bfloat16)
    p = zk.pack(tensors, dtype=torch.bfloat16, out=out, impl=impl)
    assert_bits_equal(p.flat, torch.cat([t.flatten().to(torch.bfloat16) for t in tensors]), "1000 tensors")
    back = [torch.full_like(t, float("nan")) for t in tensors]
    zk.unpack(p.flat, back, offsets=p.offsets, impl=impl)
    for i, (b, t) in enumerate(zip(back, tensors)):
        assert_bits_equal(b, t.to(torch.bfloat16).to(t.dtype), f"tensor {i}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("flat_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("align", [1, 64])
def test_unpack_of_pack_round_trips(impl, flat_dtype, align):
    tensors = [awkward(n, dt, seed=n) for n, dt in zip([1, 3, 4097, 0, 40], FLOATS + FLOATS)]
    p = zk.pack(tensors, dtype=flat_dtype, align=align, impl=impl)
    back = [torch.full_like(t, float("nan")) for t in tensors]
    zk.unpack(p.flat, back, offsets=p.offsets, impl=impl)
    for i, (b, t) in enumerate(zip(back, tensors)):
        assert_bits_equal(b, t.to(flat_dtype).to(t.dtype), f"tensor {i}")


@pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors needs the interpreter (off with a GPU)")
def test_unpack_default_offsets_are_contiguous():
    tensors = [torch.randn(3), torch.randn(4)]
    flat = torch.arange(7, dtype=torch.float32)
    zk.unpack(flat, tensors, impl="triton")
    assert torch.equal(tensors[0], flat[:3]) and torch.equal(tensors[1], flat[3:])


@pytest.mark.parametrize("impl", IMPLS)
def test_offsets_beyond_2_pow_31_elements(impl):
    """A segment starting past element 2^31 (4 GiB of bf16, never touched but for one page): int64 offsets."""
    flat = torch.empty(2**31 + 64, dtype=torch.bfloat16)
    off = 2**31 + 5
    src = torch.randn(10).to(torch.bfloat16)
    flat[off : off + 10] = src
    dst = torch.full((10,), float("nan"))
    zk.unpack(flat, [dst], offsets=[off], impl=impl)
    assert_bits_equal(dst, src.float(), "segment past 2^31")


# ---------------------------------------------------------------- bad input: clear error, nothing written


def _bad_pack_cases():
    ok = [torch.randn(5), torch.randn(7)]
    cases = [
        ("out-dtype", dict(out=torch.zeros(12, dtype=torch.float16)), TypeError, "out has dtype"),
        ("out-small", dict(out=torch.zeros(11)), ValueError, "out has 11 elements, needs at least 12"),
        ("out-2d", dict(out=torch.zeros(3, 4)), ValueError, "out must be 1-D"),
        ("out-strided", dict(out=torch.zeros(24)[::2]), ValueError, "out must be contiguous"),
        ("devices", dict(tensors=[ok[0], torch.empty(3, device="meta")]), ValueError, r"tensors\[1\] is on meta"),
        ("int", dict(tensors=[ok[0], torch.ones(3, dtype=torch.int32)]), TypeError, r"tensors\[1\] must be float32"),
        ("align-0", dict(align=0), ValueError, "align must be >= 1"),
        ("align-float", dict(align=2.0), TypeError, "align must be an int"),
        ("dtype-int8", dict(dtype=torch.int8), TypeError, "dtype must be"),
        ("scale-nan", dict(scale=float("nan")), ValueError, "scale must be finite"),
        ("single-tensor", dict(tensors=ok[0]), TypeError, "tensors must be a list"),
        ("noncontig", dict(tensors=[torch.randn(4, 4).t()]), ValueError, r"tensors\[0\] must be contiguous"),
        ("impl", dict(impl="cuda"), ValueError, "impl must be one of"),
    ]
    return [pytest.param({"tensors": ok, **kw}, exc, match, id=name) for name, kw, exc, match in cases]


@pytest.mark.parametrize("kwargs, exc, match", _bad_pack_cases())
def test_pack_bad_input_writes_nothing(kwargs, exc, match):
    tensors = kwargs.pop("tensors")
    watched = [t for t in (list(tensors) if isinstance(tensors, list) else [tensors]) if t.device.type == "cpu"]
    out = kwargs.get("out")
    before = digest(*watched, *([out] if out is not None else []))
    with pytest.raises(exc, match=match):
        zk.pack(tensors, **kwargs)
    assert digest(*watched, *([out] if out is not None else [])) == before


def test_pack_out_overlapping_input_is_refused():
    buf = torch.zeros(20)
    with pytest.raises(ValueError, match="overlap"):
        zk.pack([buf[:5]], out=buf)


def test_unpack_and_cast_bad_input():
    flat = torch.randn(10)
    t = [torch.zeros(4), torch.zeros(4)]
    before = digest(flat, *t)
    for kwargs, exc, match in [
        (dict(offsets=[0, 7]), ValueError, r"offsets\[1\] \+ tensors\[1\].numel\(\) = 11 > flat.numel\(\) = 10"),
        (dict(offsets=[0]), ValueError, "offsets must be a sequence of 2 ints"),
        (dict(offsets=[0, -1]), ValueError, r"offsets\[1\] must be an int >= 0"),
    ]:
        with pytest.raises(exc, match=match):
            zk.unpack(flat, t, **kwargs)
    with pytest.raises(ValueError, match="flat must be 1-D"):
        zk.unpack(flat.reshape(2, 5), t)
    with pytest.raises(ValueError, match="overlap"):
        zk.unpack(flat, [flat[:4]])
    with pytest.raises(TypeError, match="out has dtype"):
        zk.cast(flat, torch.float16, out=torch.zeros(10))
    with pytest.raises(ValueError, match="out has 9 elements, x has 10"):
        zk.cast(flat, torch.float32, out=torch.zeros(9))
    with pytest.raises(TypeError, match="x must be float32"):
        zk.cast(torch.ones(3, dtype=torch.int64), torch.float16)
    assert digest(flat, *t) == before


def test_forcing_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        zk.cast(torch.randn(3), torch.float16, impl="triton")
