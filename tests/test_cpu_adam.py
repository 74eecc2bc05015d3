"""cpu_adam_step against a float64 reference of torch's formulas, and against torch.optim.AdamW/Adam in fp32.

Tolerance: fp32 arithmetic. Our error against float64 must be within 2x the error of torch doing the same
thing in fp32 (flash-attention's rule), plus 2 ulp of the largest value for sizes where torch is exact by luck.
Casts and the ISA variants against one another are compared bit for bit.
"""

import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import FP32_EPS, assert_bits_equal, assert_within_2x_of, digest, ref_adam

import zo_kernels as zk
from zo_kernels import cpu_adam_step

ISAS = zk.available_isas()
# What each variant needs (cpu/adam.cpp isa_supported). Every variant is a parameter of every ISA test, so
# one this CPU lacks shows as skipped, with the reason, instead of vanishing from the count.
ISA_NEEDS = {"scalar": "nothing", "avx2": "AVX2, FMA and F16C", "avx512": "AVX-512 F, BW, VL and DQ"}
ALL_ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(isa not in ISAS, reason=f"this CPU lacks {ISA_NEEDS[isa]} ({isa})"))
    for isa in zk.cpu_adam.ISAS
]
GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 15, 16, 17, 4097, 1_000_003]


def make(n, grad_dtype=torch.float32, steps=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(steps)]
    return p, grads


def run_zo(p, grads, *, isa, first_step=1, m=None, v=None, **hp):
    p = p.clone()
    m = torch.zeros_like(p) if m is None else m.clone()
    v = torch.zeros_like(p) if v is None else v.clone()
    for i, g in enumerate(grads):
        cpu_adam_step(p, g, m, v, step=first_step + i, isa=isa, **hp)
    return p, m, v


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_matches_torch_adamw(isa, grad_dtype, n):
    steps = 3 if n > 10_000 else 12
    p0, grads = make(n, grad_dtype, steps)
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    p, m, v = run_zo(p0, grads, isa=isa, **hp)
    ref = ref_adam(p0, grads, **hp)
    tp = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([tp], **hp)
    for g in grads:
        tp.grad = g.float()
        opt.step()
    st = opt.state[tp]
    assert_within_2x_of(p, ref[0], tp.detach(), "param")
    assert_within_2x_of(m, ref[1], st["exp_avg"], "exp_avg")
    assert_within_2x_of(v, ref[2], st["exp_avg_sq"], "exp_avg_sq")


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37, 1 / 65536])
def test_modes_against_fp32_torch_ops(isa, adamw, bias_correction, grad_scale):
    p0, grads = make(4097, torch.bfloat16, steps=20, seed=1)
    grads = [g * (65536.0 if grad_scale == 1 / 65536 else 1.0) for g in grads]  # a loss-scaled gradient
    hp = dict(lr=3e-3, weight_decay=0.1, adamw=adamw, bias_correction=bias_correction, grad_scale=grad_scale)
    p, m, v = run_zo(p0, grads, isa=isa, **hp)
    ref = ref_adam(p0, grads, **hp)
    ref32 = ref_adam(p0, grads, dtype=torch.float32, **hp)
    for name, a, r, r32 in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), ref, ref32):
        assert_within_2x_of(a, r, r32, name)


@pytest.mark.parametrize("adamw", [True, False])
def test_l2_mode_matches_torch_adam(adamw):
    p0, grads = make(4097, steps=15, seed=2)
    hp = dict(lr=1e-2, weight_decay=0.1)
    p, m, v = run_zo(p0, grads, isa=zk.best_isa(), adamw=adamw, **hp)
    tp = p0.clone().requires_grad_()
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([tp], **hp)
    for g in grads:
        tp.grad = g.clone()
        opt.step()
    ref = ref_adam(p0, grads, adamw=adamw, **hp)
    assert_within_2x_of(p, ref[0], tp.detach(), "param")
    assert_within_2x_of(v, ref[2], opt.state[tp]["exp_avg_sq"], "exp_avg_sq")


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 17, 4097, 100_003])
def test_isas_and_threads_are_bit_identical(grad_dtype, n):
    """Every variant runs the same fp32 operation sequence, so all agree bit for bit, at any thread count."""
    p0, grads = make(n, grad_dtype, steps=4, seed=3)
    hp = dict(lr=1e-2, weight_decay=0.01, param_out=None)
    results = {}
    for isa in ISAS:
        for threads in (1, 2):
            results[isa, threads] = run_zo(p0, grads, isa=isa, threads=threads, **hp)
    first_key, first = next(iter(results.items()))
    for key, res in results.items():
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), res, first):
            assert_bits_equal(a, b, f"{name} {key} vs {first_key}")


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("out_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_param_out_is_exact_cast_of_param(isa, out_dtype, grad_dtype):
    p0, grads = make(4097, grad_dtype, steps=1, seed=4)
    p, m, v = p0.clone(), torch.zeros(4097), torch.zeros(4097)
    out = torch.full((4097,), float("nan"), dtype=out_dtype)  # poison: an unwritten element fails
    cpu_adam_step(p, grads[0], m, v, step=1, lr=1e-2, isa=isa, param_out=out)
    assert_bits_equal(out, p.to(out_dtype), "param_out")


def special_values() -> torch.Tensor:
    """Every class of fp32 value a cast can meet, plus random bit patterns over the whole range."""
    f16max, bf16max = 65504.0, float(torch.finfo(torch.bfloat16).max)
    vals = [0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
            65519.0, 65520.0, 65535.9, 65536.0, f16max, 70000.0, -70000.0, bf16max, 3.4e38, -3.4e38,
            6.0e-8, 5.96e-8, 2.98e-8, 2.9802322e-08, 3.0e-8, 1e-40, -1e-40, 1.4e-45, 6.1035156e-05, 6.1e-05,
            1.00048828125, 1.0009765625, 1.00146484375, 1.00390625, 1.005859375, 1.0078125]  # fmt: skip
    bits = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    ties = torch.randint(0, 2**16, (4000,), generator=torch.Generator().manual_seed(6), dtype=torch.int64)
    ties = (ties << 16) | 0x8000  # exact halfway cases for bf16
    rand = torch.cat([bits, ties]).to(torch.int32).view(torch.float32)
    small = torch.randn(4000, generator=torch.Generator().manual_seed(7)) * 1e-5  # fp16 subnormal range
    return torch.cat([torch.tensor(vals), rand, small])


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_downcast_bit_exact_against_torch(isa, out_dtype):
    """With lr = 0 and zero gradients the step leaves p as is and only casts it: compare to torch's .to()."""
    p = special_values()
    n = p.numel()
    expected = p.to(out_dtype)
    out = torch.full((n,), 1.0, dtype=out_dtype)
    cpu_adam_step(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, isa=isa, param_out=out)
    assert_bits_equal(out, expected, f"param -> {out_dtype}")


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_grad_upcast_exact(isa, grad_dtype):
    """A 16-bit grad is read exactly: one step from zero state equals the fp32-grad step on grad.float()."""
    g = special_values().to(grad_dtype)
    g[g.isnan() | g.isinf()] = 1.0
    n = g.numel()
    p0 = torch.randn(n)
    a = run_zo(p0, [g], isa=isa, lr=1e-2)
    b = run_zo(p0, [g.float()], isa=isa, lr=1e-2)
    for x, y in zip(a, b):
        assert_bits_equal(x, y, "16-bit grad vs its fp32 upcast")


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("offset", [1, 3, 7])
def test_views_at_odd_offsets(isa, offset):
    n = 4097
    p0, grads = make(n, torch.bfloat16, steps=3, seed=8)
    store = torch.zeros(4 * (n + 8))
    p, m, v = (store[k * (n + 8) + offset : k * (n + 8) + offset + n] for k in range(3))
    p.copy_(p0)
    gstore = torch.zeros(n + 8, dtype=torch.bfloat16)
    g = gstore[offset : offset + n]
    out_store = torch.zeros(n + 8, dtype=torch.float16)
    out = out_store[offset : offset + n]
    for i, gi in enumerate(grads):
        g.copy_(gi)
        cpu_adam_step(p, g, m, v, step=i + 1, lr=1e-2, isa=isa, param_out=out)
    expected = run_zo(p0, grads, isa=isa, lr=1e-2)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), expected):
        assert_bits_equal(a, b, name)
    assert_bits_equal(out, expected[0].half(), "param_out")
    assert torch.all(out_store[:offset] == 0) and torch.all(out_store[offset + n :] == 0), "wrote outside the view"


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("tile", [1, 16, 100, 1000, 4096, 5000])
def test_tiled_is_bit_identical_and_sink_sees_final_tiles(isa, tile):
    n = 4097
    p0, grads = make(n, torch.bfloat16, steps=1, seed=9)
    untiled = run_zo(p0, grads, isa=isa, lr=1e-2)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    seen = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    calls = []

    def sink(start, end):
        calls.append((start, end))
        seen[start:end] = out[start:end]  # what a copy stream would send at this moment

    cpu_adam_step(p, grads[0], m, v, step=1, lr=1e-2, isa=isa, param_out=out, tile_numel=tile, sink=sink)
    expected_calls = [(s, min(n, s + tile)) for s in range(0, n, tile)]
    assert calls == expected_calls
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), untiled):
        assert_bits_equal(a, b, name)
    assert_bits_equal(seen, untiled[0].to(torch.bfloat16), "tile contents at sink time")


def test_empty_tensor_is_a_no_op():
    e = torch.empty(0)
    cpu_adam_step(e, e.clone(), e.clone(), e.clone(), step=1, lr=1e-3, sink=lambda s, t: pytest.fail("called"))


def test_env_var_forces_isa(monkeypatch):
    for isa in ISAS:
        monkeypatch.setenv(zk.cpu_adam.ISA_ENV, isa)
        assert zk.best_isa() == isa
    monkeypatch.setenv(zk.cpu_adam.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="ZO_KERNELS_ISA"):
        zk.best_isa()


def test_releases_the_gil():
    """Python code runs in another thread while the kernel runs (the scalar variant: slowest, longest window)."""
    n = 4_000_000
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    window = {}

    def work():
        window["start"] = time.perf_counter()
        cpu_adam_step(p, g, m, v, step=1, lr=1e-3, isa="scalar", threads=1)
        window["end"] = time.perf_counter()

    t = threading.Thread(target=work)
    stamps = []
    t.start()
    while t.is_alive():
        stamps.append(time.perf_counter())
    t.join()
    inside = [s for s in stamps if window["start"] < s < window["end"]]
    assert len(inside) > 100, f"only {len(inside)} Python iterations ran during the kernel: GIL held?"


# ---------------------------------------------------------------- bad input: named, and nothing touched


def _bad_cases():
    n = 33
    ok = dict(step=1, lr=1e-3)
    t32 = lambda k=n: torch.randn(k)  # noqa: E731
    base = lambda: dict(param=t32(), grad=t32(), exp_avg=t32(), exp_avg_sq=t32())  # noqa: E731
    cases = []

    def case(name, exc, match, **changes):
        cases.append(pytest.param(changes, exc, match, id=name))

    case("grad-size", ValueError, "grad has 32 elements", grad=lambda b: t32(32))
    case("exp_avg-size", ValueError, "exp_avg has 34", exp_avg=lambda b: t32(34))
    case("param_out-size", ValueError, "param_out has", param_out=lambda b: torch.zeros(32, dtype=torch.float16))
    case("param-dtype", TypeError, "param must have dtype float32", param=lambda b: t32().double())
    case("grad-int", TypeError, "grad must have dtype", grad=lambda b: torch.ones(n, dtype=torch.int32))
    case("exp_avg_sq-half", TypeError, "exp_avg_sq must have dtype float32", exp_avg_sq=lambda b: t32().half())
    case("param_out-int8", TypeError, "param_out must have dtype", param_out=lambda b: torch.zeros(n, dtype=torch.int8))
    case("grad-noncontig", ValueError, "grad must be contiguous", grad=lambda b: torch.randn(2 * n)[::2])
    case("param-noncontig", ValueError, "param must be contiguous", param=lambda b: torch.randn(n, 2).t())
    case("param-not-tensor", TypeError, "param must be a torch.Tensor", param=lambda b: [1.0] * n)
    case("grad-meta", ValueError, "grad must be a CPU tensor", grad=lambda b: torch.empty(n, device="meta"))
    case("out-overlaps-param", ValueError, "param and param_out overlap", param_out=lambda b: b["param"])
    case("out-overlaps-m", ValueError, "exp_avg and param_out overlap",
         param_out=lambda b: b["exp_avg"].view(torch.bfloat16)[:n])  # fmt: skip
    case("m-is-v", ValueError, "exp_avg and exp_avg_sq overlap", exp_avg_sq=lambda b: b["exp_avg"])
    case("lr-neg", ValueError, "lr must be >= 0", lr=-1e-3)
    case("lr-nan", ValueError, "lr must be finite", lr=float("nan"))
    case("lr-str", TypeError, "lr must be a real number", lr="0.1")
    case("beta1-1", ValueError, r"betas\[0\] must be in \[0, 1\)", betas=(1.0, 0.999))
    case("beta2-neg", ValueError, r"betas\[1\] must be in \[0, 1\)", betas=(0.9, -0.1))
    case("beta2-inf", ValueError, r"betas\[1\] must be finite", betas=(0.9, float("inf")))
    case("betas-3", ValueError, "betas must be a pair", betas=(0.9, 0.99, 0.9))
    case("eps-0", ValueError, "eps must be > 0", eps=0.0)
    case("eps-inf", ValueError, "eps must be finite", eps=float("inf"))
    case("wd-neg", ValueError, "weight_decay must be >= 0", weight_decay=-0.1)
    case("wd-nan", ValueError, "weight_decay must be finite", weight_decay=float("nan"))
    case("step-0", ValueError, "step must be >= 1", step=0)
    case("step-float", TypeError, "step must be an int", step=1.5)
    case("grad_scale-inf", ValueError, "grad_scale must be finite", grad_scale=float("inf"))
    case("grad_scale-neg", ValueError, "grad_scale must be >= 0", grad_scale=-1.0)
    case("threads-0", ValueError, "threads must be >= 1", threads=0)
    case("isa-bad", ValueError, "isa must be one of", isa="neon")
    case("tile-0", ValueError, "tile_numel must be >= 1", tile_numel=0)
    case("sink-not-callable", TypeError, "sink must be callable", sink=3)
    return base, ok, cases


_BASE, _OK, _CASES = _bad_cases()


@pytest.mark.parametrize("changes, exc, match", _CASES)
def test_bad_input_is_named_and_touches_nothing(changes, exc, match):
    b = _BASE()
    b["param_out"] = torch.zeros(33, dtype=torch.bfloat16)
    kw = dict(_OK)
    for k, val in changes.items():
        if k in b:
            b[k] = val(b)
        else:
            kw[k] = val
    tensors = [t for t in b.values() if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    before = digest(*tensors)
    with pytest.raises(exc, match=match):
        cpu_adam_step(b["param"], b["grad"], b["exp_avg"], b["exp_avg_sq"], param_out=b["param_out"], **kw)
    assert digest(*tensors) == before, "a rejected call modified a tensor"


def test_cpp_boundary_checks_too():
    """The C++ entry point validates on its own (a caller that skips the Python layer gets an error, not a crash)."""
    from zo_kernels import _cpu

    x = torch.zeros(16)
    args = dict(param=x.data_ptr(), grad=x.data_ptr(), grad_dtype=0, exp_avg=x.data_ptr(), exp_avg_sq=x.data_ptr(),
                param_out=0, out_dtype=3, n=16, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.0, grad_scale=1.0, adamw=True, bias_correction=True, isa=0, threads=1)  # fmt: skip
    for key, val, msg in [("grad_dtype", 7, "grad dtype code"), ("n", -1, "n must be >= 0"), ("step", 0, "step must"),
                          ("beta1", 1.0, "beta1 must be in"), ("eps", math.nan, "eps must be finite"),
                          ("isa", 9, "isa code"), ("threads", 0, "threads must"), ("param", 0, "param address is null"),
                          ("exp_avg", 2, "exp_avg address must be 4-byte aligned"),
                          ("out_dtype", 1, "param_out address is null")]:  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            _cpu.adam_step(**{**args, key: val})


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 15, 64, 65, 4097, 100_003])
def test_sum_squares_and_nonfinite_flag(isa, dtype, n):
    """Within fp32 accumulation error of a float64 reference (chunks of 4096 in fp32, then double)."""
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    out = torch.full((n,), float("nan"), dtype=dtype)
    got, bad = zk.sum_squares(x, isa=isa, out=out)
    ref = (x.double() ** 2).sum().item()
    assert not bad and abs(got - ref) <= 4096 * FP32_EPS * ref + 1e-30
    assert_bits_equal(out, x, "the copy made in the same pass")
    assert zk.sum_squares(x, isa=isa) == (got, bad)
    for value in (float("inf"), -float("inf"), float("nan")):
        if n:
            y = x.clone()
            y[n // 2] = value
            assert zk.sum_squares(y, isa=isa)[1], f"{value} at {n // 2} not flagged"
    if dtype == torch.bfloat16 and n:
        y = x.clone()
        y[-1] = 3.0e38  # finite, its square overflows fp32: a large value, not a non-finite one
        assert not zk.sum_squares(y, isa=isa)[1]


def test_sum_squares_bits_depend_on_neither_threads_nor_timing():
    """The gradient norm's sum (clipping, accumulation, several ranks) is the same bits in every run and for every
    thread count: the chunks' partials are added in chunk order. Before, each thread summed its own chunks and an
    OpenMP reduction added those in the order the threads finished: 2 different sums in 300 calls with 8 threads
    on a 2-core machine, and here 2**54 + 224 with 8 threads against 2**54 with one."""
    n = 8 << 17  # 256 chunks of 4096, 32 per thread with 8 threads
    x = torch.zeros(n)
    x[0] = 2.0**27  # its square, 2**54, is the first chunk's partial: 1 more rounds back to 2**54 (ulp 4)...
    x[4096::4096] = 1.0  # ...and each other chunk adds 1, while 32 of them summed apart add 32 exactly
    assert zk.sum_squares(x, threads=1)[0] == 2.0**54
    seen = {zk.sum_squares(x, threads=t)[0] for t in (2, 3, 8, 16) for _ in range(20)}
    assert seen == {2.0**54}, f"sums {sorted(seen)}"
    g = torch.Generator().manual_seed(5)
    scales = torch.exp2(torch.randint(-20, 20, (n // 4096,), generator=g).float()).repeat_interleave(4096)
    y = torch.randn(n, generator=g) * scales
    ref = zk.sum_squares(y, threads=1)[0]
    assert math.isclose(ref, (y.double() ** 2).sum().item(), rel_tol=1e-5)
    assert {zk.sum_squares(y, threads=t)[0] for t in (2, 5, 8) for _ in range(50)} == {ref}


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 4097, 100_003])
@pytest.mark.parametrize("alpha", [1.0, 0.37, -2.5e-3])
def test_accumulate_is_one_rounding_of_acc_plus_alpha_x(isa, dtype, n, alpha):
    """acc + alpha * x with one rounding: against float64 (the product of an fp32 alpha and a value of <= 24 bits is
    exact there; for these randn-range values its sum then rounds to fp32 once, as the fma does), bit for bit;
    torch's fp32 add_ gives the same bits. Three threads: split ranges join exactly."""
    gen = torch.Generator().manual_seed(n)
    acc = torch.randn(n, generator=gen) * 5
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    a32 = torch.tensor(alpha, dtype=torch.float32).item()  # the kernel's alpha: rounded to fp32 once
    ref = (acc.double() + a32 * x.double()).float()
    got = acc.clone()
    assert zk.accumulate(got, x, alpha=alpha, isa=isa, threads=3) is got
    assert_bits_equal(got, ref, "fma(alpha, x, acc)")
    assert_bits_equal(got, acc.clone().add_(x.float(), alpha=a32), "torch's add_ in fp32")


_TEAM_SCRIPT = """
import torch, zo_kernels as zk
from zo_kernels import Quantized8bit
n = 200_003
g = torch.Generator().manual_seed(0)
p0, gr = torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16()
def run(threads, fmt):
    p = p0.clone()
    if fmt == "8bit":
        m, v = Quantized8bit.empty(n, signed=True), Quantized8bit.empty(n, signed=False)
    else:
        m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2):
        zk.cpu_adam_step(p, gr, m, v, step=step, lr=1e-2, param_out=out, threads=threads)
    return p, out
for fmt in ("fp32", "8bit"):
    (a, ao), (b, bo) = run(1, fmt), run(4, fmt)
    assert torch.equal(a, b) and torch.equal(ao, bo), fmt
x = zk.accumulate(torch.zeros(n), gr, alpha=0.5, threads=1)
assert torch.equal(x, zk.accumulate(torch.zeros(n), gr, alpha=0.5, threads=4)), "accumulate"
print("ok")
"""


@pytest.mark.parametrize("env", [{"OMP_THREAD_LIMIT": "1"}, {"OMP_DYNAMIC": "true", "OMP_THREAD_LIMIT": "2"}],
                         ids=["thread_limit", "dynamic"])  # fmt: skip
def test_a_smaller_openmp_team_still_covers_every_element(env):
    """OpenMP may give a region fewer threads than asked (OMP_THREAD_LIMIT, OMP_DYNAMIC=true, as clusters set
    them): the split is made from the team's own size, so 4 threads asked under a limit of 1 or 2 update every
    element, bit for bit as one thread does (they left 3/4 of the parameters untouched, silently, until 2026-11-26)."""
    r = subprocess.run([sys.executable, "-c", _TEAM_SCRIPT], env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_accumulate_refuses_bad_arguments_before_writing():
    acc, x = torch.zeros(8), torch.ones(8, dtype=torch.bfloat16)
    for args, kw, err, words in (
        ((acc.double(), x), {}, TypeError, "acc must have dtype float32"),
        ((acc, x[:4]), {}, ValueError, "x has 4 elements, expected 8"),
        ((acc, x.int()), {}, TypeError, "x must have dtype"),
        ((acc, acc), {}, ValueError, "acc and x overlap"),
        ((acc, x), {"alpha": float("nan")}, ValueError, "alpha must be finite"),
        ((acc, x), {"alpha": "2"}, TypeError, "alpha must be a real number"),
        ((acc, x), {"threads": 0}, ValueError, "threads must be >= 1"),
        ((torch.zeros(16)[::2], x), {}, ValueError, "acc must be contiguous"),
        ((torch.zeros(8, requires_grad=True), x), {}, RuntimeError, "acc requires grad"),
    ):
        with pytest.raises(err, match=words):
            zk.accumulate(*args, **kw)
    assert torch.equal(acc, torch.zeros(8))


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("tile", [1, 100, 4096, 5000])
def test_c_tile_sink_runs_the_tile_loop_in_cpp(isa, tile):
    """A C sink (here the host copy one; on a GPU the H2D one) sees every finished tile, bit for bit."""
    n = 4097
    p0, grads = make(n, torch.bfloat16, steps=1, seed=11)
    ref = run_zo(p0, grads, isa=isa, lr=1e-2, param_out=None)
    ref_out = ref[0].to(torch.bfloat16)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    staging = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    dst = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    sink = zk.cpu_adam.copy_tile_sink(dst, staging)
    cpu_adam_step(p, grads[0], m, v, step=1, lr=1e-2, isa=isa, param_out=staging, tile_numel=tile, sink=sink)
    assert_bits_equal(dst, ref_out, "tiles copied by the C sink")
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), ref):
        assert_bits_equal(a, b, name)


def test_c_tile_sink_bad_input():
    import datetime

    x = torch.zeros(8)
    with pytest.raises(TypeError, match="sink must be callable"):
        cpu_adam_step(x.clone(), x.clone(), x.clone(), x.clone(), step=1, lr=1e-3, sink=datetime.datetime_CAPI)
    with pytest.raises(TypeError, match="dst must have dtype float32"):
        zk.cpu_adam.copy_tile_sink(torch.zeros(8, dtype=torch.float16), x)
    with pytest.raises(ValueError, match="dst has 4 elements, expected 8"):
        zk.cpu_adam.copy_tile_sink(torch.zeros(4), x)


def test_a_small_call_keeps_the_update_threads():
    """Each parallel region asks for the whole `threads` team (the threads past the work idle): libgomp ends pool
    threads when a region asks for fewer than the last one and starts them again for a larger one, so a short run
    between two long ones cost a thread start per worker (2 of 4 threads ended and restarted here, the long call
    after it 3.9 ms against 0.2). The process keeps its thread count across long, short and sum-of-squares calls."""
    n = 1 << 20
    p, g, m, v = (torch.zeros(n) for _ in range(4))
    zk.cpu_adam_step(p, g, m, v, step=1, lr=1e-3, threads=4)  # the team: 3 workers beside this thread
    before = len(os.listdir("/proc/self/task"))
    k = 1 << 15  # two ranges' worth (kMinPerThread = 2**14): before, a team of 2
    zk.cpu_adam_step(p[:k], g[:k], m[:k], v[:k], step=2, lr=1e-3, threads=4)
    assert len(os.listdir("/proc/self/task")) == before
    zk.sum_squares(p[:k], threads=4)
    zk.accumulate(m[:k], g[:k], threads=4)
    assert len(os.listdir("/proc/self/task")) == before


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sum_squares_copy_keeps_every_bit(isa, dtype):
    """A review's find: sum_squares(x, out=y)'s copy went through fp32 in the vector variants, so a NaN's sign and
    payload were rewritten (bf16 -NaN 0xffc0 -> 0x7fc0, sNaN 0x7f81 -> 0x7fc0); the scalar variant copied the bits.
    Every 16-bit pattern, copied bit for bit by every variant (the reference: the input's bits)."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    y = torch.zeros_like(x)
    zk.sum_squares(x, out=y, isa=isa)
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))


@pytest.mark.skipif(len(ISAS) < 1 or os.cpu_count() < 2, reason="needs two threads")
def test_flush_denormal_reaches_every_thread():
    """A review's find: torch.set_flush_denormal(True) sets flush-to-zero / denormals-are-zero on the calling thread
    only; the kernel's OpenMP workers kept their own mode, so one step gave other bits with threads=2 than with
    threads=1 (half of a 65536-element tensor differed). The caller's mode is every worker's for the call."""
    n = 1 << 16
    g = torch.full((n,), 1e-20)  # g^2 = 1e-40: a subnormal

    def run(threads):
        p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
        cpu_adam_step(p, g, m, v, step=1, lr=1e-3, eps=1.2e-38, threads=threads)
        return p.clone(), v.clone(), zk.sum_squares(g * 1e-19, threads=threads)[0]

    run(2)  # (the team exists)
    was = torch.set_flush_denormal(True)
    try:
        one, two = run(1), run(2)
    finally:
        torch.set_flush_denormal(False)
    assert was
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1]) and one[2] == two[2]
    assert not bool((one[1] != 0).any())  # flushed: the mode was the caller's on both threads
    after = run(2)
    assert bool((after[1] != 0).all())  # and it is not left on the workers after the call


@pytest.mark.parametrize("option", [{"delay_update_after": 0},
                                    {"selective": {"fraction": 0.5, "apply_every": 1, "warmup": 0}}])  # fmt: skip
def test_flush_denormal_reaches_the_optimizers_background_threads(option):
    """A review's find: the delayed update (and selective's window) run on pool threads made at the first step, which
    keep the floating-point mode they were made with: torch.set_flush_denormal(True) after that reached the
    synchronous step only (subnormal exp_avg_sq elements kept under DPU, flushed without it). The submitting
    thread's mode is the job's. The reference: the synchronous run (every subnormal flushed)."""
    def unflushed(**kw):
        torch.manual_seed(0)
        m = torch.nn.Linear(64, 64, bias=False)
        opt = zk.ZeroOffloadAdamW(m, lr=1e-3, dtype=torch.float32, eps=1.2e-38, threads=1, **kw)
        try:
            for i in range(3):
                if i == 1:
                    torch.set_flush_denormal(True)  # (after the first step: the pool threads exist)
                (m(torch.ones(1, 64)) * 1e-20).sum().backward()  # g = 1e-20: g^2 and v subnormal
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            v = opt.state[m.weight]["exp_avg_sq"]
        finally:
            torch.set_flush_denormal(False)
            opt.close()
        return int((v != 0).sum())  # (counted with denormals-are-zero off: under it a subnormal compares as 0)

    assert unflushed() == 0
    assert unflushed(**option) == 0
