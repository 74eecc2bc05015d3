"""Stage 3 in the ways a user drives it beyond a plain training loop, judged against stage 2 or plain PyTorch."""

from __future__ import annotations

import gc
import weakref

import pytest
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


@pytest.mark.xfail(strict=True, reason="autograd saves weight.t() (a view of the gathered buffer) for nn.Linear's "
                   "backward: the buffer stays alive until backward although the unit counts as freed; needs a "
                   "linear that saves no view (as DeepSpeed's) or storage-level freeing")
def test_linear_units_are_released_after_their_forward() -> None:
    """After forward, no unit's gathered buffer is still alive (stage 3's device working set), with nn.Linear."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=3, prefetch=0)
    bufs: list[weakref.ref] = []
    start = opt.shards._start
    opt.shards._start = lambda u: (start(u), bufs.append(weakref.ref(u.buf)))
    loss = model(torch.randn(4, 8)).sum()
    gc.collect()
    alive = sum(r() is not None for r in bufs)
    loss.backward()
    opt.step()
    opt.close()
    assert alive == 0, f"{alive} of {len(bufs)} gathered buffers outlived their module's forward"


class UsesChildWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.emb(x)), self.emb.weight)  # the parent reads a child's parameter


@pytest.mark.xfail(strict=True, reason="a parameter read outside its own module's forward (here by the parent) is "
                   "empty at stage 3: no external-parameter registration yet")
def test_parent_reading_a_child_parameter_trains_as_at_stage2() -> None:
    losses = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = UsesChildWeight()
        opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=stage)
        loss = model(torch.ones(2, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        losses[stage] = loss.item()
        opt.close()
    assert losses[3] == losses[2]
