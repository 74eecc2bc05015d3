"""Stage 3 in the ways a user drives it beyond a plain training loop, judged against stage 2 or plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn as nn

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
