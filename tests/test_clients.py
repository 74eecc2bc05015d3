"""ZeroOffloadAdamW inside the training stacks people use (issue 10): HF transformers in a plain loop and in
Trainer, PEFT LoRA, accelerate, torch.compile, activation checkpointing, safetensors.

Every scenario runs the same stack twice from the same weights and data: once with
`torch.optim.AdamW(foreach=False)` on an fp32 model (the oracle; plain torch, no zo code), once with
`ZeroOffloadAdamW(model, dtype=torch.float32)`. Tolerances of those fp32 comparisons:
- losses: 1e-4 relative at every micro-batch. Our CPU Adam and torch's AdamW differ only by the rounding order
  of fp32 operations (~1 ulp per element per step); over these runs the losses differ by <= 2.1e-7 relative.
- parameters: per tensor, ||zo - torch|| <= 1e-2 x ||torch - initial|| (the distance the oracle travelled), and
  a tensor the oracle did not move (frozen) bit-identical. Measured: <= 2.6e-6 for every tensor except GPT-2's
  `c_attn.bias` (<= 6.2e-4): it holds the key bias, whose true gradient is exactly zero (softmax ignores a
  per-query constant), so its gradient is rounding noise that Adam's m / sqrt(v) normalizes to a full-size
  step: there the fp32 ulp differences become visible.
- a checkpoint resumed in a new process-like setup (new model, optimizer, Trainer / Accelerator) must end
  bit-identical to the uninterrupted run: the checkpoint holds the fp32 masters and moments exactly, and
  torch.optim.AdamW resumes bit-exactly through the same Trainer code (checked when this test was written).
The bf16 runs are a smoke check: the loss falls on held-out data, and the losses stay as close to the fp32
oracle as the textbook mixed-precision loop (clients_util.MixedPrecisionReference) does, within 2x + 1e-4.
Models are tiny (about 0.1M parameters), random, built from configs in code: no hub access.
"""

from __future__ import annotations

import copy

import pytest
import torch
from clients_util import (
    HP,
    LOSS_RTOL,
    MODELS,
    PARAM_FRAC,
    MixedPrecisionReference,
    assert_one_name_per_tensor,
    assert_params_track,
    assert_same_tensors,
    assert_series_close,
    enable_checkpointing,
    group,
    lm_loss,
    snapshot,
    tiny_gpt2,
    tiny_llama,
    token_batches,
    torch_adamw,
    train,
)

import zo_kernels as zk

STEPS, MICRO = 4, 2  # optimizer steps per run, micro-batches (backward calls) per step


def need(*modules: str) -> None:
    for name in modules:
        pytest.importorskip(name, reason=f"{name} is not installed (pip install -e '.[dev]')")


def zo_adamw(model: torch.nn.Module, dtype: torch.dtype = torch.float32, **kw) -> zk.ZeroOffloadAdamW:
    return zk.ZeroOffloadAdamW(model, dtype=dtype, **{**HP, **kw})


def reset_accelerate() -> None:
    """accelerate keeps process-wide singletons (AcceleratorState, GradientState): start each run afresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@torch.no_grad()
def held_out_loss(model: torch.nn.Module) -> float:
    ids = token_batches(1, batch=8, seed=99)[0]
    return lm_loss(model, ids).item()


def check_micro_batches(stats: list[dict], expected: int, what: str) -> None:
    got = [s.get("micro_batches") for s in stats]
    assert got == [expected] * len(stats), f"{what}: opt.stats['micro_batches'] per step {got}, expected {expected} " \
                                           f"(one per backward call)"  # fmt: skip


def compare_fp32_runs(m0, ref_model, ref_losses, zo_model, zo_losses, what: str) -> None:
    assert_series_close(zo_losses, ref_losses, LOSS_RTOL, f"{what}: losses, ZeroOffloadAdamW fp32 vs torch AdamW")
    assert_params_track(snapshot(zo_model), snapshot(ref_model), snapshot(m0), PARAM_FRAC,
                        f"{what}: final params, ZeroOffloadAdamW fp32 vs torch AdamW")  # fmt: skip


# ---------------------------------------------------------------------- 1. HF models in a plain loop


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_plain_loop_fp32_matches_torch(arch):
    need("transformers")
    m0 = MODELS[arch](0)
    data = group(token_batches(STEPS * MICRO), MICRO)
    ref = copy.deepcopy(m0)
    ref_losses, _ = train(ref, torch_adamw(ref), data)
    model = copy.deepcopy(m0)
    losses, stats = train(model, zo_adamw(model), data)
    compare_fp32_runs(m0, ref, ref_losses, model, losses, f"{arch} plain loop")
    check_micro_batches(stats, MICRO, arch)
    if arch == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight, "the tied embedding came untied"


def check_bf16_smoke(m0, what: str, **opt_kw) -> None:
    """zo bf16 vs the fp32 oracle: within 2x (+1e-4) of the textbook bf16 loop's distance to it; loss falls."""
    data = group(token_batches(STEPS * MICRO), MICRO)
    ref = copy.deepcopy(m0)
    ref_losses, _ = train(ref, torch_adamw(ref, **opt_kw), data)
    mixed_losses = MixedPrecisionReference(m0, torch.bfloat16, **opt_kw).train(data)
    model = copy.deepcopy(m0)
    opt = zo_adamw(model, torch.bfloat16, **opt_kw)
    before = held_out_loss(model)
    losses, stats = train(model, opt, data)
    dev = lambda ls: max(abs(a - b) / b for a, b in zip(ls, ref_losses))  # noqa: E731
    bound = 2 * dev(mixed_losses) + 1e-4
    assert dev(losses) <= bound, (f"{what}: bf16 losses {dev(losses):.3g} (relative) from the fp32 oracle; the "
                                  f"textbook bf16 loop is {dev(mixed_losses):.3g} from it; allowed {bound:.3g}")
    drop, ref_drop = before - held_out_loss(model), held_out_loss(m0) - held_out_loss(ref)
    assert drop >= 0.5 * ref_drop > 0, f"{what}: held-out loss fell by {drop:.4f} in bf16, {ref_drop:.4f} in fp32"
    check_micro_batches(stats, MICRO, what)


def test_hf_plain_loop_bf16_smoke():
    need("transformers")
    check_bf16_smoke(tiny_gpt2(0), "gpt2 plain loop bf16")


# ---------------------------------------------------------------------- 2. HF Trainer


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def make_trainer(model, opt, out_dir, *, max_grad_norm=None, save_steps=None, stats=None, **args_kw):
    """Trainer over 16 sequences: batch 2, gradient_accumulation_steps=2, 4 optimizer steps, linear LR decay.

    max_grad_norm=None keeps Trainer's default (1.0). `stats`, if a list, receives opt.stats after each step.
    args_kw: more TrainingArguments (gradient_checkpointing=True, ...).
    """
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class RecordStats(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            if stats is not None:
                stats.append(dict(getattr(opt, "stats", {})))

    reset_accelerate()
    clip = {} if max_grad_norm is None else {"max_grad_norm": max_grad_norm}
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=MICRO,
                             max_steps=STEPS, use_cpu=True, report_to="none", dataloader_num_workers=0, seed=0,
                             logging_steps=1, disable_tqdm=True, save_strategy="steps" if save_steps else "no",
                             save_steps=save_steps or 500, **clip, **args_kw)  # fmt: skip
    rows = torch.cat(token_batches(STEPS * MICRO))
    return Trainer(model=model, args=args, train_dataset=_Rows(rows), optimizers=(opt, None),
                   callbacks=[RecordStats()])  # fmt: skip


def record_losses(model: torch.nn.Module) -> tuple[list[float], object]:
    """Every forward's loss, in order (Trainer computes them inside train())."""
    losses: list[float] = []
    handle = model.register_forward_hook(lambda mod, args, out: losses.append(out.loss.item()))
    return losses, handle


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory):
    """torch AdamW in Trainer with its default max_grad_norm=1.0: (initial model, trained model, losses, logged
    gradient norms), shared by the clipping tests."""
    need("transformers", "accelerate")
    m0 = tiny_gpt2(0)
    ref = copy.deepcopy(m0)
    ref_losses, handle = record_losses(ref)
    ref_trainer = make_trainer(ref, torch_adamw(ref), tmp_path_factory.mktemp("torch"))
    ref_trainer.train()
    handle.remove()
    ref_norms = [h["grad_norm"] for h in ref_trainer.state.log_history if "grad_norm" in h]
    assert len(ref_norms) == STEPS and min(ref_norms) > 1.0, f"premise: clipping must act at every step: {ref_norms}"
    return m0, ref, ref_losses, ref_norms


def test_trainer_own_clipping_matches_torch(tmp_path, trainer_reference):
    """Trainer's default max_grad_norm=1.0 clips p.grad with torch.nn.utils.clip_grad_norm_: on our MovedGrad
    placeholders the norm is the host gradient's and the multiplication is applied at step(), so Trainer's own
    clipping takes effect and its logged grad_norm is the true one (it used to clip nothing and log 0.0)."""
    m0, ref, ref_losses, ref_norms = trainer_reference
    model = copy.deepcopy(m0)
    losses, handle = record_losses(model)
    trainer = make_trainer(model, zo_adamw(model), tmp_path / "zo")
    trainer.train()
    handle.remove()
    compare_fp32_runs(m0, ref, ref_losses, model, losses, "Trainer's own clipping")
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert_series_close(norms, ref_norms, LOSS_RTOL, "Trainer: logged gradient norm, zo vs torch")


def test_trainer_clipping_matches_torch(tmp_path, trainer_reference):
    """ZeroOffloadAdamW(max_grad_norm=1) + Trainer(max_grad_norm=0) == torch AdamW + Trainer(max_grad_norm=1).

    Note: transformers 5.x computes the gradient norm for its logs even with max_grad_norm=0
    (Trainer._get_grad_norm -> accelerator.clip_grad_norm_(params, inf) -> torch.nn.utils.clip_grad_norm_),
    so reading p.grad's norm after backward must work (and multiplying by 1.0).
    """
    m0, ref, ref_losses, ref_norms = trainer_reference
    model = copy.deepcopy(m0)
    losses, handle = record_losses(model)
    stats: list[dict] = []
    make_trainer(model, zo_adamw(model, max_grad_norm=1.0), tmp_path / "zo", max_grad_norm=0.0, stats=stats).train()
    handle.remove()
    compare_fp32_runs(m0, ref, ref_losses, model, losses, "Trainer with clipping")
    norms = [s.get("grad_norm") for s in stats]
    assert_series_close(norms, ref_norms, LOSS_RTOL, "Trainer: pre-clip gradient norm, opt.stats vs torch")
    check_micro_batches(stats, MICRO, "Trainer")


@pytest.mark.parametrize("stage, delay, nvme", [(2, None, False), (3, None, False), (2, 1, False), (3, 1, False),
                                               (2, 1, True)],
                         ids=["stage2", "stage3", "stage2-dpu", "stage3-dpu", "stage2-dpu-nvme"])  # fmt: skip
def test_trainer_checkpoint_resume(tmp_path, stage, delay, nvme):
    """save_steps=2 then resume_from_checkpoint in a new Trainer (new model, new optimizer): same end. At stage 3
    Trainer's model.state_dict()/load_state_dict() gather by themselves. With delay_update_after the checkpoint is
    taken with a writeback pending: the model file holds the weights the next forward reads, the optimizer's state
    the masters one update ahead. Trainer loads the model's weights first, then accelerate's prepare saves and loads
    the new optimizer's state once (a round trip), then Trainer loads the checkpoint's: the round trip used to write
    the new optimizer's construction masters over the loaded weights, and the state loaded last, its writeback
    pending, kept them (the resumed run's first forward ran on the new model's initial weights); also with the
    optimizer's state on NVMe."""
    need("transformers", "accelerate", "safetensors")
    from safetensors import safe_open

    full = tiny_gpt2(0)
    full_losses, handle = record_losses(full)
    kw = {"stage": stage, "delay_update_after": delay}
    if nvme:
        (tmp_path / "nvme").mkdir()
        kw.update(offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"))
    make_trainer(full, zo_adamw(full, **kw), tmp_path / "full", max_grad_norm=0.0, save_steps=2).train()
    handle.remove()
    ckpt = tmp_path / "full" / "checkpoint-2"
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert_one_name_per_tensor(f.keys(), full, "the checkpoint's model.safetensors")

    resumed = tiny_gpt2(1)  # other weights: the checkpoint must bring them all
    losses, handle = record_losses(resumed)
    make_trainer(resumed, zo_adamw(resumed, **kw), tmp_path / "resumed", max_grad_norm=0.0,
                 save_steps=2).train(resume_from_checkpoint=str(ckpt))  # fmt: skip
    handle.remove()
    assert losses == full_losses[-len(losses) :] and len(losses) == (STEPS // 2) * MICRO, \
        f"resumed losses {losses} vs uninterrupted {full_losses}"
    whole = lambda m: {k: v.float().clone() for k, v in m.state_dict().items()}  # noqa: E731  (stage 3: gathered)
    assert all(v.numel() for v in whole(full).values())
    assert_same_tensors(whole(resumed), whole(full), "Trainer: resumed run's end vs the uninterrupted run's")


# ---------------------------------------------------------------------- 3. PEFT LoRA


LORA_LR = 2e-2  # adapters train with a larger lr than full models: the held-out loss visibly falls in 4 steps


def tiny_lora(seed: int = 0) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(tiny_llama(seed), cfg)


def test_peft_lora_fp32_matches_torch():
    need("transformers", "peft")
    m0 = tiny_lora(0)
    trainable = [n for n, p in m0.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), f"premise: only adapters train: {trainable[:4]}"
    data = group(token_batches(STEPS * MICRO), MICRO)
    ref = copy.deepcopy(m0)
    ref_losses, _ = train(ref, torch_adamw(ref, lr=LORA_LR), data)
    model = copy.deepcopy(m0)
    opt = zo_adamw(model, lr=LORA_LR)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
        m0.get_parameter(n).numel() for n in trainable), "the optimizer must hold exactly the adapters"
    losses, stats = train(model, opt, data)
    compare_fp32_runs(m0, ref, ref_losses, model, losses, "LoRA")  # frozen base: bit-identical
    check_micro_batches(stats, MICRO, "LoRA")


def test_peft_lora_bf16_frozen_base_follows_dtype():
    need("transformers", "peft")
    m0 = tiny_lora(0)
    model = copy.deepcopy(m0)
    want = copy.deepcopy(m0).to(torch.bfloat16)  # api.md: exactly what model.to(dtype) does
    zo_adamw(model, torch.bfloat16)
    for (name, t), (_, w) in zip(list(model.named_parameters()) + list(model.named_buffers()),
                                 list(want.named_parameters()) + list(want.named_buffers())):  # fmt: skip
        assert t.dtype == w.dtype, f"{name}: {t.dtype} after construction, model.to(bfloat16) gives {w.dtype}"
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for _, p in frozen)
    assert nbytes == 2 * sum(p.numel() for _, p in frozen), f"frozen base: {nbytes} bytes, not 2 per parameter"
    for name, p in frozen:  # the cast is the plain rounding of the fp32 weights
        assert torch.equal(p, m0.get_parameter(name).to(torch.bfloat16)), f"{name}: not the bf16 cast of its value"
    check_bf16_smoke(m0, "LoRA bf16", lr=LORA_LR)


# ---------------------------------------------------------------------- 4. accelerate


def accelerate_train(accelerator, model, opt, loader) -> list[float]:
    losses = []
    for ids in loader:
        with accelerator.accumulate(model):
            loss = lm_loss(model, ids)
            losses.append(loss.item())
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    return losses


def loader(rows: torch.Tensor):
    return torch.utils.data.DataLoader(rows, batch_size=2, shuffle=False)


def new_accelerator():
    from accelerate import Accelerator

    reset_accelerate()
    return Accelerator(cpu=True, gradient_accumulation_steps=MICRO)


def test_accelerate_matches_torch():
    need("transformers", "accelerate")
    m0 = tiny_gpt2(0)
    rows = torch.cat(token_batches(STEPS * MICRO))
    runs = {}
    for kind in ("torch", "zo"):
        model = copy.deepcopy(m0)
        acc = new_accelerator()
        opt = torch_adamw(model) if kind == "torch" else zo_adamw(model)
        model, prepared, dl = acc.prepare(model, opt, loader(rows))
        runs[kind] = (model, accelerate_train(acc, model, prepared, dl), opt)
    (ref, ref_losses, _), (model, losses, opt) = runs["torch"], runs["zo"]
    compare_fp32_runs(m0, ref, ref_losses, model, losses, "accelerate")
    check_micro_batches([opt.stats], MICRO, "accelerate (last step)")


def test_accelerate_save_load_state_resume(tmp_path):
    """save_state after 2 steps (safetensors model file), load_state into a new model/optimizer/Accelerator."""
    need("transformers", "accelerate", "safetensors")
    from safetensors import safe_open

    rows = torch.cat(token_batches(STEPS * MICRO))
    half = len(rows) // 2
    full = tiny_gpt2(0)
    acc = new_accelerator()
    full, opt, first, second = acc.prepare(full, zo_adamw(full), loader(rows[:half]), loader(rows[half:]))
    accelerate_train(acc, full, opt, first)
    acc.save_state(str(tmp_path / "state"))
    at_save = {k: v.clone() for k, v in full.state_dict().items()}
    full_losses = accelerate_train(acc, full, opt, second)

    with safe_open(str(tmp_path / "state" / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert_one_name_per_tensor(saved, full, "save_state's model.safetensors")
    assert_same_tensors(saved, {k: at_save[k] for k in saved}, "save_state's model.safetensors vs the model")

    resumed = tiny_gpt2(1)  # other weights: load_state must bring them all
    acc = new_accelerator()
    resumed, opt, dl = acc.prepare(resumed, zo_adamw(resumed), loader(rows[half:]))
    acc.load_state(str(tmp_path / "state"))
    assert_same_tensors(resumed.state_dict(), at_save, "the model after load_state vs at save_state")
    losses = accelerate_train(acc, resumed, opt, dl)
    assert losses == full_losses, f"resumed losses {losses} vs uninterrupted {full_losses}"
    assert_same_tensors(snapshot(resumed), snapshot(full), "accelerate: resumed run's end vs the uninterrupted run's")


# ---------------------------------------------------------------------- 5. torch.compile


def test_torch_compile_aot_eager():
    need("transformers")
    if not hasattr(torch.compiler, "is_exporting"):  # transformers >= 4.5x calls it inside the compiled forward
        pytest.skip(f"torch {torch.__version__} lacks torch.compiler.is_exporting, which transformers' masks call "
                    "when compiled (a transformers/torch pairing, not zo_kernels)")  # fmt: skip
    m0 = tiny_gpt2(0)
    data = group(token_batches(STEPS * MICRO), MICRO)
    ref = copy.deepcopy(m0)
    ref_losses, _ = train(ref, torch_adamw(ref), data)  # eager: aot_eager runs the same aten ops
    model = copy.deepcopy(m0)
    opt = zo_adamw(model)
    compiled = torch.compile(model, backend="aot_eager")
    losses, stats = train(compiled, opt, data)
    compare_fp32_runs(m0, ref, ref_losses, model, losses, "torch.compile(aot_eager)")
    check_micro_batches(stats, MICRO, "torch.compile")


# ---------------------------------------------------------------------- 6. activation checkpointing


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_hf_gradient_checkpointing(reentrant):
    need("transformers")
    m0 = tiny_gpt2(0)
    enable_checkpointing(m0, reentrant)
    data = group(token_batches(STEPS * MICRO), MICRO)
    ref = copy.deepcopy(m0)
    ref_losses, _ = train(ref, torch_adamw(ref), data)
    model = copy.deepcopy(m0)
    losses, stats = train(model, zo_adamw(model), data)
    what = f"HF gradient checkpointing (use_reentrant={reentrant})"
    compare_fp32_runs(m0, ref, ref_losses, model, losses, what)
    check_micro_batches(stats, MICRO, what)


class CheckpointedStack(torch.nn.Module):
    """in -> checkpointed blocks -> out. With `shared`, block 1 runs twice, in two checkpointed segments, so its
    weights receive two gradient contributions, each inside its own nested (reentrant) backward."""

    def __init__(self, reentrant: bool, shared: bool, width: int = 32) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(8, width)  # outside the checkpoints: the segments' inputs require grad
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                          for _ in range(3))  # fmt: skip
        self.order = [0, 1, 2, 1] if shared else [0, 1, 2]
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i in self.order:
            h = torch.utils.checkpoint.checkpoint(self.blocks[i], h, use_reentrant=self.reentrant)
        return self.out(h)


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("shared", [False, True], ids=["distinct_blocks", "block_in_two_segments"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_torch_checkpoint_stack(reentrant, shared):
    torch.manual_seed(0)
    m0 = CheckpointedStack(reentrant, shared)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS * MICRO)]
    data = group(batches, MICRO)
    ref = copy.deepcopy(m0)
    ref_losses, _ = train(ref, torch_adamw(ref), data, loss_fn=mse)
    model = copy.deepcopy(m0)
    losses, stats = train(model, zo_adamw(model), data, loss_fn=mse)
    what = f"torch.utils.checkpoint (use_reentrant={reentrant}, shared block={shared})"
    compare_fp32_runs(m0, ref, ref_losses, model, losses, what)
    check_micro_batches(stats, MICRO, what)


# ---------------------------------------------------------------------- 7. safetensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_safetensors_save_model_load_model(tmp_path, dtype):
    need("transformers", "safetensors")
    from safetensors import safe_open
    from safetensors.torch import load_model, save_model

    model = tiny_gpt2(0)
    opt = zo_adamw(model, dtype)
    data = group(token_batches(2 * MICRO), MICRO)
    path = str(tmp_path / "model.safetensors")
    for when in ("right after construction", "after a step"):
        if when == "after a step":
            train(model, opt, data[:1])  # values that are neither the init nor another seed's
        at_save = {k: v.clone() for k, v in model.state_dict().items()}
        save_model(model, path)
        with safe_open(path, "pt") as f:
            saved = {k: f.get_tensor(k) for k in f.keys()}
        assert_one_name_per_tensor(saved, model, f"save_model's file, {when}")
        assert_same_tensors(saved, {k: at_save[k] for k in saved}, f"save_model's file vs the model, {when}")

    fresh = tiny_gpt2(1).to(dtype)
    load_model(fresh, path)
    assert_same_tensors(fresh.state_dict(), at_save, "load_model into a plain model")

    train(model, opt, data[1:])  # the optimizer's own model moves on, then is restored from the file
    load_model(model, path)
    assert_same_tensors(model.state_dict(), at_save, "load_model into the optimizer's own model")


def test_trainer_with_selective_equals_its_synchronous_sums(tmp_path, monkeypatch):
    """selective= inside HF Trainer (accumulation 2, Trainer's own clipping on the placeholders, linear decay,
    model.zero_grad between steps): the window sums on their own thread give the bits, and the losses, the same run
    gets with each sum waited for inside step()."""
    need("transformers", "accelerate")
    from zo_kernels.offload.selective import SelectiveUpdate

    cfg = {"fraction": 0.5, "select_every": 100, "apply_every": 2}
    m0 = tiny_gpt2(0)

    def run(out):
        model = copy.deepcopy(m0)
        losses, handle = record_losses(model)
        opt = zo_adamw(model, selective=cfg)
        make_trainer(model, opt, out).train()
        handle.remove()
        state = opt.state_dict()
        opt.close()
        return state, losses

    import time

    from zo_kernels.offload import selective as sel_mod

    slow = sel_mod.accumulate

    def late(*args, **kwargs):  # each sum late: a backward that did not wait for it would land under it
        time.sleep(0.05)
        return slow(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(sel_mod, "accumulate", late)
        got, losses = run(tmp_path / "async")
    real = SelectiveUpdate._submit_sum

    def waited(self, acc, grad, pieces):
        real(self, acc, grad, pieces)
        self._last_sum.result()

    monkeypatch.setattr(SelectiveUpdate, "_submit_sum", waited)
    want, want_losses = run(tmp_path / "sync")
    assert losses == want_losses and len(losses) == STEPS * MICRO
    for i in want["state"]:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][i][key], want["state"][i][key]), (i, key)
