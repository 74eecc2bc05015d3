"""Shared pieces of the benchmark suites: the machine description, memory high-water marks, sizes."""

from __future__ import annotations

import datetime
import os
import platform
import re
from collections.abc import Callable

import torch

import zo_kernels


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
        return m.group(1).strip() if m else platform.processor()
    except OSError:
        return platform.processor()


def machine() -> dict:
    """What the numbers were measured on; goes into every result."""
    return {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),  # usable
        "isa": zo_kernels.best_isa(),
        "torch": torch.__version__,
        "zo_kernels": zo_kernels.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def filesystem(path: str) -> str:
    """The block device, filesystem type and mount point holding `path` (Linux /proc/mounts), e.g.
    '/dev/vda ext4 on / (rotational 0)'; the kernel's rotational flag where /sys has it."""
    real, best = os.path.realpath(path), None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and (best is None or len(mnt) >= len(best[1])):
                    best = (dev, mnt, fstype)
    except OSError:
        return "unknown filesystem"
    if best is None:
        return "unknown filesystem"
    dev, mnt, fstype = best
    text = f"{dev} {fstype} on {mnt}"
    name = os.path.basename(dev)
    for flag in (f"/sys/class/block/{name}/queue/rotational", f"/sys/class/block/{name}/../queue/rotational"):
        if os.path.exists(flag):
            with open(flag) as f:
                text += f" (rotational {f.read().strip()})"
            break
    return text


def sizes(default: list[int], var: str = "ZO_BENCH_SIZES") -> list[int]:
    """$ZO_BENCH_SIZES (or $var; comma-separated, e.g. '1e6,1e7') overrides a suite's default sizes."""
    env = os.environ.get(var)
    return [int(float(s)) for s in env.split(",")] if env else default


def size_label(n: int) -> str:
    """n in the fewest significant digits that give n back: 1e+07, 1.6e+07 (`:.0e` printed 2e+07 for 16M, and two
    sizes that round alike shared one group, so one of them was dropped from the ratio tables)."""
    for digits in range(16):
        text = f"{n:.{digits}e}"
        if int(float(text)) == n:
            return text
    return str(n)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s*(\d+)", f.read()).group(1))


def peak_extra_bytes(fn: Callable[[], None]) -> int | None:
    """Resident-memory high-water mark of one call of fn, above the resident size before it (Linux only)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = _status_kib("VmRSS")
        fn()
        return max(0, _status_kib("VmHWM") - before) * 1024
    except (OSError, AttributeError):
        return None
