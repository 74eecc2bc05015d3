"""UpdateProbe: how far a synchronous step moved the masters, against lr, and whether the device got their cast.

The scale check's diagnostic (bench/scale_check.py, issue 23): a few windows of every parameter's fp32 master are
read before and after each synchronous step (`opt.update.copy_state`, the path `opt.state` reads through, on a few
KiB per parameter instead of whole copies). Exact Adam moves no element further than lr x B_t at step t (B_t = 1 at
step 1; the 8-bit format's guard, cpu/adam.cpp's update_cap, holds its update to the same), so `update_over_lr`
well above the bound is a broken update, wherever in the flat buffers it sits (a move is counted less one fp32 ulp
of the master: the new master is rounded once, and a LayerNorm weight of 1.0 moved by lr = 2e-6 rounds by up to 3%
of lr, which read as "1.03 x lr, beyond the bound" at steps 1 and 3 of a 1B GPT on the CPU); and after a synchronous
step the device's 16-bit parameters are the masters' cast, so a window where they differ is a misplaced or missing
writeback.
Only between synchronous steps: a delayed update runs in the background after step() returns.
"""

from __future__ import annotations

import torch
from zo_kernels._cpu import update_cap

WINDOW = 1024  # elements per window: four 8-bit blocks (windows start on a block of the parameter)
WINDOWS = 2  # per parameter: its first elements and a random block-aligned window (a tile or bucket seam anywhere)


class UpdateProbe:
    """Windows of each parameter's flat range (partition coordinates, one rank), read before and after a step."""

    def __init__(self, opt, model: torch.nn.Module, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.opt, self.windows = opt, []  # (name, param, offset in the param, partition range a, b)
        names = {p: n for n, p in model.named_parameters()}
        for i, p in enumerate(opt.layout.params):
            a, b = opt.layout.part_range(p)
            if b - a <= 0:
                continue
            starts = {0}
            if b - a > WINDOW:
                starts.add(int(torch.randint(0, (b - a - WINDOW) // 256 + 1, (1,), generator=gen)) * 256)
            for s in sorted(starts)[:WINDOWS]:
                self.windows.append((names.get(p, f"param {i}"), p, s, a + s, min(b, a + s + WINDOW)))
        self.before_masters: list[torch.Tensor] | None = None

    def _masters(self) -> list[torch.Tensor]:
        outs = [tuple(torch.empty(b - a) for _ in range(3)) for _, _, _, a, b in self.windows]
        self.opt.update.copy_state([(a, b, o) for (_, _, _, a, b), o in zip(self.windows, outs)])
        return [o[0] for o in outs]

    def before(self) -> None:
        self.before_masters = self._masters()

    def after(self, *, step: int, lr: float, betas: tuple[float, float], weight_decay: float = 0.0,
              device_params: bool = True) -> dict:  # fmt: skip
        """After a synchronous step (the device synchronized): the largest master move over lr (AdamW's decay, the
        master x lr x weight_decay, left out; each move less one fp32 ulp of its master, the rounding of the new
        value), the bound exact Adam keeps at this step, the windows past 1.001 x that bound, and (device_params) the
        elements whose device value differs from the master's cast."""
        after = self._masters()
        cap = update_cap(step, *betas)
        bound = 1.0 / ((1.0 - betas[0] ** step) * cap) if cap > 0 else float("inf")
        worst, worst_name, beyond, mismatched = 0.0, None, [], 0
        for (name, p, s, a, b), m0, m1 in zip(self.windows, self.before_masters, after):
            big = torch.maximum(m0.abs(), m1.abs())
            ulp = torch.nextafter(big, torch.full_like(big, float("inf"))) - big
            move = ((m1 - m0 * (1.0 - lr * weight_decay)).abs() - ulp).clamp_(min=0.0)
            moved = move.max().item() / lr if lr > 0 else 0.0
            if moved > worst:
                worst, worst_name = moved, name
            if moved > 1.001 * bound:
                beyond.append(f"{name}[{s}:{s + b - a}]: {moved:.3g}")
            if device_params:
                dev = p.detach().reshape(-1)[s : s + b - a].float().cpu()
                mismatched += int((dev != m1.to(p.dtype).float()).sum())
        out = dict(update_over_lr=worst, update_bound=bound, worst_param=worst_name, beyond_bound=beyond[:8])
        if device_params:
            out["writeback_mismatches"] = mismatched
        self.before_masters = None
        return out
