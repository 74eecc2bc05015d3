"""kernels/launch.py: launches after the first go to the compiled kernel's runner with the arguments Triton's own
launch would pass (signature order, constexprs included); a new key goes through Triton again.

Triton here has no GPU, so the jitted kernel is replaced by a recorder that has the real kernel's parameter names
and binds arguments as Triton does (positional, then keywords, by name); the real pack plan drives it. The runner
path itself runs on a GPU in tests/test_gpu.py, which compares it with Triton's launch (passed on the H200).
"""

from __future__ import annotations

import pytest
import torch

import zo_kernels as zk
from zo_kernels.kernels import pack as kpack
from zo_kernels.kernels.launch import Launches


class Recorder:
    """Stands in for a jitted kernel: fn[grid](*args, **kw) binds by name as Triton does and returns a compiled
    kernel (or None, as the interpreter does) whose runner, kernel[grid3](*args), records what it was given."""

    def __init__(self, fn, compiled=True):
        self.arg_names, self.__name__ = list(fn.arg_names), fn.__name__
        self.launches, self.runs, self.compiled = [], [], compiled
        self.compiled_type = Compiled  # what a launch returns (Launcher: one with a C launcher's attributes)

    def __getitem__(self, grid):
        def launch(*args, num_warps, **kw):
            bound = dict(zip(self.arg_names, args))
            assert not set(bound) & set(kw) and set(bound) | set(kw) == set(self.arg_names)
            bound.update(kw)
            self.launches.append((grid, {n: bound[n] for n in self.arg_names}))
            return self.compiled_type(self) if self.compiled else None

        return launch


class Compiled:
    def __init__(self, rec):
        self.rec = rec

    def __getitem__(self, grid3):
        def runner(*args):
            assert len(args) == len(self.rec.arg_names)
            self.rec.runs.append((grid3, dict(zip(self.rec.arg_names, args))))

        return runner


def _recorder(monkeypatch, which="_PACK", compiled=True):
    rec = Recorder(getattr(kpack, which).fn, compiled)
    fresh = Launches(rec)
    monkeypatch.setattr(kpack, which, fresh)
    return rec, fresh


@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_later_launches_pass_what_triton_would(monkeypatch, op):
    rec, launches = _recorder(monkeypatch, "_PACK" if op == "pack" else "_UNPACK")
    ts = [torch.randn(1000 + i) for i in range(5)]
    plan = zk.buckets.plan(ts, dtype=torch.bfloat16, align=1)
    outs = [torch.empty(plan.total + 8, dtype=torch.bfloat16) for _ in range(2)]

    def call(out):
        if op == "pack":
            plan.pack(ts, out=out, impl="triton")
        else:
            plan.unpack(out, ts, impl="triton")

    call(outs[0][: plan.total])
    call(outs[0][: plan.total])
    call(outs[0][: plan.total])
    assert launches.through_triton == 1 and len(rec.launches) == 1 and len(rec.runs) == 2
    grid, first = rec.launches[0]
    for grid3, args in rec.runs:
        assert grid3 == tuple(grid) + (1,) * (3 - len(grid))
        same = {n: (v.data_ptr() if isinstance(v, torch.Tensor) else v) for n, v in args.items()}
        want = {n: (v.data_ptr() if isinstance(v, torch.Tensor) else v) for n, v in first.items()}
        if op == "pack":  # fresh result tensors per call
            for n in ("sum_ptr", "flag_ptr"):
                same.pop(n), want.pop(n)
        assert same == want, "the runner got other arguments than Triton's launch had"
    call(outs[1][1 : plan.total + 1])  # flat 2 bytes off: another specialization, so through Triton again
    assert launches.through_triton == 2
    call(outs[1][1 : plan.total + 1])
    assert launches.through_triton == 2 and len(rec.runs) == 3


def test_without_a_runner_every_launch_goes_through_triton(monkeypatch):
    ts = [torch.randn(100) for _ in range(3)]
    plan = zk.buckets.plan(ts, dtype=torch.float32)
    out = torch.empty(plan.total)
    rec, launches = _recorder(monkeypatch, compiled=False)  # the interpreter's case: no compiled kernel returned
    for _ in range(3):
        plan.pack(ts, out=out, impl="triton")
    assert launches.through_triton == 3 and not rec.runs
    monkeypatch.setenv("ZO_TRITON_DIRECT_LAUNCH", "0")
    rec, launches = _recorder(monkeypatch)
    for _ in range(3):
        plan.pack(ts, out=out, impl="triton")
    assert launches.through_triton == 3 and not rec.runs, "ZO_TRITON_DIRECT_LAUNCH=0 still took the runner"


def test_a_compiled_kernel_without_a_runner_turns_the_shortcut_off(monkeypatch):
    class Bare:
        pass

    class Fn:
        arg_names, __name__ = ["a", "K"], "k"

        def __init__(self):
            self.n = 0

        def __getitem__(self, grid):
            def launch(*a, **kw):
                self.n += 1
                return Bare()

            return launch

    fn = Fn()
    launches = Launches(fn)
    for _ in range(3):
        launches("key", (4,), (1,), {"K": 2}, 4)
    assert fn.n == 3 and not launches.direct


def test_wrong_constexprs_are_refused():
    class Fn:
        arg_names, __name__ = ["a", "K"], "k"

        def __getitem__(self, grid):
            return lambda *a, **kw: object()

    with pytest.raises(TypeError, match=r"constexprs \['J'\] are not its parameters \['K'\]"):
        Launches(Fn())("key", (4,), (1,), {"J": 2}, 4)


def test_runners_are_bounded(monkeypatch):
    """One runner per key, and keys can carry sizes (a cast's grid): the dict is cleared past MAX_RUNNERS."""
    from zo_kernels.kernels import launch

    class Fn:
        arg_names, __name__ = ["a", "K"], "k"

        def __init__(self):
            self.triton, self.runs = 0, 0

        def __getitem__(self, grid):
            def launch_(*a, **kw):
                self.triton += 1
                return self

            return launch_

        def run(self, *a):
            self.runs += 1

    class WithRunner(Fn):
        def __getitem__(self, grid):
            return self.run if len(grid) == 3 else super().__getitem__(grid)

    fn = WithRunner()
    launches = Launches(fn)
    monkeypatch.setattr(launch, "MAX_RUNNERS", 8)
    for key in range(20):
        launches(key, (key + 1,), (1,), {"K": 2}, 4)
        launches(key, (key + 1,), (1,), {"K": 2}, 4)
        assert len(launches.runners) <= 8
    assert fn.triton == 20 and fn.runs == 20


@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_equal_keys_mean_equal_specializations(op):
    """pack.launch_key against Triton's own binder: argument sets whose keys are equal get the same specialization
    (the compiled variant a runner stands for), over pointers aligned or not one by one, n_work equal to 1, a
    multiple of 16 or neither, and flat addresses below and above 2**31 at every 16-byte phase."""
    import itertools
    import random

    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except ImportError as e:
        pytest.skip(f"this Triton has no binder to compare with: {e}")
    fn = getattr(kpack, "_pack_kernel" if op == "pack" else "_unpack_kernel")
    jit = JITFunction(getattr(fn, "fn", fn))  # (under the interpreter, fn is its stand-in)
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    dtypes = [torch.int64, torch.int64, torch.float32, torch.int32, torch.float32, torch.bool]
    dtypes = dtypes if op == "pack" else dtypes[:2]  # (table, work, part, count, sum_sq, found)
    bufs = [torch.zeros(64, dtype=d) for d in dtypes]
    rng = random.Random(0)
    seen = {}
    for n_work, base in itertools.product([1, 5, 16, 17, 32], [16, 2**31 - 16, 2**31, 0x7F00_0000_0000]):
        for _ in range(12):
            flat_addr = base + 2 * rng.randrange(8)
            ptrs = [b[k : k + 4] for b, k in ((b, rng.choice([0, 1, 4])) for b in bufs)]
            key = kpack.launch_key(0, 2, n_work, flat_addr, *ptrs)
            if op == "pack":
                args = (ptrs[0], ptrs[1], n_work, flat_addr, ptrs[2], ptrs[3], ptrs[4], ptrs[5], 0.5)
                kw = dict(OUT_KIND=2, CHUNK=16, BLOCK=16, RBLOCK=16, ACCUMULATE=False)
            else:
                args = (ptrs[0], ptrs[1], flat_addr)
                kw = dict(IN_KIND=2, CHUNK=16, BLOCK=16)
            _, spec, _ = binder(*args, **kw)
            spec = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in spec)
            assert seen.setdefault(key, spec) == spec, f"key {key} stands for two specializations"
    assert len(seen) > 20


class Launcher(Compiled):
    """A compiled kernel with what its runner hands the C launcher (run, function, packed_metadata): the launcher
    stand-in records every call's arguments."""

    function, packed_metadata = object(), object()

    def __init__(self, rec):
        super().__init__(rec)
        rec.__dict__.setdefault("launcher", [])

    def run(self, *a):
        self.rec.launcher.append(a)


def test_without_hooks_later_launches_go_to_the_launcher_with_addresses(monkeypatch):
    """What Triton's runner would pass its launcher (grid, the current stream, function, metadata, no launch
    metadata or hooks, the arguments, the constexprs), each tensor as its address: pointers ints skip the
    launcher's data_ptr() call and driver query per tensor. With a launch hook set, Triton's runner."""
    from triton import knobs

    from zo_kernels.kernels import launch

    rec, launches = _recorder(monkeypatch)
    rec.compiled_type = Launcher
    monkeypatch.setattr(launch, "_current_stream", lambda: 77)
    ts = [torch.randn(1000 + i) for i in range(5)]
    plan = zk.buckets.plan(ts, dtype=torch.bfloat16, align=1)
    out = torch.empty(plan.total, dtype=torch.bfloat16)
    plan.pack(ts, out=out, impl="triton")
    results = [plan.pack(ts, out=out, impl="triton") for _ in range(2)]
    assert launches.through_triton == 1 and not rec.runs and len(rec.launcher) == 2
    grid, first = rec.launches[0]
    names = rec.arg_names
    for got, packed in zip(rec.launcher, results):
        assert got[:9] == (grid[0], 1, 1, 77, Launcher.function, Launcher.packed_metadata, None, None, None)
        args = dict(zip(names, got[9:], strict=True))
        want = {n: (v.data_ptr() if isinstance(v, torch.Tensor) else v) for n, v in first.items()}
        want.update(sum_ptr=packed.sum_sq.data_ptr(), flag_ptr=packed.found_inf.data_ptr())
        assert args == want and all(type(v) is not torch.Tensor for v in args.values())
    hook = knobs.runtime.launch_enter_hook  # a profiler's hook: another key (a HookChain's, or set in its place)
    if hasattr(hook, "calls"):
        monkeypatch.setattr(hook, "calls", [_a_hook])
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", _a_hook)
    for _ in range(2):
        plan.pack(ts, out=out, impl="triton")
    assert launches.through_triton == 2 and len(rec.runs) == 1 and len(rec.launcher) == 2


def _a_hook(*a) -> None:
    pass
