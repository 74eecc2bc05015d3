"""Repeated launches of a jitted kernel, straight to the launcher Triton compiled for it.

`kernel[grid](*args, **constexprs)` binds the arguments, computes their specialization and the cache key, and
finds the compiled kernel on every launch: several microseconds of host time, the same each time for a pack plan's
calls (its tables, grid and constexprs never change). The first launch for a key goes through Triton and keeps the
compiled kernel's runner (`CompiledKernel[grid]`, which Triton's own launch calls after its lookup, with the same
arguments in signature order); later launches with that key call the runner. The caller's key must name all that
decides the compiled variant and the grid: the grid, the constexprs, the device, and the specializations Triton
draws from the values (integers equal to 1, multiples of 16, 32 or 64 bits; pointers aligned to 16 bytes); the
options Triton reads on every launch (debug, instrumentation, whether a launch hook is set) are added to it here.
Without launch hooks the runner's own work is done here too: the C launcher it calls is called with the current
stream and each tensor as its address (on the H200 the runner took 13.6 us of a 33.7 us pack call; the launcher
asks the driver about every tensor's pointer, and about no int).

Under Triton's interpreter a launch returns no compiled kernel, so every launch goes through Triton.
`ZO_TRITON_DIRECT_LAUNCH=0`, set before zo_kernels is imported, turns the shortcut off (every launch through
Triton), as does the first runner that cannot be made (another Triton's API); bench/test_bench_buckets.py times both
on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Hashable

import torch

try:
    from triton import knobs
except ImportError:  # a Triton older than 3.4 (CUDA tensors take the torch path there: versions.default_impl)
    knobs = None

MAX_RUNNERS = 256  # per kernel; past it the runners are dropped and made again as launches come


def _options() -> tuple:
    """The options Triton's dispatch reads on every launch (another value compiles another variant: debug,
    instrumentation, a profiler's pass pipeline): part of every key."""
    if knobs is None:
        return ()
    c, r = knobs.compilation, knobs.runtime
    return (r.debug, c.instrumentation_mode, getattr(c, "fpsan_homomorphic_casts", None),
            getattr(r, "add_stages_inspection_hook", None), _unhooked())  # fmt: skip


def _unhooked() -> bool:
    """No launch hook is set (a profiler's, e.g. proton's): None, or an empty chain (Triton 3.6 and 3.9 keep a
    HookChain, which their runner passes the launcher to call, with launch metadata it builds, on every launch)."""
    r = knobs.runtime
    return all(h is None or (isinstance(getattr(h, "calls", None), list) and not h.calls)
               for h in (getattr(r, "launch_enter_hook", None), getattr(r, "launch_exit_hook", None)))  # fmt: skip


def _current_stream() -> int:
    """The current CUDA stream of the current device, as Triton's runner finds it (the raw handle)."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


class Launches:
    """The launches of one jitted kernel `fn`: `launches(key, grid, args, constexprs, num_warps)`.

    args are the kernel's leading, non-constexpr parameters in order; constexprs the rest, by name.
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self.direct = os.environ.get("ZO_TRITON_DIRECT_LAUNCH", "1") != "0"
        self.runners: dict[Hashable, object] = {}  # key -> runner(*args) with the constexprs bound
        self.through_triton = 0  # launches that went through fn[grid] (a test counts them)

    def __call__(self, key: Hashable, grid: tuple[int, ...], args: tuple, constexprs: dict, num_warps: int):
        key = (key, _options())
        runner = self.runners.get(key) if self.direct else None
        if runner is not None:
            runner(*args)
            return
        self.through_triton += 1
        kernel = self.fn[grid](*args, **constexprs, num_warps=num_warps)
        if hasattr(kernel, "result"):  # an asynchronous compile's future (Triton 3.9's AsyncCompileMode)
            kernel = kernel.result()
        if self.direct and kernel is not None:
            if len(self.runners) >= MAX_RUNNERS:  # bounded: keys with sizes in them (cast) can be many
                self.runners.clear()
            self.runners[key] = self._runner(kernel, grid, args, constexprs)

    def _runner(self, kernel, grid: tuple[int, ...], args: tuple, constexprs: dict):
        """kernel's runner for grid with the constexprs bound in signature order (None, and no more shortcuts,
        where this Triton's compiled kernel has no runner). Without launch hooks, the launcher itself (what the
        runner calls) with the current stream and each tensor argument as its address: the launcher then neither
        calls data_ptr() nor asks the driver about the pointer (cuPointerGetAttribute) per tensor, which it does
        for a tensor and skips for an int; the tensors were checked to be on the device before the first launch,
        and a key holds the same kinds of arguments in the same places."""
        names = list(self.fn.arg_names)
        rest = names[len(args):]
        if sorted(rest) != sorted(constexprs):
            raise TypeError(f"{self.fn.__name__}: constexprs {sorted(constexprs)} are not its parameters {rest}")
        bound = tuple(constexprs[n] for n in rest)
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        try:
            run = kernel[grid3]
        except (AttributeError, TypeError, KeyError):
            self.direct = False
            return None
        launch = getattr(kernel, "run", None)
        if knobs is None or not _unhooked() or not callable(launch) or not all(
                hasattr(kernel, a) for a in ("function", "packed_metadata")):  # fmt: skip
            return lambda *args: run(*args, *bound)
        function, packed = kernel.function, kernel.packed_metadata
        tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        gx, gy, gz = grid3

        def direct(*args) -> None:
            args = list(args)
            for i in tensors:
                args[i] = args[i].data_ptr()
            launch(gx, gy, gz, _current_stream(), function, packed, None, None, None, *args, *bound)

        return direct
