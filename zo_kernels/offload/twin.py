"""gpu_fraction (Twin-Flow, ZeRO-Offload++): the tail of this rank's partition keeps its fp32 master and Adam's moments
(in the run's state_dtype) on the device and is updated there (device_adam.py: on a GPU a Triton kernel with CPU Adam's
arithmetic; on the CPU stand-in torch's fused AdamW), on a device stream, while CPU Adam updates the head.

The partition [0, part) is cut at `split`: the head [0, split) is an ordinary HostUpdate (host memory or NVMe), the
tail [split, part) a DeviceState (fp32 masters, moments in the head's format). Its gradients never leave the device
(GradPath's `device_landing`).
The step is the same AdamW step as the host's: one overflow flag, one clipping norm and one loss scale over the whole
partition (grads.py sums both parts), each parameter's own step count; on a GPU CPU Adam's arithmetic bit for bit, on
the CPU stand-in torch's fused kernel, whose rounding differs.

Delayed parameter update: the tail follows the head's one-step delay. Update i of the tail runs at step i (on the device
stream) into the device masters; its 16-bit parameters reach the model together with the head's, when update i's
writeback runs (the next step's start, or synchronize()). So forward i uses P_{i-2} for every parameter, as the oracle
(tests/oracle.py) defines it, and one rule describes the whole model; the tail needs no staging buffer: at the writeback
its masters still hold P_i (update i+1 is launched after it).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from ..cpu_adam import callers_fp_mode
from .device_adam import DeviceState
from .formats import block_of, bytes_per_element, cut_raw
from .layout import FlatLayout, Run
from .update import HostUpdate, MasterFill, StateViews, differing, param_ranges, stale_warning, stopped_waiting


def check_gpu_fraction(x: Any) -> float:
    """gpu_fraction: a real number in [0, 1] (not a bool, a string or None)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"gpu_fraction must be a number in [0, 1], got {type(x).__name__}")
    x = float(x)
    if not (math.isfinite(x) and 0.0 <= x <= 1.0):
        raise ValueError(f"gpu_fraction must be in [0, 1], got {x}")
    return x


def device_split(part: int, fraction: float, align: int) -> int:
    """Where the device's tail starts in the partition: its last round(fraction * part) elements, cut on `align`
    (part is a multiple of it)."""
    return part - min(part, round(fraction * part / align) * align)


def split_runs(runs: list[Run], split: int) -> tuple[list[Run], list[Run]]:
    """Runs of the partition -> (the head's, the tail's in tail coordinates: partition offset - split)."""
    head = [(g, a, min(b, split), s, f) for g, a, b, s, f in runs if a < split]
    tail = [(g, max(a, split) - split, b - split, s, f) for g, a, b, s, f in runs if b > split]
    return head, tail


class DeviceStream:
    """Where the tail's update runs, beside the host's CPU Adam: a CUDA side stream; on the CPU a worker thread (the
    stand-in for a stream: it runs later, after `delay_s`, so a missing wait reads stale values, as on a GPU).

    Args:
        device: the parameters' device.
        timeout_s: the longest `wait` blocks on the CPU stand-in.
    """

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device, self.timeout_s = device, timeout_s
        self.delay_s = 0.0  # tests: the stand-in runs each job this late
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._event: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None

    def launch(self, job: Callable[[], None]) -> None:
        """Run job() after the work queued so far on the compute stream (the reduce and the copies to the landing)."""
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with torch.cuda.stream(self._stream):
                    job()
            finally:  # (a job that failed midway has queued some kernels: the next wait covers them too)
                self._event = self._stream.record_event()
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zo-twin")
        self._future = self._executor.submit(callers_fp_mode(self._run), job)

    def _run(self, job: Callable[[], None]) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        with torch.no_grad():
            job()

    def wait(self) -> None:
        """The compute stream (on the CPU: the host) waits for the last job; the job's exception is raised here."""
        if self._cuda:
            if self._event is not None:
                torch.cuda.current_stream(self.device).wait_event(self._event)
            return
        fut, self._future = self._future, None
        if fut is not None:
            try:
                fut.result(timeout=self.timeout_s)
            except BaseException as e:
                if stopped_waiting(fut, e) and not isinstance(e, FutureTimeout):
                    self._future = fut  # Ctrl-C in the wait: the job goes on, waited for by the next wait
                raise

    @property
    def pending(self) -> bool:
        """A job launched and not waited for (on the CPU stand-in)."""
        return self._future is not None

    def close(self) -> None:
        """Wait for the last job (its failure was raised by wait) and stop the worker."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class TwinUpdate(StateViews):
    """HostUpdate's interface over the whole partition: the head [0, split) a HostUpdate, the tail on the device.

    Args:
        layout, own, master, transport, publish: as HostUpdate's (own and master over the whole partition).
        split: where the tail starts (device_split).
        device: the device of the tail's state.
        delayed: the delayed parameter update is on (the tail's parameters are then written with the head's).
        timeout_s: the longest the host waits for the tail's update.
        state_fmt: the moments' format, the same on both sides (formats.py).
        host_kwargs: HostUpdate's other keyword arguments.
    """

    HAS_MOMENTS = True

    def __init__(self, layout: FlatLayout, own: torch.Tensor, master: torch.Tensor | MasterFill, transport: Any,
                 publish: Callable[[], None], *, split: int, device: torch.device, delayed: bool, timeout_s: float,
                 state_fmt: str = "fp32", **host_kwargs: Any) -> None:  # fmt: skip
        self.layout, self.own, self.split, self.delayed, self.fmt = layout, own, split, delayed, state_fmt
        self._publish_all = publish
        tail = layout.part - split
        values = torch.zeros(tail, dtype=torch.float32)
        if isinstance(master, torch.Tensor):
            values.copy_(master[split:])
        else:
            master(split, layout.part, values)
        # the device tail's fp32 master, exp_avg, exp_avg_sq in the format (K bytes per element of the tail); the
        # stochastic rounding (bf16, 8-bit exp_avg) hashes each element's partition offset, as the host's tiles do
        self.device_state = DeviceState(state_fmt, values.to(device), seed=layout.rank << 40, offset=split)
        self.stream = DeviceStream(device, timeout_s)
        self.steps = [0] * len(layout.params)
        self._failed: BaseException | None = None
        self._staged = False  # DPU: the tail's last update is in its masters, not yet in the parameters
        self.host: HostUpdate | None = None
        if split:
            # (a copy: a view would keep the whole partition's fp32 masters alive, the tail's 4 bytes per element too)
            head_master = master[:split].clone() if isinstance(master, torch.Tensor) else master
            self.host = HostUpdate(layout, own[:split], head_master, transport, self._publish, delayed=delayed,
                                   timeout_s=timeout_s, numel=split, state_fmt=state_fmt, **host_kwargs)  # fmt: skip

    # ------------------------------------------------------------------ what the other parts read

    @property
    def failed(self) -> BaseException | None:
        return self._failed or (self.host.failed if self.host is not None else None)

    @property
    def stopped(self) -> BaseException | None:
        return self.host.stopped if self.host is not None else None

    @stopped.setter
    def stopped(self, value: BaseException | None) -> None:
        if self.host is not None:
            self.host.stopped = value

    @property
    def staged(self) -> bool:
        return self._staged

    params_in_swapper = False
    moments = None

    @property
    def swapper(self) -> Any:
        return self.host.swapper if self.host is not None else None

    @property
    def staging_in_place(self) -> bool:
        return self.host is None or self.host.staging_in_place

    @property
    def params_over_grads(self) -> bool:
        return self.host is not None and self.host.params_over_grads

    @property
    def staging_buf(self) -> torch.Tensor | None:
        return self.host.staging_buf if self.host is not None else None

    @property
    def host_state_bytes(self) -> int:
        return self.host.host_state_bytes if self.host is not None else 0

    @property
    def state_bytes_per_param(self) -> float:
        """K, on both sides: the masters' 4 bytes and the moments' in their format."""
        return 4 + bytes_per_element(self.fmt)

    @property
    def device_state_bytes(self) -> int:
        """Device bytes of the tail's state: fp32 master, exp_avg, exp_avg_sq in their format."""
        return self.device_state.nbytes

    # ------------------------------------------------------------------ state over the whole partition

    def state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of the whole partition: copies (write changes back with save_state)."""
        self._wait_device()
        head = self.host.state() if self.host is not None else (torch.empty(0),) * 3
        tail = (self.device_state.master, *self.device_state.get(0, self.device_state.numel))
        return tuple(torch.cat([h[: self.split], d.cpu()]) for h, d in zip(head, tail))

    def copy_state(self, ranges: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]) -> None:
        """HostUpdate.copy_state over the whole partition: the head's pieces from the host, the tail's from the
        device."""
        self._wait_device()
        s = self.split
        if self.host is not None:
            self.host.copy_state([(a, min(b, s), tuple(o[: max(0, min(b, s) - a)] for o in outs))
                                  for a, b, outs in ranges if a < s])  # fmt: skip
        for a, b, outs in ranges:
            if b > s and b > a:
                x = max(a, s)  # (a parameter's start or the split: on a block)
                tail = (self.device_state.master[x - s : b - s], *self.device_state.get(x - s, b - s))
                for out, src in zip(outs, tail):
                    out[x - a :].copy_(src)

    def save_state(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Make these (whole partition) the state."""
        self._wait_device()
        if self.host is not None:
            self.host.save_state(*(t[: self.split] for t in (master, exp_avg, exp_avg_sq)))
        s, d = self.split, self.device_state
        d.master.copy_(master[s:])
        d.set(0, d.numel, exp_avg[s:], exp_avg_sq[s:])

    def raw_moments(self) -> list[torch.Tensor]:
        """The partition's moments bit for bit (formats.Moments.tensors() of the whole partition): the head's, then
        the tail's (the split is on a block: the head's last scale is its own)."""
        self._wait_device()
        tail = self.device_state.raw()
        if self.host is None:
            return tail
        return [torch.cat([h, t]) for h, t in zip(self.host.raw_moments(), tail)]

    def set_raw(self, pieces: list[tuple[int, int, dict[str, torch.Tensor]]]) -> None:
        """Partition ranges [a, b) (each on a block) of the moments from formats.Moments.raw() bits."""
        self._wait_device()
        s, block = self.split, block_of(self.fmt)
        head, tail = [], []
        for a, b, raw in pieces:
            for lo, hi, side, base in ((a, min(b, s), head, 0), (max(a, s), b, tail, s)):
                if lo < hi:  # (lo - a is on a block)
                    side.append((lo - base, hi - base, cut_raw(raw, lo - a, hi - a, block)))
        if head:
            self.host.set_raw(head)
        for a, b, raw in tail:
            self.device_state.set_raw(a, b, raw)

    def wait_written(self) -> None:
        """The head's writeback (the tail is written by the device update, on the compute stream's order)."""
        if self.host is not None:
            self.host.wait_written()

    def save_master(self, master: torch.Tensor) -> None:
        """Make `master` (whole partition) the masters; the moments stay."""
        self._wait_device()
        if self.host is not None:
            self.host.save_master(master[: self.split])
        self.device_state.master.copy_(master[self.split :])

    # ------------------------------------------------------------------ the update

    def run(self, grad: torch.Tensor, grad_scale: float, runs: list[Run], hparams: list[dict],
            device_grad: torch.Tensor | None = None, out: torch.Tensor | None = None) -> None:  # fmt: skip
        """The synchronous update: the tail's launched on the device stream, the head's CPU Adam meanwhile; the new
        parameters of both, then the all-gather."""
        head, tail = split_runs(runs, self.split)
        self._launch(device_grad, grad_scale, tail, hparams)
        if self.host is not None:
            self.host.run(grad, grad_scale, head, hparams, out)  # (its publish writes the tail's parameters first)
        else:
            self._publish()

    def start(self, grad: torch.Tensor, grad_scale: float, runs: list[Run], hparams: list[dict],
              device_grad: torch.Tensor | None = None, out: torch.Tensor | None = None) -> None:  # fmt: skip
        """The delayed update: the tail's on the device stream, the head's in the background thread; the parameters
        of both reach the model at the next writeback."""
        head, tail = split_runs(runs, self.split)
        self._launch(device_grad, grad_scale, tail, hparams)
        if self.host is not None:
            self.host.start(grad, grad_scale, head, hparams, out)
        self._staged = True

    def _launch(self, grad: torch.Tensor | None, grad_scale: float, runs: list[Run], hparams: list[dict]) -> None:
        if not runs:
            return
        self.stream.launch(lambda: self.device_state.step(grad, grad_scale, runs, hparams))

    def wait_device(self) -> None:
        """Before the tail's gradient buffers are written again (GradPath.tail_free: they are one, also under DPU): the
        compute stream waits for the update reading them (on the CPU stand-in, the host does)."""
        self._wait_device()

    def _wait_device(self) -> None:
        """The tail's launched update done (ordered on the compute stream); its failure makes the optimizer unusable."""
        try:
            self.stream.wait()
        except BaseException as e:
            if not self.stream.pending:  # (else Ctrl-C in the wait: the update goes on, nothing failed)
                self._failed = e
            raise

    def _write_tail(self) -> None:
        """The tail's masters, cast, into its parameters."""
        self._wait_device()
        self.own[self.split :].copy_(self.device_state.master)

    def _publish(self) -> None:
        """The head's new parameters are in `own`: the tail's too, then the all-gather."""
        self._write_tail()
        self._staged = False
        self._publish_all()

    def finish_pending(self, write: bool, keep_model: bool = False) -> None:
        """Wait for both updates; with write, their parameters to the device."""
        self._wait_device()
        if self.host is not None:
            self.host.finish_pending(write, keep_model)  # (a flush publishes: the tail's parameters too)
        if write and self._staged:
            self._publish()

    def flush_staged(self) -> None:
        """Send the parameters of the last (delayed) update to the device, if not sent yet."""
        if self.host is not None:
            self.host.flush_staged()
        if self._staged:
            self._publish()

    def write_staging(self) -> None:
        """The parameters of the last update of both parts to the device."""
        if self.host is not None:
            self.host.write_staging()
        else:
            self._publish()

    @torch.no_grad()
    def resume(self, staged: bool) -> None:
        """After a state was loaded: the device params now, or (saved between a delayed update and its writeback) by
        the next step()."""
        if self.host is not None:
            self.host.resume(staged)
            self._staged = self.host.staged
        elif staged and self.delayed:
            self._staged = True
        else:
            self._publish()

    @torch.no_grad()
    def refresh_stale_masters(self, warn: bool = True) -> None:
        """Keep each parameter's fp32 masters if its device values are still their cast; else take that parameter's
        from the model, on both sides of the split (as HostUpdate's; a parameter across the split is taken whole if
        either side differs)."""
        self._wait_device()
        s, tail = self.split, self.device_state.master
        stale = self.host.stale_ranges() if self.host is not None else set()
        if tail.numel():
            stale.update(differing(tail, self.own[s:], param_ranges(self.layout), s))
        if not stale:
            return
        if warn:
            warnings.warn(stale_warning(self.staged or (self.host is not None and self.host.staged)),
                          stacklevel=5)  # fmt: skip
        if self.host is not None:
            self.host.take_masters([(a, min(b, s)) for a, b in stale if a < s])
        for a, b in sorted(stale):
            if b > s:
                tail[max(a, s) - s : b - s].copy_(self.own[max(a, s) : b])

    @torch.no_grad()
    def refresh_from_model(self) -> None:
        """Take the fp32 masters from the model's current (device) parameters."""
        self.finish_pending(write=False)
        if self.host is not None:
            self.host.refresh_from_model()
        self.device_state.master.copy_(self.own[self.split :])
        self._staged = False

    def close(self) -> None:
        """Stop the device stream's worker and the host update."""
        self.stream.close()
        if self.host is not None:
            self.host.close()
