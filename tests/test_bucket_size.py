"""The default gradient bucket: 2**24 elements, larger for large models so that they have about 32 buckets (each
bucket costs the step ~0.3 ms of host time on the GPUs' hosts: docs/gpu-runs.md, eighth run), at most 2**26."""

import pytest
import torch
from torch import nn

import zo_kernels as zk
from zo_kernels.offload import layout as layout_mod


def by_hand(numel: int, floor: int, cap: int, count: int = 32) -> int:
    want = -(-numel // count)
    size = 1
    while size < want:
        size *= 2
    return min(cap, max(floor, size))


@pytest.mark.parametrize("numel, expect", [
    (0, 1 << 24), (95_000_000, 1 << 24), (32 << 24, 1 << 24), ((32 << 24) + 1, 1 << 25), (600_000_000, 1 << 25),
    (1_311_416_320, 1 << 26), (15_270_000_000, 1 << 26),
])  # fmt: skip
def test_default_bucket_numel(numel, expect):
    assert zk.offload.default_bucket_numel(numel) == expect == by_hand(numel, 1 << 24, 1 << 26)


def test_default_bucket_numel_refuses_what_is_not_a_count():
    with pytest.raises(ValueError, match="numel"):
        zk.offload.default_bucket_numel(-1)
    for bad in (True, 1.5, "1e9", None):
        with pytest.raises(TypeError, match="numel"):
            zk.offload.default_bucket_numel(bad)
    assert zk.offload.default_bucket_numel(torch.tensor(2**31)) == 1 << 26  # (an integer tensor is a count)


def _buckets(opt):
    return [(b.lo, b.hi) for b in opt.layout.buckets]


def test_the_optimizer_sizes_its_buckets_by_the_model(monkeypatch):
    """With the floor and cap scaled down, a small model gets the buckets the rule gives for its size (the same as
    passing that bucket_numel), not the floor's; a given bucket_numel still wins."""
    monkeypatch.setattr(layout_mod, "DEFAULT_BUCKET_NUMEL", 1 << 4)
    monkeypatch.setattr(layout_mod, "MAX_DEFAULT_BUCKET_NUMEL", 1 << 10)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(48)])  # 48 x 72 = 3,456 params
    numel = sum(p.numel() for p in model.parameters())
    expect = by_hand(numel, 1 << 4, 1 << 10)
    assert expect == 128
    opts = []
    try:
        for kw in ({}, {"bucket_numel": expect}, {"bucket_numel": 1 << 4}):
            opts.append(zk.ZeroOffloadAdamW(model, lr=1e-3, dtype=torch.float32, **kw))
        auto, given, floor = (_buckets(o) for o in opts)
        assert auto == given and auto != floor, (auto, floor)
        assert len(auto) < len(floor)
    finally:
        for o in opts:
            o.close()


def test_frozen_parameters_and_groups(monkeypatch):
    """The default counts the trainable elements only (frozen ones are not in the flat space), over every group."""
    monkeypatch.setattr(layout_mod, "DEFAULT_BUCKET_NUMEL", 1 << 4)
    monkeypatch.setattr(layout_mod, "MAX_DEFAULT_BUCKET_NUMEL", 1 << 10)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(48)])
    for layer in list(model)[::2]:
        layer.requires_grad_(False)  # 1,728 of 3,456 trainable: 64-element buckets, not 128
    groups = [{"params": [p for p in model[1::4].parameters()]},
              {"params": [p for p in model[3::4].parameters()], "lr": 1e-4}]  # fmt: skip
    assert by_hand(1728, 1 << 4, 1 << 10) == 64
    opts = []
    try:
        for kw in ({}, {"bucket_numel": 64}, {"bucket_numel": 128}):
            opts.append(zk.ZeroOffloadAdamW(model, lr=1e-3, dtype=torch.float32, **kw))
        assert _buckets(opts[0]) == _buckets(opts[1]) != _buckets(opts[2])
        for o in opts:
            o.close()
        opts = [zk.ZeroOffloadAdamW(groups, lr=1e-3, dtype=torch.float32),
                zk.ZeroOffloadAdamW(groups, lr=1e-3, dtype=torch.float32, bucket_numel=64)]
        assert _buckets(opts[0]) == _buckets(opts[1])
    finally:
        for o in opts:
            o.close()
