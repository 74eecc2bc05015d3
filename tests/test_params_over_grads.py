"""The new 16-bit parameters written over the gradients they replace (one host buffer, issue 23's host bytes): the
kernel with param_out = grad gives the bits of separate buffers for every ISA and moment format, and on the GPU
path (CopyEngineTransport) the optimizer keeps no staging buffer and orders the landing buffer's writers after the
writeback that reads it."""

from __future__ import annotations

import pytest
import torch

import zo_kernels as zk
from zo_kernels import cpu_adam_step
from zo_kernels.cpu_adam import available_isas, plan_adam_step, zero_moments
from zo_kernels.offload.grads import GradPath
from zo_kernels.transport import CopyEngineTransport

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


# ---------------------------------------------------------------- the optimizer: one host buffer, and its ordering


def two_engines(delay_s: float) -> CopyEngineTransport:
    """D2H copies on an engine of their own, as CUDA's two copy streams (CopyEngineTransport's two engines), the H2D
    ones delayed: a gradient's copy into a landing buffer does not queue behind the H2D copies still reading it."""
    tr = CopyEngineTransport(delay_s=lambda dst, src: 0.0 if tr.pool.holds(dst) else delay_s, engines=2)
    return tr


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)).square().mean()


def _partial_forward_run(transport) -> tuple[list[float], list[torch.Tensor], int]:
    """DPU with per-module waits; iterations 2 and 3 call only model.a (not the root: b's tiles of the writeback at
    step 2 are never waited for by a forward, and b gets no gradient, so steps 2 and 3 leave its parameters as they
    are); iteration 4 reads b again. Returns the losses, the final parameters and b's tiles pending when backward
    3 began."""
    model = Two()
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, tile_numel=256, bucket_numel=1 << 12, transport=transport,
                              delay_update_after=0, dpu_writeback="per_module")  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    losses, pending = [], 0
    for it in range(4):
        x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
        loss = model(x) if it in (0, 3) else model.a(x).square().mean()
        losses.append(loss.item())
        if it == 2 and opt.update.fence is not None:
            pending = opt.update.fence.pending
        opt.backward(loss)
        opt.step()
    opt.synchronize()
    params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return losses, params, pending


def test_backward_does_not_overwrite_a_landing_buffer_under_its_writeback(monkeypatch):
    """Backward's copies into a landing buffer wait for the writeback copying the new parameters out of it: with
    the D2H copies on their own engine (as on CUDA) and the H2D ones delayed, a backward whose forward did not wait
    for every tile (only model.a called) must not overwrite b's parameters before they are copied. Without the wait
    (GradPath.landing_free) the device gets b's zero gradients as its parameters and iteration 4's loss differs."""
    from zo_kernels.transport import HostTransport

    ref = _partial_forward_run(HostTransport())
    tr = two_engines(delay_s=0.01)
    got = _partial_forward_run(tr)
    assert got[2] > 0, "no tile was in flight when backward began: nothing was tested"
    assert got[0] == ref[0] and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
    monkeypatch.setattr(GradPath, "landing_free", lambda self, s, host=False: None)
    broken = _partial_forward_run(tr)
    tr.close()
    assert broken[0][3] != ref[0][3], "the missing wait was not caught"


@pytest.mark.parametrize("state_dtype", [torch.float32, "8bit"], ids=["fp32", "8bit"])
def test_a_checkpoint_between_a_delayed_update_and_its_writeback_resumes_bitwise(tmp_path, state_dtype):
    """Saved under DPU (the last update's parameters not yet on the device: in its landing buffer), loaded into a new
    optimizer on the GPU's data flow: the loaded masters' cast waits in the landing buffer the next backward does not
    write, and the run goes on bit for bit as the uninterrupted one."""
    from offload_ref import make_data, make_model

    data = make_data(8, batch=2, seed=5)

    def train(model, opt, steps):
        for s in steps:
            x = data[s][0]
            opt.backward(model(x[:, :-1], x[:, 1:]))
            opt.step()

    def build(model, tr):
        return zk.ZeroOffloadAdamW(model, lr=2e-3, transport=tr, delay_update_after=1, tile_numel=4096,
                                   state_dtype=state_dtype)  # fmt: skip

    tr = CopyEngineTransport(delay_s=0.001)
    model_a = make_model()
    opt_a = build(model_a, tr)
    train(model_a, opt_a, range(8))
    opt_a.synchronize()
    model_b = make_model()
    opt_b = build(model_b, tr)
    train(model_b, opt_b, range(4))
    assert opt_b.update.staged or opt_b.update._pending is not None
    zk.save_checkpoint(tmp_path / "c.pt", model_b, opt_b, step=4)
    opt_b.close()
    model_c = make_model(seed=99)
    opt_c = build(model_c, tr)
    zk.load_checkpoint(tmp_path / "c.pt", model_c, opt_c)
    assert opt_c.update.staged, "the checkpoint was not taken between an update and its writeback"
    train(model_c, opt_c, range(4, 8))
    opt_c.synchronize()
    assert torch.equal(opt_a.master, opt_c.master)
    for p, q in zip(model_a.parameters(), model_c.parameters()):
        assert torch.equal(p, q)
    opt_a.close()
    opt_c.close()
    tr.close()
