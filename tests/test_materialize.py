"""ZeroOffloadAdamW(model_on_meta, init=ParamInit(fn, device, seed)): the model materialised parameter by parameter.

The reference is the same model built normally and filled by the documented scheme, written here from its spec
(tensor `name`'s generator seeded with seed * 2**32 + crc32(name)), then trained by the same optimizer without
init=: the two runs must be identical bit for bit (losses, state, model), at stage 2 (fp32 and 8-bit moments) and
stage 3 with the shards in host memory, under DPU; the fp32 run is judged against tests/oracle.py; on two ranks
the materialised state equals the one-rank state (no dependence on the world size). Bad input is refused before
the model changes.
"""

from __future__ import annotations

import os
import weakref
import zlib

import pytest
import torch
from dist_worker import spawn_ranks
from oracle import Oracle
from test_oracle_matrix import FACTOR_FP32, FLOOR_ULPS, FP32_EPS, compare, rel_spread, top
from torch import nn

import zo_kernels as zk
from zo_kernels.gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab=61, context=12, layers=2, width=48, heads=3)
SEED = 7
ADAMW = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
STEPS = 4
SETTINGS = {
    "s2-fp32": dict(stage=2),
    "s2-8bit": dict(stage=2, state_dtype="8bit"),
    "s3-cpu": dict(stage=3, offload_param="cpu"),
}


def fill(name: str, out: torch.Tensor, gen: torch.Generator) -> None:
    """An init in the shape of GPT-2's, with non-zero biases (so that every tensor's seed matters)."""
    if out.dim() >= 2:
        out.normal_(0.0, 0.05, generator=gen)
    else:
        out.uniform_(-0.1, 0.1, generator=gen)
        if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name == "ln.weight":
            out.add_(1.0)


def built_normally(config: GPTConfig = CONFIG, seed: int = SEED) -> GPT:
    """The model on the CPU, each tensor filled from its own generator (the spec's seed, written out here)."""
    model = GPT(config)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            values = torch.zeros(t.shape, dtype=torch.float32)
            fill(name, values, torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode())))
            t.copy_(values)
    return model


def on_meta(config: GPTConfig = CONFIG) -> GPT:
    with torch.device("meta"):
        return GPT(config)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, CONFIG.vocab, (STEPS, 4, CONFIG.context + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in x]


def train(model: GPT, dtype: torch.dtype = torch.bfloat16, **kwargs) -> dict:
    """STEPS steps under DPU (delayed after the first); losses, the state dict's tensors and the model after."""
    opt = zk.ZeroOffloadAdamW(model, **ADAMW, dtype=dtype, delay_update_after=1, **kwargs)
    try:
        losses = []
        for x, y in batches():
            loss = model(x, y)
            losses.append(loss.item())
            loss.backward()
            opt.step()
        opt.synchronize()
        sd = opt.state_dict()
        with opt.gathered():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return dict(losses=losses, state={i: {k: v for k, v in st.items()} for i, st in sd["state"].items()},
                    params=params)  # fmt: skip
    finally:
        opt.close()


def assert_identical(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"]
    assert got["state"].keys() == want["state"].keys()
    for i, st in want["state"].items():
        for k, v in st.items():
            g = got["state"][i][k]
            assert torch.equal(g, v) if isinstance(v, torch.Tensor) else g == v, f"state {i} {k} differs"
    for n, v in want["params"].items():
        g = got["params"][n]
        assert g.dtype == v.dtype and torch.equal(g, v), f"{n} differs"


@pytest.mark.parametrize("setting", SETTINGS)
def test_materialised_run_is_the_normally_built_run_bit_for_bit(setting):
    kwargs = SETTINGS[setting]
    want = train(built_normally(), **kwargs)
    got = train(on_meta(), init=zk.ParamInit(fill, device="cpu", seed=SEED), **kwargs)
    assert_identical(got, want)


def run_oracle(**perturb) -> dict:
    model = built_normally()
    oracle = Oracle(model, torch.float32, delay_update_after=1, **perturb, **ADAMW)
    losses = [oracle.step([[b]], lambda m, b: m(*b))[0][0][0] for b in batches()]
    oracle.synchronize()
    names = [n for n, _ in model.named_parameters()]
    return dict(losses=torch.tensor(losses), masters=[oracle.state(n)["master"].reshape(-1) for n in names],
                params={n: p.detach().clone() for n, p in oracle.work.named_parameters()})  # fmt: skip


def test_materialised_fp32_run_matches_the_oracle():
    """dtype fp32: zo against plain torch (fp32 AdamW, DPU as the oracle writes it) within FACTOR_FP32 times the
    oracle's own fp32 noise (its run perturbed: foreach AdamW, masters nudged by an ulp), as the oracle matrix
    judges (a key bias has a ~0 gradient, so its Adam update is all noise)."""
    got = train(on_meta(), dtype=torch.float32, init=zk.ParamInit(fill, device="cpu", seed=SEED))
    want, other = run_oracle(), run_oracle(foreach=True, nudge=True)
    kinds = {
        "losses": [("losses", torch.tensor(got["losses"]), want["losses"], other["losses"])],
        "master": [(f"master {i}", got["state"][i]["master"].reshape(-1), w, o)
                   for i, (w, o) in enumerate(zip(want["masters"], other["masters"]))],
        "params": [(n, got["params"][n], w, other["params"][n]) for n, w in want["params"].items()],
    }  # fmt: skip
    errors = []
    for items in kinds.values():
        rel = rel_spread([(w, o) for _, _, w, o in items])
        for what, g, w, _ in items:
            msg = compare(what, g, w, (FACTOR_FP32 * rel + FLOOR_ULPS * FP32_EPS) * top(w))
            if msg:
                errors.append(msg)
    assert not errors, "\n".join(errors)


def test_one_fp32_temporary_at_a_time_and_frozen_tensors_follow():
    """fn's fp32 tensors never outlive the next call (no full fp32 copy); frozen params and buffers on the meta
    device are materialised too, in the model's dtype, with their own seeds."""
    outs: list[weakref.ref] = []

    def tracking(name: str, out: torch.Tensor, gen: torch.Generator) -> None:
        alive = [r for r in outs if r() is not None]
        assert not alive, f"{len(alive)} earlier fp32 tensors still alive when {name} is made"
        outs.append(weakref.ref(out))
        fill(name, out, gen)

    model = on_meta()
    model.blocks[0].fc.requires_grad_(False)
    model.register_buffer("gain", torch.empty(CONFIG.width, device="meta"))
    opt = zk.ZeroOffloadAdamW(model, **ADAMW, init=zk.ParamInit(tracking, device="cpu", seed=SEED))
    try:
        ref = built_normally()
        gen = torch.Generator().manual_seed(SEED * 2**32 + zlib.crc32(b"gain"))
        gain = torch.zeros(CONFIG.width)
        fill("gain", gain, gen)
        assert model.gain.dtype == torch.bfloat16 and torch.equal(model.gain, gain.to(torch.bfloat16))
        fc = model.blocks[0].fc
        assert fc.weight.dtype == torch.bfloat16 and not fc.weight.requires_grad
        assert torch.equal(fc.weight, ref.blocks[0].fc.weight.to(torch.bfloat16))
        assert all(not t.is_meta for t in [*model.parameters(), *model.buffers()])
        assert len(outs) == len(list(model.parameters())) + 1
    finally:
        opt.close()


def _materialise_on_ranks(rank: int, world: int, out: str) -> None:
    result = {}
    for setting in ("s2-fp32", "s3-cpu"):
        model = on_meta()
        opt = zk.ZeroOffloadAdamW(model, **ADAMW, init=zk.ParamInit(fill, device="cpu", seed=SEED),
                                  collective_timeout_s=300.0, **SETTINGS[setting])  # fmt: skip
        sd = opt.state_dict()
        with opt.gathered():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        result[setting] = {"masters": [sd["state"][i]["master"] for i in sorted(sd["state"])], "params": params}
        opt.close()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def test_two_ranks_materialise_what_one_rank_does(tmp_path):
    spawn_ranks(_materialise_on_ranks, 2, tmp_path, str(tmp_path))
    ref = built_normally()
    want_masters = [p.detach().float() for p in ref.parameters()]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for setting, res in got.items():
            for i, (g, w) in enumerate(zip(res["masters"], want_masters, strict=True)):
                assert torch.equal(g.view_as(w), w), f"rank {rank} {setting}: master {i} differs"
            for n, p in ref.named_parameters():
                assert torch.equal(res["params"][n], p.detach().to(torch.bfloat16)), f"rank {rank} {setting}: {n}"


# ---------------------------------------------------------------------- bad input


def _still_meta(model: nn.Module) -> bool:
    return all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=2**31), ValueError, "seed"),
    (dict(seed=True), ValueError, "seed"),
    (dict(device="meta"), ValueError, "device"),
    (dict(device="tpu"), ValueError, "device"),
    (dict(device=3.5), ValueError, "device"),
    pytest.param(dict(device="cuda"), ValueError, "no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="CUDA is available here")),
])  # fmt: skip
def test_param_init_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        zk.ParamInit(fill, **{"device": "cpu", **kwargs})
    with pytest.raises(TypeError, match="fn"):
        zk.ParamInit("normal", device="cpu")


def test_bad_init_is_refused_before_the_model_changes(tmp_path):
    good = zk.ParamInit(fill, device="cpu")
    model = on_meta()
    with pytest.raises(TypeError, match="init must be a zo_kernels.ParamInit"):
        zk.ZeroOffloadAdamW(model, init=fill)
    with pytest.raises(ValueError, match="pass the model"):
        zk.ZeroOffloadAdamW(list(model.parameters()), init=good)
    with pytest.raises(ValueError, match="nvme"):
        zk.ZeroOffloadAdamW(model, init=good, offload_optimizer="nvme", nvme_dir=str(tmp_path))
    with pytest.raises(ValueError, match="pass init="):
        zk.ZeroOffloadAdamW(model)
    ref = weakref.ref(model.blocks[1].qkv.weight)
    with pytest.raises(ValueError, match="'blocks.1.qkv.weight' is referenced elsewhere"):
        zk.ZeroOffloadAdamW(model, init=good)
    del ref
    view = model.ln.bias.view(-1)
    with pytest.raises(ValueError, match="'ln.bias' is referenced elsewhere"):
        zk.ZeroOffloadAdamW(model, init=good)
    del view
    assert _still_meta(model) and not os.listdir(tmp_path)
    with pytest.raises(ValueError, match="meta device, but trainable param 0 is on cpu"):
        zk.ZeroOffloadAdamW(GPT(CONFIG), init=good)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_failing_fn_leaves_the_model_on_meta_and_a_new_optimizer_works(stage):
    def returns(name, out, gen):
        return torch.ones_like(out)

    def reshapes(name, out, gen):
        out.data = torch.zeros(1)

    def raises(name, out, gen):
        if name.startswith("blocks.1"):
            raise RuntimeError("boom")
        fill(name, out, gen)

    extra = {"offload_param": "cpu"} if stage == 3 else {}
    model = on_meta()
    for fn, error, match in ((returns, TypeError, "in place and return None"), (reshapes, ValueError, "changed"),
                             (raises, RuntimeError, "boom")):  # fmt: skip
        with pytest.raises(error, match=match):
            zk.ZeroOffloadAdamW(model, stage=stage, init=zk.ParamInit(fn, device="cpu"), **extra)
        assert _still_meta(model)
    want = train(built_normally(), stage=stage, **extra)
    got = train(model, stage=stage, init=zk.ParamInit(fill, device="cpu", seed=SEED), **extra)
    assert_identical(got, want)


class _WithFollowers(nn.Module):
    """A trainable Linear, a frozen Linear and a buffer: the last two are made after the trainable ones."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.frozen = nn.Linear(4, 4), nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.register_buffer("gain", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.frozen(self.lin(x)) * self.gain).square().mean()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("fails_on", ["gain", "frozen.weight"])
def test_an_fn_failing_on_a_frozen_param_or_buffer_leaves_the_whole_model_on_meta(stage, fails_on):
    """A helper's bug hunt: frozen params and buffers were made after the trainable ones were in place, so an fn
    failing on one of them left the trainable ones real (at stage 3 empty shards) and a second try was refused
    ("trainable param 0 is on cpu"; "no elements"). Now their values are made before anything is swapped."""

    def bad(name, out, gen):
        out.normal_(generator=gen)
        return out if name == fails_on else None

    def good(name, out, gen):
        out.normal_(generator=gen)

    with torch.device("meta"):
        model = _WithFollowers()
    with pytest.raises(TypeError, match=f"in place and return None; for '{fails_on}'"):
        zk.ZeroOffloadAdamW(model, dtype=torch.float32, stage=stage, init=zk.ParamInit(bad, device="cpu"))
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    opt = zk.ZeroOffloadAdamW(model, dtype=torch.float32, stage=stage, init=zk.ParamInit(good, device="cpu"))
    assert not any(t.is_meta for t in model.buffers())
    opt.backward(model(torch.randn(3, 4)))
    opt.step()
    opt.close()

