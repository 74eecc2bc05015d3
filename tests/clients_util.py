"""Tiny models, data and comparisons for tests/test_clients.py (ZeroOffloadAdamW inside HF / accelerate / PEFT).

Everything is built in code with random weights: no hub access, no tokenizer. The reference for every run is
plain torch: `torch.optim.AdamW(foreach=False)` on an fp32 model, or, for a 16-bit run, the textbook mixed
precision loop of `MixedPrecisionReference` (fp32 masters + AdamW + a 16-bit working copy). Nothing here
imports zo_kernels, so the reference shares no code with what it judges.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test that reaches for the hub fails instead of downloading
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB, SEQ = 128, 16
HP = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)  # the same AdamW for both sides of a run
LOSS_RTOL = 1e-4  # fp32 vs fp32 (tests/test_clients.py's docstring)
PARAM_FRAC = 1e-2  # fp32 vs fp32, of the distance travelled (tests/test_clients.py's docstring)


# ---------------------------------------------------------------------- models and data


def tiny_mlp(seed: int = 0) -> torch.nn.Module:
    """8 -> 32 -> 1 with a GELU: the regression model of the loop and framework recipes."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


def regression_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n batches of 4 rows (x of 8 features, y of 1) for tiny_mlp."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """GPT-2 with tied input/output embeddings, 2 layers, width 64; dropout off so two runs can agree."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg).train()


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """Llama with grouped-query attention (4 heads, 2 KV heads), 2 layers, width 64, untied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).train()


MODELS: dict[str, Callable[[int], torch.nn.Module]] = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def enable_checkpointing(model: torch.nn.Module, reentrant: bool) -> None:
    """HF's activation checkpointing on: transformers 5's activation_checkpointing_enable where the model has it,
    else gradient_checkpointing_enable (deprecated by it, to be removed in transformers 6)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": reentrant})


def checkpointing_args(reentrant: bool) -> dict:
    """TrainingArguments that turn HF's activation checkpointing on: transformers 5's names where they exist."""
    import inspect

    from transformers import TrainingArguments

    new = "activation_checkpointing" in inspect.signature(TrainingArguments.__init__).parameters
    name = "activation_checkpointing" if new else "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": {"use_reentrant": reentrant}}


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether HF's activation checkpointing is on (transformers 5's name where it exists)."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def token_batches(n: int, batch: int = 2, seq: int = SEQ, seed: int = 1) -> list[torch.Tensor]:
    """n batches [batch, seq] of arithmetic sequences start + stride * t (mod VOCAB), stride in 1..3.

    Learnable in a few steps (the loss visibly falls), unlike uniform noise, and with no tokenizer.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, VOCAB, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        out.append((start + stride * torch.arange(seq)) % VOCAB)
    return out


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


# ---------------------------------------------------------------------- training loops


def torch_adamw(model: torch.nn.Module, **kw) -> torch.optim.AdamW:
    """The reference optimizer: torch's single-tensor AdamW over the trainable params."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False, **{**HP, **kw})


def train(model: torch.nn.Module, opt, steps: Sequence[Sequence[torch.Tensor]],
          loss_fn: Callable = lm_loss) -> tuple[list[float], list[dict]]:  # fmt: skip
    """Per step: loss / n_micro backward for each micro-batch, step, zero_grad. Returns the micro-batch losses
    (flat, in order) and, if the optimizer has `stats`, a copy of them after each step."""
    losses, stats = [], []
    for micro in steps:
        for ids in micro:
            loss = loss_fn(model, ids)
            losses.append(loss.item())
            (loss / len(micro)).backward()
        opt.step()
        opt.zero_grad()
        if hasattr(opt, "stats"):
            stats.append(dict(opt.stats))
    return losses, stats


def group(batches: Sequence[torch.Tensor], micro: int) -> list[list[torch.Tensor]]:
    """Consecutive batches, `micro` per optimizer step."""
    return [list(batches[i : i + micro]) for i in range(0, len(batches), micro)]


class MixedPrecisionReference:
    """The textbook mixed-precision loop in plain torch: a `dtype` working copy runs forward/backward, its
    gradients are summed in fp32 over the micro-batches, torch AdamW updates fp32 masters, the masters are cast
    back. What a 16-bit ZeroOffloadAdamW run is judged against (as in tests/offload_ref.py, for any module).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, **opt_kw) -> None:
        self.master = copy.deepcopy(model).float()
        self.work = copy.deepcopy(model).to(dtype)
        self.pairs = [(m, w) for m, w in zip(self.master.parameters(), self.work.parameters()) if m.requires_grad]
        self.opt = torch_adamw(self.master, **opt_kw)

    def train(self, steps: Sequence[Sequence[torch.Tensor]], loss_fn: Callable = lm_loss) -> list[float]:
        losses = []
        for micro in steps:
            for m, _ in self.pairs:
                m.grad = torch.zeros_like(m)
            for ids in micro:
                loss = loss_fn(self.work, ids)
                losses.append(loss.item())
                (loss / len(micro)).backward()
                for m, w in self.pairs:
                    m.grad += w.grad.float()
                    w.grad = None
            self.opt.step()
            with torch.no_grad():
                for m, w in self.pairs:
                    w.copy_(m)
        return losses


# ---------------------------------------------------------------------- comparisons


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of the model's distinct parameters, by name (a tied weight appears once)."""
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def assert_series_close(got: Sequence[float], want: Sequence[float], rtol: float, what: str) -> None:
    """Every value (a loss, a norm) within rtol (relative) of the reference's; on failure list the bad pairs."""
    assert len(got) == len(want), f"{what}: {len(got)} values vs {len(want)} in the reference"
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not abs(a - b) <= rtol * abs(b)]
    if bad:
        rows = ", ".join(f"[{i}] {got[i]:.7g} vs {want[i]:.7g}" for i in bad[:8])
        raise AssertionError(f"{what}: {len(bad)} of {len(got)} off by more than {rtol:g} relative: {rows}")


def assert_params_track(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], init: dict[str, torch.Tensor],
                        frac: float, what: str) -> None:  # fmt: skip
    """Per parameter: ||got - want|| <= frac * ||want - init|| (a fraction of the distance the reference
    travelled); a parameter the reference did not move must be bit-identical. Lists the worst offenders."""
    assert got.keys() == want.keys(), f"{what}: parameter names differ: {sorted(got.keys() ^ want.keys())[:8]}"
    rows = []
    for name in want:
        err = (got[name].double() - want[name].double()).norm().item()
        travel = (want[name].double() - init[name].double()).norm().item()
        if (travel == 0 and not torch.equal(got[name], want[name])) or err > frac * travel:
            rows.append((err / travel if travel else float("inf"), name, err, travel))
    if rows:
        rows.sort(reverse=True)
        text = "; ".join(f"{n}: err {e:.3g} = {r:.3g} x travelled {t:.3g}" for r, n, e, t in rows[:6])
        raise AssertionError(f"{what}: {len(rows)} of {len(want)} params off by more than {frac:g} of the "
                             f"distance travelled: {text}")  # fmt: skip


def tied_names(model: torch.nn.Module) -> list[list[str]]:
    """model.state_dict() keys grouped by tensor: a tied weight's names form one group (in state_dict order)."""
    groups: dict[int, list[str]] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(v), []).append(k)
    return list(groups.values())


def assert_one_name_per_tensor(saved, model: torch.nn.Module, what: str) -> None:
    """A saved file holds every tensor of the model once: one name of each tied group (savers differ on which:
    safetensors keeps the first in sorted order, HF and accelerate the first in state_dict order), nothing else."""
    saved = set(saved)
    groups = tied_names(model)
    missing = [g for g in groups if not saved.intersection(g)]
    twice = [g for g in groups if len(saved.intersection(g)) > 1]
    unknown = saved.difference(k for g in groups for k in g)
    assert not (missing or twice or unknown), \
        f"{what}: missing {missing[:8]}, saved more than once {twice[:4]}, unexpected {sorted(unknown)[:8]}"


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Bit-identical values and dtypes for every key of `want`."""
    bad = [k for k in want if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))]
    if bad:
        errs = [(got[k].double() - want[k].double()).abs().max().item() if got[k].shape == want[k].shape
                else float("nan") for k in bad]  # fmt: skip
        rows = ", ".join(f"{k} ({got[k].dtype} vs {want[k].dtype}, max err {e:.3g})" for k, e in zip(bad[:6], errs))
        raise AssertionError(f"{what}: {len(bad)} of {len(want)} tensors differ: {rows}")
