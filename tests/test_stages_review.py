"""Stage 3 in the ways a user drives it beyond a plain training loop, judged against stage 2 or plain PyTorch."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

import zo_kernels as zk


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _train(stage: int, compile_backend: str | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=stage)
    run = torch.compile(model, backend=compile_backend) if compile_backend else model
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        loss = run(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with opt.gathered():
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt.close()
    return losses, weights


def test_compiled_model_at_stage3_trains_as_at_stage2() -> None:
    """torch.compile(model) (AOT autograd) at stage 3: the hooks' `p.data = ...` must not be traced as in-place
    writes of the parameters (autograd then refused the backward: "modified by an inplace operation")."""
    torch._dynamo.reset()
    want = _train(2, "aot_eager")
    torch._dynamo.reset()
    got = _train(3, "aot_eager")
    assert got[0] == want[0]
    assert all(torch.equal(got[1][k], v) for k, v in want[1].items())


def test_close_inside_gathered_leaves_the_parameters_whole() -> None:
    """close() hands the model back with whole parameters (as stage 2 does), also when called inside
    `with opt.gathered():` (the block's end freed them again: every parameter was left empty)."""
    torch.manual_seed(0)
    model = Net()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=3)
    with opt.gathered():
        opt.close()
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items()), {k: tuple(v.shape) for k, v in got.items()}


def test_linear_units_are_released_after_their_forward() -> None:
    """After forward, no unit holds memory (stage 3's device working set), with nn.Linear, whose backward saves
    weight.t(), a view of the gathered parameters: the storage under those views is released (resized to 0) and
    refilled before backward; training still matches stage 2 exactly."""
    results = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
        opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=stage, prefetch=0)
        bufs: list[weakref.ref] = []  # every gathered buffer, as long as anything (autograd's views) holds it
        if stage == 3:
            for u in opt.shards.units:
                u.start = lambda u=u, start=u.start, bufs=bufs: (start(), bufs.append(weakref.ref(u.buf)))
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(len(losses)))).square().sum()
            gc.collect()
            held = [b() for b in bufs if b() is not None and b().untyped_storage().nbytes()]
            assert not held, f"{len(held)} gathered buffers still hold memory after forward"
            if stage == 3:
                assert opt.device_bytes.now == opt.shards.shard.numel() * 4, "the counter disagrees"
            loss.backward()
            opt.step()
            losses.append(loss.item())
        opt.close()
        results[stage] = (losses, [p.detach().clone() for p in model.parameters()])
    assert results[3][0] == results[2][0]
    assert all(torch.equal(a, b) for a, b in zip(results[3][1], results[2][1]))


class UsesChildWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.emb(x)), self.emb.weight)  # the parent reads a child's parameter


def test_parent_reading_a_child_parameter_trains_as_at_stage2() -> None:
    """A parent reading a child's weight, registered with register_external_parameter: as at stage 2."""
    losses = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = UsesChildWeight()
        opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=stage)
        opt.register_external_parameter(model, model.emb.weight)  # the parent reads it (a no-op at stage 2)
        loss = model(torch.ones(2, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        losses[stage] = loss.item()
        opt.close()
    assert losses[3] == losses[2]
