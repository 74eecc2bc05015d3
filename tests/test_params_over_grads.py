"""The new 16-bit parameters written over the gradients they replace (one host buffer, issue 23's host bytes): the
kernel with param_out = grad gives the bits of separate buffers for every ISA and moment format, and on the GPU
path (CopyEngineTransport) the optimizer keeps no staging buffer and orders the landing buffer's writers after the
writeback that reads it."""

from __future__ import annotations

import pytest
import torch

from zo_kernels import cpu_adam_step
from zo_kernels.cpu_adam import available_isas, plan_adam_step, zero_moments

FORMATS = [torch.float32, torch.bfloat16, "8bit"]


def _state(n: int, fmt, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m, v = zero_moments(p, fmt)
    return p, m, v


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    return type(x)(x.codes.clone(), x.scales.clone(), signed=x.signed, block=x.block)


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_param_out_over_grad_is_bitwise_the_separate_buffer(isa, fmt, dtype):
    # odd lengths (vector tails, a short last 8-bit block) and one long enough for the non-temporal stores
    for n, threads in ((1000 + 37, 1), (600_000 + 13, 2)):
        p, m, v = _state(n, fmt, seed=n)
        grads = [torch.randn(n, generator=torch.Generator().manual_seed(k)).mul_(1e-2).to(dtype) for k in range(3)]
        p2, m2, v2 = p.clone(), _clone(m), _clone(v)
        for step, g in enumerate(grads, 1):
            hp = dict(step=step, lr=1e-2, weight_decay=0.1, threads=threads, isa=isa, seed=7)
            out = torch.empty(n, dtype=dtype)
            cpu_adam_step(p, g, m, v, param_out=out, **hp)
            over = g.clone()  # the landing buffer: the update writes the params over its gradient
            cpu_adam_step(p2, over, m2, v2, param_out=over, **hp)
            assert torch.equal(over.view(torch.uint8), out.view(torch.uint8)), (isa, fmt, dtype, n, step)
            assert torch.equal(p2, p)
        # the planned call's ranges (tiles of the writeback): out = grad[start:end]
        p3, m3, v3 = _state(n, fmt, seed=n)
        g = grads[0].clone()
        ref = torch.empty(n, dtype=dtype)
        cpu_adam_step(p3.clone(), g.clone(), _clone(m3), _clone(v3), param_out=ref, step=1, lr=1e-2, isa=isa)
        plan = plan_adam_step(p3, g, m3, v3, step=1, lr=1e-2, isa=isa, out_dtype=dtype)
        tile = 512 * 3
        for a in range(0, n, tile):
            plan.run(a, min(n, a + tile), g[a : min(n, a + tile)])
        assert torch.equal(g.view(torch.uint8), ref.view(torch.uint8))


def test_param_out_overlapping_grad_elsewhere_is_refused():
    p, m, v = _state(64, torch.float32, 0)
    g = torch.randn(65, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="overlap"):  # shifted by one element: not the same place
        cpu_adam_step(p, g[:64], m, v, param_out=g[1:], step=1, lr=1e-3)
    g16 = torch.randn(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="overlap"):  # same address, another dtype
        cpu_adam_step(p, g16, m, v, param_out=g16.view(torch.float16), step=1, lr=1e-3)

