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
from zo_kernels.versions import triton_too_old

triton = pytest.importorskip("triton")
from zo_kernels.kernels.pack import BLOCK, CHUNK  # noqa: E402  (the interpreter's smaller constants, with it)

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# On CPU tensors the kernels run in Triton's interpreter (tests/conftest.py sets it without a GPU); with a GPU
# the interpreter is off, and tests/test_gpu.py checks the compiled kernels on CUDA tensors instead.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
IMPLS = ["triton", "torch"] if INTERPRETED else ["torch"]
TRITON_TOO_OLD = triton_too_old(triton.__version__)


@pytest.fixture(autouse=True)
def _triton_new_enough(request):
    """The kernels' cases skip under a Triton older than the oldest they are checked with (the torch path runs)."""
    spec = getattr(request.node, "callspec", None)
    if TRITON_TOO_OLD and spec is not None and spec.params.get("impl") == "triton":
        pytest.skip(f"{TRITON_TOO_OLD}: zo_kernels takes the torch path there")


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


# The interpreter runs a program in ~20-40 ms on a loaded 2-core machine: 120 tensors through it (300 in
# test_pack_many_mixed_tensors_equals_cat), 1000 through the torch path (or the compiled kernels, on a GPU).
@pytest.mark.parametrize("impl, n", [(i, 1000 if i == "torch" or not INTERPRETED else 120) for i in IMPLS])
def test_thousand_small_tensors_one_call(impl, n):
    g = torch.Generator().manual_seed(4)
    dtypes = FLOATS
    tensors = [torch.randn(i % 13 + (i % 3 == 0), generator=g).to(dtypes[i % 3]) for i in range(n)]
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
@pytest.mark.parametrize("impl", IMPLS)
def test_unpack_default_offsets_are_contiguous(impl):
    tensors = [torch.randn(3), torch.randn(4)]
    flat = torch.arange(7, dtype=torch.float32)
    zk.unpack(flat, tensors, impl=impl)
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
        zk.unpack(flat, [flat[:4]], offsets=[4])
    # without offsets: the dense bucket only (a new user unpacked an align=64 bucket so, and got its gaps' zeros)
    with pytest.raises(ValueError, match=r"flat has 10 elements, the tensors 8: without offsets= .*Packed.offsets"):
        zk.unpack(flat, t)
    grads = [torch.randn(4097), torch.randn(3, 5, dtype=torch.float16)]
    p = zk.pack(grads, dtype=torch.bfloat16, align=64)
    back = [torch.zeros_like(g) for g in grads]
    with pytest.raises(ValueError, match="without offsets="):
        zk.unpack(p.flat, back)
    assert all(not b.any() for b in back)
    zk.unpack(p.flat, back, offsets=p.offsets)
    assert all(torch.equal(b, g.to(torch.bfloat16).to(g.dtype)) for b, g in zip(back, grads))
    # segments that overlap (offsets wrong for these tensors) are refused, naming both
    with pytest.raises(ValueError, match=r"the segments of tensors\[0\] and tensors\[1\] overlap"):
        zk.unpack(p.flat, back, offsets=[0, 10])
    assert digest(flat, *t) == before
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


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter is off (a GPU)")
@pytest.mark.skipif(bool(TRITON_TOO_OLD), reason=f"{TRITON_TOO_OLD}: its interpreter is not used")
def test_interpreter_reads_a_kernel_scalar_as_an_index():
    """A kernel scalar (a 1-element array in the interpreter) as a `range` bound: Triton 3.6's interpreter fails
    under numpy 2.4 unless tests/interpreter_compat.py (applied by conftest) patched it."""
    from interpreter_compat import _index_fails
    from triton.runtime import interpreter

    assert not _index_fails(interpreter)


# ---------------------------------------------------------------- launch plans: many tensors, chunks, reuse


def _mixed(n_tensors, seed, big=False, plain=False):
    """Odd sizes (some over several of a program's CHUNK elements when big), mixed dtypes, some tensors 4 or 2 bytes off
    a 16-byte boundary (a head before the aligned interior); awkward values, or plain randn ones (finite squares)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_tensors):
        n = int(torch.randint(1, 5 * CHUNK if big else 300, (1,), generator=g))
        skew = i % 3  # elements of the buffer skipped: the tensor's address is skew elements past an aligned one
        if plain:
            buf = torch.randn(n + skew, generator=g).to(FLOATS[i % 3])
        else:
            buf = awkward(n + skew, FLOATS[i % 3], seed=seed + i)
        out.append(buf[skew:])
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n, align, flat_skew", [(300, 1, 1), (60, 8, 0), (60, 64, 0)])
def test_pack_many_mixed_tensors_equals_cat(impl, n, align, flat_skew):
    tensors = _mixed(n, seed=align)
    ref, offsets = expected_pack(tensors, torch.bfloat16, 1.0, align)
    buf = poisoned(ref.numel() + flat_skew + 3, torch.bfloat16)
    out = buf[flat_skew:]  # flat_skew = 1: no segment's flat side is 16-byte aligned where its tensor's is
    p = zk.pack(tensors, dtype=torch.bfloat16, out=out, align=align, impl=impl)
    assert p.offsets == offsets
    assert torch.equal(p.flat, ref), "pack != torch.cat of the casts (gaps zero)"
    assert buf[flat_skew + ref.numel() :].isnan().all() and (flat_skew == 0 or buf[0].isnan())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("out_dtype, align", [(torch.bfloat16, 1), (torch.float32, 8), (torch.float16, 1)], ids=str)
def test_pack_and_unpack_across_programs(impl, out_dtype, align):
    """Tensors of several chunks, unaligned addresses: head, whole blocks, last block, gap."""
    tensors = _mixed(3, seed=7, big=True) + [awkward(2 * CHUNK + 5, torch.float32, seed=9)[1:]]
    ref, _ = expected_pack(tensors, out_dtype, 0.75, align)
    p = zk.pack(tensors, dtype=out_dtype, scale=0.75, align=align, impl=impl)
    assert torch.equal(p.flat, ref)
    back = [torch.full_like(t, float("nan")) for t in tensors]
    zk.unpack(p.flat, back, offsets=p.offsets, impl=impl)
    for i, (b, t) in enumerate(zip(back, tensors)):
        assert torch.equal(b, (t.float() * 0.75).to(out_dtype).to(t.dtype)), f"tensor {i}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("where", ["head", "head+1", "block", "chunk", "tail"])
@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan"), 1e5])
def test_flag_anywhere_in_a_long_tensor(impl, where, value):
    n = 2 * CHUNK + 77
    where = {"head": 0, "head+1": 1, "block": BLOCK + 5, "chunk": CHUNK + 3, "tail": n - 1}[where]
    t = (torch.randn(n + 1) * 0.01)[1:]  # 4 bytes off: a 3-element head in chunk 0
    t[where] = value
    p = zk.pack([torch.randn(7), t], dtype=torch.float16, impl=impl)  # 1e5 overflows fp16
    assert p.found_inf.item() is True
    t[where] = 0.5
    assert zk.pack([torch.randn(7), t], dtype=torch.float16, impl=impl).found_inf.item() is False


@pytest.mark.parametrize("impl", IMPLS)
def test_sum_sq_is_deterministic_and_fp32_accurate(impl):
    tensors = _mixed(6, seed=11, big=True, plain=True)
    a = zk.pack(tensors, dtype=torch.float32, impl=impl).sum_sq
    b = zk.pack(tensors, dtype=torch.float32, impl=impl).sum_sq
    assert a.view(torch.int32).item() == b.view(torch.int32).item(), "two calls, two different sums"
    ref = sum((t.double() ** 2).sum() for t in tensors).item()
    n = sum(t.numel() for t in tensors)
    assert abs(a.item() - ref) <= n * FP32_EPS * ref


@pytest.mark.parametrize("impl", IMPLS)
def test_plan_reused_then_invalidated_by_new_tensors(impl):
    """The plan keeps its table while the addresses repeat and rebuilds it when they change: a stale table would
    read the first tensors (still alive, other values) and this would fail."""
    first = _mixed(20, seed=1)
    plan = zk.buckets.plan(first, dtype=torch.float32, align=8)
    for _ in range(3):
        p = plan.pack(first, impl=impl)
        assert torch.equal(p.flat, expected_pack(first, torch.float32, 1.0, 8)[0])
    if impl == "triton":
        assert plan.uploads == 1, "the table was uploaded again for the same tensors"
    first[4].mul_(2.0)  # in place: same address, new values; nothing is cached but the addresses
    assert torch.equal(plan.pack(first, impl=impl).flat, expected_pack(first, torch.float32, 1.0, 8)[0])
    second = [awkward(t.numel(), t.dtype, seed=100 + i) for i, t in enumerate(first)]
    p = plan.pack(second, impl=impl)
    assert torch.equal(p.flat, expected_pack(second, torch.float32, 1.0, 8)[0]), "a stale plan was used"
    if impl == "triton":
        assert plan.uploads == 2
    back = [torch.full_like(t, float("nan")) for t in second]
    plan.unpack(p.flat, back, impl=impl)
    assert all(torch.equal(b, t.float().to(t.dtype)) for b, t in zip(back, second))


@pytest.mark.parametrize("impl", [i for i in IMPLS if i == "triton"])
def test_new_addresses_rewrite_one_table_in_place(impl):
    """Addresses that move every call (a step's gradients where the caching allocator put them elsewhere) rewrite the
    plan's one table in place: the same device table, no new allocation per upload, and every call packs the
    tensors it was given (alternating between two sets, each reused after the other: a table not rewritten, or
    rewritten before the last launch read it, would pack the other set's values)."""
    first = _mixed(12, seed=3)
    second = [awkward(t.numel(), t.dtype, seed=300 + i) for i, t in enumerate(first)]
    plan = zk.buckets.plan(first, dtype=torch.float32, align=8)
    out = torch.empty(plan.total, dtype=torch.float32, device=first[0].device)
    tables = set()
    for i in range(6):
        tensors = (first, second)[i % 2]
        plan.pack(tensors, out=out, impl=impl)
        assert torch.equal(out, expected_pack(tensors, torch.float32, 1.0, 8)[0]), f"call {i} packed stale addresses"
        tables.add(plan._table.data_ptr())
    assert plan.uploads == 6 and len(tables) == 1, (plan.uploads, len(tables))


def test_plan_refuses_other_tensors_before_writing():
    ts = [torch.randn(5), torch.randn(7, dtype=torch.float16)]
    plan = zk.buckets.plan(ts, dtype=torch.float32)
    out = torch.zeros(12)
    bad = [
        ([torch.randn(6), ts[1]], ValueError, r"tensors\[0\] is torch.float32 with 6 elements; the plan was built"),
        ([ts[0], ts[1].float()], ValueError, r"tensors\[1\] is torch.float32 with 7"),
        ([ts[0]], ValueError, "has 1 tensors, the plan 2"),
        ([ts[0], torch.randn(7, 2, dtype=torch.float16)[:, 0]], ValueError, r"tensors\[1\] must be contiguous"),
        ([ts[0], "x"], TypeError, r"tensors\[1\] must be a torch.Tensor"),
        ([ts[0], torch.empty(7, dtype=torch.float16, device="meta")], ValueError, r"tensors\[1\] is on meta"),
        ([ts[0], ts[1]], ValueError, "out and a tensor of tensors overlap"),
    ]
    for tensors, exc, match in bad:
        o = torch.cat([ts[0], torch.zeros(7)]) if "overlap" in match else out
        if "overlap" in match:
            tensors = [o[:5], ts[1]]
        before = digest(o)
        with pytest.raises(exc, match=match):
            plan.pack(tensors, out=o)
        assert digest(o) == before
    with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] overlap"):
        buf = torch.zeros(12)
        zk.buckets.plan([buf[:5], buf[3:10]]).unpack(torch.zeros(12), [buf[:5], buf[3:10]])


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_reads_tensors_sharing_memory_unpack_refuses_them(impl):
    """pack only reads: the same tensor twice, or views that overlap, pack as copies of what they see (a new user's
    list with one tensor twice was refused). unpack writes: refused, naming both, nothing written. `out` overlapping
    any of them is refused, also where only a long tensor spanning a later shorter one covers it."""
    x = torch.randn(7)
    p = zk.pack([x, x], dtype=torch.float32, impl=impl)
    assert torch.equal(p.flat, torch.cat([x, x]))
    buf = torch.randn(100)
    ts = [buf[:100], buf[10:20], buf[30:40]]  # the first spans the others
    plan = zk.buckets.plan(ts, dtype=torch.float32)
    assert torch.equal(plan.pack(ts, impl=impl).flat, torch.cat([t.clone() for t in ts]))
    before = digest(buf)
    with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] overlap in memory; .* to be written"):
        plan.unpack(torch.zeros(plan.total), ts, impl=impl)
    assert digest(buf) == before
    big = torch.zeros(200)
    inner = [big[:100], big[10:20], big[30:40]]
    with pytest.raises(ValueError, match="out and a tensor of tensors overlap"):
        plan.pack(inner, out=big[50:], impl=impl)  # inside inner[0] only, past inner[1] and inner[2]
    assert not big.any()


@pytest.mark.parametrize("guarded", [True, False], ids=["layout guard", "passes only"])
def test_plan_refuses_other_tensors_after_good_calls(monkeypatch, guarded):
    """After good calls the plan reads only addresses while its layout guard (one C++ call) holds; every list the
    full check refuses must still be refused, with the same message and nothing written. 'passes only': a torch
    whose guard fails its self-test (the plan keeps its passes)."""
    from zo_kernels.kernels import layout_guard

    if not guarded:
        monkeypatch.setattr(layout_guard, "_WORKS", False)
    ts = [torch.randn(5), torch.randn(7, dtype=torch.float16)]
    plan = zk.buckets.plan(ts, dtype=torch.float32)
    out = torch.zeros(12)
    for _ in range(3):
        assert torch.equal(plan.pack(ts, out=out).flat, torch.cat([ts[0], ts[1].float()]))
    if guarded and layout_guard.guard(ts) is not None:
        assert plan.full_checks == 1, "the layout guard did not spare the full check of the same tensors"
    else:
        assert plan.full_checks == 3
    bad = [
        ([torch.randn(6), ts[1]], ValueError, r"tensors\[0\] is torch.float32 with 6 elements; the plan was built"),
        ([ts[0], ts[1].float()], ValueError, r"tensors\[1\] is torch.float32 with 7"),
        ([ts[0], torch.randn(7, 2, dtype=torch.float16)[:, 0]], ValueError, r"tensors\[1\] must be contiguous"),
        ([ts[0], "x"], TypeError, r"tensors\[1\] must be a torch.Tensor"),
        ([ts[0], None], TypeError, r"tensors\[1\] must be a torch.Tensor, got NoneType"),
        ([torch.empty(5, device="meta"), ts[1]], ValueError, r"tensors\[0\] is on meta; the plan is for .* cpu"),
        ([ts[0], torch.empty(7, dtype=torch.float16, device="meta")], ValueError, r"tensors\[1\] is on meta"),
    ]
    for tensors, exc, match in bad:
        before = digest(out)
        with pytest.raises(exc, match=match):
            plan.pack(tensors, out=out)
        assert digest(out) == before
        assert torch.equal(plan.pack(ts, out=out).flat, torch.cat([ts[0], ts[1].float()]))  # the guard is back
    # negated views: read (resolved) by pack, refused by unpack, whatever the guard held before
    neg = torch._neg_view(ts[1])
    assert torch.equal(plan.pack([ts[0], neg], out=out).flat, torch.cat([ts[0], -ts[1].float()]))
    plan.unpack(out, [ts[0].clone(), ts[1].clone()])
    with pytest.raises(ValueError, match=r"tensors\[1\] is a negated view"):
        plan.unpack(out, [ts[0].clone(), torch._neg_view(ts[1].clone())])
    # another layout of the same sizes and dtypes is checked in full and accepted (then guarded)
    other = [ts[0].clone().reshape(5, 1), ts[1].clone()]
    assert torch.equal(plan.pack(other, out=out).flat, torch.cat([ts[0], ts[1].float()]))
    # the same layout at new addresses: the new memory is checked (overlap with out refused)
    o = torch.cat([ts[0], torch.zeros(7)])
    with pytest.raises(ValueError, match="out and a tensor of tensors overlap"):
        plan.pack([o[:5], ts[1]], out=o)
    # the apart check is skipped only for the same out and the same addresses as the last good call: the same
    # tensors with another out that overlaps them, and the same out with tensors inside it, are refused
    plan.pack([o[:5], ts[1]], out=out)
    with pytest.raises(ValueError, match="out and a tensor of tensors overlap"):
        plan.pack([o[:5], ts[1]], out=o)
    with pytest.raises(ValueError, match="out and a tensor of tensors overlap"):
        plan.pack([out[:5], ts[1]], out=out)


@pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors needs the interpreter (off with a GPU)")
def test_host_work_per_call_is_independent_of_the_tensor_count(monkeypatch):
    """The host side of a GPU-style pack call (the plan reused, the launch stubbed): the same Python lines run for
    64 tensors as for 640, one launch, no table rebuilt or uploaded, so the per-call cost is a constant plus a few
    C-level passes over the list. Deterministic (lines counted, not time); the time is printed (run with -s;
    bench/test_bench_buckets.py::test_host_time_per_call prints it too)."""
    import sys
    import time

    from zo_kernels.kernels import pack as kpack

    launches = []
    monkeypatch.setattr(kpack, "pack", lambda *a, **k: launches.append(a))
    lines = {}
    for n in (64, 640):
        ts = [torch.randn(100 + i) for i in range(n)]
        plan = zk.buckets.plan(ts, dtype=torch.bfloat16, align=8)
        out = torch.empty(plan.total, dtype=torch.bfloat16)
        plan.pack(ts, out=out, impl="triton")  # first call: tables built and uploaded
        count = [0]

        def tracer(frame, event, arg, count=count):
            if event == "line":
                count[0] += 1
            return tracer

        launches.clear()
        sys.settrace(tracer)
        try:
            plan.pack(ts, out=out, impl="triton")
        finally:
            sys.settrace(None)
        assert len(launches) == 1 and plan.uploads == 1
        lines[n] = count[0]
        best = min(_timed(plan, ts, out, time) for _ in range(200))
        print(f"\nhost time per pack call, {n} tensors, launch stubbed: {best * 1e6:.1f} us (best of 200)")
    assert lines[64] == lines[640], f"Python lines per call grow with the tensor count: {lines}"


def _timed(plan, ts, out, time):
    t0 = time.perf_counter()
    plan.pack(ts, out=out, impl="triton")
    return time.perf_counter() - t0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_pack_into_running_totals_equals_adding_each_calls_results(impl, out_dtype):
    """into=(sum_sq, found_inf): each call adds its Σx² to the running sum (one fp32 addition, as `sum_sq +=
    packed.sum_sq` after a plain call would) and ORs its flag, in place; the buckets are the plain calls' bit for
    bit, and the result holds the caller's two tensors (the offload step's buckets, with no allocation per call)."""
    g = torch.Generator().manual_seed(11)
    calls = [[torch.randn(n, generator=g) * 3 for n in (5000, 17)], [torch.randn(1, generator=g)],
             [torch.randn(40, generator=g), torch.tensor([1.0, float("inf")])], [torch.randn(300, generator=g)]]
    sum_sq, found = torch.tensor(0.75), torch.tensor(False)
    want_sum, want_found = torch.tensor(0.75), torch.tensor(False)
    for k, tensors in enumerate(calls):
        plain = zk.pack(tensors, dtype=out_dtype, scale=0.5, impl=impl)
        got = zk.pack(tensors, dtype=out_dtype, scale=0.5, impl=impl, into=(sum_sq, found))
        want_sum += plain.sum_sq
        want_found |= plain.found_inf
        assert got.sum_sq is sum_sq and got.found_inf is found
        assert_bits_equal(got.flat, plain.flat, f"call {k}")
        assert_bits_equal(sum_sq, want_sum, f"sum after call {k}")
        assert found.item() is want_found.item() is (k >= 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_step_is_pack_into_the_same_buffers_call_after_call(impl):
    """plan.pack_step (the offload step's call): the same bucket and totals as pack(..., out=, into=) gives, call
    after call, with the gradients at new addresses some calls; the same `out` view and totals are trusted after
    the first call, the tensors are still checked (a wrong one refused, nothing written), and another out is
    checked again (one overlapping the tensors refused)."""
    g = torch.Generator().manual_seed(5)
    sizes = (5000, 17, 300)
    plan = zk.buckets.plan([torch.randn(n) for n in sizes], dtype=torch.bfloat16, align=8)
    plan.impl = impl
    buf, ref_buf = (torch.empty(plan.total * 4 + 9, dtype=torch.bfloat16) for _ in range(2))  # (out: all of it)
    out, ref_out = buf[:], ref_buf[:]
    totals, want = (torch.tensor(0.5), torch.tensor(False)), (torch.tensor(0.5), torch.tensor(False))
    kept = [torch.randn(n, generator=g) for n in sizes]
    for k in range(5):
        ts = kept if k % 2 else [torch.randn(n, generator=g) * (k + 1) for n in sizes]  # (new addresses on even k)
        if k == 3:
            ts = [ts[0], torch.tensor([float("nan")] * 17), ts[2]]
        assert plan.pack_step(ts, out, totals, scale=0.25) is None
        plan.pack(ts, scale=0.25, out=ref_out, into=want)
        assert_bits_equal(buf[: plan.total], ref_buf[: plan.total], f"call {k}")
        assert_bits_equal(totals[0], want[0], f"sum after call {k}")
        assert totals[1].item() is want[1].item() is (k >= 3)
    before = (buf.clone(), totals[0].clone())
    with pytest.raises(ValueError, match=r"tensors\[1\] is torch.float32 with 18 elements"):
        plan.pack_step([kept[0], torch.randn(18), kept[2]], out, totals)
    inside = buf[plan.total * 2 : plan.total * 2 + 10000].view(torch.float32)  # the trusted out's memory
    with pytest.raises(ValueError, match="out and a tensor of tensors overlap"):  # tensors at new addresses in it
        plan.pack_step([inside, kept[1], kept[2]], out, totals)
    with pytest.raises(ValueError, match="overlap"):  # a new out: checked as pack checks it
        whole = torch.zeros(plan.total * 4, dtype=torch.bfloat16)
        as32 = whole.view(torch.float32)  # (the tensors read what the new out would write)
        plan.pack_step([as32[:5000], as32[5000:5017], torch.randn(300)], whole[: plan.total], totals)
    assert_bits_equal(buf, before[0], "the bucket after the refusals")
    assert_bits_equal(totals[0], before[1], "the sum after the refusals")  # (NaN since call 3: bits, not ==)
    moved = torch.zeros(plan.total, dtype=torch.bfloat16)  # the trusted out re-pointed (set_): the new memory is
    out.set_(moved)  # written, as pack writes it (the old memory was written before, found by a review)
    plan.pack_step(kept, out, totals)
    plan.pack(kept, out=ref_out, into=want)
    assert_bits_equal(moved, ref_buf[: plan.total], "the re-pointed out")
    assert_bits_equal(buf, before[0], "the memory out left")
    out.set_(buf)
    gone = torch.zeros(plan.total, dtype=torch.bfloat16)
    view = gone[:]
    plan.pack_step(kept, view, totals)
    gone.untyped_storage().resize_(0)  # its storage resized away: refused as pack refuses it (it wrote through a
    with pytest.raises(ValueError, match="storage"):  # dangling pointer: a crash on the CPU path)
        plan.pack_step(kept, view, totals)
    before = (buf.clone(), totals[0].clone())
    other = torch.zeros(plan.total, dtype=torch.bfloat16)  # another out, apart: written, the trusted one not
    plan.pack_step(kept, other, totals)
    plan.pack(kept, out=ref_out, into=want)
    assert_bits_equal(other, ref_buf[: plan.total], "another out")
    assert_bits_equal(buf, before[0], "the first out, after another was given")


@pytest.mark.parametrize("into, exc, match", [
    (lambda: [torch.tensor(0.0), torch.tensor(False)], TypeError, "into must be a tuple"),
    (lambda: (torch.tensor(0.0, dtype=torch.float64), torch.tensor(False)), ValueError, r"into\[0\] \(sum_sq\)"),
    (lambda: (torch.zeros(1), torch.tensor(False)), ValueError, r"into\[0\] \(sum_sq\) must be a 0-dim"),
    (lambda: (torch.tensor(0.0), torch.tensor(0)), ValueError, r"into\[1\] \(found_inf\)"),
    (lambda: (torch.tensor(0.0), torch.tensor(False, device="meta")), ValueError, r"into\[1\].*on cpu"),
    (lambda: (torch.tensor(0.0, requires_grad=True), torch.tensor(False)), RuntimeError, "requires grad"),
    (lambda: (torch.zeros(2)[0], torch.zeros(2).view(torch.bool)[0]), None, None),  # (a control: two buffers)
    (lambda: _aliased(), ValueError, "two tensors of their own"),
    (lambda: (_resized(torch.tensor(0.0)), torch.tensor(False)), ValueError, r"into\[0\].*storage holds 0 bytes"),
    (lambda: (torch.tensor(0.0)._neg_view(), torch.tensor(False)), ValueError, r"into\[0\].*negated"),
    (lambda: (_inference(0.0), torch.tensor(False)), RuntimeError, r"into\[0\].*inference tensor"),
])  # fmt: skip
def test_pack_bad_into_is_refused_before_anything_is_written(into, exc, match):
    """A wrong dtype, shape or device, a tensor that needs grad, two views of one buffer, a storage resized away (the
    kernel would write through address 0), a negated view, an inference tensor: refused naming it, out and the
    totals untouched."""
    tensors, out, into = [torch.randn(50), torch.randn(7)], poisoned(57, torch.bfloat16), into()
    if exc is None:  # the control: accepted
        zk.pack(tensors, dtype=torch.bfloat16, out=out, into=into)
        return
    readable = [t for t in into if t.device.type == "cpu" and t.untyped_storage().nbytes() and not t.is_neg()]
    before = digest(out, *readable)
    with pytest.raises(exc, match=match):
        zk.pack(tensors, dtype=torch.bfloat16, out=out, into=into)
    assert digest(out, *readable) == before


def _aliased():
    buf = torch.zeros(2)
    return buf[0], buf.view(torch.bool)[0]


def _resized(t):
    t.untyped_storage().resize_(0)
    return t


def _inference(value):
    with torch.inference_mode():
        return torch.tensor(value)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
def test_a_negative_scale_leaves_the_gaps_positive_zero(impl, out_dtype):
    """The gaps of an aligned bucket are +0 whatever the scale's sign, bit for bit the torch path's (the kernel's
    masked lanes loaded 0 and multiplied it by the scale: -0.0 in every gap for a negative one)."""
    tensors = [torch.ones(3), torch.full((17,), 2.0), torch.ones(1)]
    flat_ref, _ = expected_pack(tensors, out_dtype, -2.0, 8)
    p = zk.pack(tensors, dtype=out_dtype, scale=-2.0, align=8, impl=impl)
    assert_bits_equal(p.flat, flat_ref, "flat (gaps +0)")


def test_out_and_into_misuse_is_refused_also_at_a_known_address():
    """What a fresh plan refuses is refused at an address the plan has seen: a negated view of a checked `out` (the
    bucket came out negated), an inference tensor as `out` (written, then refused, or silently with align 1) or
    among unpack's tensors (the earlier ones written); and `into` overlapping itself or the bucket (the running sum
    overwrote bucket element 0; a flag inside the sum's bytes corrupted it). Each leaves every tensor unchanged."""
    x = torch.arange(1.0, 6.0)
    b = torch.zeros(5)
    zk.pack([x], out=b)  # the plan has seen b
    with pytest.raises(ValueError, match="negated"):
        zk.pack([x], out=torch._neg_view(b))
    with torch.inference_mode():
        inf_out = torch.zeros(8)
    with pytest.raises(RuntimeError, match="inference tensor"):
        zk.pack([x], out=inf_out, align=8)
    assert not inf_out.any()
    with pytest.raises(RuntimeError, match="inference tensor"):
        zk.pack([x], out=inf_out)
    assert not inf_out.any()
    a = torch.zeros(4)
    with torch.inference_mode():
        c = torch.zeros(4)
    with pytest.raises(RuntimeError, match="inference tensor"):
        zk.unpack(torch.arange(1.0, 9.0), [a, c])
    assert not a.any() and not c.any()
    out = torch.zeros(5)
    flag = torch.zeros((), dtype=torch.bool)
    with pytest.raises(ValueError, match="into\\[0\\] \\(sum_sq\\) and out overlap"):
        zk.pack([x], out=out, into=(out[0], flag))
    assert not out.any() and not flag
    raw = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlap"):
        zk.pack([x], into=(raw.view(torch.float32)[0], raw[3].view(torch.bool)))
    assert not raw.any()
    longer = torch.zeros(6)  # the bucket is longer[:5]: its last element may hold the running sum
    p = zk.pack([x], out=longer, into=(longer[5], flag))
    assert torch.equal(p.flat, x) and longer[5].item() == (x * x).sum().item()
