"""The importance-selective update (ZenFlow's scheme, `selective=`): an approximation of AdamW.

Per step, the columns of each parameter with the largest gradient norm (the "selected" fraction) are updated on the
device at once, from fp32 masters and moments held there while they are selected. The rest's gradients are summed
on the host over a window of `apply_every` steps (each step's sum on a thread of its own, beside the next forward and
backward: a second gradient landing buffer lets the next backward land while the sum reads the last one, and the
backward after it waits for that sum) and applied by CPU Adam in the background while the next window's
forward/backward run; their new values reach the device at the end of that next window. Every `select_every` steps
the columns are chosen again from that step's gradient: the host first applies the rest of the open window at once
(no overlap on that step), then the state of the columns moves between host and device.

Columns: a parameter of 2 or more dims is viewed as (shape[0], numel // shape[0]) (nn.Linear's weight: one column per
input feature); its rank-local piece selects ceil(fraction * its columns). A parameter of 0 or 1 dim (biases, norms)
is always selected, as in ZenFlow: small, updated every step on the device.

Time of the moments: the selected columns' moments are updated every step; the rest's once per window of w steps,
with the window's mean gradient ḡ as if ḡ had arrived at each of its w steps (m <- b1^w m + (1 - b1^w) ḡ, the same
for v with b2^w and ḡ^2), followed by one AdamW step (lr, weight decay lr * wd) with the bias correction of the
parameter's step count t. So both halves' moments always carry t steps of history, and a column keeps its moments,
unchanged, when it moves. (A step of w * lr, "w steps' worth", was measured worse: bench/convergence.py's demo GPT
ended at 1.19x exact AdamW's validation loss with loss spikes, against 1.11x with one step of lr; see the README.)
With fraction 1.0 every column is selected: exact AdamW (tests/test_selective.py).

What crosses PCIe per step: the whole gradient goes down to the host as without `selective` (the rest's part is
summed there; the selected part's D2H is kept: a re-selection, p.grad's norms and, with accumulation or several
ranks, the norm and overflow check read it on the host). The selected elements'
gradient does not come back: GradPath gathers it on the device from each reduced bucket (selected.py), so a step
sends nothing host-to-device but, once a window ends, the parameters CPU Adam updated. A selection step chooses the
columns from the host's gradient, which the device did not gather: that step moves the selected state (12 bytes per
element) and its selected gradient (4) host-to-device, once per `select_every` steps.

Warm-up: the first `warmup` steps are plain synchronous ZeRO-Offload steps (exact AdamW), as ZenFlow's full warm-up
rounds; the scheme starts at the step after (a resumed run counts from the checkpoint's step counts).

Synchronisation points (the rest of the open window applied at once, every column's state back on the host, the
next step selects again): a re-selection, state_dict(), opt.state[p], load_state_dict(), synchronize(), close().
A run that saves a checkpoint and a run resumed from it therefore continue identically.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple

import torch

from ..cpu_adam import FP32_TINY, accumulate, callers_fp_mode, cpu_adam_step
from .layout import FlatLayout, Run
from .selected import SelectedGrad
from .update import HostUpdate, stopped_waiting

KEYS = ("fraction", "select_every", "apply_every", "warmup")
# host_ranges: a gap of fully selected params shorter than this is summed anyway. Measured (2 cores): an accumulate
# call on a slice costs ~8 us of checks and slicing, 16K bf16 elements ~1 us more, so a shorter gap is cheaper to add
MIN_GAP = 1 << 14


class Selective(NamedTuple):
    """The checked `selective=` dict.

    Args:
        fraction: the share of each parameter's columns updated on the device every step, in (0, 1] (default 0.1,
            ZenFlow's topk_ratio).
        select_every: steps between two choices of the columns (default 100).
        apply_every: steps of gradient summed on the host before CPU Adam applies them to the other columns
            (default 4); the update runs in the background during the next window.
        warmup: the first steps are exact ZeRO-Offload steps (CPU Adam over every column, synchronously) before the
            scheme starts (default 0; ZenFlow's full_warm_up_rounds).
    """

    fraction: float = 0.1
    select_every: int = 100
    apply_every: int = 4
    warmup: int = 0


def check_selective(selective: Any, *, stage: int, offload_optimizer: str, state_format: str, delayed: bool,
                    rule: type, gpu_fraction: float = 0.0) -> Selective | None:  # fmt: skip
    """`selective` as a Selective (None: off); every key and every unsupported combination is refused naming it."""
    if selective is None:
        return None
    if not isinstance(selective, dict):
        raise TypeError(f"selective must be a dict (keys {', '.join(KEYS)}) or None, got {type(selective).__name__}")
    unknown = sorted(str(k) for k in selective if k not in KEYS)
    if unknown:
        raise ValueError(f"selective has unknown key(s) {unknown}: the keys are {', '.join(KEYS)}")
    out = Selective(**selective)
    f = out.fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)):
        raise TypeError(f"selective['fraction'] must be a number in (0, 1], got {type(f).__name__}")
    if not (0.0 < f <= 1.0):  # (NaN fails this too)
        raise ValueError(f"selective['fraction'] must be in (0, 1], got {f}")
    for key, least in (("select_every", 1), ("apply_every", 1), ("warmup", 0)):
        v = getattr(out, key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"selective[{key!r}] must be an int >= {least}, got {type(v).__name__}")
        if v < least:
            raise ValueError(f"selective[{key!r}] must be an int >= {least}, got {v}")
    refusals = [
        (stage not in (1, 2), f"stage={stage} (stages 1 and 2 only)"),
        (offload_optimizer != "cpu", f"offload_optimizer={offload_optimizer!r} (the state in host memory only)"),
        (state_format != "fp32", f"state_dtype {state_format!r} (fp32 moments only)"),
        (delayed, "delay_update_after (the rest is already applied in the background)"),
        (rule is not HostUpdate, "another update rule than AdamW's"),
        (gpu_fraction != 0.0, "gpu_fraction > 0"),
    ]  # fmt: skip
    for refused, what in refusals:
        if refused:
            raise ValueError(f"selective is not supported with {what}")
    return out._replace(fraction=float(f))


def selection_bound(layout: FlatLayout, fraction: float) -> int:
    """S: the most elements a selection of `fraction` (SelectiveUpdate._select) holds in this rank's partition.

    A param's piece of L elements with c columns holds each column q = L // c or q + 1 times (r = L % c of them
    q + 1): its k = ceil(fraction * min(L, c)) selected columns hold at most k q + min(k, r) elements, exactly
    k * rows where the piece is whole rows (one rank); a 0/1-dim param's piece is selected whole."""
    total = 0
    for p in layout.params:
        a, b = layout.part_range(p)
        if a >= b:
            continue
        shape = layout.shape[p]
        if len(shape) < 2:
            total += b - a
            continue
        cols = shape.numel() // shape[0]
        q, r = divmod(b - a, cols)
        k = math.ceil(fraction * min(b - a, cols))
        total += k * q + min(k, r)
    return total


def host_ranges(layout: FlatLayout, full: list[bool]) -> list[tuple[int, int]]:
    """The partition ranges whose gradient is summed on the host: the params not fully selected, a gap of fully
    selected ones shorter than MIN_GAP summed anyway (one add_ call more costs more than its elements)."""
    out: list[tuple[int, int]] = []
    for p in layout.flat_order:
        a, b = layout.part_range(p)
        if a >= b or full[layout.index[p]]:
            continue
        if out and a - out[-1][1] < MIN_GAP:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class SelectiveUpdate(HostUpdate):
    """HostUpdate with the selective scheme: the selected columns' state on the device, the rest's gradient summed.

    Args (beyond HostUpdate's): selective: the checked configuration. device: the parameters' device.
    """

    PARAMS_OVER_GRADS = False  # its staging of its own: the summed gradients are read again at each apply

    def __init__(self, *args: Any, selective: Selective, device: torch.device, selected: SelectedGrad,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        assert not self.staging_in_place and self._state is not None, "built with delayed=True, fp32, in memory"
        self.cfg, self.device, self.selected = selective, device, selected
        self._publish_all = self.publish
        self.publish = self._publish  # (write_staging publishes through it)
        part, cap = self.layout.part, selected.capacity
        self.acc = [torch.zeros(part, dtype=torch.float32) for _ in range(2)]  # a window's sum, and the last one's
        self.window = [[0] * len(self.layout.params) for _ in range(2)]  # steps summed per param, per buffer
        self.cur = 0  # the buffer of the open window
        self.in_window = 0  # steps in the open window
        self.since_select = 0
        # the selection (sorted partition indices: selected.sel, a view of sel_buf) and its fp32 state on the
        # device (master, exp_avg, exp_avg_sq): buffers for the largest selection S, made once
        self.sel_buf = torch.zeros(cap, dtype=torch.int64)
        self.state_device = torch.zeros(3 * cap, dtype=torch.float32, device=device)
        self.transport.pool.max_bytes += 12 * cap
        # pinned: the selected state on its way between host and device (and, at a selection step, its gradient)
        self.shuttle = self.transport.pool.take(3 * cap, torch.float32) if cap else torch.zeros(0)
        self._grad_event: Any = None  # the H2D of a selection step's gradient, which reads the shuttle
        self._hparams: list[dict] = []
        self.full = [False] * len(self.layout.params)  # every element of this rank's piece of param i is selected
        self._host_ranges: list[tuple[int, int]] = []  # partition ranges summed on the host: the params not full
        # the window sums run on a thread of their own, beside the next forward and backward (a step's gradient
        # is read there until its sum ends: the backward that lands in that buffer again waits for it, wait_readers)
        self._sum_executor: ThreadPoolExecutor | None = None
        self._sum_reading: dict[int, Future] = {}  # address of a gradient buffer -> the sum still reading it
        self._last_sum: Future | None = None  # the last sum submitted (they run in order: it covers the others)

    @property
    def sel(self) -> torch.Tensor | None:
        """The selection held (sorted partition indices), None between a synchronisation point and the next step."""
        return self.selected.sel

    @property
    def device_state_bytes(self) -> int:
        """The device bytes made once: the selection's p32, m, v (12S), its gradient (4S) and index (8S)."""
        return sum(t.numel() * t.element_size() for t in (self.state_device, self.selected.landing,
                                                          self.selected.index))  # fmt: skip

    # ------------------------------------------------------------------ one step

    def selective_step(self, grad: torch.Tensor, grad_scale: float, runs: list[Run], hparams: list[dict],
                       got: list[bool], selected: torch.Tensor | None = None) -> None:  # fmt: skip
        """The step's gradient (the host's whole one, and `selected`: the selection's, gathered on the device during
        backward): the selected columns updated on the device now, the rest summed; at a window's end the last
        window's update lands on the device and this one's starts in the background."""
        if max(self.steps, default=0) <= self.cfg.warmup:  # (steps counts this step already)
            self.run(grad, grad_scale, runs, hparams)
            return
        t0 = time.perf_counter()
        if self.sel is None or self.since_select >= self.cfg.select_every:
            self.drain()
            self._select(grad)
            # the selection is chosen from this step's gradient, which the device did not gather: this step's
            # selected gradient takes the round trip (host gather, H2D); the next steps' is gathered on the device
            selected = self._selected_from_host(grad)
        assert selected is not None, "a selection held since the last step gathers its gradient on the device"
        self._hparams = hparams  # (a drain applies the open window with the hyper-parameters of its last step)
        self._device_update(selected, grad_scale, runs, hparams)
        closes = self.in_window + 1 == self.cfg.apply_every
        if closes:  # the last window's update (its parameters go down below)
            super().finish_pending(write=False)
        # (the fully selected params' gradient is never applied from acc)
        pieces = [(x, y, grad_scale * factor) for _, a, b, _, factor in runs for x, y in self._host_part(a, b)]
        self._submit_sum(self.acc[self.cur], grad, pieces)
        window = self.window[self.cur]
        for i, g in enumerate(got):
            window[i] += g
        self.since_select += 1
        self.in_window += 1
        if closes:
            self._send_staging()
            self._start_apply(hparams)
        # (the background update's own time is "cpu_update", added when it is waited for)
        self.times.add("selective", time.perf_counter() - t0)
        self.publish()

    def _submit_sum(self, acc: torch.Tensor, grad: torch.Tensor, pieces: list[tuple[int, int, float]]) -> None:
        """acc[x:y] += alpha * grad[x:y] for each piece, on the sum thread: the step returns at once."""
        if self._sum_executor is None:
            self._sum_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zo-selective-sum")

        def job() -> None:
            for x, y, alpha in pieces:
                accumulate(acc[x:y], grad[x:y], alpha=alpha, threads=self.bg_threads)

        self._last_sum = self._sum_reading[grad.data_ptr()] = self._sum_executor.submit(callers_fp_mode(job))

    def _wait_sum(self, fut: Future) -> None:
        """Wait for a window sum; its failure stops the optimizer (as a background update's does) and forgets every
        sum, whose buffers then hold part of a window (a loaded state replaces them: see drain)."""
        try:
            fut.result(timeout=self.timeout_s)
        except FutureTimeout:  # (it may still be writing the sums: fatal, as a background update's timeout)
            self._sum_reading, self._last_sum, self._pending = {}, None, None  # (close's shutdown waits for them)
            raise self._timed_out() from None
        except BaseException as e:
            if stopped_waiting(fut, e):  # Ctrl-C in the wait: the sum goes on, waited for again next time
                raise
            self.stopped = e
            self._quiesce()
            raise

    def _quiesce(self) -> None:
        """After a failed sum: the sums queued behind it and the background update (which reads its buffer) end,
        their errors this one's; then the window buffers are emptied (a loaded state replaces the rest)."""
        pending = [f for f in (self._last_sum, self._pending) if f is not None]
        if wait_futures(pending, timeout=self.timeout_s).not_done:
            self._timed_out()
        self._sum_reading, self._last_sum, self._pending = {}, None, None
        for buf in range(2):
            self.acc[buf].zero_()
            self.window[buf] = [0] * len(self.layout.params)
        self.in_window = 0

    def _timed_out(self) -> TimeoutError:
        """A window sum (or the update behind it) is past update_timeout_s: the optimizer is unusable (`failed`)."""
        self.failed = TimeoutError(f"a window sum of the selective update did not finish within {self.timeout_s:g} s "
                                   "(update_timeout_s)")  # fmt: skip
        return self.failed

    def wait_readers(self, tensors: list[torch.Tensor]) -> None:
        """Before a backward writes these gradient buffers: the window sum still reading one of them is done."""
        for t in tensors:
            fut = self._sum_reading.get(t.data_ptr())
            if fut is not None:
                self._wait_sum(fut)
                self._sum_reading.pop(t.data_ptr(), None)

    def _wait_all_sums(self) -> None:
        """Every window sum submitted is done (they run in order: the last one's end is all of theirs)."""
        if self._last_sum is not None:
            self._wait_sum(self._last_sum)
            self._sum_reading, self._last_sum = {}, None

    def _host_part(self, a: int, b: int) -> list[tuple[int, int]]:
        """Partition range [a, b) intersected with the host-summed ranges."""
        out = []
        for x, y in self._host_ranges:
            if y <= a:
                continue
            if x >= b:
                break
            out.append((max(x, a), min(y, b)))
        return out

    def _select(self, grad: torch.Tensor) -> None:
        """Choose the columns from this gradient and move their state to the device."""
        lay, pieces = self.layout, []
        self.full = [False] * len(lay.params)
        for i, p in enumerate(lay.params):
            a, b = lay.part_range(p)
            if a >= b:
                continue
            shape = lay.shape[p]
            if len(shape) < 2:
                pieces.append(torch.arange(a, b))
                self.full[i] = True
                continue
            cols = shape.numel() // shape[0]
            first = a + lay.part_lo - lay.offset[p]  # p's element at partition index a
            col = torch.arange(first, first + b - a) % cols
            norms = torch.zeros(cols, dtype=torch.float64).index_add_(0, col, grad[a:b].double().square())
            present = torch.zeros(cols, dtype=torch.bool)
            present[col] = True
            n_present = int(present.sum())
            k = math.ceil(self.cfg.fraction * n_present)
            self.full[i] = k == n_present
            chosen = torch.zeros(cols, dtype=torch.bool)  # (a lookup per element: isin sorted per element)
            chosen[torch.topk(norms.masked_fill(~present, -1.0), k).indices] = True
            pieces.append(a + torch.nonzero(chosen[col]).view(-1))
        n = sum(x.numel() for x in pieces)
        sel = self.sel_buf[:n]
        if pieces:
            torch.cat(pieces, out=sel)
        self._host_ranges = host_ranges(lay, self.full)
        master, exp_avg, exp_avg_sq = self._state
        for j, t in enumerate((master, exp_avg, exp_avg_sq)):
            torch.index_select(t, 0, sel, out=self.shuttle[j * n : (j + 1) * n])
        ev = self.transport.h2d(self.state_device[: 3 * n], self.shuttle[: 3 * n])
        self.transport.device_wait(ev)
        self.transport.wait(ev)  # (the shuttle is read by the copy: reused only after it)
        self.selected.select(sel)
        self.since_select = 0

    def _selected_from_host(self, grad: torch.Tensor) -> torch.Tensor:
        """The selection's gradient gathered from the host gradient and copied to the device (a selection step)."""
        n = self.sel.numel()
        g = self.selected.landing[:n]  # (not read again this step: the next backward overwrites it)
        if n:
            g_host = self.shuttle[:n]  # (free: _select waited for its copy)
            if grad.dtype == torch.float32:
                torch.index_select(grad, 0, self.sel, out=g_host)
            else:
                g_host.copy_(grad[self.sel])
            self._grad_event = self.transport.h2d(g, g_host)
            self.transport.device_wait(self._grad_event)
        return g

    def _device_update(self, g: torch.Tensor, grad_scale: float, runs: list[Run], hparams: list[dict]) -> None:
        """AdamW on the device over the selected elements of the runs (torch's single-tensor AdamW arithmetic), from
        their gradient g (fp32, on the device; scaled in place)."""
        n = self.sel.numel()
        if n == 0:
            return
        master, exp_avg, exp_avg_sq = self.state_device[: 3 * n].view(3, n)
        bounds = torch.tensor([x for _, a, b, _, _ in runs for x in (a, b)], dtype=torch.int64)
        cuts = torch.searchsorted(self.sel, bounds).tolist()
        for k, (gi, _, _, step, factor) in enumerate(runs):
            s0, s1 = cuts[2 * k], cuts[2 * k + 1]
            if s0 == s1:
                continue
            h = hparams[gi]
            lr, (b1, b2), eps, wd = h["lr"], h["betas"], h["eps"], h["weight_decay"]
            gk = g[s0:s1].mul_(-grad_scale * factor if h["maximize"] else grad_scale * factor)
            p, m, v = master[s0:s1], exp_avg[s0:s1], exp_avg_sq[s0:s1]
            p.mul_(1 - lr * wd)
            m.lerp_(gk, 1 - b1)
            v.mul_(b2).addcmul_(gk, gk, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2**step)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1**step))

    def _publish(self) -> None:
        """The selected elements' parameters from their device masters (staging holds stale ones), then publish."""
        if self.sel is not None and self.sel.numel():
            n = self.sel.numel()
            self.own.index_copy_(0, self.selected.index[:n], self.state_device[:n].to(self.own.dtype))
        self._publish_all()

    # ------------------------------------------------------------------ the rest, on the host

    def _apply_runs(self, buf: int) -> list[Run]:
        """The runs of window buffer `buf`: (group, a, b, step t, steps summed w) of the params it holds."""
        w = [0 if full else x for x, full in zip(self.window[buf], self.full)]  # (those are on the device only)
        # layout.runs cuts where the group, steps[i] + 1 or factor[i] changes: t and w are passed as those two
        return self.layout.runs([x > 0 for x in w], [s - 1 for s in self.steps], [float(x) for x in w])

    def _apply(self, buf: int, runs: list[Run], hparams: list[dict], sums: Future | None = None,
               threads: int | None = None) -> float:  # fmt: skip
        """CPU Adam over the rest with the window's mean gradient (moments as w steps, one step: see the module
        docstring), into staging, once `sums` (the window's last sum) is done; the window's buffer is zeroed for
        reuse. Returns its wall time."""
        if sums is not None:
            sums.result()  # (its failure is this update's: finish_pending raises it)
        t0 = time.perf_counter()
        self.transport.wait(self._staging_read)  # the last copy out of staging has read it
        master, exp_avg, exp_avg_sq = self._state
        acc = self.acc[buf]
        for gi, a, b, t, w in runs:
            h, w = hparams[gi], int(w)
            (b1, b2), c1 = h["betas"], 1.0 - h["betas"][0] ** t
            c2 = math.sqrt(1.0 - b2**t)
            eps = max(h["eps"] * c2, FP32_TINY)  # (an eps taken down to fp32's smallest normal, times c2: below it)
            # the kernel without bias correction: p *= 1 - lr' wd'; p -= lr' m / (sqrt(v) + eps')
            cpu_adam_step(master[a:b], acc[a:b], exp_avg[a:b], exp_avg_sq[a:b], step=1, bias_correction=False,
                          lr=h["lr"] * c2 / c1, betas=(b1**w, b2**w), eps=eps,
                          weight_decay=h["weight_decay"] * c1 / c2, grad_scale=1.0 / w, maximize=h["maximize"],
                          param_out=self.staging_buf[a:b], threads=threads or self.threads)  # fmt: skip
        acc.zero_()
        return time.perf_counter() - t0

    def _start_apply(self, hparams: list[dict]) -> None:
        """The open window's update starts in the background; the next window sums into the other buffer."""
        buf = self.cur
        runs = self._apply_runs(buf)
        self.window[buf] = [0] * len(self.layout.params)
        self.cur, self.in_window = 1 - buf, 0
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zo-selective")
        self._pending = self._executor.submit(callers_fp_mode(self._apply), buf, runs, hparams, self._last_sum,
                                              self.bg_threads)  # fmt: skip

    def _send_staging(self) -> None:
        """Staging (the last update's parameters) -> this rank's device parameters; published by the caller."""
        if self.staged:
            self._staging_read = self.transport.h2d(self.own, self.staging_buf)
            self.transport.device_wait(self._staging_read)
            self.staged = False

    def drain(self) -> None:
        """The synchronisation point: the background update waited for, the open window applied at once, the
        selected state back on the host, the selection dropped (the next step selects), the parameters sent."""
        if self.failed is not None:  # (a sum or update past the timeout may still write: nothing is read)
            return
        if self.stopped is not None:  # a failure already raised: not again (a load or close follows)
            self._quiesce()
        self._wait_all_sums()
        super().finish_pending(write=False)
        applied = self.staged
        if any(self.window[self.cur]):
            hparams = self._hparams
            runs = self._apply_runs(self.cur)
            self.window[self.cur] = [0] * len(self.layout.params)
            self.times.add("cpu_update", self._apply(self.cur, runs, hparams))
            applied = True
        self.in_window = 0
        if self.sel is not None:
            n = self.sel.numel()
            self.transport.wait(self._grad_event)  # the shuttle is read by a selection step's gradient copy
            self._grad_event = None
            if n:
                ev = self.transport.d2h(self.shuttle[: 3 * n], self.state_device[: 3 * n])
                self.transport.wait(ev)
                for j, t in enumerate(self._state):
                    t.index_copy_(0, self.sel, self.shuttle[j * n : (j + 1) * n])
                self.staging_buf.index_copy_(0, self.sel, self._state[0][self.sel].to(self.staging_buf.dtype))
            self.selected.drop()
            applied = True
        if applied:
            self.staged = True
            self.write_staging()
            self.staged = False

    def finish_pending(self, write: bool, keep_model: bool = False) -> None:
        """Every reader and writer of the state (state_dict, opt.state, load, synchronize, close) drains first.
        `keep_model`: the masters are taken from the model next (refresh_from_model, a load without masters): the
        parameters stay as the model holds them now (the drain writes its update over them: weights loaded into the
        model since the last step were lost, and the masters refreshed from the update's parameters)."""
        if not keep_model:
            self.drain()
            return
        now = self.own.detach().to("cpu", copy=True)  # (in host memory: no device copy of the partition at once)
        self.drain()
        self.own.copy_(now)  # (after the drain's writeback: the compute stream waits for its copies)
        self._publish_all()

    def refresh_from_model(self) -> None:
        """The masters from the model's parameters as they are now (not after the drain's update)."""
        self.finish_pending(write=False, keep_model=True)
        super().refresh_from_model()

    @torch.no_grad()
    def resume(self, staged: bool) -> None:
        """After a load: the device parameters from the masters now. A delayed update's state saved with its
        writeback pending (`staged`) finds no later point here to send it: a selective step writes its parameters
        at the end of a window or a synchronisation point, after that step's forward has read them."""
        super().resume(staged=False)

    def close(self) -> None:
        """Stop the sum thread and the background worker (after finish_pending)."""
        if self._sum_executor is not None:
            self._sum_executor.shutdown(wait=True)
        super().close()
