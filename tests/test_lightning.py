"""ZeroOffloadAdamW inside PyTorch Lightning: the LightningModule a user writes, with configure_optimizers returning
ZeroOffloadAdamW(self, dtype=torch.float32), judged against the same module and Trainer with torch.optim.AdamW.

Automatic optimization makes Lightning call optimizer.step(closure) (the closure runs training_step, zero_grad and
backward), accumulate_grad_batches runs the other micro-batches' backward outside step, gradient_clip_val clips
p.grad with torch.nn.utils.clip_grad_norm_, and a checkpoint saves and loads the optimizer's state dict. Tolerances
as tests/test_clients.py (fp32 vs fp32: losses 1e-4 relative, parameters 1e-2 of the distance travelled; a resumed
run bit-identical to the uninterrupted one). Tiny MLP, CPU, a few seconds.
"""

from __future__ import annotations

import copy

import pytest
import torch
from clients_util import (
    HP,
    LOSS_RTOL,
    PARAM_FRAC,
    assert_params_track,
    assert_same_tensors,
    assert_series_close,
    snapshot,
    tiny_mlp,
)

import zo_kernels as zk

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install -e '.[dev]')")

ROWS, BATCH, ACCUMULATE = 16, 2, 2  # 8 micro-batches per epoch, 4 optimizer steps


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    rows = torch.utils.data.TensorDataset(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 1, generator=g))
    return torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False)


class Regression(pl.LightningModule):
    """MSE regression; `kind` "torch" or "zo" picks the optimizer; `manual` turns automatic optimization off;
    `schedule` adds a LambdaLR stepped per optimizer step. Every training loss is recorded."""

    def __init__(self, net: torch.nn.Module, kind: str, manual: bool = False, schedule: bool = False) -> None:
        super().__init__()
        self.net, self.kind, self.schedule = net, kind, schedule
        self.automatic_optimization = not manual
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss / ACCUMULATE)
        if (batch_idx + 1) % ACCUMULATE == 0:
            opt.step()
            opt.zero_grad()
            if self.schedule:
                self.lr_schedulers().step()
        return None

    def configure_optimizers(self):
        if self.kind == "torch":
            opt = torch.optim.AdamW(self.parameters(), foreach=False, **HP)
        else:
            opt = zk.ZeroOffloadAdamW(self, dtype=torch.float32, **HP)
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7**s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(root, epochs: int = 1, manual: bool = False, **kw) -> pl.Trainer:
    kw = {"enable_model_summary": False, **({} if manual else {"accumulate_grad_batches": ACCUMULATE}), **kw}
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                      default_root_dir=str(root), **kw)  # fmt: skip


def fit(kind: str, root, m0: torch.nn.Module, manual: bool = False, schedule: bool = False, **kw) -> Regression:
    module = Regression(copy.deepcopy(m0), kind, manual=manual, schedule=schedule)
    trainer(root / kind, manual=manual, enable_checkpointing=False, **kw).fit(module, loader())
    return module


def compare(ref: Regression, got: Regression, m0: torch.nn.Module, what: str) -> None:
    assert len(ref.losses) == ROWS // BATCH, f"premise: {len(ref.losses)} training steps ran, not {ROWS // BATCH}"
    assert_series_close(got.losses, ref.losses, LOSS_RTOL, f"{what}: losses, ZeroOffloadAdamW vs torch AdamW")
    assert_params_track(snapshot(got.net), snapshot(ref.net), snapshot(m0), PARAM_FRAC,
                        f"{what}: final params, ZeroOffloadAdamW vs torch AdamW")  # fmt: skip


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no_clip", "gradient_clip_val"])
def test_automatic_optimization_matches_torch(tmp_path, clip):
    """Lightning calls step(closure) (refused before: "takes no closure"), accumulates 2 micro-batches, steps a
    LambdaLR per optimizer step and, with gradient_clip_val, clips p.grad through the MovedGrad placeholders."""
    m0 = tiny_mlp()
    ref = fit("torch", tmp_path, m0, schedule=True, gradient_clip_val=clip)
    got = fit("zo", tmp_path, m0, schedule=True, gradient_clip_val=clip)
    compare(ref, got, m0, f"Lightning automatic optimization, gradient_clip_val={clip}")
    opt = got.trainer.optimizers[0]
    assert isinstance(opt, zk.ZeroOffloadAdamW) and opt.stats["micro_batches"] == ACCUMULATE
    assert opt.param_groups[0]["lr"] == pytest.approx(HP["lr"] * 0.7 ** (ROWS // BATCH // ACCUMULATE))
    if clip is not None:  # premise: the clipping acted (the unclipped run ends elsewhere)
        unclipped = fit("torch", tmp_path / "unclipped", m0, schedule=True)
        assert not torch.equal(unclipped.net[0].weight, ref.net[0].weight)


def test_manual_optimization_matches_torch(tmp_path):
    """self.manual_backward(loss), opt.step() (LightningOptimizer passes a do-nothing closure), opt.zero_grad()."""
    m0 = tiny_mlp()
    ref = fit("torch", tmp_path, m0, manual=True, schedule=True)
    got = fit("zo", tmp_path, m0, manual=True, schedule=True)
    compare(ref, got, m0, "Lightning manual optimization")


def test_checkpoint_resume_is_bit_exact(tmp_path):
    """ModelCheckpoint after epoch 1, then a new module and Trainer fit(ckpt_path=...) to epoch 2: the optimizer's
    state dict (masters, moments, steps) and the scheduler's come back, so the end equals the uninterrupted run's."""
    full = Regression(tiny_mlp(0), "zo", schedule=True)
    trainer(tmp_path / "full", epochs=2).fit(full, loader())
    first = Regression(tiny_mlp(0), "zo", schedule=True)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    trainer(tmp_path / "first", epochs=1, callbacks=[ckpt]).fit(first, loader())
    resumed = Regression(tiny_mlp(1), "zo", schedule=True)  # other weights: the checkpoint must bring them all
    trainer(tmp_path / "resumed", epochs=2).fit(resumed, loader(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.losses == full.losses[len(first.losses) :], "resumed losses vs the uninterrupted run's"
    assert_same_tensors(snapshot(resumed.net), snapshot(full.net), "Lightning: resumed end vs uninterrupted end")
    opt, ref = resumed.trainer.optimizers[0], full.trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"], "the scheduler's lr did not come back"


def test_compiled_module_matches_torch(tmp_path):
    """Trainer.fit(torch.compile(module, backend="aot_eager")): configure_optimizers builds ZeroOffloadAdamW on the
    module inside; the same run as torch AdamW's (aot_eager runs the same aten ops as eager)."""
    m0 = tiny_mlp()
    runs = {}
    for kind in ("torch", "zo"):
        module = Regression(copy.deepcopy(m0), kind, schedule=True)
        trainer(tmp_path / kind, enable_checkpointing=False).fit(torch.compile(module, backend="aot_eager"), loader())
        runs[kind] = module
    compare(runs["torch"], runs["zo"], m0, "Lightning with torch.compile(aot_eager)")
    assert runs["zo"].trainer.optimizers[0].stats["micro_batches"] == ACCUMULATE


def test_bf16_mixed_matches_torch(tmp_path):
    """precision="bf16-mixed" (torch.autocast, no GradScaler) on the fp32 model: the same run as torch AdamW's."""
    m0 = tiny_mlp()
    ref = fit("torch", tmp_path, m0, precision="bf16-mixed")
    got = fit("zo", tmp_path, m0, precision="bf16-mixed")
    compare(ref, got, m0, "Lightning bf16-mixed")


# precision="16-mixed" is bf16-mixed on a CPU (Lightning switches it); on a GPU it unscales p.grad with
# torch.amp.GradScaler, which is refused with the recipe (tests/test_amp_recipes.py checks the refusal).


class Zero16(Regression):
    """The 16-bit recipe: ZeroOffloadAdamW(self, dtype, stage, loss_scale); inputs cast to dtype; with a loss
    scale, LightningModule.backward is overridden to call opt.backward(loss) (Lightning's own calls loss.backward(),
    which would skip the scale)."""

    def __init__(self, net: torch.nn.Module, dtype: torch.dtype, stage: int, loss_scale) -> None:
        super().__init__(net, "zo")  # (not self.dtype: LightningModule's own, read-only)
        self.work_dtype, self.stage, self.loss_scale = dtype, stage, loss_scale

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x.to(self.work_dtype)).float(), y)
        self.losses.append(loss.item())
        return loss

    def backward(self, loss, *args, **kwargs):
        self.trainer.optimizers[0].backward(loss)

    def configure_optimizers(self):
        return zk.ZeroOffloadAdamW(self, dtype=self.work_dtype, stage=self.stage, loss_scale=self.loss_scale, **HP)


@pytest.mark.parametrize("dtype, stage, loss_scale", [(torch.bfloat16, 2, None), (torch.bfloat16, 3, None),
                                                      (torch.float16, 2, "dynamic")],
                         ids=["bf16-stage2", "bf16-stage3", "fp16-dynamic-stage2"])  # fmt: skip
def test_16bit_and_stage3_equal_the_plain_loop(tmp_path, dtype, stage, loss_scale):
    """Lightning (accumulate_grad_batches=2, model summary on) bit-identical to the same optimizer in a plain loop:
    Lightning adds nothing but the loss / 2 of accumulation. The fp16 run's loss scale is the optimizer's."""
    module = Zero16(tiny_mlp(0), dtype, stage, loss_scale)
    trainer(tmp_path, enable_checkpointing=False, enable_model_summary=True).fit(module, loader())
    net = tiny_mlp(0)
    opt = zk.ZeroOffloadAdamW(net, dtype=dtype, stage=stage, loss_scale=loss_scale, **HP)
    losses = []
    for i, (x, y) in enumerate(loader()):
        loss = torch.nn.functional.mse_loss(net(x.to(dtype)).float(), y)
        losses.append(loss.item())
        opt.backward(loss / ACCUMULATE)
        if (i + 1) % ACCUMULATE == 0:
            opt.step()
            opt.zero_grad()
    used = module.trainer.optimizers[0]
    assert module.losses == losses, "Lightning's losses vs the plain loop's"
    assert used.loss_scale == opt.loss_scale and used.stats["micro_batches"] == ACCUMULATE
    with used.gathered(), opt.gathered():
        assert_same_tensors(snapshot(module.net), snapshot(net), "Lightning vs the plain loop")


def test_loss_scale_without_the_backward_override_is_refused(tmp_path):
    """Lightning's own backward calls loss.backward(): with a loss scale that would skip it, so it is refused,
    naming the override (fails on main: step(closure) refused; with closures alone it ran 1/scale gradients)."""

    class NoOverride(Zero16):
        backward = pl.LightningModule.backward

    module = NoOverride(tiny_mlp(0), torch.bfloat16, 2, "dynamic")
    with pytest.raises(RuntimeError, match=r"outside opt\.backward\(loss\).*override LightningModule\.backward"):
        trainer(tmp_path, enable_checkpointing=False).fit(module, loader())


@pytest.mark.parametrize("stage", [2, 3])
def test_16bit_checkpoint_resume_is_bit_exact(tmp_path, stage):
    """bf16 at stages 2 and 3: Lightning's checkpoint (model.state_dict() gathers at stage 3 by itself, the
    optimizer's state dict holds the fp32 masters) resumes into a new module to the uninterrupted run's end."""
    full = Zero16(tiny_mlp(0), torch.bfloat16, stage, None)
    trainer(tmp_path / "full", epochs=2, enable_checkpointing=False).fit(full, loader())
    first = Zero16(tiny_mlp(0), torch.bfloat16, stage, None)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    trainer(tmp_path / "first", epochs=1, callbacks=[ckpt]).fit(first, loader())
    resumed = Zero16(tiny_mlp(1), torch.bfloat16, stage, None)
    trainer(tmp_path / "resumed", epochs=2, enable_checkpointing=False).fit(
        resumed, loader(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))  # fmt: skip
    assert resumed.losses == full.losses[len(first.losses) :], "resumed losses vs the uninterrupted run's"
    with full.trainer.optimizers[0].gathered(), resumed.trainer.optimizers[0].gathered():
        assert_same_tensors(snapshot(resumed.net), snapshot(full.net), f"stage {stage}: resumed vs uninterrupted")
