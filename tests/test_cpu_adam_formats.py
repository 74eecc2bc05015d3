"""cpu_adam_step and CPUAdam with bf16 and 8-bit moments, against references written here from the formats' spec.

The references share no code with zo_kernels: the 8-bit quantizer, the stochastic rounding's hash and AdamW are
written out below in float64 with explicit roundings to fp32 where the spec rounds. Exact operations compare
exactly; where the kernel's fp32 Adam arithmetic (not the format) can move a value across a rounding boundary,
only those elements may differ, by one step of the format, and each such allowance is stated where it is made.
"""

import warnings

import pytest
import torch
from helpers import adam_bound, assert_bits_equal, digest

import zo_kernels as zk
from zo_kernels import Quantized8bit, cpu_adam_step

ISAS = zk.available_isas()
ISA_NEEDS = {"scalar": "nothing", "avx2": "AVX2, FMA and F16C", "avx512": "AVX-512 F, BW, VL and DQ"}
ALL_ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(isa not in ISAS, reason=f"this CPU lacks {ISA_NEEDS[isa]} ({isa})"))
    for isa in zk.cpu_adam.ISAS
]
GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 255, 256, 257, 4097]
HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
F32 = torch.float32
M32 = 0xFFFFFFFF


# ---------------------------------------------------------------- references from the spec


def f32(x: torch.Tensor) -> torch.Tensor:
    """Round float64 to fp32 (RNE) and back to float64."""
    return x.to(F32).double()


def ref_quantize(x: torch.Tensor, signed: bool, block: int = 256,
                 r: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(codes as int64, scales) of fp32 values x (float64 holding fp32 values) by the spec in quant8's docstring:
    rounded to nearest even, or with `r` (int64, 16 random bits per element; signed only) stochastically: code =
    floor(fp32(x * mult + r / 2^16)), clamped to [-127, 127]."""
    levels, lo, hi = (127.0, -127.0, 127.0) if signed else (255.0, 0.0, 255.0)
    n = x.numel()
    nb = -(-n // block)
    xb = torch.zeros(nb * block, dtype=torch.float64)
    xb[:n] = x
    xb = xb.view(nb, block)
    amax = xb.abs().amax(1)
    small = amax < 2.0**-100
    scale = torch.where(small, 0.0, amax)
    mult = torch.where(small, 0.0, f32(levels / torch.where(small, 1.0, amax)))  # one fp32-rounded division
    prod = f32(xb * mult[:, None])  # the fp32 product (exact in float64, then rounded once)
    if r is None:
        codes = torch.round(prod).flatten()[:n]  # torch.round: half to even
    else:  # (the sum of two fp32 values is exact in float64, then rounded to fp32 once)
        codes = f32(prod.flatten()[:n] + r.double() * 2.0**-16).floor().clamp(lo, hi)
    assert ((codes >= lo) & (codes <= hi)).all()  # |x| <= absmax keeps x * mult within the levels
    return codes.long(), scale.to(F32)


def ref_dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool, block: int = 256) -> torch.Tensor:
    """float64 of the fp32 values the kernel reads: code * fp32(scale / levels) (then squared if unsigned)."""
    d = f32(scales.double() / (127.0 if signed else 255.0)).repeat_interleave(block)[: codes.numel()]
    x = f32(codes.double() * d)
    return x if signed else f32(x * x)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The spec's 32-bit hash on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def sr_key(seed: int, step: int) -> int:
    def h(v: int) -> int:
        return int(mix32(torch.tensor([v & M32]))[0])

    k = h((seed & M32) ^ 0x9E3779B9)
    k = h(k ^ (seed >> 32))
    k = h(k ^ (step & M32))
    return h(k ^ (step >> 32))


def weyl_bits(n: int, key: int, index0: int = 0) -> torch.Tensor:
    """The 8-bit exp_avg's 16 random bits (int64) of elements index0 .. index0 + n - 1: the top half of
    (uint32(index) * 0x9E3779B9 + key) mod 2^32 (the multiplier in two halves: products below 2^48)."""
    idx = (torch.arange(n, dtype=torch.int64) + index0) & M32
    c = 0x9E3779B9
    prod = (idx * (c & 0xFFFF) + (((idx * (c >> 16)) & 0xFFFF) << 16)) & M32
    return ((prod + key) & M32) >> 16


def sr_bits(x32: torch.Tensor, key: int, moment: int, index0: int = 0) -> torch.Tensor:
    """(fp32 bits + 16 random bits) as int64, for fp32 values x32; the bf16 is this >> 16 (NaN aside).

    One hash per element: exp_avg (moment 1) takes its low 16 bits, exp_avg_sq (moment 2) its high 16."""
    idx = (torch.arange(x32.numel(), dtype=torch.int64) + index0) & M32
    h = mix32(idx ^ key)
    r = h & 0xFFFF if moment == 1 else h >> 16
    return (x32.view(torch.int32).long() & M32) + r


def ref_adamw(p, g, m, v, *, step, lr, betas, eps, weight_decay, grad_scale=1.0, guard=False):
    """One AdamW step in float64 from float64 inputs; returns (p, m, v). `guard` (the 8-bit format's): the
    denominator is at least |m_hat| / adam_bound, so no element moves further than lr x adam_bound."""
    b1, b2 = betas
    g = g.double() * grad_scale
    p = p * (1 - lr * weight_decay)
    m = m + (1 - b1) * (g - m)
    v = v * b2 + (1 - b2) * g * g
    m_hat = m / (1 - b1**step)
    denom = v.sqrt() / (1 - b2**step) ** 0.5 + eps
    if guard:
        denom = torch.maximum(denom, m_hat.abs() / adam_bound(step, b1, b2))
    p = p - lr * m_hat / denom
    return p, m, v


def random_q8(n: int, signed: bool, seed: int, block: int = 256) -> Quantized8bit:
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-127, 128) if signed else (0, 256)
    codes = torch.randint(lo, hi, (n,), generator=gen).to(torch.int8 if signed else torch.uint8)
    scales = torch.rand(-(-n // block), generator=gen) * (0.1 if signed else 0.3) + 1e-3
    return Quantized8bit(codes, scales, signed=signed, block=block)


def make(n, grad_dtype=F32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(grad_dtype)


def clone_q(q: Quantized8bit) -> Quantized8bit:
    return Quantized8bit(q.codes.clone(), q.scales.clone(), signed=q.signed, block=q.block)


def near_half(x: torch.Tensor, tol: float) -> torch.Tensor:
    """Where x (float64) lies within tol of a rounding tie k + 1/2."""
    return ((x - x.floor()) - 0.5).abs() < tol


# ---------------------------------------------------------------- Quantized8bit


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_from_float_matches_spec_exactly(signed, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.logspace(-3, 3, n)
    x = x if signed else x.abs() * x.abs()
    x[: n // 7] = 0.0  # a block may hold zeros, or be all zeros
    q = Quantized8bit.from_float(x, signed=signed)
    codes, scales = ref_quantize(x.double() if signed else f32(x.double().sqrt()), signed)
    assert torch.equal(q.codes.long(), codes)
    assert torch.equal(q.scales, scales)
    assert torch.equal(q.to_float().double(), ref_dequantize(q.codes, q.scales, signed))


def test_empty_is_zero_and_narrow_shares_memory():
    q = Quantized8bit.empty(1000, signed=False)
    assert q.codes.dtype == torch.uint8 and q.scales.numel() == 4 and not q.to_float().any()
    view = q.narrow(256, 744)
    assert view.numel == 744 and view.scales.numel() == 3
    view.codes.fill_(3)
    view.scales.fill_(1.0)
    assert q.codes[256:].eq(3).all() and q.codes[:256].eq(0).all() and q.scales[1:].eq(1.0).all()
    for start, length, match in ((255, 256, "start must be a multiple"), (0, 300, "length must be a multiple"),
                                 (768, 300, "exceeds numel")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            q.narrow(start, length)


def test_quantized8bit_bad_construction():
    with pytest.raises(TypeError, match="codes must have dtype torch.int8"):
        Quantized8bit(torch.zeros(10, dtype=torch.uint8), torch.zeros(1), signed=True)
    with pytest.raises(ValueError, match="scales has 2 elements"):
        Quantized8bit(torch.zeros(10, dtype=torch.int8), torch.zeros(2), signed=True)
    with pytest.raises(ValueError, match="block must be a multiple of 16"):
        Quantized8bit.empty(10, signed=True, block=100)
    with pytest.raises(ValueError, match="t must be >= 0"):
        Quantized8bit.from_float(torch.tensor([-1.0]), signed=False)
    with pytest.raises(ValueError, match="t must be finite"):
        Quantized8bit.from_float(torch.tensor([float("nan")]), signed=True)


# ---------------------------------------------------------------- the 8-bit kernel


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_8bit_requantization_is_exact(isa, grad_dtype, n):
    """betas = 0 from zero state: m = g and v = g*g exactly in fp32, so the codes are the spec's, bit for bit
    (exp_avg's stochastically rounded with the spec's bits from seed, step and index; exp_avg_sq's to nearest)."""
    p, g = make(n, grad_dtype, seed=n)
    m, v = Quantized8bit.empty(n, signed=True), Quantized8bit.empty(n, signed=False)
    cpu_adam_step(p, g, m, v, step=1, lr=1e-3, betas=(0.0, 0.0), isa=isa, seed=5, index0=1000)
    g64 = g.double()
    codes_m, scales_m = ref_quantize(g64, True, r=weyl_bits(n, sr_key(5, 1), index0=1000))
    codes_v, scales_v = ref_quantize(f32(f32(g64 * g64).sqrt()), False)
    assert torch.equal(m.codes.long(), codes_m) and torch.equal(m.scales, scales_m)
    assert torch.equal(v.codes.long(), codes_v) and torch.equal(v.scales, scales_v)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_8bit_step_against_float64(isa, grad_dtype, n):
    """One step from random codes: dequantize, AdamW in float64 (with the format's guard: random codes pair large m
    with small v), quantize by the spec.

    Allowed: scales within 4 fp32 ulps (the fp32 Adam arithmetic's error on the block's absmax), and a code off by
    one only where the float64 value scaled to codes lies within 1e-4 of a rounding tie (that error, times 255):
    for exp_avg_sq a tie k + 1/2, for exp_avg (stochastic) where the scaled value plus its random bits / 2^16 is an
    integer.
    """
    p0, g = make(n, grad_dtype, seed=n + 1)
    m, v = random_q8(n, True, 1), random_q8(n, False, 2)
    m0, v0 = ref_dequantize(m.codes, m.scales, True), ref_dequantize(v.codes, v.scales, False)
    p = p0.clone()
    cpu_adam_step(p, g, m, v, step=7, isa=isa, seed=3, **HP)
    rp, rm, rv = ref_adamw(p0.double(), g, m0, v0, step=7, **HP, guard=True)
    assert (p.double() - rp).abs().max() <= 1e-6 * max(1.0, rp.abs().max().item())
    r = weyl_bits(n, sr_key(3, 7))
    for q, x, signed in ((m, rm, True), (v, rv.sqrt(), False)):
        codes, scales = ref_quantize(x, signed, r=r if signed else None)
        torch.testing.assert_close(q.scales, scales, rtol=4 * 2**-23, atol=0)
        scaled = x * (127.0 if signed else 255.0) / scales.double().repeat_interleave(256)[:n]
        diff = q.codes.long() - codes
        assert diff.abs().max() <= 1
        edge = near_half(scaled + r * 2.0**-16 - 0.5, 1e-4) if signed else near_half(scaled, 1e-4)
        assert edge[diff != 0].all(), "a code differs away from a rounding edge"


# ---------------------------------------------------------------- the bf16 kernel


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_bf16_stochastic_rounding_against_spec(isa, grad_dtype, n):
    """One step from random bf16 moments; the moments are the float64 AdamW values rounded by the spec's hash.

    Allowed: an element whose fp32 value plus its random bits lies within 16 fp32 ulps of the truncation
    boundary may land one bf16 step away (the kernel's fp32 m and v differ from float64 by a few ulps).
    """
    p0, g = make(n, grad_dtype, seed=n + 2)
    gen = torch.Generator().manual_seed(3)
    m = (torch.randn(n, generator=gen) * 0.1).bfloat16()
    v = (torch.rand(n, generator=gen) * 0.1).bfloat16()
    rp, rm, rv = ref_adamw(p0.double(), g, m.double(), v.double(), step=5, **HP)
    p = p0.clone()
    cpu_adam_step(p, g, m, v, step=5, isa=isa, seed=1234, **HP)
    assert (p.double() - rp).abs().max() <= 1e-6 * max(1.0, rp.abs().max().item())
    for got, ref, moment in ((m, rm, 1), (v, rv, 2)):
        bits = sr_bits(ref.to(F32), sr_key(1234, 5), moment)
        want = (bits >> 16).to(torch.int32).to(torch.int16)
        diff = got.view(torch.int16).long() - want.long()
        low = bits & 0xFFFF
        at_edge = (low < 16) | (low > 0xFFFF - 16)
        assert diff.abs().max() <= 1 and at_edge[diff != 0].all(), "a bf16 moment differs away from its SR edge"
        assert (diff != 0).sum() <= max(2, n // 1000)


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_index0_makes_calls_over_parts_round_as_one_call(fmt):
    """Calls over [0, k) and [k, n), the second given index0=k, give the one call's bits (bf16: the rounding hashes
    index0 + i, as does the 8-bit exp_avg's); without index0 the second part's moments round otherwise."""
    n, k = 5000, 2048

    def run(parts, with_index):
        p, g = make(n, torch.bfloat16, seed=11)
        m, v = moments(fmt, n)
        for step in (1, 2, 3):
            for a, b in parts:
                mv = [x.narrow(a, b - a) if isinstance(x, Quantized8bit) else x[a:b] for x in (m, v)]
                cpu_adam_step(p[a:b], g[a:b], *mv, step=step, seed=99, index0=a if with_index else 0, **HP)
        return digest(p, *(x.codes if isinstance(x, Quantized8bit) else x for x in (m, v)))

    whole = run([(0, n)], True)
    assert run([(0, k), (k, n)], True) == whole
    assert run([(0, k), (k, n)], False) != whole, "the test cannot tell the parts apart"


@pytest.mark.parametrize("index0, exc", [(-1, ValueError), (2**63, ValueError), (1.0, TypeError), (True, TypeError)])
def test_bad_index0_is_refused_before_anything_is_written(index0, exc):
    p, g = make(64, torch.float32, seed=1)
    m, v = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    before = p.clone()
    with pytest.raises(exc, match="index0"):
        cpu_adam_step(p, g, m, v, step=1, index0=index0, **HP)
    assert torch.equal(p, before) and not m.any()


def test_bf16_stochastic_rounding_is_unbiased():
    """A value between two bf16 neighbours rounds up with probability (its distance from the lower) / (the gap)."""
    n = 1 << 16
    frac = 0.3
    lo = torch.tensor(1.0)
    val = (lo + frac * 2**-7).item()  # 30% of the way from 1 to the next bf16 (1 + 2^-7)
    p, g = torch.zeros(n), torch.zeros(n)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    g.fill_(val)
    cpu_adam_step(p, g, m, v, step=1, lr=0.0, betas=(0.0, 0.0))  # m = g exactly
    ups = (m.float() > 1.0).double().mean().item()
    assert abs(ups - frac) < 0.01, ups


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_8bit_exp_avg_rounding_is_unbiased(isa):
    """exp_avg's codes round stochastically: in blocks whose absmax is 1 (code 127), values 0.3 of a code above
    (below) a code round away from zero with probability 0.3, and the codes' mean is the values' (m = g: betas 0)."""
    n = 1 << 16
    y = torch.arange(n, dtype=torch.float64).remainder(5) + 0.3  # 0.3, 1.3, .. 4.3 codes
    y = torch.where(torch.arange(n) % 2 == 0, y, -y)
    g = (y / 127).float()
    g[::256] = 1.0  # each block's absmax: scale 1, multiplier 127
    p, m, v = torch.zeros(n), Quantized8bit.empty(n, signed=True), Quantized8bit.empty(n, signed=False)
    cpu_adam_step(p, g, m, v, step=1, lr=0.0, betas=(0.0, 0.0), isa=isa)
    live = torch.arange(n) % 256 != 0
    scaled = (g.double() * 127)[live]
    codes = m.codes.long()[live]
    away = (codes.abs() > scaled.abs().floor()).double().mean().item()
    assert abs(away - 0.3) < 0.01, away
    assert ((codes - scaled).abs() < 1).all()
    assert abs((codes - scaled).mean().item()) < 0.01


# ---------------------------------------------------------------- every format: ISAs, threads, tiles, many steps


def moments(fmt: str, n: int):
    if fmt == "bf16":
        return torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    return Quantized8bit.empty(n, signed=True), Quantized8bit.empty(n, signed=False)


def moment_bits(x) -> list[torch.Tensor]:
    return [x.codes, x.scales] if isinstance(x, Quantized8bit) else [x]


def run_steps(fmt, p0, grads, *, out_dtype=None, **kw):
    p = p0.clone()
    m, v = moments(fmt, p.numel())
    out = None if out_dtype is None else torch.empty(p.numel(), dtype=out_dtype)
    for i, g in enumerate(grads, 1):
        cpu_adam_step(p, g, m, v, step=i, param_out=out, seed=7, **HP, **kw)
    return [p, *moment_bits(m), *moment_bits(v)] + ([] if out is None else [out])


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_isas_threads_tiles_bit_identical(fmt, out_dtype, grad_dtype):
    n = 70_001  # > 2 x the per-thread minimum, and a short last block
    p0, _ = make(n, seed=4)
    grads = [make(n, grad_dtype, seed=10 + i)[1] for i in range(4)]
    ref = run_steps(fmt, p0, grads, out_dtype=out_dtype, isa="scalar", threads=1)
    if out_dtype is not None:
        assert_bits_equal(ref[-1], ref[0].to(out_dtype), "param_out is the cast of param")
    seen = []
    variants = [dict(isa=isa, threads=t) for isa in ISAS for t in (1, 2)]
    variants += [dict(tile_numel=256 * 37, sink=lambda s, e: seen.append((s, e)))]
    for kw in variants:
        got = run_steps(fmt, p0, grads, out_dtype=out_dtype, **kw)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert torch.equal(a, b), f"{fmt} {kw}: tensor {i} differs from the scalar single-thread run"
    assert seen[-1] == (256 * 37 * 7, n)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_long_param_out_bit_identical(fmt, out_dtype):
    """A range long enough for the non-temporal param_out stores (>= 1 MiB of param_out per thread): every ISA and
    thread count, param_out aligned (streamed) or one element off (cached), equals the scalar single-thread run."""
    n = (1 << 20) + 300
    p0, _ = make(n, seed=5)
    grads = [make(n, torch.bfloat16, seed=20 + i)[1] for i in range(2)]

    def run(offset, **kw):
        p = p0.clone()
        m, v = (torch.zeros(n), torch.zeros(n)) if fmt == "fp32" else moments(fmt, n)
        out = torch.full((n + offset,), 7.0, dtype=out_dtype)[offset:]
        for i, g in enumerate(grads, 1):
            cpu_adam_step(p, g, m, v, step=i, param_out=out, seed=7, **HP, **kw)
        return [p, *moment_bits(m), *moment_bits(v), out]

    ref = run(0, isa="scalar", threads=1)
    assert torch.equal(ref[-1], ref[0].to(out_dtype))
    for kw in [dict(isa=isa, threads=t, offset=o) for isa in ISAS for t in (1, 2) for o in (0, 1)]:
        got = run(**kw)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert torch.equal(a, b), f"{fmt} {kw}: tensor {i} differs from the scalar single-thread run"


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_c_tile_sink(fmt):
    n = 10_000
    p0, g = make(n, torch.bfloat16, seed=5)
    ref = run_steps(fmt, p0, [g], out_dtype=torch.bfloat16)
    p = p0.clone()
    m, v = moments(fmt, n)
    staging, dst = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    sink = zk.cpu_adam.copy_tile_sink(dst, staging)
    cpu_adam_step(p, g, m, v, step=1, param_out=staging, tile_numel=512, sink=sink, seed=7, **HP)
    assert torch.equal(dst, ref[-1]) and torch.equal(p, ref[0])


def heavy_tailed_grads(n: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Gradients whose scale varies by orders of magnitude between elements and between steps (log-normal, sigma 2):
    an element's sqrt(v) can then sit far below its block's largest while its m does not."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * torch.exp(2.0 * torch.randn(n, generator=gen)) * 1e-4 for _ in range(steps)]


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_8bit_update_stays_within_exact_adams_bound(isa):
    """No 8-bit step moves an element further than exact Adam ever could at that step (lr x adam_bound: 1.0 at step 1,
    1.04 at step 10 for betas (0.9, 0.999)), and the guard's bits are the same on every ISA, thread count and tile.
    Before the guard, in bounds: 1.54 at step 2, 279 at step 3, 692 at worst in the 14 (sqrt(v) rounded to a code or
    two, or to 0, under a block scale set by another element while m did not: up to lr x m_hat / eps)."""
    n, lr, betas = 256 * 64 + 77, 1e-3, (0.9, 0.999)
    grads = heavy_tailed_grads(n, 14, seed=5)

    def run(**kw):
        p = torch.zeros(n)  # (small params: their fp32 rounding stays far below the step measured)
        m, v = moments("8bit", n)
        worst = []
        for step, g in enumerate(grads, 1):
            before = p.clone()
            cpu_adam_step(p, g, m, v, step=step, lr=lr, betas=betas, eps=1e-8, weight_decay=0.0, **kw)
            worst.append((p - before).abs().max().item() / (lr * adam_bound(step, *betas)))
        return worst, [p, *moment_bits(m), *moment_bits(v)]

    worst, bits = run(isa=isa)
    assert max(worst) <= 1 + 1e-5, [round(w, 2) for w in worst]
    _, ref = run(isa="scalar", threads=1)
    _, tiled = run(isa=isa, threads=3, tile_numel=256 * 5, sink=lambda a, b: None)
    for got in (bits, tiled):
        assert all(torch.equal(x, y) for x, y in zip(got, ref)), f"{isa}: the guard's bits differ from the scalar run"


def test_update_cap_is_one_over_bc1_times_the_bound():
    """zo_kernels._cpu.update_cap (the kernels' guard: the denominator is at least |m| x it) against the bound summed
    from its definition, with and without bias correction, rho = b1^2 / b2 below, at and above 1; 0 (no guard) where
    the bound is infinite (b2 = 0 after step 1); bad arguments refused."""
    from zo_kernels import _cpu

    for b1, b2 in [(0.9, 0.999), (0.0, 0.999), (0.99, 0.95), (0.5, 0.25), (0.9, 0.81), (0.9, 0.0), (0.9, 1e-320)]:
        for t in (1, 2, 3, 10, 100, 1000):
            cap = _cpu.update_cap(t, b1, b2)  # (an infinite bound: 0, no guard)
            assert cap == pytest.approx(1 / ((1 - b1**t) * adam_bound(t, b1, b2)), rel=1e-9), (b1, b2, t)
            raw = _cpu.update_cap(t, b1, b2, bias_correction=False)
            assert raw == pytest.approx(1 / adam_bound(t, b1, b2, bias_correction=False), rel=1e-9), (b1, b2, t)
    for args in [(0, 0.9, 0.999), (-3, 0.9, 0.999), (1, 0.9, 1.0), (1, 1.0, 0.9), (1, -0.1, 0.9)]:
        with pytest.raises(ValueError):
            _cpu.update_cap(*args)


def test_8bit_update_without_bias_correction_stays_within_its_bound():
    """bias_correction=False: m and v are not normalized, nor is the bound; heavy-tailed gradients."""
    n, lr, betas = 256 * 16, 1e-3, (0.9, 0.999)
    p = torch.zeros(n)
    m, v = moments("8bit", n)
    for step, g in enumerate(heavy_tailed_grads(n, 10, seed=6), 1):
        before = p.clone()
        cpu_adam_step(p, g, m, v, step=step, lr=lr, betas=betas, eps=1e-8, bias_correction=False)
        bound = adam_bound(step, *betas, bias_correction=False)
        assert (p - before).abs().max().item() <= (1 + 1e-5) * lr * bound, step


def test_8bit_guard_moves_an_element_whose_sqrt_v_rounded_to_zero_by_lr_times_the_bound():
    """A block where element 0 took a large gradient, then one of opposite sign (its m back to ~0, its v large), while
    element 5 took a small one: element 5's sqrt(v) rounds to code 0 under element 0's scale, its m to code 127 (it
    is the block's largest m). At the next step (zero gradients) the update is m_hat / max(eps, |m_hat| / bound):
    exactly lr x bound, where the unguarded kernel moved it by lr x m_hat / eps (3.3e7 x lr)."""
    n, lr, betas = 256, 1e-3, (0.9, 0.999)
    p = torch.zeros(n)
    m, v = moments("8bit", n)
    g1, g2 = torch.zeros(n), torch.zeros(n)
    g1[0], g2[0], g2[5] = 1000.0, -900.0, 1.0
    for step, g in enumerate((g1, g2), 1):
        cpu_adam_step(p, g, m, v, step=step, lr=lr, betas=betas, eps=1e-8)
    assert m.codes[5] == 127 and v.codes[5] == 0, (m.codes[5], v.codes[5])
    before = p[5].item()
    cpu_adam_step(p, torch.zeros(n), m, v, step=3, lr=lr, betas=betas, eps=1e-8)
    moved = before - p[5].item()
    assert moved == pytest.approx(lr * adam_bound(3, *betas), rel=1e-5), moved / lr


@pytest.mark.parametrize("fmt, tol", [("bf16", 0.01), ("8bit", 0.05)])
def test_many_steps_track_fp32_adamw(fmt, tol):
    """200 steps: each format's params stay within tol of the fp32-state run, relative to the distance travelled."""
    n = 4097
    p0, _ = make(n, seed=6)
    gen = torch.Generator().manual_seed(8)
    target = torch.randn(n, generator=gen)
    p32, m32, v32 = p0.clone(), torch.zeros(n), torch.zeros(n)
    p = p0.clone()
    m, v = moments(fmt, n)
    hp = dict(lr=3e-3, betas=(0.9, 0.999), weight_decay=0.01)
    for step in range(1, 201):
        noise = torch.randn(n, generator=gen)
        cpu_adam_step(p32, (p32 - target) + noise, m32, v32, step=step, **hp)
        cpu_adam_step(p, (p - target) + noise, m, v, step=step, **hp)
    travelled = (p32 - p0).norm()
    assert (p - p32).norm() <= tol * travelled, ((p - p32).norm() / travelled).item()


def test_stream_pass_each_format():
    n = 1000
    p, g = make(n, seed=9)
    m, v = random_q8(n, True, 3), random_q8(n, False, 4)
    codes = [m.codes.clone(), m.scales.clone(), v.codes.clone(), v.scales.clone()]
    p1 = p.clone()
    zk.stream_pass(p1, g, m, v, param_out=torch.empty(n, dtype=torch.bfloat16))
    assert torch.equal(p1, p + g)
    assert all(torch.equal(a, b) for a, b in zip(codes, [m.codes, m.scales, v.codes, v.scales]))
    mb, vb = torch.randn(n).bfloat16(), torch.rand(n).bfloat16()
    zk.stream_pass(p.clone(), g, mb, vb)


# ---------------------------------------------------------------- interruption and bad input


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_interrupted_tiles_report_updated(fmt):
    n = 5000
    p0, g = make(n, seed=11)
    ref = run_steps(fmt, p0, [g])
    p = p0.clone()
    m, v = moments(fmt, n)
    before = [t.clone() for t in [p, *moment_bits(m), *moment_bits(v)]]

    def sink(start, end):
        if end >= 2048:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        cpu_adam_step(p, g, m, v, step=1, tile_numel=1024, sink=sink, seed=7, **HP)
    assert info.value.updated == (0, 2048)
    assert torch.equal(p[:2048], ref[0][:2048]) and torch.equal(p[2048:], before[0][2048:])
    if fmt == "8bit":
        assert torch.equal(m.codes[:2048], ref[1][:2048]) and torch.equal(m.codes[2048:], before[1][2048:])
        assert torch.equal(m.scales[:8], ref[2][:8]) and torch.equal(m.scales[8:], before[2][8:])


def _bad_format_cases():
    n = 300
    z = lambda dt=F32, k=n: torch.zeros(k, dtype=dt)  # noqa: E731
    q = lambda s, k=n, block=256: Quantized8bit.empty(k, signed=s, block=block)  # noqa: E731
    cases = [
        ("f32-bf16", TypeError, "exp_avg_sq must have dtype float32", lambda: (z(), z(torch.bfloat16)), {}),
        ("bf16-f32", TypeError, "exp_avg_sq must have dtype bfloat16", lambda: (z(torch.bfloat16), z()), {}),
        ("f16-f16", TypeError, "exp_avg must have dtype float32 or bfloat16", lambda: (z(torch.half), z(torch.half)),
         {}),
        ("q-tensor", TypeError, "exp_avg_sq must be a Quantized8bit", lambda: (q(True), z()), {}),
        ("tensor-q", TypeError, "exp_avg must be a Quantized8bit", lambda: (z(), q(False)), {}),
        ("unsigned-m", TypeError, "exp_avg must be a signed", lambda: (q(False), q(False)), {}),
        ("signed-v", TypeError, "exp_avg_sq must be an unsigned", lambda: (q(True), q(True)), {}),
        ("block-mismatch", ValueError, "one block size", lambda: (q(True), q(False, block=128)), {}),
        ("numel", ValueError, "exp_avg has 299 elements", lambda: (q(True, 299), q(False)), {}),
        ("tile", ValueError, "tile_numel must be a multiple", lambda: (q(True), q(False)),
         dict(tile_numel=100, sink=lambda s, e: None)),
        ("seed", ValueError, "seed must be in", lambda: (z(torch.bfloat16), z(torch.bfloat16)), dict(seed=-1)),
        ("m-is-v", ValueError, "overlap", lambda: (lambda t: (t, t))(z(torch.bfloat16)), {}),
    ]  # fmt: skip
    return [pytest.param(make_mv, exc, match, kw, id=name) for name, exc, match, make_mv, kw in cases]


@pytest.mark.parametrize("make_mv, exc, match, kw", _bad_format_cases())
def test_bad_moments_are_named_and_touch_nothing(make_mv, exc, match, kw):
    m, v = make_mv()
    p, g = make(300, seed=12)
    tensors = [p, g, *moment_bits(m), *moment_bits(v)]
    before = digest(*tensors)
    with pytest.raises(exc, match=match):
        cpu_adam_step(p, g, m, v, step=1, lr=1e-3, **kw)
    assert digest(*tensors) == before


def test_readonly_codes_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        codes = torch.frombuffer(bytearray(300), dtype=torch.int8)
        ro = torch.frombuffer(bytes(300), dtype=torch.uint8)
    m = Quantized8bit(codes, torch.zeros(2), signed=True)
    v = Quantized8bit(ro, torch.zeros(2), signed=False)
    p, g = make(300, seed=13)
    before = digest(p, m.codes, m.scales)
    with pytest.raises(ValueError, match="exp_avg_sq.codes is read-only"):
        cpu_adam_step(p, g, m, v, step=1, lr=1e-3)
    assert digest(p, m.codes, m.scales) == before


def test_plan_run_refuses_unaligned_ranges():
    p, g = make(1000, seed=14)
    plan = zk.cpu_adam.plan_adam_step(p, g, *moments("8bit", 1000), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="multiples of the 8-bit moments' block"):
        plan.run(100, 512)
    plan.run(512, 1000)  # the end may be numel


def test_cpp_checks_the_format():
    from zo_kernels import _cpu

    x, c = torch.zeros(32), torch.zeros(32, dtype=torch.uint8)
    args = dict(param=x.data_ptr(), grad=x.data_ptr(), grad_dtype=0, exp_avg=c.data_ptr(), exp_avg_sq=c.data_ptr(),
                param_out=0, out_dtype=3, n=32, step=1, lr=0.0, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0,
                grad_scale=1.0, adamw=True, bias_correction=True, isa=0, threads=1)  # fmt: skip
    with pytest.raises(ValueError, match="block must be a multiple of 16"):
        _cpu.adam_step(**args, state=(2, x.data_ptr(), x.data_ptr(), 100, 0, 0))
    with pytest.raises(ValueError, match="exp_avg scales address is null"):
        _cpu.adam_step(**args, state=(2, 0, x.data_ptr(), 256, 0, 0))
    with pytest.raises(ValueError, match="state format code"):
        _cpu.adam_step(**args, state=(5, 0, 0, 256, 0, 0))


# ---------------------------------------------------------------- CPUAdam


def train(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


FORMATS = [torch.float32, torch.bfloat16, "8bit"]


@pytest.mark.parametrize("state_dtype", FORMATS, ids=str)
def test_cpuadam_state_dict_round_trip_is_bitwise(state_dtype, tmp_path):
    params = [torch.randn(300, 7), torch.randn(5)]
    opt = zk.CPUAdam(params, lr=1e-2, weight_decay=0.01, state_dtype=state_dtype)
    train(opt, params, 3, seed=0)
    sd = opt.state_dict()
    st = sd["state"][0]
    assert st["exp_avg"].dtype == F32 and st["exp_avg"].shape == (300, 7)
    assert ("exp_avg_codes" in st) == (state_dtype == "8bit")
    torch.save(sd, tmp_path / "sd.pt")
    params2 = [p.clone() for p in params]
    opt2 = zk.CPUAdam(params2, lr=1e-2, weight_decay=0.01, state_dtype=state_dtype)
    opt2.load_state_dict(torch.load(tmp_path / "sd.pt"))
    train(opt, params, 3, seed=1)
    train(opt2, params2, 3, seed=1)
    for a, b in zip(params, params2):
        assert torch.equal(a, b)
    # ... and it loads into torch.optim.AdamW, which continues from the dequantized moments
    tparams = [p.clone() for p in params]
    topt = torch.optim.AdamW(tparams, lr=1e-2, weight_decay=0.01)
    topt.load_state_dict(opt.state_dict())
    assert torch.equal(topt.state[tparams[0]]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("state_dtype", ["8bit", torch.bfloat16], ids=str)
def test_cpuadam_loads_fp32_state_dict(state_dtype):
    params = [torch.randn(1000)]
    ref = torch.optim.AdamW([p.clone() for p in params], lr=1e-2)
    train(ref, ref.param_groups[0]["params"], 2, seed=2)
    opt = zk.CPUAdam(params, lr=1e-2, state_dtype=state_dtype)
    opt.load_state_dict(ref.state_dict())
    m = opt.state[params[0]]["exp_avg"]
    want = ref.state[ref.param_groups[0]["params"][0]]["exp_avg"]
    if state_dtype == "8bit":
        codes, scales = ref_quantize(want.double(), True)
        assert isinstance(m, Quantized8bit) and torch.equal(m.codes.long(), codes) and torch.equal(m.scales, scales)
    else:
        assert torch.equal(m, want.bfloat16())
    train(opt, params, 1, seed=3)


def test_cpuadam_ignores_stale_codes():
    """A torch.optim.AdamW that loaded an 8-bit state dict and stepped carries the old codes along: not used."""
    params = [torch.randn(1000)]
    opt = zk.CPUAdam(params, lr=1e-2, state_dtype="8bit")
    train(opt, params, 2, seed=4)
    tp = [params[0].clone()]
    topt = torch.optim.AdamW(tp, lr=1e-2)
    topt.load_state_dict(opt.state_dict())
    train(topt, tp, 1, seed=5)
    opt2 = zk.CPUAdam([params[0].clone()], lr=1e-2, state_dtype="8bit")
    opt2.load_state_dict(topt.state_dict())
    m = opt2.state[opt2.param_groups[0]["params"][0]]["exp_avg"]
    codes, _ = ref_quantize(topt.state[tp[0]]["exp_avg"].double(), True)
    assert torch.equal(m.codes.long(), codes)


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda st: st.update(exp_avg=torch.zeros(3)), r"has 3 elements|has shape \(3,\)"),
        (lambda st: st.update(exp_avg_sq=torch.full((1000,), -1.0)), "must be >= 0"),
        (lambda st: st.update(exp_avg=torch.full((1000,), float("nan"))), "must be finite"),
        (lambda st: st.update(exp_avg_scales=torch.zeros(2)), "exp_avg_scales"),
        (lambda st: st.update(exp_avg_codes=torch.full((1000,), 300.0)), "integers in"),
        (lambda st: st.update(quant_block=100), "quant_block"),
    ],
)
def test_cpuadam_refuses_bad_state_dict_before_any_change(corrupt, match):
    params = [torch.randn(1000)]
    opt = zk.CPUAdam(params, lr=1e-2, state_dtype="8bit")
    train(opt, params, 1, seed=6)
    sd = opt.state_dict()
    sd = {"state": {k: dict(v) for k, v in sd["state"].items()}, "param_groups": sd["param_groups"]}
    st = sd["state"][0]
    if match in ("must be >= 0", "must be finite"):  # only an fp32 state dict is quantized
        for key in ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales", "quant_block"):
            st.pop(key)
    corrupt(st)
    before = digest(*moment_bits(opt.state[params[0]]["exp_avg"]), *moment_bits(opt.state[params[0]]["exp_avg_sq"]))
    step_before = opt.state[params[0]]["step"].clone()
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = digest(*moment_bits(opt.state[params[0]]["exp_avg"]), *moment_bits(opt.state[params[0]]["exp_avg_sq"]))
    assert after == before and torch.equal(opt.state[params[0]]["step"], step_before)


def test_cpuadam_state_dtype_checked():
    with pytest.raises(ValueError, match="state_dtype must be"):
        zk.CPUAdam([torch.zeros(3)], state_dtype=torch.float16)
    with pytest.raises(ValueError, match="state_dtype must be"):
        zk.CPUAdam([torch.zeros(3)], state_dtype="4bit")


def test_8bit_moments_of_an_element_whose_gradient_stops_decay():
    """Element 0 of a 256-element block gets gradient 1 every step (it sets the block's scales); element 1 gets one
    gradient of 0.05 at step 50, then zeros: exact Adam moves it by 7.6 lr in all (m decays as 0.9^t). Its m is 0.6
    of a code, so one run's path is random; over 32 seeds: each run's m reaches code 0 and the element stops (no
    move in the last 100 steps), no run goes beyond 4x exact Adam's move, and their mean is within 25% of it.
    With exp_avg rounded to nearest its codes stayed at 1 (0.9 x 1 rounds to 1) and it moved by ~lr every step,
    for ever (-182 lr by step 250)."""
    n, lr, seeds = 256, 1e-3, 32
    p8, p32 = torch.zeros(seeds, n), torch.zeros(n)
    mv8 = [moments("8bit", n) for _ in range(seeds)]
    m32, v32 = torch.zeros(n), torch.zeros(n)
    for step in range(1, 251):
        g = torch.zeros(n)
        g[0] = 1.0
        if step == 50:
            g[1] = 0.05
        for s, (m, v) in enumerate(mv8):
            cpu_adam_step(p8[s], g, m, v, step=step, lr=lr, weight_decay=0.0, seed=s)
        cpu_adam_step(p32, g, m32, v32, step=step, lr=lr, weight_decay=0.0)
        if step == 150:
            at150 = p8[:, 1].clone()
    exact = p32[1].item()
    assert -8 * lr < exact < -7 * lr  # (the case as described)
    assert all(m.codes[1] == 0 for m, _ in mv8)
    assert torch.equal(p8[:, 1], at150), "an element with no gradient still moves"
    assert (p8[:, 1] / exact).max() < 4, (p8[:, 1] / lr).tolist()
    assert abs(p8[:, 1].mean().item() / exact - 1) < 0.25, (p8[:, 1].mean().item() / lr, exact / lr)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_8bit_v_past_fp32_keeps_the_block_finite(isa):
    """A review's find: one finite gradient whose square overflows fp32 (1e21: v = inf) gave its 8-bit block an inf
    scale, every code 0, and at the next step every element of the block NaN (0 * inf). Now, as with fp32 moments
    (the reference: fp32 moments, written out here): that element's update is 0 from then on, nothing is NaN, and
    the other block's elements step as with fp32 moments."""
    n = 512

    def run(fmt):
        p = torch.ones(n)
        m, v = moments(fmt, n)
        for step in (1, 2, 3):
            g = torch.full((n,), 0.01)
            if step == 1:
                g[3] = 1e21
            cpu_adam_step(p, g, m, v, step=step, lr=1e-3, isa=isa if fmt == "8bit" else "scalar")
        return p

    exact, q = run("fp32"), run("8bit")
    assert not bool(q.isnan().any())
    assert q[3].item() == exact[3].item() == 1.0  # (frozen after its first step's zero update)
    assert torch.equal(q[256:], exact[256:]) or (q[256:] - exact[256:]).abs().max().item() < 1e-5
    assert bool(torch.isfinite(q).all())


@pytest.mark.parametrize("n,tile", [(300, None), (300, 512), (100, 256)])
def test_8bit_c_tile_sink_one_tile_not_a_block_multiple(n, tile):
    """A review's find: 8-bit moments with a C tile sink refused a step shorter than its tile whose length is not a
    multiple of the block ("tile_numel must be a multiple of the block (256), got 300"), where the Python sink and
    a longer step take it: one tile is the whole step. The reference: the same step with no sink."""
    gen = torch.Generator().manual_seed(2)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    ref = p0.clone()
    m, v = moments("8bit", n)
    cpu_adam_step(ref, g, m, v, step=1, lr=1e-3)
    p, dst = p0.clone(), torch.empty(n)
    m, v = moments("8bit", n)
    cpu_adam_step(p, g, m, v, step=1, lr=1e-3, sink=zk.cpu_adam.copy_tile_sink(dst, p), tile_numel=tile)
    assert torch.equal(p, ref) and torch.equal(dst, ref)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_8bit_nan_gradient_gives_every_isa_the_same_bits(isa):
    """A review's find (emulating AVX-512 with SIMDe): the scalar variant's clamp of sqrt(v) at fp32's largest
    (this session's) took a NaN to that largest (std::min(largest, NaN) is its first argument), where the vector
    variants kept the NaN: the block's scale and codes then differed between ISAs. The scalar variant's bits are the
    reference of every other (the library's promise), NaN included."""
    n = 300
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(n, generator=gen)
    g[0], g[260] = float("nan"), float("inf")

    def run(which):
        p = torch.randn(n, generator=torch.Generator().manual_seed(5))
        m, v = moments("8bit", n)
        for step in (1, 2):
            cpu_adam_step(p, g, m, v, step=step, lr=1e-3, isa=which)
        return [p, *moment_bits(m), *moment_bits(v)]

    for i, (a, b) in enumerate(zip(run(isa), run("scalar"), strict=True)):
        if a.is_floating_point():
            assert_bits_equal(a, b, f"tensor {i}")
        else:
            assert torch.equal(a, b), f"tensor {i}"
