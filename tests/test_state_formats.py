"""ZeroOffloadAdamW's state_dtype (fp32 / bf16 / 8-bit moments) against a plain-torch oracle; conversions, resume.

The oracle (FormatOracle) is tests/oracle.py's mixed-precision AdamW with one change: after every AdamW step its
moments are stored in the format, i.e. replaced by their rounding, written here from the format's spec and sharing
no code with zo_kernels (`round_bf16`, `round_8bit`). AdamW's step uses the new moments before they are stored, as
the fused kernel does (it updates the moments in fp32 registers, uses them, then stores them rounded); with 8-bit
moments the step is guarded as the format's kernels guard it (FormatOracle._guard_8bit, tests/helpers.py's adam_bound).

Tolerance: the oracle matrix's, plus the format's own noise. The oracle's noise is measured per case by a perturbed
oracle in the same format (foreach AdamW, sums in reverse order, masters moved by one ulp; with 16-bit parameters the
oracle in fp32; for bf16 also other random bits of the stochastic rounding); per kind of quantity (losses, master,
exp_avg, exp_avg_sq, params) each tensor must be within FACTOR x that noise (pooled over the kind) + FORMAT_FACTOR x
the format's whole effect (the distance between the format oracle and the same oracle with fp32 moments, pooled) + a
floor. A last-bit difference flips a rounding to the next bf16 value or 8-bit code, so the bound scales with the
format's quantum; at FORMAT_FACTOR = 0.25 a run that ignored the format is refused (test_oracle_tells_formats_apart).
Measured: err/bound <= 0.45 (bf16, stochastic rounding), <= 0.44 (8-bit, its exp_avg stochastically rounded too).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
from dist_worker import resume_two_steps, spawn_ranks
from helpers import adam_bound
from oracle import FeatureNet, Oracle, param_groups

import zo_kernels as zk
from zo_kernels.transport import CopyEngineTransport

STEPS = 6
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
BATCH, SEQ, VOCAB, WIDTH = 3, 5, 37, 24
BLOCK = 256  # the 8-bit format's block (each parameter's own blocks, from its first element)
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": "8bit"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FACTOR = 4.0
FORMAT_FACTOR = 0.25
FLOOR = STEPS * torch.finfo(torch.float32).eps


# ---------------------------------------------------------------------- the formats, from their spec


def round_bf16(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """bf16 moments, stochastically rounded: away from zero with probability (the dropped 16 bits) / 2^16, i.e.
    16 random bits added to the fp32 bits, then truncated. (zo's bits come from a hash; these from `gen`.)"""
    bits = t.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    r = torch.randint(0, 1 << 16, bits.shape, generator=gen)
    out = ((bits + r) >> 16 << 16) & 0xFFFFFFFF
    return torch.where(out >= 1 << 31, out - (1 << 32), out).int().view(torch.float32).view_as(t)


def round_8bit(t: torch.Tensor, signed: bool, gen: torch.Generator | None = None) -> torch.Tensor:
    """8-bit moments, per block of BLOCK elements from the parameter's first, in fp32 arithmetic: exp_avg (signed)
    code = round(x * (127 / absmax)), or as the step stores it, with `gen`, floor(x * (127 / absmax) + u), u uniform
    in [0, 1) in steps of 2^-16 (stochastic rounding: zo's 16 bits come from a hash, these from `gen`); value = code
    * (absmax / 127); exp_avg_sq (unsigned) holds r = sqrt(v): code = round(r * (255 / max r)), value = (code *
    (max r / 255))^2; a block with absmax < 2^-100 is zeros."""
    x = t.reshape(-1).float()
    x = x if signed else x.sqrt()
    levels = torch.tensor(127.0 if signed else 255.0)
    out = torch.zeros_like(x)
    for lo in range(0, x.numel(), BLOCK):
        xb = x[lo : lo + BLOCK]
        amax = xb.abs().max()
        if amax < 2.0**-100:
            continue
        y = xb * (levels / amax)
        if signed and gen is not None:
            y = (y + torch.randint(0, 1 << 16, y.shape, generator=gen) * 2.0**-16).floor()
        code = torch.round(y.clamp(-levels if signed else 0, levels))
        out[lo : lo + BLOCK] = code * (amax / levels)
    return (out if signed else out * out).view_as(t)


class FormatOracle(Oracle):
    """tests/oracle.py's AdamW whose moments are stored in `fmt` after every step (the stochastic roundings, bf16
    and 8-bit exp_avg: random bits of `sr_seed`)."""

    def __init__(self, model, dtype, *, fmt: str, sr_seed: int = 0, **kwargs) -> None:
        super().__init__(model, dtype, **kwargs)
        self.fmt, step = fmt, self.opt.step
        gen = torch.Generator().manual_seed(sr_seed)

        def step_and_store() -> None:
            step()
            with torch.no_grad():
                if fmt == "8bit":
                    self._guard_8bit()
                for st in self.opt.state.values():
                    for key in ("exp_avg", "exp_avg_sq"):
                        if fmt == "bf16":
                            st[key].copy_(round_bf16(st[key], gen))
                        elif fmt == "8bit":
                            st[key].copy_(round_8bit(st[key], signed=key == "exp_avg", gen=gen))

        self.opt.step = step_and_store

    def _guard_8bit(self) -> None:
        """The 8-bit format's guard, applied to torch's step after it: where |m_hat| / adam_bound exceeds AdamW's
        denominator sqrt(v_hat) + eps, the step is lr x m_hat over that instead (torch's step added back, the guarded
        one taken). Exact moments never reach it; the format's stored ones can (a sqrt(v) rounded to a code or to 0
        under another element's block scale)."""
        for group in self.opt.param_groups:
            lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                st = self.opt.state.get(p)
                if not st:
                    continue
                t = int(st["step"])
                m_hat = st["exp_avg"] / (1 - b1**t)
                denom = st["exp_avg_sq"].sqrt() / (1 - b2**t) ** 0.5 + eps
                guarded = torch.maximum(denom, m_hat.abs() / adam_bound(t, b1, b2))
                p.add_(lr * m_hat / denom - lr * m_hat / guarded)


# ---------------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class Case:
    fmt: str
    dtype: str = "fp32"
    micro: int = 1
    clip: bool = False
    scale: str | None = None
    dpu: int | None = None
    world: int = 1
    stage: int = 2
    transport: str = "host"
    groups: bool = False
    nvme: str | None = None  # "state": offload_optimizer="nvme"; "state+params": and offload_param="nvme" (stage 3)
    gpu_fraction: float = 0.0  # the partition's tail on the device, its moments in the format (device_adam.py)

    @property
    def id(self) -> str:
        changed = [f for f in dataclasses.fields(self) if f.name != "fmt" and getattr(self, f.name) != f.default]
        return "-".join([self.fmt] + [f"{f.name}{getattr(self, f.name)}" for f in changed])

    def model(self) -> FeatureNet:
        return FeatureNet(VOCAB, WIDTH, tied=self.groups)

    def batches(self) -> list:
        g = torch.Generator().manual_seed(7)
        shape = (STEPS, self.world, self.micro, BATCH, SEQ)
        x, y = torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g)
        return [[[(x[s, r, i], y[s, r, i]) for i in range(self.micro)] for r in range(self.world)]
                for s in range(STEPS)]  # fmt: skip

    def options(self) -> dict:
        return dict(loss_scale={None: None, "static": 1024.0, "dynamic": "dynamic"}[self.scale],
                    max_grad_norm=2.5 if self.clip else None, delay_update_after=self.dpu)  # fmt: skip


# every format with every option at least once, each format at 2 ranks, at every stage, with the GPU's data flow
CASES = [
    Case(fmt, **kw)
    for fmt in ("bf16", "8bit")
    for kw in (
        {},
        dict(dtype="bf16", micro=2, clip=True),
        dict(scale="dynamic", dpu=2, transport="copy_engine"),
        dict(dtype="bf16", scale="static", stage=1, groups=True),
        dict(stage=3, micro=2, dpu=2),
        dict(world=2, clip=True, scale="dynamic"),
        dict(world=2, dtype="bf16", stage=3, dpu=2, micro=2),
    )
] + [Case("fp32", world=2, stage=1)] + [
    # the moments in the NVMe files, in their format
    Case("8bit", nvme="state", micro=2, clip=True, dpu=2),
    Case("bf16", nvme="state", dtype="bf16", scale="dynamic", stage=1, groups=True),
    Case("8bit", nvme="state+params", dtype="bf16", stage=3, micro=2),
    Case("bf16", nvme="state", world=2, stage=3, dpu=2),
    Case("8bit", nvme="state", world=2, dtype="bf16", clip=True, scale="dynamic"),
    Case("8bit", nvme="state+params", world=2, dtype="bf16", stage=3),
] + [
    # gpu_fraction: the tail's moments in the format on the device, encoded as the host encodes them
    Case("8bit", gpu_fraction=0.4),
    Case("bf16", gpu_fraction=0.5, dtype="bf16", micro=2, clip=True, dpu=2, transport="copy_engine"),
    Case("8bit", gpu_fraction=1.0, scale="dynamic", stage=3, micro=2),
    Case("bf16", gpu_fraction=0.3, stage=1, groups=True, scale="static"),
    Case("8bit", gpu_fraction=0.5, nvme="state", micro=2, dpu=2),
    Case("8bit", gpu_fraction=0.3, world=2, clip=True, dpu=2),
    Case("bf16", gpu_fraction=0.6, world=2, dtype="bf16", stage=3, micro=2),
]


def forward(model, batch) -> torch.Tensor:
    x, y = batch
    return model(x, y)


def run_zo(case: Case, rank: int, group) -> dict:
    model = case.model()
    params, extra = (param_groups(model), {"module": model}) if case.groups else (model, {})
    if case.stage == 3:
        extra["module"] = model
    transport = CopyEngineTransport(delay_s=0.002) if case.transport == "copy_engine" else None
    nvme_dir = tempfile.mkdtemp() if case.nvme else None
    if case.nvme:
        extra.update(offload_optimizer="nvme", nvme_dir=nvme_dir)
    if case.nvme == "state+params":
        extra["offload_param"] = "nvme"
    opt = zk.ZeroOffloadAdamW(params, **ADAMW, dtype=DTYPES[case.dtype], state_dtype=FORMATS[case.fmt],
                              stage=case.stage, process_group=group, transport=transport, bucket_numel=1_000,
                              collective_timeout_s=60.0, gpu_fraction=case.gpu_fraction, **case.options(),
                              **extra)  # fmt: skip
    try:
        losses = []
        for step in case.batches():
            losses.append([])
            for batch in step[rank]:
                loss = forward(model, batch)
                losses[-1].append(loss.item())
                opt.backward(loss)
            opt.step()
        sd = opt.state_dict()
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
        state = {order[i]: {k: v.clone() for k, v in st.items() if k != "step"} for i, st in sd["state"].items()}
        opt.synchronize()
        with opt.gathered():
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        return dict(losses=losses, state=state, params=params)
    finally:
        opt.close()
        if transport is not None:
            transport.close()
        if nvme_dir is not None:
            assert os.listdir(nvme_dir) == [], "close() removes the scratch files"
            os.rmdir(nvme_dir)


def run_oracle(case: Case, dtype: torch.dtype, **perturb) -> dict:
    model = case.model()
    oracle = FormatOracle(model, dtype, fmt=case.fmt, groups=param_groups(model) if case.groups else None,
                          **case.options(), **perturb, **ADAMW)  # fmt: skip
    losses = []
    for step in case.batches():
        step_losses, _ = oracle.step(step, forward)
        losses.append(step_losses)
    oracle.synchronize()
    return dict(losses=losses, state={n: oracle.state(n) for n in oracle.masters},
                params={n: p.detach().float().clone() for n, p in oracle.work.named_parameters()})  # fmt: skip


def _rank_entry(rank: int, world: int, cases: list[Case], out: str) -> None:
    for i, case in enumerate(cases):
        group = dist.new_group(backend="gloo")
        try:
            result = run_zo(case, rank, group)
        except Exception:
            result = {"error": traceback.format_exc(limit=6)}
        torch.save(result, os.path.join(out, f"{i}.{rank}.pt"))


_RESULTS: dict[Case, list[dict]] = {}


def zo_results(case: Case, tmp_dir: str) -> list[dict]:
    """Each rank's results; the 2-rank cases all run in one launch of two gloo processes, on first need."""
    if case not in _RESULTS:
        if case.world == 1:
            _RESULTS[case] = [run_zo(case, 0, None)]
        else:
            two = [c for c in CASES if c.world == 2]
            failure = {"error": "no result written"}
            try:
                spawn_ranks(_rank_entry, 2, tmp_dir, two, tmp_dir)
            except Exception as e:
                failure = {"error": f"the 2-rank launch failed: {e}"}
            for i, c in enumerate(two):
                paths = [os.path.join(tmp_dir, f"{i}.{r}.pt") for r in range(2)]
                _RESULTS[c] = [torch.load(p, weights_only=False) if os.path.exists(p) else failure for p in paths]
    return _RESULTS[case]


def top(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def check(case: Case, zo: dict, want: dict, other: dict, plain: dict) -> list[str]:
    """Per kind (losses, master, exp_avg, exp_avg_sq, params): |zo - oracle| <= FACTOR x the oracle's noise +
    FORMAT_FACTOR x the format's effect (see the module docstring) + a floor."""
    kinds: dict[str, list] = {k: [] for k in ("losses", "master", "exp_avg", "exp_avg_sq", "params")}
    flat = lambda d: torch.tensor(d["losses"]).reshape(-1)  # noqa: E731
    kinds["losses"].append(("losses", flat(zo), flat(want), flat(other), flat(plain)))
    for name, w in want["state"].items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            kinds[key].append((f"{key}[{name}]", zo["state"][name][key], w[key], other["state"][name][key],
                               plain["state"][name][key]))  # fmt: skip
    for name, w in want["params"].items():
        kinds["params"].append((f"param {name}", zo["params"][name], w, other["params"][name], plain["params"][name]))
    errors, worst = [], 0.0
    ulp = torch.finfo(DTYPES[case.dtype]).eps
    spread = lambda items, j: max((top(it[2].double() - it[j].double()) / top(it[2])  # noqa: E731
                                   for it in items if top(it[2]) > 0), default=0.0)  # fmt: skip
    for kind, items in kinds.items():
        noise, effect = spread(items, 3), spread(items, 4)
        for what, g, w, _, _ in items:
            bound = (FACTOR * noise + FORMAT_FACTOR * effect + FLOOR + (ulp if kind == "params" else 0)) * top(w)
            err = (g.double() - w.double()).abs()
            worst = max(worst, top(err) / bound)
            if g.shape != w.shape or bool((err > bound).any()) or bool(g.isnan().any()):
                errors.append(f"{what}: max err {top(err):.3g} > bound {bound:.3g} (noise {noise:.3g}, "
                              f"format effect {effect:.3g})")  # fmt: skip
    print(f"{case.id}: worst err/bound {worst:.3f}")
    return errors


DEFAULT = {Case("bf16"), Case("8bit"), Case("8bit", dtype="bf16", micro=2, clip=True),
           Case("bf16", scale="dynamic", dpu=2, transport="copy_engine"), Case("8bit", stage=3, micro=2, dpu=2),
           Case("8bit", nvme="state", micro=2, clip=True, dpu=2), Case("8bit", nvme="state+params", dtype="bf16",
                                                                      stage=3, micro=2),
           Case("8bit", gpu_fraction=0.4), Case("bf16", gpu_fraction=0.5, dtype="bf16", micro=2, clip=True, dpu=2,
                                                transport="copy_engine"),
           Case("8bit", gpu_fraction=1.0, scale="dynamic", stage=3, micro=2)}  # fmt: skip
# the rest (the 2-rank ones: one launch of two processes) in the slow run; a few seconds each on a quiet machine


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=() if c in DEFAULT else pytest.mark.slow)
                                  for c in CASES])  # fmt: skip
def test_format_matches_oracle(case: Case, tmp_path_factory) -> None:
    results = zo_results(case, str(tmp_path_factory.getbasetemp()))
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}: {res['error']}"
    dtype = DTYPES[case.dtype]
    want = run_oracle(case, dtype)
    # the oracle's own noise: fp32 rounding (perturbed), 16-bit parameters (the oracle in fp32), and the stochastic
    # rounding (other random bits)
    perturb = dict(foreach=True, reverse_sums=True, nudge=True) if dtype == torch.float32 else {}
    other = run_oracle(case, dtype if dtype == torch.float32 else torch.float32, sr_seed=1, **perturb)
    zo = results[0]
    zo = dict(zo, losses=[[res["losses"][s] for res in results] for s in range(STEPS)])
    plain = run_oracle(dataclasses.replace(case, fmt="fp32"), dtype)  # the same training with fp32 moments
    errors = check(case, zo, want, other, plain)
    assert not errors, "\n".join(errors[:10])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on CPU tensors needs Triton's "
                    "interpreter (with a GPU the tail runs it on CUDA: tests/test_gpu.py)")  # fmt: skip
@pytest.mark.parametrize("case", [Case("bf16", gpu_fraction=0.5, dtype="bf16", micro=2, scale="dynamic", dpu=2,
                                       transport="copy_engine"),
                                  Case("8bit", gpu_fraction=0.7, clip=True, stage=3)], ids=lambda c: c.id)  # fmt: skip
def test_the_tail_through_the_kernel_matches_oracle(case: Case, monkeypatch) -> None:
    """The tail's update as on a GPU, through zo_kernels/kernels/adam.py (interpreted), judged as above."""
    import zo_kernels.offload.device_adam as device_adam

    monkeypatch.setattr(device_adam, "IMPL", "triton")
    zo = run_zo(case, 0, None)
    dtype = DTYPES[case.dtype]
    perturb = dict(foreach=True, reverse_sums=True, nudge=True) if dtype == torch.float32 else {}
    other = run_oracle(case, dtype if dtype == torch.float32 else torch.float32, sr_seed=1, **perturb)
    plain = run_oracle(dataclasses.replace(case, fmt="fp32"), dtype)
    errors = check(case, dict(zo, losses=[[s] for s in zo["losses"]]), run_oracle(case, dtype), other, plain)
    assert not errors, "\n".join(errors[:10])


def test_oracle_tells_formats_apart() -> None:
    """The judge can fail: fp32 moments judged as 8-bit ones are refused."""
    case = Case("8bit")
    zo = run_zo(Case("fp32"), 0, None)
    want, plain = run_oracle(case, torch.float32), run_oracle(Case("fp32"), torch.float32)
    other = run_oracle(case, torch.float32, foreach=True, reverse_sums=True, nudge=True)
    assert check(case, zo, want, other, plain)


# ---------------------------------------------------------------------- state, checkpoints, memory, arguments


def _train(fmt: str, steps: int, *, load=None, ckpt_in=None, ckpt_out=None, first: int = 0, **kw):
    """FeatureNet trained `steps` steps of fixed data (from step `first`) on one rank; returns (model, opt)."""
    model = FeatureNet(VOCAB, WIDTH, seed=3)
    opt = zk.ZeroOffloadAdamW(model, **ADAMW, dtype=torch.float32, state_dtype=FORMATS[fmt], bucket_numel=1_000, **kw)
    if load is not None:
        opt.load_state_dict(copy.deepcopy(load))
    if ckpt_in is not None:
        zk.load_checkpoint(ckpt_in, model, opt)
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, VOCAB, (first + steps, 2, BATCH, SEQ), generator=g)
    for s in range(first, first + steps):
        opt.backward(model(data[s, 0], data[s, 1]))
        opt.step()
    if ckpt_out is not None:
        zk.save_checkpoint(ckpt_out, model, opt)
    return model, opt


def _exact(sd: dict) -> list[torch.Tensor]:
    """Every tensor of a state dict (the 8-bit codes and scales included), in a fixed order."""
    out = [v for st in sd["state"].values() for k, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    for entry in sd["zero_offload"].get("moments", {}).values():
        out += [entry[k] for k in sorted(entry)]
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_is_bitwise(fmt: str, tmp_path) -> None:
    m_all, o_all = _train(fmt, 6)
    _train(fmt, 3, ckpt_out=tmp_path / "c.pt")
    m_res, o_res = _train(fmt, 3, ckpt_in=tmp_path / "c.pt", first=3)
    for a, b in zip(m_all.parameters(), m_res.parameters()):
        assert torch.equal(a, b)
    got, want = _exact(o_res.state_dict()), _exact(o_all.state_dict())
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize(("src", "dst"), [("8bit", "fp32"), ("fp32", "8bit"), ("bf16", "fp32"), ("fp32", "bf16"),
                                          ("8bit", "bf16"), ("bf16", "8bit")])  # fmt: skip
def test_state_dict_converts_between_formats(src: str, dst: str) -> None:
    """A run's state dict loads into a run of another format: the fp32 moments (torch's keys) are stored in the new
    format (bf16: rounded to nearest even; 8-bit: quantized per parameter as round_8bit); masters and steps exact."""
    _, o_src = _train(src, 3)
    saved = o_src.state_dict()
    _, o_dst = _train(dst, 0, load=saved)
    got = o_dst.state_dict()
    for i, st in saved["state"].items():
        assert torch.equal(got["state"][i]["master"], st["master"]) and float(got["state"][i]["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            want = {"fp32": st[key], "bf16": st[key].bfloat16().float(),
                    "8bit": round_8bit(st[key], signed=key == "exp_avg")}[dst]  # fmt: skip
            assert torch.equal(got["state"][i][key], want), (i, key)


def test_8bit_state_dict_is_its_codes() -> None:
    """state_dict's fp32 moments of an 8-bit run are its codes x scale / levels (sqrt(v) squared), exactly."""
    _, opt = _train("8bit", 3)
    sd = opt.state_dict()
    for i, st in sd["state"].items():
        raw = sd["zero_offload"]["moments"][i]
        for key, levels in (("exp_avg", 127.0), ("exp_avg_sq", 255.0)):
            d = (raw[f"{key}_scales"] / levels).repeat_interleave(BLOCK)[: st[key].numel()]
            x = raw[f"{key}_codes"].float() * d
            assert torch.equal(st[key].reshape(-1), x if key == "exp_avg" else x * x)
        assert raw["exp_avg_codes"].dtype == torch.int8 and raw["exp_avg_sq_codes"].dtype == torch.uint8


def test_bf16_moments_are_bf16() -> None:
    _, opt = _train("bf16", 3)
    for st in opt.state_dict()["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], st[key].bfloat16().float()) and bool(st[key].ne(0).any())


def _ranks_entry(rank: int, world: int, fmt: str, ckpt_in, ckpt_out: str, out: str) -> None:
    model = FeatureNet(VOCAB, WIDTH, seed=3)
    opt = zk.ZeroOffloadAdamW(model, **ADAMW, dtype=torch.float32, state_dtype=FORMATS[fmt], bucket_numel=1_000,
                              collective_timeout_s=60.0)  # fmt: skip
    resume_two_steps(rank, model, opt, ckpt_in, ckpt_out, out, vocab=VOCAB, batch=BATCH, seq=SEQ, seed=11)


@pytest.mark.parametrize("fmt", ["8bit", pytest.param("bf16", marks=pytest.mark.slow)])
def test_checkpoint_moves_between_world_sizes_exactly(fmt: str, tmp_path) -> None:
    """2 ranks save, 1 rank loads: its state is the saved one bit for bit (the 8-bit blocks are per parameter);
    1 rank saves, 2 ranks load: the same."""
    a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    spawn_ranks(_ranks_entry, 2, tmp_path, fmt, None, a, str(tmp_path / "two.pt"))
    saved_by_two = torch.load(tmp_path / "two.pt", weights_only=False)["saved"]
    _, opt = _train(fmt, 0, ckpt_in=a)
    assert all(torch.equal(x, y) for x, y in zip(_exact(opt.state_dict()), _exact(saved_by_two)))
    _train(fmt, 2, ckpt_in=a, ckpt_out=b, first=5)
    saved_by_one = torch.load(b, weights_only=True)["optimizer"]
    spawn_ranks(_ranks_entry, 2, tmp_path, fmt, b, str(tmp_path / "c.pt"), str(tmp_path / "two.pt"))
    loaded_by_two = torch.load(tmp_path / "two.pt", weights_only=False)["loaded"]
    got, want = _exact(loaded_by_two), _exact(saved_by_one)
    assert len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize(("fmt", "per_param"), [("fp32", 12), ("bf16", 8), ("8bit", 6)])
def test_memory_report_counts_the_format(fmt: str, per_param: int) -> None:
    """host_state = the fp32 masters + the moments in their format, byte for byte; one rank with bf16 parameters
    holds <= 8.1 B/param with 8-bit moments, <= 10.1 with bf16 (14 with fp32)."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 1000), torch.nn.Linear(1000, 509, bias=False))
    opt = zk.ZeroOffloadAdamW(model, state_dtype=FORMATS[fmt])
    rep, part = opt.memory_report(), opt.part
    scales = 2 * 4 * -(-part // BLOCK) if fmt == "8bit" else 0
    assert rep.host_state == per_param * part + scales
    limit = {"fp32": 14.1, "bf16": 10.1, "8bit": 8.1}[fmt]
    assert rep.host_bytes / rep.params <= limit, str(rep)
    opt.close()


BAD = [(torch.float16, ValueError), ("int8", ValueError), ("fp16", ValueError), (8, TypeError), (None, TypeError),
       (torch.float64, ValueError)]  # fmt: skip


@pytest.mark.parametrize(("bad", "error"), BAD)
def test_bad_state_dtype_is_refused_before_anything_changes(bad, error) -> None:
    model = FeatureNet(VOCAB, WIDTH)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match="state_dtype"):
        zk.ZeroOffloadAdamW(model, dtype=torch.bfloat16, state_dtype=bad)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_nvme_resume_is_bitwise_and_equals_memory(fmt: str, tmp_path) -> None:
    """The moments in the NVMe files in their format: 3 + 3 steps through a checkpoint equal 6 steps bit for bit, and
    the in-memory run of the format (one tile: bf16's kernel calls, hence its random bits, are the same)."""
    nvme = dict(offload_optimizer="nvme", nvme_dir=str(tmp_path))
    m_mem, o_mem = _train(fmt, 6)
    m_all, o_all = _train(fmt, 6, **nvme)
    _train(fmt, 3, ckpt_out=tmp_path / "c.pt", **nvme)[1].close()
    m_res, o_res = _train(fmt, 3, ckpt_in=tmp_path / "c.pt", first=3, **nvme)
    for a, b, c in zip(m_all.parameters(), m_res.parameters(), m_mem.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    got, want, mem = _exact(o_res.state_dict()), _exact(o_all.state_dict()), _exact(o_mem.state_dict())
    assert len(got) == len(want) == len(mem) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got, mem))
    for o in (o_all, o_res):
        o.close()
    assert [e.name for e in tmp_path.iterdir()] == ["c.pt"]


def test_nvme_state_dict_converts_between_formats(tmp_path) -> None:
    """An NVMe 8-bit run's state dict loads into an NVMe bf16 run and the reverse, as in memory (see
    test_state_dict_converts_between_formats): rounded to nearest even, or quantized per parameter."""
    nvme = dict(offload_optimizer="nvme", nvme_dir=str(tmp_path))
    for src, dst in (("8bit", "bf16"), ("bf16", "8bit")):
        _, o_src = _train(src, 3, **nvme)
        saved = o_src.state_dict()
        _, o_dst = _train(dst, 0, load=saved, **nvme)
        got = o_dst.state_dict()
        for i, st in saved["state"].items():
            assert torch.equal(got["state"][i]["master"], st["master"]) and float(got["state"][i]["step"]) == 3
            for key in ("exp_avg", "exp_avg_sq"):
                want = st[key].bfloat16().float() if dst == "bf16" else round_8bit(st[key], signed=key == "exp_avg")
                assert torch.equal(got["state"][i][key], want), (src, dst, i, key)
        o_src.close()
        o_dst.close()


# ---------------------------------------------------------------------- the planner and the demo


@pytest.mark.parametrize(("fmt", "k"), [("fp32", "12"), ("bf16", "8"), ("8bit", "6.03125")])
def test_plan_state_dtype_sets_k(fmt: str, k: str, capsys) -> None:
    """K = 4 (fp32 master) + the moments' bytes: host bytes per GPU of ZeRO-2 + offload = (2 + K) x params (no p16
    staging: the new parameters go over the gradients)."""
    from zo_kernels.cli import main

    assert main(["plan", "--params", "1e9", "--state-dtype", fmt]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(f"K = {k}")
    row = next(line for line in out.splitlines() if line.startswith("ZeRO-2 + offload"))
    assert row.split()[7] == f"{(2 + float(k)):.1f}"


def test_plan_refuses_k_and_state_dtype_together(capsys) -> None:
    from zo_kernels.cli import main

    assert main(["plan", "--params", "1e9", "--state-dtype", "8bit", "--k", "12"]) == 2
    assert "--state-dtype" in capsys.readouterr().err
    assert main(["plan", "--params", "1e9", "--state-dtype", "int4"]) == 2


def test_demo_with_8bit_state(capsys) -> None:
    from zo_kernels.cli import main

    code = main(["demo", "--steps", "6", "--model-size", "1e5", "--batch", "2", "--context", "16", "--dtype", "bf16",
                 "--quiet", "--state-dtype", "8bit"])  # fmt: skip
    out = capsys.readouterr().out
    # the planner's 2 + K (no p16 staging, as on a GPU); measured here: 8.03 + padding
    assert code == 0 and "host 8.031 (" in out, out


def _stage3_entry(rank: int, world: int, ckpt_in, ckpt_out: str, out: str) -> None:
    model = FeatureNet(VOCAB, WIDTH, seed=3 + (ckpt_in is not None))  # (a resumed run takes all from the file)
    opt = zk.ZeroOffloadAdamW(model, **ADAMW, dtype=torch.float32, stage=3, bucket_numel=1_000,
                              collective_timeout_s=60.0)  # fmt: skip
    resume_two_steps(rank, model, opt, ckpt_in, ckpt_out, out, vocab=VOCAB, batch=BATCH, seq=SEQ, seed=11)
    opt.close()


def test_a_stage3_checkpoint_loads_at_two_ranks(tmp_path) -> None:
    """A review's find: load_checkpoint's checks read model.state_dict() before gathering (so a refused checkpoint
    changes nothing), which at stage 3 with several ranks is refused outside gathered(): every two-rank load failed.
    The checks read its keys and dtypes without a gather; two ranks load what two ranks saved, bit for bit."""
    a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    spawn_ranks(_stage3_entry, 2, tmp_path, None, a, str(tmp_path / "first.pt"))
    saved = torch.load(tmp_path / "first.pt", weights_only=False)["saved"]
    spawn_ranks(_stage3_entry, 2, tmp_path, a, b, str(tmp_path / "second.pt"))
    loaded = torch.load(tmp_path / "second.pt", weights_only=False)["loaded"]
    got, want = _exact(loaded), _exact(saved)
    assert len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))
