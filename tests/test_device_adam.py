"""gpu_fraction's tail with bf16 and 8-bit moments (zo_kernels/offload/device_adam.py), judged by the host's CPU Adam
kernel (cpu/adam.cpp: C++, sharing no code with the torch-op encoders under test).

The oracle runs (tests/test_state_formats.py, cases with gpu_fraction) judge whole training runs against plain
PyTorch; here the encoders meet the kernel element by element: the stochastic rounding's bits, the 8-bit blocks and
their padding, and a parameter's short last block.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import adam_bound

import zo_kernels as zk
from zo_kernels.offload.device_adam import DeviceState, round_bf16_sr, sr_key
from zo_kernels.quant8 import Quantized8bit

HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _gradients(n: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(n, generator=g) * torch.logspace(-4, 1, n) for _ in range(steps)]


@pytest.mark.parametrize("seed,step", [(0, 1), (123, 7), ((5 << 40) + 4096, 2**33 + 5)])
def test_stochastic_rounding_is_the_host_kernels_bit_for_bit(seed, step):
    """With betas (0, 0) and zero moments the kernel's fp32 moments are exactly g and fl(g * g) before it rounds them,
    so its stored bf16 bits are its rounding's alone: round_bf16_sr must give the same bits, for every element
    (infinities and NaN included), every seed and step (their 32-bit halves both count)."""
    n = 5000
    g = _gradients(n, 1)[0]
    g[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    zk.cpu_adam_step(torch.zeros(n), g, m, v, step=step, lr=0.0, betas=(0.0, 0.0), eps=1e-8, seed=seed)
    got_m, got_v = round_bf16_sr(g, g * g, seed, step)
    assert torch.equal(got_m.view(torch.int16), m.view(torch.int16)), "exp_avg's random bits differ"
    assert torch.equal(got_v.view(torch.int16), v.view(torch.int16)), "exp_avg_sq's random bits differ"
    # index0: element i of a call from index0 is element index0 + i of one from 0; the index wraps as a uint32
    whole_m, whole_v = round_bf16_sr(torch.cat([torch.zeros(8), g]), torch.cat([torch.zeros(8), g * g]), seed, step)
    part_m, part_v = round_bf16_sr(g, g * g, seed, step, index0=8)
    assert torch.equal(whole_m[8:].view(torch.int16), part_m.view(torch.int16))
    assert torch.equal(whole_v[8:].view(torch.int16), part_v.view(torch.int16))
    wrapped = round_bf16_sr(g, g * g, seed, step, index0=2**32 + 8)
    assert torch.equal(wrapped[0].view(torch.int16), part_m.view(torch.int16))


def test_the_key_depends_on_every_half():
    """sr_key mixes the seed's and the step's two 32-bit halves (the bitwise test above judges its values)."""
    keys = {sr_key(s, t) for s in (0, 1, 1 << 32) for t in (0, 1, 1 << 32)}
    assert len(keys) == 9 and all(0 <= k < 2**32 for k in keys)


def _host_state(fmt: str, n: int):
    if fmt == "8bit":
        return Quantized8bit.empty(n, signed=True), Quantized8bit.empty(n, signed=False)
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    return torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)


def _bits(fmt: str, m, v, d: DeviceState) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if fmt == "8bit":
        return [(m.codes.int(), d.moments[0].int()), (m.scales, d.moments[1]), (v.codes.int(), d.moments[2].int()),
                (v.scales, d.moments[3])]  # fmt: skip
    return [(m.view(torch.int16).int(), d.moments[0].view(torch.int16).int()),
            (v.view(torch.int16).int(), d.moments[1].view(torch.int16).int())]  # fmt: skip


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_five_steps_store_the_moments_as_the_host_kernel(fmt):
    """Five AdamW steps of DeviceState (on the CPU: torch's fused kernel, then the encoders) against cpu_adam_step
    on the same values: the stored moments agree bit for bit in >= 99% of the elements (measured: all of them) and
    elsewhere by one code / one bf16 step (the two kernels' fp32 roundings may differ); the masters within fp32
    rounding. Two parameters, the first ending inside a block, the padding to the second's first block left out of
    the device's runs (as the optimizer's runs leave it) and kept as zeros."""
    a, pad = 256 * 6 + 17, 256 - 17  # (a parameter, the padding to the next block, then a second parameter)
    n = a + pad + 256 * 3 + 5
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
    p0[a : a + pad] = 0.0
    m, v = _host_state(fmt, n)
    p, d = p0.clone(), DeviceState(fmt, p0.clone(), seed=77)
    for step, g in enumerate(_gradients(n, 5), 1):
        g[a : a + pad] = 0.0
        zk.cpu_adam_step(p, g, m, v, step=step, **HP, seed=77)
        d.step(g, 1.0, [(0, 0, a, step, 1.0), (0, a + pad, n, step, 1.0)], [dict(HP, maximize=False)])
    for host, dev in _bits(fmt, m, v, d):
        diff = (host.double() - dev.double()).abs()
        if host.dtype == torch.float32:  # 8-bit scales: the block's absmax
            torch.testing.assert_close(dev, host, rtol=1e-6, atol=0)
            continue
        assert (diff == 0).double().mean() >= 0.99 and diff.max() <= 1, f"{int((diff > 0).sum())} elements differ"
    torch.testing.assert_close(d.master, p, rtol=2e-5, atol=1e-7)
    assert not d.master[a : a + pad].any(), "the padding between parameters stays zero"
    mm, vv = d.get(0, n)
    assert not mm[a : a + pad].any() and not vv[a : a + pad].any()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "8bit"])
def test_set_and_get_and_raw(fmt):
    """set from fp32 then get: exact for values the format holds (bf16 values; 8-bit: a quantized state's own values);
    set_raw of raw() bits restores them bit for bit; a set of a parameter's range leaves the next parameter's block
    alone."""
    n = 256 * 4 + 40
    g = torch.Generator().manual_seed(2)
    m = torch.randn(n, generator=g)
    v = torch.rand(n, generator=g)
    d = DeviceState(fmt, torch.zeros(n))
    d.set(0, n, m, v)
    got_m, got_v = d.get(0, n)
    if fmt == "fp32":
        assert torch.equal(got_m, m) and torch.equal(got_v, v)
    elif fmt == "bf16":
        assert torch.equal(got_m, m.bfloat16().float()) and torch.equal(got_v, v.bfloat16().float())
    else:
        assert torch.equal(got_m, Quantized8bit.from_float(m, signed=True).to_float())
        assert torch.equal(got_v, Quantized8bit.from_float(v, signed=False).to_float())
    raw = d.raw()
    other = DeviceState(fmt, torch.zeros(n))
    keys = (["exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales"] if fmt == "8bit"
            else ["exp_avg", "exp_avg_sq"])  # fmt: skip
    other.set_raw(0, n, dict(zip(keys, raw)))
    assert all(torch.equal(x, y) for x, y in zip(other.raw(), raw))
    before = [t.clone() for t in d.moments]
    d.set(256, 512, torch.ones(256), torch.ones(256))  # one block: the others keep their bits
    for t, b in zip(d.moments, before):
        per = 1 if t.numel() == n else 256  # (8-bit scales: one per block)
        assert torch.equal(t[: 256 // per], b[: 256 // per]) and torch.equal(t[512 // per :], b[512 // per :])


# ---------------------------------------------------------------------- the Triton kernel (on a GPU: the tail's update)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors needs the interpreter (off "
                                       "with a GPU: tests/test_gpu.py runs the compiled kernel)")  # fmt: skip


def _kernel_moments(fmt: str, n: int) -> list[torch.Tensor]:
    if fmt == "8bit":
        nb = -(-n // 256)
        return [torch.zeros(n, dtype=torch.int8), torch.zeros(nb), torch.zeros(n, dtype=torch.uint8), torch.zeros(nb)]
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    return [torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)]


@needs_interpreter
@pytest.mark.parametrize("fmt", ["8bit", "bf16", "fp32"])
@pytest.mark.parametrize("gdtype, weight_decay, maximize", [(torch.float32, 0.1, False), (torch.bfloat16, 0.0, True),
                                                            (torch.float16, 0.1, False)])  # fmt: skip
def test_triton_kernel_is_the_host_kernel_bit_for_bit(fmt, gdtype, weight_decay, maximize):
    """zo_kernels/kernels/adam.py (interpreted) against cpu_adam_step over four steps from the same state: masters,
    codes, scales and bf16 bits equal bit for bit, for a call ending inside its last block, gradients of every
    dtype, with and without weight decay, maximize, a grad scale, and tiny, zero and NaN-free extreme gradients."""
    from zo_kernels.kernels.adam import adam_step

    n = 1024 + 256 * 3 + 77  # (launched as whole blocks, then the short last one)
    p_host = torch.randn(n, generator=torch.Generator().manual_seed(4))
    p_dev = p_host.clone()
    m, v = _host_state(fmt, n)
    dev = _kernel_moments(fmt, n)
    hp = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    for step, g in enumerate(_gradients(n, 4), 1):
        g[:3] = torch.tensor([0.0, 1e-30, 3e4])
        g = g.to(gdtype)
        zk.cpu_adam_step(p_host, g, m, v, step=step, **hp, grad_scale=0.25, maximize=maximize, seed=5)
        adam_step(p_dev, g, dev, fmt, step=step, **hp, grad_scale=0.25, maximize=maximize,
                  key=sr_key(5, step))  # fmt: skip
    assert torch.equal(p_dev, p_host), f"masters differ at {int((p_dev != p_host).sum())} elements"
    host = ([m.codes, m.scales, v.codes, v.scales] if fmt == "8bit" else [m, v] if fmt == "fp32"
            else [m.view(torch.int16), v.view(torch.int16)])  # fmt: skip
    for a, b in zip(dev, host):
        assert torch.equal(a.view(b.dtype), b)


@needs_interpreter
@pytest.mark.parametrize("fmt", ["8bit", "bf16", "fp32"])
def test_with_the_kernel_the_tail_is_the_host_only_run_bit_for_bit(fmt, monkeypatch):
    """The tail's update through the kernel (interpreted) is CPU Adam's arithmetic, its random bits (bf16, 8-bit
    exp_avg) hashed from each element's partition offset as the host's: gpu_fraction 0.5 trains the same masters and
    moments (8-bit: codes and scales) as 0, bit for bit (no clipping: its norm sums the two parts in another order)."""
    from test_twin import FORMATS, _train, assert_same_state

    import zo_kernels.offload.device_adam as device_adam

    _, host_only = _train(0.0, steps=3, state_dtype=FORMATS[fmt])
    want = host_only.state_dict()
    host_only.close()
    monkeypatch.setattr(device_adam, "IMPL", "triton")
    _, twin = _train(0.5, steps=3, state_dtype=FORMATS[fmt])
    assert twin.split < twin.part
    assert_same_state(twin.state_dict(), want, "gpu_fraction 0.5 through the kernel")
    twin.close()


def test_the_interpreter_shims_fma_rounds_once():
    """tests/interpreter_compat.py's fp32 fma (for Triton 3.6's interpreter, which rounds a * b + c twice) against the
    exact value rounded once to fp32 in rational arithmetic (ties to even): random operands, the product's own
    rounding error (c = -fl(a * b): an fma gives it exactly), near-ties, signed zeros, infinities."""
    from fractions import Fraction

    import numpy as np
    from interpreter_compat import fma_f32

    rng = np.random.default_rng(0)
    a = rng.standard_normal(1500).astype(np.float32)
    b = (rng.standard_normal(1500) * 2.0 ** rng.integers(-20, 20, 1500)).astype(np.float32)
    c = np.concatenate([-(a[:500] * b[:500]), rng.standard_normal(1000).astype(np.float32)]).astype(np.float32)
    a = np.append(a, np.float32(1 + 2**-12)).astype(np.float32)
    b = np.append(b, np.float32(1 + 2**-12)).astype(np.float32)
    c = np.append(c, np.float32(-1.0)).astype(np.float32)
    got = fma_f32(a, b, c)

    def rounded(x: Fraction) -> np.float32:
        f = np.float32(float(x))
        best = None
        for cand in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))):
            d = abs(Fraction(float(cand)) - x)
            even = int(np.array(cand).view(np.int32)) % 2 == 0
            if best is None or d < best[0] or (d == best[0] and even):
                best = (d, cand)
        return best[1]

    for x, y, z, g in zip(a, b, c, got):
        want = rounded(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
        assert g == want, (x, y, z, g, want)
    assert got[-1] == np.float32(2**-11 + 2**-24)
    inf = np.float32(np.inf)
    special = fma_f32(np.array([inf, 0.0, 2.0], np.float32), np.array([1.0, -1.0, 3.0], np.float32),
                      np.array([1.0, 0.0, inf], np.float32))  # fmt: skip
    assert special[0] == inf and special[2] == inf and special[1] == 0.0 and np.signbit(special[1]) == np.signbit(
        np.float32(-0.0) + np.float32(0.0))  # fmt: skip


def _guard_case(n: int) -> list[torch.Tensor]:
    """Three steps whose third meets the 8-bit guard: element 0 takes a large gradient then one of opposite sign (its m
    back near 0, its sqrt(v) the block's scale), element 5 a small one (its sqrt(v) rounds to code 0, its m to 127);
    the rest of the tensor heavy-tailed gradients (log-normal scales, sigma 2)."""
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(n, generator=gen) * torch.exp(2.0 * torch.randn(n, generator=gen)) * 1e-4 for _ in range(3)]
    for g in grads:
        g[:256] = 0.0
    grads[0][0], grads[1][0], grads[1][5] = 1000.0, -900.0, 1.0
    return grads


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_interpreter), "torch"])
def test_the_tail_applies_the_8bit_guard_as_the_host_kernel(impl, monkeypatch):
    """Element 5 of _guard_case moves by lr x the bound at step 3 on the host (tests/helpers.py's adam_bound, from
    its definition); the tail's update does the same: through the kernel (interpreted) bit for bit, in
    torch ops within fp32 rounding (masters; codes off by one only where the two roundings straddle a tie)."""
    import zo_kernels.offload.device_adam as device_adam

    monkeypatch.setattr(device_adam, "IMPL", impl)
    n = 256 * 8 + 77
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    p = torch.zeros(n)
    m, v = _host_state("8bit", n)
    d = DeviceState("8bit", p.clone(), seed=1)
    for step, g in enumerate(_guard_case(n), 1):
        before = (p[5].item(), d.master[5].item())
        zk.cpu_adam_step(p, g, m, v, step=step, seed=1, **hp)
        d.step(g, 1.0, [(0, 0, n, step, 1.0)], [dict(hp, maximize=False)])
    bound = adam_bound(3, 0.9, 0.999)
    assert before[0] - p[5].item() == pytest.approx(1e-3 * bound, rel=1e-5)
    assert before[1] - d.master[5].item() == pytest.approx(1e-3 * bound, rel=1e-5)
    if impl == "triton":
        assert torch.equal(d.master, p)
        for host, dev in _bits("8bit", m, v, d):
            assert torch.equal(host, dev)
    else:
        torch.testing.assert_close(d.master, p, rtol=2e-5, atol=1e-9)
