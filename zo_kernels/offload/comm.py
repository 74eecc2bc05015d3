"""The process group: collectives with bounded waits that record a failure, and the gathers over the flat space."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .report import PhaseTimes

COLLECTIVE_TIMEOUT_S = 300.0  # default bound on a gloo collective: a dead peer fails this rank, no hang
GATHER_CHUNK_NUMEL = 1 << 24  # elements per broadcast when state_dict() gathers the partitions (64 MiB fp32)


class Comm:
    """The optimizer's process group seen from this rank; the first failed collective makes it unusable.

    Args:
        group: a torch.distributed ProcessGroup, or None for the default group when initialized, else one rank.
        device: the parameters' device (its backend decides where collectives take their tensors).
        timeout_s: the longest a collective on a CPU (gloo) group may take before this rank raises.
        times: the step's phase timings ("all_gather").
    """

    def __init__(self, group: Any, device: torch.device, timeout_s: float, times: PhaseTimes) -> None:
        self.group = group
        if self.group is None and dist.is_available() and dist.is_initialized():
            self.group = dist.group.WORLD
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.device, self.timeout_s, self.times = device, timeout_s, times
        self.failed: BaseException | None = None

    def global_rank(self, r: int) -> int:
        """Global rank of rank r of the group."""
        if self.group is None:
            return r
        return dist.get_global_rank(self.group, r) if self.group is not dist.group.WORLD else r

    def collective(self, what: str, collective: Any, *args: Any, **kwargs: Any) -> None:
        """Run a torch.distributed collective on the group and wait for it (bounded on gloo). After one failed, none
        is started: the ranks are out of step (close() waited a second full timeout on a group known to have
        failed)."""
        if self.failed is not None:
            raise RuntimeError(f"rank {self.rank}: {what} not started: an earlier collective of this optimizer "
                               "failed (see the chained exception)") from self.failed  # fmt: skip
        self.wait(collective(*args, group=self.group, async_op=True, **kwargs), what)

    def wait(self, work: Any, what: str) -> None:
        """Wait for a collective; on gloo at most timeout_s, so a dead peer fails this rank clearly."""
        try:
            if _backend_for(self.group, self.device) == "nccl":
                work.wait()  # orders the current stream; NCCL's watchdog bounds it
            else:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            limit = f"{self.timeout_s:g} s"
            self.failed = RuntimeError(f"rank {self.rank}: {what} failed or did not finish within {limit}; "
                                       "another rank has probably failed, or did not make the same call (every rank "
                                       "makes the optimizer's collective calls: backward, step, state_dict, "
                                       f"gathered, save_checkpoint, load_checkpoint): {e}")  # fmt: skip
            raise self.failed from e

    @property
    def device_of_collectives(self) -> torch.device:
        """Where this group's collectives take their tensors: the device if its backend for the device's type
        is NCCL (also for a mixed "cpu:gloo,cuda:nccl" group), else host memory."""
        return self.device if _backend_for(self.group, self.device) == "nccl" else torch.device("cpu")

    def all_gather_flat(self, flat: torch.Tensor, lo: int, hi: int) -> None:
        """Every rank's slice [lo, hi) of `flat` (its partition) to every rank, in place."""
        if self.world == 1:
            return
        t0 = time.perf_counter()
        # In place into the flat buffer (the input is this rank's slice of the output): no hidden temporary.
        if self.device_of_collectives.type == self.device.type:
            self.collective("the all-gather of the parameters", _all_gather_single, flat, flat[lo:hi])
        else:
            host = flat.cpu()
            self.collective("the all-gather of the parameters", _all_gather_single, host, host[lo:hi])
            flat.copy_(host)
        self.times.add("all_gather", time.perf_counter() - t0)

    def gather(self, part: torch.Tensor, flat_numel: int) -> torch.Tensor:
        """The full flat tensor (on the host) from every rank's partition (a collective when N > 1).

        Each rank's partition is broadcast in chunks of at most GATHER_CHUNK_NUMEL elements through one
        buffer on the collective's device: device memory stays bounded whatever the model size.
        """
        if self.world == 1:
            return part
        n_part = part.numel()
        out = torch.empty(flat_numel, dtype=part.dtype)
        chunk = min(n_part, GATHER_CHUNK_NUMEL)
        buf = torch.empty(chunk, dtype=part.dtype, device=self.device_of_collectives)
        for r in range(self.world):
            for lo in range(0, n_part, chunk):
                n = min(chunk, n_part - lo)
                if r == self.rank:
                    buf[:n].copy_(part[lo : lo + n])
                self.collective("the gather of the optimizer state", dist.broadcast, buf[:n], src=self.global_rank(r))
                out[r * n_part + lo : r * n_part + lo + n].copy_(buf[:n])
        return out


def _backend_for(group: Any, device: torch.device) -> str:
    """The backend a group uses for tensors on `device`."""
    return backend_for_device(str(dist.get_backend(group)), device.type)


def backend_for_device(backend: str, device_type: str) -> str:
    """The backend of a group's backend string for one device type: "nccl" -> "nccl";
    "cpu:gloo,cuda:nccl" -> "nccl" for "cuda" and "gloo" for "cpu"."""
    if ":" not in backend:
        return backend
    per_device = dict(item.split(":", 1) for item in backend.split(","))
    return per_device.get(device_type, "")


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    """dist.all_gather_single (torch >= 2.13), else its older name all_gather_into_tensor."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, **kwargs)


def beside_compute(threads: int) -> int:
    """The threads of an update that runs beside forward and backward (the delayed update, selective's window): one
    core fewer from 4 up, left to the thread that launches the device's kernels and runs the backward hooks (with
    every core busy in the update, that thread waits for time slices and the device for it)."""
    return threads - 1 if threads >= 4 else threads


def pin_rank_threads(world: int, rank: int) -> int:
    """Ranks sharing a host split its cores: pin this process to its own slice, return its thread count."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, local_world)))
    if local_world <= 1 or not hasattr(os, "sched_getaffinity"):
        return max(1, torch.get_num_threads())
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < local_world:
        return 1
    per = len(cores) // local_world
    mine = cores[local_rank * per : (local_rank + 1) * per]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return len(mine)
