"""ZeRO stages 1, 2, 3 (and 3 with the parameter shards in host memory) against each other.

The oracle matrix (tests/test_oracle_matrix.py) judges every stage against plain PyTorch, on one and two ranks.
Here the stages are held to each other bit for bit where their arithmetic is the same: on one rank stage 1 is
stage 2, and stage 3 moves the same values through other buffers (gathers, shards), so every matrix case must
come out identical. One difference is allowed: stage 3 lays the flat space out module by module, stages 1 and 2
group by group; with several param groups the gradient norm then sums in another order, which can move the clip
coefficient by an ulp. Cases with groups and clipping are compared within that.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist_worker import TIMEOUT_S, spawn_ranks
from oracle import FeatureNet
from test_oracle_matrix import CASES, Case, run_two_ranks, run_zo

import zo_kernels as zk
from zo_kernels.offload.unit import UnitState
from zo_kernels.transport import CopyEngineTransport

STAGES = ("1", "3", "3+cpu", "3+nvme")


def allowed(case: Case, stage: str) -> bool:
    """ZeRO-Infinity ("3+nvme": the shards on NVMe) keeps 16-bit parameters and refuses DPU."""
    return not stage.endswith("+nvme") or (case.dpu is None and case.dtype != "fp32")


def assert_same_run(got: dict, want: dict, what: str, exact: bool = True) -> None:
    """Two runs of run_zo: losses, skips, scales, every state tensor and the model before/after synchronize."""
    assert got["losses"] == want["losses"] or not exact, f"{what}: losses differ"
    assert got["skipped"] == want["skipped"] and got["scales"] == want["scales"], f"{what}: skips/scales differ"

    def same(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        if exact:
            assert torch.equal(a, b), f"{what}: {name} differs (max {(a.double() - b.double()).abs().max():.3g})"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {name}: {m}")

    for name, st in want["state"].items():
        for key, v in st.items():
            g = got["state"][name][key]
            if key == "step":
                assert g == v, f"{what}: {name} step {g} vs {v}"
            else:
                same(g, v, f"{name}.{key}")
    for phase in ("before", "after"):
        assert sorted(got[phase]) == sorted(want[phase]), f"{what}: model keys differ"
        for k, v in want[phase].items():
            assert got[phase][k].dtype == v.dtype, f"{what}: model.{k} dtype"
            same(got[phase][k], v, f"model.{k} ({phase})")


# The first 8 one-rank cases (the matrix had 8 before it grew to 18; each runs here at 4 more stages).
# (gpu_fraction 0: the device's tail starts elsewhere in stage 3's layout, so its elements are updated by the other
# kernel; the matrix judges gpu_fraction at every stage against the oracle)
ONE_RANK = [dataclasses.replace(c, gpu_fraction=0.0) for c in CASES if c.world == 1][:8]


@pytest.mark.parametrize("case", ONE_RANK, ids=[c.id for c in ONE_RANK])
def test_one_rank_stages_are_bitwise_equal(case: Case) -> None:
    """Stage 1, 3, 3 with the shards in host memory and 3 with shards and state on NVMe (ZeRO-Infinity; 16-bit
    cases without DPU) on one rank == stage 2, bit for bit (losses, state, model)."""
    want = run_zo(case, 0, None, stage="2")
    for stage in (s for s in STAGES if allowed(case, s)):
        got = run_zo(case, 0, None, stage=stage)
        exact = not (stage.startswith("3") and case.groups and case.clip)
        assert_same_run(got, want, f"stage {stage} vs 2", exact=exact)


# Two ranks: the cases without a branch on one rank only (at stage 3 every rank must run the same modules).
TWO_RANK = [dataclasses.replace(c, gpu_fraction=0.0) for c in CASES if c.world == 2 and not c.unused][:3]


def test_two_ranks_stages_agree(tmp_path) -> None:
    """On two gloo ranks stages 1 and 3 == stage 2 bit for bit (the same reductions of the same averages);
    with clipping, stage 3's norm sums in another order (its flat layout), within 1e-5."""
    variants = []
    for c in TWO_RANK:
        for s in ("2", *(s for s in STAGES if allowed(c, s))):
            variants.append(dataclasses.replace(c, index=1000 + len(variants), stage=s, seed=c.index))
    results = run_two_ranks(variants, str(tmp_path))
    by_case: dict[int, dict[str, list[dict]]] = {}
    for v in variants:
        res = results[v.index]
        errors = [r["error"] for r in res if "error" in r]
        assert not errors, f"case {v.id} seed {v.seed}: {errors[0]}"
        by_case.setdefault(v.seed, {})[v.stage] = res
    for seed, runs in by_case.items():
        case = next(c for c in CASES if c.index == seed)
        for stage in (s for s in STAGES if allowed(case, s)):
            for r in range(2):
                exact = not (stage.startswith("3") and case.clip)
                assert_same_run(runs[stage][r], runs["2"][r], f"{case.id} rank {r}: stage {stage} vs 2", exact)


# ---------------------------------------------------------------------------------------------- checkpoints


def _train(model: nn.Module, opt: zk.ZeroOffloadAdamW, steps: range) -> list[float]:
    g = torch.Generator().manual_seed(7)
    losses = []
    for s in range(steps.stop):
        x, y = torch.randint(0, 37, (3, 5), generator=g), torch.randint(0, 37, (3, 5), generator=g)
        if s < steps.start:
            continue
        loss = model(x, y, branch=s % 3 == 0)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


CONFIGS = {
    "stage1": dict(stage=1),
    "stage2": dict(stage=2),
    "stage3": dict(stage=3),
    "stage3+cpu": dict(stage=3, offload_param="cpu"),
    "stage3+nvme-state": dict(stage=3, offload_optimizer="nvme"),
    "stage3+nvme": dict(stage=3, offload_optimizer="nvme", offload_param="nvme"),
}


def _build(config: str, tmp_path, model: nn.Module | None = None):
    model = model or FeatureNet(37, tied=True, unused=True, buffers=True)
    kw = dict(CONFIGS[config])
    if kw.get("offload_optimizer") == "nvme":
        kw["nvme_dir"] = str(tmp_path)
    return model, zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.bfloat16, bucket_numel=1000, **kw)


def _snapshot(model: nn.Module, opt: zk.ZeroOffloadAdamW) -> dict[str, torch.Tensor]:
    with opt.gathered():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("src", "dst"), [("stage2", "stage3"), ("stage3", "stage1"), ("stage3+cpu", "stage2"),
                                          ("stage1", "stage3+cpu"), ("stage3+nvme-state", "stage3"),
                                          ("stage2", "stage3+nvme"), ("stage3+nvme", "stage1")])  # fmt: skip
def test_checkpoint_moves_between_stages(src: str, dst: str, tmp_path) -> None:
    """Save at one stage/offload setting, load into another: the state is the same bit for bit, and training goes
    on exactly as it would have at the source."""
    model, opt = _build(src, tmp_path)
    _train(model, opt, range(0, 4))
    saved_opt, saved_model = opt.state_dict(), _snapshot(model, opt)
    want_losses = _train(model, opt, range(4, 8))
    want = opt.state_dict()
    opt.close()

    fresh = FeatureNet(37, tied=True, unused=True, buffers=True)
    fresh.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in saved_model.items()})
    model2, opt2 = _build(dst, tmp_path, fresh)
    opt2.load_state_dict(saved_opt)
    again = opt2.state_dict()
    for i, st in saved_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(again["state"][i][k], v), f"param {i} {k} changed in the move {src} -> {dst}"
    loaded = _snapshot(model2, opt2)
    assert all(torch.equal(loaded[k], v) for k, v in saved_model.items()), "the model's weights changed in the move"
    got_losses = _train(model2, opt2, range(4, 8))
    assert got_losses == want_losses, f"{src} -> {dst}: training after the move differs"
    got = opt2.state_dict()
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), f"param {i} {k}: {src} -> {dst} then 4 steps differs"
    opt2.close()


def _ckpt_rank(rank: int, world: int, stage: int, path: str, mode: str) -> None:
    model = FeatureNet(37, tied=True, buffers=True)
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, bucket_numel=1000, stage=stage,
                              collective_timeout_s=TIMEOUT_S)  # fmt: skip
    if mode == "load":
        opt.load_state_dict(torch.load(path, weights_only=False))
    sd = opt.state_dict()
    if rank == 0:
        torch.save(sd, path + f".{mode}.out")
    opt.close()  # (a collective at stage 3: the model is gathered back whole)


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_moves_between_world_sizes(stage: int, tmp_path) -> None:
    """A one-rank stage-2 state loads into two ranks at stage 1 or 3 and comes back out of them the same."""
    model, opt = _build("stage2", tmp_path, FeatureNet(37, tied=True, buffers=True))
    _train(model, opt, range(0, 3))
    sd = opt.state_dict()
    opt.close()
    path = str(tmp_path / "ckpt.pt")
    torch.save(sd, path)
    spawn_ranks(_ckpt_rank, 2, tmp_path, stage, path, "load")
    back = torch.load(path + ".load.out", weights_only=False)
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(back["state"][i][k].to(v.dtype), v), f"param {i} {k} changed through 2 ranks"


# ---------------------------------------------------------------------------------------------- the working set


class Stack(nn.Module):
    """Linear layers of different widths (leaf modules: one unit each), for the device working set."""

    def __init__(self, widths=(24, 64, 64, 64, 64, 64, 64, 64, 64, 37)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.emb = nn.Embedding(37, widths[0])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, layer in enumerate(self.layers):
            h = layer(h)
            h = F.gelu(h) if i < len(self.layers) - 1 else h
        return F.cross_entropy(h.float().flatten(0, 1), y.flatten())


@pytest.mark.parametrize(("offload", "prefetch"), [("cpu", 0), ("cpu", 1), ("cpu", 2), ("nvme", 1)])
def test_device_working_set_is_bounded(offload: str, prefetch: int, tmp_path) -> None:
    """GPU-shaped mode, stage 3, parameter shards in host memory (or on NVMe): the peak of the optimizer's device
    bytes stays within the largest unit's parameters x (1 + prefetch) + the two gradient buckets, while holding
    all the parameters would take more (and stage 2 does)."""
    torch.manual_seed(0)
    model = Stack()
    transport = CopyEngineTransport(delay_s=0.0005)
    nvme = dict(offload_optimizer="nvme", nvme_dir=str(tmp_path)) if offload == "nvme" else {}
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.bfloat16, bucket_numel=2000, stage=3,
                              offload_param=offload, prefetch=prefetch, transport=transport, **nvme)  # fmt: skip
    units = [u.hi - u.lo for u in opt.shards.units]
    buckets = sum(b.numel() for b in opt.grads.bucket_bufs) * 2
    bound = max(units) * 2 * (1 + prefetch) + buckets
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4, 6), generator=g)
        opt.device_bytes.reset_peak()
        model(x, y).backward()
        opt.step()
        assert opt.device_bytes.peak <= bound, f"peak {opt.device_bytes.peak} > bound {bound} (units {units})"
    assert sum(units) * 2 + buckets > bound, "the model is too small for the bound to say anything"
    assert opt.device_bytes.peak >= max(units) * 2, "the counter missed the gathers"
    assert opt.device_bytes.now == buckets, "a gathered unit was not freed after the step"
    opt.close()
    transport.close()


@pytest.mark.parametrize("evals", [(0,), (2,), (0, 1, 2, 3)])
def test_evaluation_forwards_keep_the_prefetch_of_training(monkeypatch, evals) -> None:
    """A forward without gradients (an evaluation) before the first step or between steps: the training iterations
    after it prefetch as without it (all but the first use of each pass), and it leaves no unit gathered. It was
    counted as the iteration's uses: before the first step it entered the recorded order, and every later backward
    found the order out of step (10 of 18 uses prefetched, for good); between steps the next iteration prefetched
    nothing."""
    torch.manual_seed(0)
    model = Stack()
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=3, prefetch=1)
    log: list[bool] = []
    use = opt.shards._use
    monkeypatch.setattr(opt.shards, "_use", lambda u: (log.append(u.live), use(u)))
    g = torch.Generator().manual_seed(1)
    n = len(opt.shards.units)
    for it in range(4):
        x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4, 6), generator=g)
        if it in evals:
            with torch.no_grad():
                model(x, y)
            assert all(u.state is UnitState.SHARDED for u in opt.shards.units)
        log.clear()
        model(x, y).backward()
        opt.step()
        assert sum(log) == (0 if it == 0 else 2 * n - 2), (it, log)
    opt.close()


def test_prefetch_gathers_ahead_in_the_recorded_order(monkeypatch) -> None:
    """From the second iteration on, each unit's gather starts before its module asks for it (except the first)."""
    torch.manual_seed(0)
    model = Stack()
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=3, prefetch=1)
    log: list[tuple[int, bool]] = []  # (unit, already being gathered when its module asked for it)
    use = opt.shards._use
    monkeypatch.setattr(opt.shards, "_use", lambda u: (log.append((u.index, u.live)), use(u)))
    g = torch.Generator().manual_seed(1)
    n = len(opt.shards.units)
    for it in range(3):
        log.clear()
        x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4, 6), generator=g)
        model(x, y).backward()
        opt.step()
        forward, backward = [i for i, _ in log[:n]], [i for i, _ in log[n:]]
        assert forward == [n - 1, *range(n - 1)] and backward == forward[::-1], log  # emb is the last unit
        ahead = [i for i, early in log if early]
        if it == 0:
            assert not ahead, "nothing can be prefetched before the order is known"
        else:  # all but the first use of each pass
            assert len(ahead) == 2 * n - 2, f"iteration {it}: prefetched {ahead} of {log}"
    opt.close()


# ---------------------------------------------------------------------------------------------- rules


def _diverge_rank(rank: int, world: int, out: str) -> None:
    model = FeatureNet(37, unused=True)
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=3, collective_timeout_s=TIMEOUT_S)
    x = torch.randint(0, 37, (3, 5))
    try:
        model(x, x, branch=rank == 0).backward()
        opt.step()
        msg = "no error"
    except RuntimeError as e:
        msg = str(e)
    with open(os.path.join(out, f"{rank}.txt"), "w") as f:
        f.write(msg)


def test_stage3_ranks_running_different_modules_fail_clearly(tmp_path) -> None:
    """A branch taken on one rank only: at stage 3 both ranks raise, naming the rule (no hang, no abort)."""
    spawn_ranks(_diverge_rank, 2, tmp_path, str(tmp_path))
    for r in range(2):
        msg = (tmp_path / f"{r}.txt").read_text()
        assert "every rank must run the same modules" in msg, f"rank {r}: {msg}"


def test_stage3_params_are_empty_between_uses_and_whole_in_gathered() -> None:
    model = FeatureNet(37)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.bfloat16, stage=3)
    assert all(p.numel() == 0 and p.dtype == torch.bfloat16 for p in model.parameters())
    with opt.gathered():
        assert {n: p.shape for n, p in model.named_parameters()} == shapes
    assert all(p.numel() == 0 for p in model.parameters())
    opt.close()  # the model keeps its parameters, whole
    assert {n: p.shape for n, p in model.named_parameters()} == shapes


# ---------------------------------------------------------------------------------------------- HF models


def _hf_run(arch: str, stage: int, checkpointing: bool | None, **kw) -> tuple[list[float], dict, dict]:
    from clients_util import MODELS, enable_checkpointing, group, lm_loss, token_batches, train

    model = MODELS[arch](0)
    if checkpointing is not None:
        enable_checkpointing(model, checkpointing)
    opt = zk.ZeroOffloadAdamW(model, lr=3e-3, dtype=torch.bfloat16, max_grad_norm=1.0, bucket_numel=20_000,
                              stage=stage, **kw)  # fmt: skip
    losses, _ = train(model, opt, group(token_batches(6), 2), lm_loss)
    sd = opt.state_dict()
    weights = _snapshot(model, opt)
    if arch == "gpt2":
        with opt.gathered():
            assert model.lm_head.weight is model.transformer.wte.weight, "the tied embedding came untied"
    opt.close()
    return losses, sd, weights


@pytest.mark.parametrize(("arch", "checkpointing"), [("gpt2", None), ("llama", None), ("gpt2", True),
                                                     ("llama", False)],
                         ids=["gpt2", "llama", "gpt2-checkpointing-reentrant", "llama-checkpointing"])  # fmt: skip
def test_hf_models_stage3_bitwise_equal_stage2(arch: str, checkpointing: bool | None) -> None:
    """HF GPT-2 (tied embedding, Conv1D) and Llama, bf16, clipping, 2 micro-batches, with and without gradient
    checkpointing: stage 3 (and stage 3 with the shards in host memory) == stage 2 bit for bit."""
    pytest.importorskip("transformers")
    want = _hf_run(arch, 2, checkpointing)
    for kw in ({}, {"offload_param": "cpu"}):
        got = _hf_run(arch, 3, checkpointing, **kw)
        assert got[0] == want[0], f"{arch} stage 3 {kw}: losses {got[0]} vs {want[0]}"
        for i, st in want[1]["state"].items():
            for k, v in st.items():
                assert torch.equal(got[1]["state"][i][k], v), f"{arch} stage 3 {kw}: param {i} {k}"
        for k, v in want[2].items():
            assert torch.equal(got[2][k], v), f"{arch} stage 3 {kw}: model.{k}"


def test_save_and_load_checkpoint_at_stage3(tmp_path) -> None:
    """zo_kernels.save_checkpoint/load_checkpoint gather the stage-3 parameters: the weights are saved whole, a
    stage-2 run resumes from a stage-3 checkpoint (and the reverse) bit for bit, and a weights-only checkpoint
    loaded at stage 3 reaches the shards and the masters."""
    model, opt = _build("stage3+cpu", tmp_path)
    _train(model, opt, range(0, 3))
    zk.save_checkpoint(tmp_path / "s3.pt", model, opt, step=3)
    zk.save_checkpoint(tmp_path / "weights.pt", model)  # no optimizer: the model's state_dict as it is
    want = _train(model, opt, range(3, 6))
    opt.close()
    saved = torch.load(tmp_path / "s3.pt", weights_only=True)["model"]
    assert all(v.numel() > 0 for v in saved.values()), "stage 3 saved empty parameters"
    for src in ("stage3", "stage2"):
        model2, opt2 = _build(src, tmp_path)
        assert zk.load_checkpoint(tmp_path / "s3.pt", model2, opt2) == {"step": 3}
        assert _train(model2, opt2, range(3, 6)) == want, f"resumed at {src}"
        opt2.close()
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)["model"]
    assert all(torch.equal(weights[k], v) for k, v in saved.items()), "a model-only save at stage 3 differs"
    model3, opt3 = _build("stage3", tmp_path)
    with pytest.warns(UserWarning, match="refreshed"):
        zk.load_checkpoint(tmp_path / "weights.pt", model3, opt3)
    sd = opt3.state_dict()
    names = [n for n, _ in model3.named_parameters()]
    for i, st in sd["state"].items():
        assert torch.equal(st["master"].to(torch.bfloat16), saved[names[i]]), f"{names[i]}: master not refreshed"
    assert all(torch.equal(v, saved[k]) for k, v in _snapshot(model3, opt3).items())
    opt3.close()


def test_state_dict_and_savers_see_whole_parameters_at_stage3(tmp_path) -> None:
    """model.state_dict(), safetensors' save_model and HF save_pretrained at stage 3 (one rank) save what stage 2
    saves, bit for bit, and leave the parameters empty again; taken between forward and backward, the saved
    tensors stay valid after backward releases the gathered storage."""
    pytest.importorskip("transformers")
    from clients_util import MODELS, lm_loss, token_batches
    from safetensors.torch import load_file, save_model
    from transformers import AutoModelForCausalLM

    saved = {}
    for stage in (2, 3):
        model = MODELS["gpt2"](0)
        opt = zk.ZeroOffloadAdamW(model, lr=3e-3, dtype=torch.bfloat16, stage=stage)
        ids = token_batches(1)[0]
        lm_loss(model, ids).backward()
        opt.step()
        loss = lm_loss(model, ids)
        mid = {k: v for k, v in model.state_dict().items()}  # between forward and backward
        loss.backward()
        opt.zero_grad()
        save_model(model, str(tmp_path / f"s{stage}.safetensors"))
        model.save_pretrained(tmp_path / f"hf{stage}")
        saved[stage] = ({k: v.clone() for k, v in mid.items()}, load_file(str(tmp_path / f"s{stage}.safetensors")),
                        AutoModelForCausalLM.from_pretrained(tmp_path / f"hf{stage}").state_dict())  # fmt: skip
        if stage == 3:
            assert all(p.numel() == 0 for p in model.parameters()), "state_dict left parameters gathered"
        opt.close()
    for what, a, b in zip(("state_dict", "safetensors", "save_pretrained"), saved[3], saved[2]):
        assert sorted(a) == sorted(b), what
        assert all(torch.equal(a[k], b[k]) for k in b), f"{what} differs at stage 3"


def _state_dict_rank(rank: int, world: int, out: str) -> None:
    model = FeatureNet(37)
    opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=3, collective_timeout_s=TIMEOUT_S)
    msg = "no error"
    if rank == 0:  # e.g. a saver that runs on rank 0 only
        try:
            model.state_dict()
        except RuntimeError as e:
            msg = str(e)
    with opt.gathered():  # every rank: whole
        whole = all(p.numel() > 0 for p in model.parameters()) and len(model.state_dict()) == 6
    with open(os.path.join(out, f"{rank}.txt"), "w") as f:
        f.write(f"{msg}|{whole}")
    opt.close()


def test_state_dict_on_one_of_two_ranks_is_refused_clearly(tmp_path) -> None:
    spawn_ranks(_state_dict_rank, 2, tmp_path, str(tmp_path))
    msg, whole = (tmp_path / "0.txt").read_text().split("|")
    assert "inside `with opt.gathered():` on every rank" in msg and whole == "True"
    assert (tmp_path / "1.txt").read_text() == "no error|True"


def test_reentrant_checkpoints_keep_the_forward_prefetch(monkeypatch) -> None:
    """Blocks under torch's reentrant checkpoint (HF's gradient_checkpointing default for years) run their forward
    without gradients inside a training forward: no evaluation, so they prefetch as the non-reentrant ones (6 of
    12 uses were missed, every forward one, when grad mode at the use decided)."""
    from torch.utils.checkpoint import checkpoint

    from zo_kernels.offload import unit as unit_module

    class Blocks(nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.blocks, self.reentrant = nn.ModuleList(nn.Linear(8, 8) for _ in range(6)), reentrant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=self.reentrant)
            return x

    missed = []
    finish = unit_module.Unit.finish
    monkeypatch.setattr(unit_module.Unit, "finish",
                        lambda u: (missed.append(u.state is UnitState.SHARDED), finish(u))[1])  # fmt: skip
    got = {}
    for reentrant in (False, True):
        torch.manual_seed(0)
        model, x = Blocks(reentrant), torch.randn(3, 8, requires_grad=True)
        opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=3, prefetch=2)
        for _ in range(3):
            missed.clear()
            opt.backward(model(x).square().mean())
            opt.step()
        got[reentrant] = sum(missed)
        opt.close()
    assert got[True] == got[False] == 1, got
