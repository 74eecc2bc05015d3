"""The oldest torch and Triton this project is checked with (README "Versions"), and what happens below them.

torch 2.4 lacks `Module.register_state_dict_post_hook` (stage 3 needs it): zo_kernels refuses to import under a torch
older than MIN_TORCH. Triton pairs with torch (torch 2.6 pins Triton 3.2): below MIN_TRITON the kernels are not
checked, so CUDA tensors take the torch path, with one warning saying so (`default_impl`, for `zo_kernels.pack` and
the launch plans alike).
"""

from __future__ import annotations

import functools
import re
import warnings

MIN_TORCH = (2, 6)
MIN_TRITON = (3, 6)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.6.0+cu124' or '3.6.0.dev0'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"cannot read a version from {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch(version: str) -> None:
    """Raise ImportError, in one line, when `version` is older than MIN_TORCH."""
    if release(version) < MIN_TORCH:
        raise ImportError(f"zo_kernels needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found {version}")


def require_torch() -> None:
    """check_torch on the installed torch."""
    import torch

    check_torch(torch.__version__)


def triton_too_old(version: str) -> str | None:
    """Why Triton `version` does not run the kernels, or None when it does."""
    if release(version) < MIN_TRITON:
        return (f"triton {version} is older than {MIN_TRITON[0]}.{MIN_TRITON[1]}, the oldest the kernels are "
                "checked with")  # fmt: skip
    return None


@functools.cache
def triton_problem() -> str | None:
    """Why the Triton kernels cannot run in this process (not installed, too old), or None; asked once."""
    try:
        import triton
    except ImportError:
        return "triton is not installed (pip install 'zo-kernels[triton]')"
    return triton_too_old(triton.__version__)


_warned_fallback = False


def default_impl(device_type: str) -> str:
    """'triton' for CUDA tensors where the kernels can run, else 'torch' (on CUDA with one warning saying why)."""
    global _warned_fallback
    if device_type != "cuda":
        return "torch"
    problem = triton_problem()
    if problem is None:
        return "triton"
    if not _warned_fallback:
        warnings.warn(f"{problem}: zo_kernels packs CUDA tensors with the multi-pass torch path", stacklevel=4)
        _warned_fallback = True
    return "torch"
