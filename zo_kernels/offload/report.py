"""What the optimizer reports: the bytes it holds (MemoryReport) and the seconds per phase of a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..aio import round_up

if TYPE_CHECKING:
    from .optimizer import ZeroOffloadAdamW

K_ADAM = 12  # bytes of fp32 optimizer state per parameter: master, exp_avg, exp_avg_sq (K = 4 + the moments' bytes
# per parameter in other state_dtype formats: 8 with bf16, 6.03 with 8-bit)


@dataclass
class Term:
    """One buffer the optimizer holds: where, what, its formula (symbols of docs/design.md), bytes by the formula
    and bytes measured from the buffer itself."""

    where: str
    what: str
    formula: str
    formula_bytes: int
    measured: int


@dataclass
class MemoryReport:
    """Bytes held by the optimizer on this rank, measured from its buffers, each next to its formula.

    The formulas are those of docs/design.md, "Memory model", in its symbols: Φ trainable parameters, N ranks,
    F the flat buffer's elements (Φ padded), P this rank's partition (F/N), e the bytes of `dtype`, B the largest
    gradient bucket's elements, T the NVMe swapper's tile elements, D the partition's tail kept on the device
    (gpu_fraction · P, 0 by default: the host terms in P are then in P - D), S the most elements selective's
    selection holds on this rank (about fraction · P: selective.selection_bound).

    Args:
        params: trainable parameters (Φ). world_size: data-parallel ranks (N).
        device_params, device_buckets: the 16-bit parameters on the device (flat buffer, or the stage-3 shard) and
            the gradient buckets.
        host_state, host_landing, host_staging, host_accumulator, host_shard: p32/m/v in host memory (K bytes per
            element: 12 with fp32 moments, 8 bf16, 6.03 8-bit; or the NVMe swapper's pool), the gradient landing
            buffers, the p16 staging buffer, the fp32 accumulation buffers (once gradients were accumulated), the
            stage-3 shard kept in host memory (offload_param="cpu").
        nvme_bytes: the scratch files (offload_optimizer="nvme": p32, m, v in their format, and the stage-3 shard
            with offload_param="nvme").
        nvme_read_per_step, nvme_written_per_step: bytes a step's update reads from and writes to those files (one
            pass over them: K bytes per element, the 16-bit shard's 2 included).
        device_state, device_grads: gpu_fraction's tail on the device: its p32, m, v (K bytes per element, as on
            the host), and its gradient landing buffers (+ fp32 accumulation once gradients were accumulated);
            selective's selection on the device: its p32, m, v and index (12 + 8 bytes per element), its gathered
            fp32 gradient (4, + 4 once gradients were accumulated).
        host_selection: selective's host buffers of the selection: its index and the pinned shuttle of its state
            (8 + 12 bytes per element; its two fp32 window sums, 8P, are in host_accumulator).
        formula_device, formula_host, formula_nvme: the same by the formulas. terms: every buffer, one Term each.
    """

    params: int
    world_size: int
    device_params: int
    device_buckets: int
    host_state: int
    host_landing: int
    host_staging: int
    host_accumulator: int
    formula_device: int
    formula_host: int
    host_shard: int = 0
    nvme_bytes: int = 0
    formula_nvme: int = 0
    nvme_read_per_step: int = 0
    nvme_written_per_step: int = 0
    device_state: int = 0
    device_grads: int = 0
    host_selection: int = 0
    terms: list[Term] = field(default_factory=list)

    @property
    def device_bytes(self) -> int:
        return self.device_params + self.device_buckets + self.device_state + self.device_grads

    @property
    def host_bytes(self) -> int:
        return (self.host_state + self.host_landing + self.host_staging + self.host_accumulator + self.host_shard
                + self.host_selection)  # fmt: skip

    def formula(self, where: str) -> str:
        """The formula of one place ("device", "host" or "nvme") as text, e.g. "12P + 2P (landing)"."""
        return " + ".join(f"{t.formula} ({t.what})" for t in self.terms if t.where == where) or "0"

    def __str__(self) -> str:
        p = max(1, self.params)
        lines = [f"params {self.params:,} x {self.world_size} rank(s)"]
        for where, measured, by_formula in (("device", self.device_bytes, self.formula_device),
                                            ("host", self.host_bytes, self.formula_host),
                                            ("nvme", self.nvme_bytes, self.formula_nvme)):  # fmt: skip
            if where == "nvme" and not any(t.where == "nvme" for t in self.terms):
                continue
            lines.append(f"  {where + ':':<7} {measured:,} B ({measured / p:.2f} B/param); "
                         f"formula {self.formula(where)} = {by_formula:,} B")  # fmt: skip
            if where == "nvme":
                lines.append(f"  nvme I/O per step: {self.nvme_read_per_step:,} B read, "
                             f"{self.nvme_written_per_step:,} B written")  # fmt: skip
        return "\n".join(lines)


def measure(opt: ZeroOffloadAdamW) -> MemoryReport:
    """The optimizer's MemoryReport on this rank: every buffer it holds, measured, next to its formula. The stage-3
    gathered units in flight are the working set, in opt.device_bytes (now and peak), not here."""
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
    layout, grads, update, shards = opt.layout, opt.grads, opt.update, opt.shards
    e = torch.empty((), dtype=opt.dtype).element_size()
    whole, flat_numel = layout.part, layout.flat_numel
    tail = whole - grads.split  # D: gpu_fraction's tail, on the device
    part = whole - tail  # what the host's state and gradient terms count: P - D
    p_ = "(P-D)" if tail else "P"
    terms: list[Term] = []
    add = lambda *a: terms.append(Term(*a))  # noqa: E731
    if shards is None:
        add("device", "parameters, flat", f"{e}F", e * flat_numel, nbytes([opt.flat]))
    elif not shards.offload:
        add("device", "parameter shard", f"{e}P", e * whole, nbytes([shards.shard]))
    if grads.direct_landing:  # one CPU rank: gradients pack into the landing buffer, no bucket is allocated
        add("device", "buckets: none, one CPU rank", "0", 0, nbytes(grads.bucket_bufs))
    else:
        big = max(b.hi - b.lo for b in layout.buckets)
        add("device", "two gradient buckets", f"2·{e}B", 2 * e * big, nbytes(grads.bucket_bufs))
    swapper = update.swapper
    k = update.state_bytes_per_param  # K: the masters and the moments in their format
    if swapper is None:
        add("host", "p32, m, v", f"{k:g}{p_}", round(k * part), update.host_state_bytes)
    else:
        extra = 2 if swapper.params_dtype is not None else 0  # a fourth, 16-bit file's buffers
        add("host", "NVMe pool", f"3·{k + extra:g}T", round(3 * (k + extra) * swapper.tile_numel),
            update.host_state_bytes)  # fmt: skip
    slots = len(grads.landing)
    sel = getattr(grads, "selected", None)
    why = ", selective's sums" if sel is not None else ", DPU"  # (what reads the other landing buffer)
    add("host", "gradient landing" + (f" x2{why}" if slots > 1 else ""),
        f"{slots}·{e}{p_}" if slots > 1 else f"{e}{p_}", slots * e * part, nbytes(grads.landing))  # fmt: skip
    if not update.staging_in_place and update.staging_buf is not None:  # (GPU path, state in memory: none)
        add("host", "p16 staging", f"{e}{p_}", e * part, nbytes([update.staging_buf]))
    if shards is not None and shards.offload == "cpu":
        add("host", "parameter shard", f"{e}P", e * whole, nbytes([shards.shard]))
    if shards is not None and shards.offload == "nvme":  # blocks the gathers read shards into, kept for reuse
        kept = opt.transport.pool.free_bytes  # one per distinct size of a unit's piece: run-time, at most 2P
        add("host", "pinned blocks of the shards read, kept", "≤ 2P", kept, kept)
    n_accum = sum(a is not None for a in grads.accum)
    if n_accum:  # made by the first accumulation into a landing buffer, kept after
        add("host", "fp32 accumulation" + (f" x{n_accum}" if n_accum > 1 else ""),
            f"{n_accum}·4{p_}" if n_accum > 1 else f"4{p_}", 4 * n_accum * part, nbytes(grads.accum))  # fmt: skip
    if tail:  # gpu_fraction: the tail's state and gradients stay on the device
        add("device", "p32, m, v of the tail", f"{k:g}D", round(k * tail), update.device_state_bytes)
        # (one of each also under DPU: the device's update reads them at once, the next backward waits for it)
        add("device", "tail gradient landing", f"{e}D", e * tail, nbytes([grads.device_landing]))
        if grads.device_accum is not None:
            add("device", "tail fp32 accumulation", "4D", 4 * tail, nbytes([grads.device_accum]))
    if sel is not None:  # selective (selected.py, selective.py): buffers for the largest selection, S, made once
        s = sel.capacity
        add("device", "p32, m, v of the selection", "12S", 12 * s, nbytes([update.state_device]))
        add("device", "selection index", "8S", 8 * s, nbytes([sel.index]))
        add("device", "selected gradient", "4S", 4 * s, nbytes([sel.landing]))
        if sel.accum is not None:
            add("device", "selected fp32 accumulation", "4S", 4 * s, nbytes([sel.accum]))
        add("host", "fp32 window sums x2", f"2·4{p_}", 8 * part, nbytes(update.acc))
        add("host", "selection index", "8S", 8 * s, nbytes([update.sel_buf]))
        add("host", "selection shuttle, pinned", "12S", 12 * s, nbytes([update.shuttle]))
    if swapper is not None:
        size = swapper.file_sizes()  # (not a scan of the directory: it may have been deleted under the run)
        shard_file = round_up(2 * part) if swapper.params_dtype is not None else 0
        add("nvme", "p32, m, v files", f"{k:g}{p_}", swapper.file_bytes - shard_file,
            sum(v for name, v in size.items() if name != "params.bin"))  # fmt: skip
        if swapper.params_dtype is not None:
            add("nvme", "parameter shard file", "2P", shard_file, size.get("params.bin", 0))
    total = lambda where, i: sum(t.formula_bytes if i else t.measured for t in terms if t.where == where)  # noqa: E731
    of = lambda where, *whats: sum(t.measured for t in terms if t.where == where and t.what.startswith(whats))  # noqa: E731
    return MemoryReport(
        params=layout.numel, world_size=opt.comm.world,
        device_params=of("device", "parameter"), device_buckets=of("device", "two", "buckets"),
        host_state=of("host", "p32", "NVMe"), host_landing=of("host", "gradient"), host_staging=of("host", "p16"),
        host_accumulator=of("host", "fp32"), host_shard=of("host", "parameter", "pinned"),
        device_state=of("device", "p32", "selection"), device_grads=of("device", "tail", "selected"),
        host_selection=of("host", "selection"),
        nvme_bytes=total("nvme", False),
        nvme_read_per_step=swapper.pass_bytes if swapper is not None else 0,
        nvme_written_per_step=swapper.pass_bytes if swapper is not None else 0,
        formula_device=total("device", True), formula_host=total("host", True), formula_nvme=total("nvme", True),
        terms=terms,
    )  # fmt: skip


class PhaseTimes(dict):
    """Seconds per phase of the step since the last step (stats["time_<phase>"]), shared by the parts."""

    def add(self, name: str, seconds: float) -> None:
        """Add `seconds` to phase `name`."""
        self[name] = self.get(name, 0.0) + seconds
