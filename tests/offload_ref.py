"""The reference the offload step is judged against: fp32 master params + an optimizer on them + a 16-bit
copy of the model for forward/backward, written with plain torch, implementing the same schedules."""

from __future__ import annotations

import copy

import torch

from zo_kernels.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab=96, context=32, layers=2, width=192, heads=4)  # ~0.93M parameters


def make_model(seed: int = 0, cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def make_data(steps: int, batch: int = 8, micro: int = 1, seed: int = 1, cfg: GPTConfig = CFG) -> torch.Tensor:
    """[steps, micro, batch, context + 1] token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (steps, micro, batch, cfg.context + 1), generator=g)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


class Reference:
    """Mixed-precision training the textbook way, one rank, whole batch.

    Args:
        model: the fp32 model (copied, left untouched).
        opt_cls, opt_kw: optimizer over the fp32 masters (torch.optim.AdamW or zo_kernels.CPUAdam).
        dtype: dtype of the working copy used for forward/backward.
        groups: optional callable(master_model) -> param groups for the optimizer.
    """

    def __init__(self, model, opt_cls, dtype=torch.bfloat16, groups=None, loss_scale=None, max_grad_norm=None,
                 delay_update_after=None, **opt_kw):  # fmt: skip
        self.master = copy.deepcopy(model).cpu()  # fp32 masters on the host (CPUAdam takes host tensors only)
        self.work = copy.deepcopy(model).to(dtype)
        params = groups(self.master) if groups else self.master.parameters()
        self.opt = opt_cls(params, **opt_kw)
        self.scale = 2.0**16 if loss_scale == "dynamic" else (loss_scale or 1.0)
        self.dynamic = loss_scale == "dynamic"
        self.good = 0
        self.max_grad_norm = max_grad_norm
        self.delay = delay_update_after
        self.steps_done = 0
        self.norms: list[float] = []
        self.clip_override = None  # set by a test to apply a given clip coefficient

    def train_step(self, micro_batches, inject_inf: bool = False) -> float:
        """Forward/backward over the micro-batches, accumulate fp32 grads, then the (maybe delayed) update."""
        acc = [None] * len(list(self.master.parameters()))
        total = 0.0
        for x, y in micro_batches:
            self.work.zero_grad()
            loss = self.work(x, y)
            (loss.float() * self.scale if self.scale != 1.0 else loss).backward()
            total += loss.item()
            for i, pw in enumerate(self.work.parameters()):
                acc[i] = pw.grad.float() if acc[i] is None else acc[i].add_(pw.grad)
        if inject_inf:
            acc[0][0] = float("inf")
        found = any(not torch.isfinite(a).all() for a in acc)
        if found:
            if self.dynamic:
                self.scale *= 0.5
                self.good = 0
            return total
        for pm, a in zip(self.master.parameters(), acc):
            a = a.cpu()
            pm.grad = a / self.scale if self.scale != 1.0 else a
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(self.master.parameters()), float("inf")).item()
            self.norms.append(norm)
            clip = min(1.0, self.max_grad_norm / (norm + 1e-6))
            clip = self.clip_override if self.clip_override is not None else clip
            for pm in self.master.parameters():
                pm.grad.mul_(clip)
        self.steps_done += 1
        delayed = self.delay is not None and self.steps_done > self.delay
        if delayed:
            self._copy_to_work()  # P_{i-1} reaches the device before update i starts
        self.opt.step()
        if not delayed:
            self._copy_to_work()
        if self.dynamic:
            self.good += 1
            if self.good == 2000:
                self.scale *= 2.0
                self.good = 0
        return total

    @torch.no_grad()
    def _copy_to_work(self) -> None:
        for pm, pw in zip(self.master.parameters(), self.work.parameters()):
            pw.copy_(pm)
