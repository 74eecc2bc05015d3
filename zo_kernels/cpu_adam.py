"""CPU Adam/AdamW: the Python face of the C++ kernel in cpu/adam.cpp, and an optimizer built on it."""

from __future__ import annotations

import ctypes
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from . import _cpu
from .optim_contract import (
    TORCH_OPTIONS,
    check_group_keys,
    check_state_dict_layout,
    check_torch_options,
    keep_implementation,
    run_load_pre_hooks,
    split_names,
)
from .quant8 import Quantized8bit

ISAS = ("scalar", "avx2", "avx512")
ISA_ENV = "ZO_KERNELS_ISA"  # forces one variant ("scalar", "avx2", "avx512"), e.g. to test all three here
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_NO_OUT = 3
# The moments' formats (cpu/adam.h State): both fp32 tensors, both bf16 tensors, or both Quantized8bit.
STATE_F32, STATE_BF16, STATE_8BIT = 0, 1, 2
MAX_SEED = 2**64 - 1

FP32_MAX = torch.finfo(torch.float32).max  # a hyper-parameter beyond it is inf once the kernel rounds it
FP32_TINY = torch.finfo(torch.float32).tiny
# A kernel's parallel region starts the whole `threads` team (cpu/adam.cpp for_ranges): tens of thousands of threads
# exhaust the process's thread limit and libgomp exits the process. The bound: 8 per CPU this process may run on, at
# least 256 (oversubscribing a small machine stays possible: tests of the threads' order do it).
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
MAX_THREADS = max(256, 8 * _CPUS)
MAX_STEP = 2**63 - 1  # the kernel's int64

# Tile handed to the sink when the caller gives a sink but no tile size: 1M elements is ~28 MB of
# traffic (a few ms), long enough to hide a Python call, short enough for copy/compute overlap.
DEFAULT_TILE_NUMEL = 1 << 20


def available_isas() -> list[str]:
    """The ISA variants this CPU can run, slowest first."""
    return [name for code, name in enumerate(ISAS) if _cpu.isa_supported(code)]


def best_isa() -> str:
    """The variant used by default: $ZO_KERNELS_ISA if set, else the fastest this CPU supports."""
    forced = os.environ.get(ISA_ENV)
    if forced:
        return _check_isa(forced, ISA_ENV)
    return available_isas()[-1]


def _check_isa(isa: str, name: str = "isa") -> str:
    if isa not in ISAS:
        raise ValueError(f"{name} must be one of {ISAS}, got {isa!r}")
    if not _cpu.isa_supported(ISAS.index(isa)):
        raise ValueError(f"{name}={isa!r} is not supported by this CPU (supported: {available_isas()})")
    return isa


def _real(x: Any, name: str) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a number, got a tensor of shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    if abs(x) > FP32_MAX:
        raise ValueError(f"{name} must be finite in fp32 (|{name}| <= {FP32_MAX:.4g}), got {x}")
    return x


def check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> tuple[float, float, float, float, float]:
    """Validate Adam hyper-parameters; returns (lr, beta1, beta2, eps, weight_decay) as floats."""
    lr = _real(lr, "lr")
    if lr < 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    b1, b2 = _real(betas[0], "betas[0]"), _real(betas[1], "betas[1]")
    for i, b in enumerate((b1, b2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
    eps = _real(eps, "eps")
    if eps < FP32_TINY:
        raise ValueError(f"eps must be > 0 and >= {FP32_TINY:.4g} (fp32's smallest normal), got {eps}")
    weight_decay = _real(weight_decay, "weight_decay")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    return lr, b1, b2, eps, weight_decay


def _check_tensor(t: Any, name: str, dtypes: tuple[torch.dtype, ...], numel: int | None, like: str = "param",
                  written: bool = False) -> None:  # fmt: skip
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense strided tensor, got layout {t.layout}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel} (the number in {like})")
    check_memory(t, name, written)


def check_memory(t: torch.Tensor, name: str, written: bool = False) -> None:
    """What a kernel given t's address relies on: plain values, aligned, inside t's storage, writable if written."""
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{name} is a negated or conjugated view; pass {name}.resolve_neg() / resolve_conj()")
    if t.numel() == 0:
        return
    if written and t.is_inference() and not torch.is_inference_mode_enabled():  # (as torch's in-place ops refuse)
        raise RuntimeError(f"{name} is an inference tensor: outside inference mode it cannot be written in place "
                           "(it has no version counter to tell a graph that saved it)")  # fmt: skip
    if t.data_ptr() % t.element_size():
        raise ValueError(f"{name} is not aligned to its {t.element_size()}-byte elements (address {t.data_ptr():#x})")
    storage = t.untyped_storage()
    need = (t.storage_offset() + t.numel()) * t.element_size()
    if storage.nbytes() < need:
        raise ValueError(f"{name}'s storage holds {storage.nbytes()} bytes, its {t.numel()} elements need {need} "
                         "(was the storage resized?)")  # fmt: skip
    # torch's own allocations are writable: check foreign memory. The check reads /proc/self/maps (milliseconds in
    # a CUDA process), and the offload step writes pinned staging tile by tile: a pinned storage found writable as a
    # whole is remembered (pinned blocks live long: the pool's). (No memory is pinned before CUDA is initialized, and
    # asking then could create a CUDA context in a CPU-only run)
    if written and not storage.resizable():
        pinned = torch.cuda.is_initialized() and t.is_pinned()
        if not (pinned and _writable_pinned(storage.data_ptr(), storage.nbytes())):
            why = _readonly(storage.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
            if why:
                raise ValueError(f"{name} is read-only memory ({why}); it would be written")


_PINNED_WRITABLE: dict[tuple[int, int], None] = {}  # (address, bytes) of pinned storages found writable


def _writable_pinned(base: int, nbytes: int) -> bool:
    """Whether the pinned storage [base, base + nbytes) is writable as a whole: checked once per storage."""
    key = (base, nbytes)
    if key in _PINNED_WRITABLE:
        return True
    if _readonly(base, base, nbytes) is not None:
        return False  # (the exact range is checked by the caller, every time)
    if len(_PINNED_WRITABLE) >= 4096:  # bounded: storages freed since are forgotten with the rest
        _PINNED_WRITABLE.clear()
    _PINNED_WRITABLE[key] = None
    return True


def _readonly(base: int, start: int, nbytes: int) -> str | None:
    """Why [start, start + nbytes) may not be written (a mapping without 'w', a Python bytes object), or None."""
    # A bytes object's header sits right before its first byte. Peek at it only where Python objects live (anonymous
    # memory, the heap) and only inside the mapping that holds the buffer: memory in front of a foreign buffer may be
    # another mapping whose reads fault (a file past its end, a device's: the GPU driver's in front of pinned memory)
    head = base - bytes.__basicsize__ + 1
    peek = 0  # the end of the Python memory mapping holding the header and the buffer's start (0: none)
    try:
        with open("/proc/self/maps") as f:
            for line in f:  # ascending addresses: stop past the range
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo >= start + nbytes:
                    break
                perms, path = fields[1], fields[5].strip() if len(fields) > 5 else ""
                if start < hi and "w" not in perms:  # (lo < start + nbytes: the loop stopped otherwise)
                    return f"mapped {perms}"
                python_memory = path in ("", "[heap]") or path.startswith("[anon")  # (allocators may name theirs)
                if not peek and lo <= head and base < hi and "r" in perms and python_memory:
                    peek = hi
    except OSError:
        return None  # no /proc (not Linux): nothing more to check
    if peek and _is_bytes_header(head, start + nbytes - base, peek):
        return "the buffer of an immutable bytes object"
    return None


def _is_bytes_header(head: int, covered: int, end: int) -> bool:
    """Whether a live bytes object starts at `head` whose buffer covers `covered` bytes, the whole object before
    `end` (the end of the readable mapping holding it): its type is bytes, its reference count positive, its size at
    least `covered`, and the NUL every bytes object ends with where its size says. (The type alone was compared until
    2026-11-26: a fresh CI process refused a write to a torch buffer whose allocation left a stale header in front.)"""
    word = ctypes.sizeof(ctypes.c_ssize_t)
    data = head + bytes.__basicsize__ - 1
    if ctypes.c_void_p.from_address(head + word).value != id(bytes) or ctypes.c_ssize_t.from_address(head).value <= 0:
        return False
    size = ctypes.c_ssize_t.from_address(head + 2 * word).value
    return covered <= size and data + size < end and ctypes.c_uint8.from_address(data + size).value == 0


def moment_format(exp_avg: Any, exp_avg_sq: Any) -> int:
    """STATE_F32, STATE_BF16 or STATE_8BIT for a pair of moments; TypeError naming the one that does not fit."""
    q = (isinstance(exp_avg, Quantized8bit), isinstance(exp_avg_sq, Quantized8bit))
    if any(q):
        if not all(q):
            bad, other = ("exp_avg_sq", "exp_avg") if q[0] else ("exp_avg", "exp_avg_sq")
            x = exp_avg_sq if q[0] else exp_avg
            raise TypeError(f"{bad} must be a Quantized8bit like {other}, got {_describe(x)}")
        if not exp_avg.signed:
            raise TypeError("exp_avg must be a signed Quantized8bit (Quantized8bit.empty(n, signed=True))")
        if exp_avg_sq.signed:
            raise TypeError("exp_avg_sq must be an unsigned Quantized8bit (Quantized8bit.empty(n, signed=False))")
        if exp_avg.block != exp_avg_sq.block:
            raise ValueError(f"exp_avg and exp_avg_sq must have one block size, got {exp_avg.block} and "
                             f"{exp_avg_sq.block}")  # fmt: skip
        return STATE_8BIT
    if not isinstance(exp_avg, torch.Tensor):
        raise TypeError(f"exp_avg must be a torch.Tensor or a Quantized8bit, got {type(exp_avg).__name__}")
    if exp_avg.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"exp_avg must have dtype float32 or bfloat16 (or be a Quantized8bit), got {exp_avg.dtype}")
    want = str(exp_avg.dtype).replace("torch.", "")
    if not isinstance(exp_avg_sq, torch.Tensor) or exp_avg_sq.dtype != exp_avg.dtype:
        raise TypeError(f"exp_avg_sq must have dtype {want} like exp_avg (the moments are both float32, both bfloat16 "
                        f"or both Quantized8bit); got {_describe(exp_avg_sq)}")  # fmt: skip
    return STATE_F32 if exp_avg.dtype == torch.float32 else STATE_BF16


def _describe(x: Any) -> str:
    return str(x.dtype).replace("torch.", "") if isinstance(x, torch.Tensor) else type(x).__name__


def moment_tensors(exp_avg: Any, exp_avg_sq: Any) -> dict[str, torch.Tensor]:
    """Every tensor the moments are stored in, by name (the kernel writes them all)."""
    if isinstance(exp_avg, Quantized8bit):
        return {"exp_avg.codes": exp_avg.codes, "exp_avg.scales": exp_avg.scales,
                "exp_avg_sq.codes": exp_avg_sq.codes, "exp_avg_sq.scales": exp_avg_sq.scales}  # fmt: skip
    return {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _check_adam_tensors(param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, param_out: Any = None) -> int:
    """The tensor checks shared by every Adam entry point; returns the element count."""
    _check_tensor(param, "param", (torch.float32,), None, written=True)
    n = param.numel()
    _check_tensor(grad, "grad", tuple(_DTYPE_CODE), n)
    fmt = moment_format(exp_avg, exp_avg_sq)
    if fmt == STATE_8BIT:
        for q, name in ((exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
            if q.numel != n:
                raise ValueError(f"{name} has {q.numel} elements, expected {n} (the number in param)")
            if q.scales.numel() != -(-n // q.block):
                raise ValueError(f"{name}.scales has {q.scales.numel()} elements, expected {-(-n // q.block)}")
            for t, part in ((q.codes, "codes"), (q.scales, "scales")):  # (changed in place since it was made?)
                if not t.is_contiguous():
                    raise ValueError(f"{name}.{part} must be contiguous (got strides {t.stride()})")
                check_memory(t, f"{name}.{part}", written=True)
    else:
        dtype = (torch.float32, torch.bfloat16)[fmt]
        _check_tensor(exp_avg, "exp_avg", (dtype,), n, written=True)
        _check_tensor(exp_avg_sq, "exp_avg_sq", (dtype,), n, written=True)
    if param_out is not None:
        _check_tensor(param_out, "param_out", tuple(_DTYPE_CODE), n, written=True)
    out = None if param_out is None or is_same_place(param_out, grad) else param_out
    check_no_overlap({"param": param, "grad": grad, **moment_tensors(exp_avg, exp_avg_sq), "param_out": out})
    return n


def is_same_place(out: torch.Tensor, grad: torch.Tensor) -> bool:
    """`out` is `grad`'s memory exactly (same address, dtype and length): the kernel may write each new param over
    the gradient element it has just read (every ISA loads a vector's gradients before storing its params; threads
    take disjoint ranges). Any other overlap is refused."""
    return out.data_ptr() == grad.data_ptr() and out.dtype == grad.dtype and out.numel() == grad.numel()


def _state_args(exp_avg: Any, exp_avg_sq: Any, start: int, seed: int, index0: int = 0) -> tuple:
    """The kernel's `state` argument for elements [start, ...) of these moments (() for fp32): the 8-bit scales
    from `start`'s block; the rounding's hash index of element `start` is index0 + start."""
    fmt = moment_format(exp_avg, exp_avg_sq)
    if fmt == STATE_F32:
        return ()
    if fmt == STATE_BF16:
        return (STATE_BF16, 0, 0, 256, index0 + start, seed)
    block = exp_avg.block
    off = 4 * (start // block)
    return (STATE_8BIT, exp_avg.scales.data_ptr() + off, exp_avg_sq.scales.data_ptr() + off, block, index0 + start,
            seed)  # fmt: skip


def _moment_address(x: Any, start: int) -> int:
    if isinstance(x, Quantized8bit):
        return x.codes.data_ptr() + start
    return x.data_ptr() + x.element_size() * start


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**64 - 1], got {seed}")
    return seed


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def check_no_overlap(named: dict[str, torch.Tensor]) -> None:
    """Raise ValueError if any two of the (non-empty) tensors share memory."""
    items = [(n, _span(t)) for n, t in named.items() if t is not None and t.numel() > 0]
    for i, (na, (a0, a1)) in enumerate(items):
        for nb, (b0, b1) in items[i + 1 :]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{na} and {nb} overlap in memory; each must be its own buffer")


class AdamPlan(NamedTuple):
    """A validated cpu_adam_step call that can run on any sub-range [start, end) of its tensors.

    Built by `plan_adam_step`; it holds its tensors (so their memory outlives it). Each `run` checks its range
    and `out` and that the storages still cover the tensors, then makes one C call, which is what lets a tiled
    pipeline drive thousands of tiles per second from Python.
    """

    numel: int
    tensors: tuple  # param, grad, exp_avg, exp_avg_sq (tensors or Quantized8bit): kept alive, re-checked by run
    grad_code: int
    out_dtype: torch.dtype | None
    args: tuple  # step, lr, beta1, beta2, eps, weight_decay, grad_scale, adamw, bias_correction, isa, threads
    seed: int = 0  # bf16 moments, 8-bit exp_avg: the stochastic rounding's seed
    index0: int = 0  # bf16 / 8-bit: the index of element 0 (the rounding's bits: seed, step, index0 + i)

    @property
    def block(self) -> int:
        """The granularity of a range: the 8-bit moments' block, else 1."""
        m = self.tensors[2]
        return m.block if isinstance(m, Quantized8bit) else 1

    def _named(self) -> dict[str, torch.Tensor]:
        return {"param": self.tensors[0], "grad": self.tensors[1], **moment_tensors(*self.tensors[2:])}

    def _addresses(self, start: int = 0) -> tuple[int, int, int, int]:
        n = self.numel
        blocks = -(-n // self.block)
        for name, t in self._named().items():  # (the tensors may have been resized or set_() since the plan)
            want = blocks if name.endswith(".scales") else n
            if t.numel() != want or not t.is_contiguous():
                raise ValueError(f"{name} has {t.numel()} elements (contiguous: {t.is_contiguous()}) where the plan "
                                 f"was made for {want} contiguous ones: make a new plan")  # fmt: skip
            check_memory(t, name)
        param, grad, m, v = self.tensors
        return (param.data_ptr() + 4 * start, grad.data_ptr() + grad.element_size() * start,
                _moment_address(m, start), _moment_address(v, start))  # fmt: skip

    def _check_out(self, out: Any, numel: int, name: str, start: int = 0) -> int:
        if out is None:
            return 0
        if self.out_dtype is None:
            raise ValueError(f"{name} given, but the plan was made without out_dtype")
        _check_tensor(out, name, (self.out_dtype,), numel, like="the range", written=True)
        named = self._named()
        grad = named["grad"][start : start + numel]
        if is_same_place(out, grad):  # the params over the gradients they replace (see is_same_place)
            del named["grad"]
        check_no_overlap({name: out, **named})
        return out.data_ptr()

    def run_tiled(self, tile: int, sink: TileSink, out: torch.Tensor | None = None,
                  progress: torch.Tensor | None = None) -> None:  # fmt: skip
        """All of [0, numel) in tiles, a C tile sink called after each: the loop runs in C++, GIL released.

        `progress` (a 1-element int64 tensor) is set to the end of each tile once it is updated."""
        tile = _check_tile(tile, self.numel, sink, self.block)
        out_addr = self._check_out(out, self.numel, "out")
        if not isinstance(sink, TileSink):
            raise TypeError(f"sink must be a TileSink (copy_tile_sink, Transport.tile_sink), got {type(sink).__name__}")
        sink.check(out if out is not None else self.tensors[0], self.numel)
        param, grad, m, v = self._addresses()
        _cpu.adam_step_tiled(param, grad, self.grad_code, m, v, out_addr,
                             _DTYPE_CODE[out.dtype] if out is not None else _NO_OUT, self.numel, *self.args, tile,
                             sink.capsule, 0 if progress is None else progress.data_ptr(),
                             _state_args(*self.tensors[2:], 0, self.seed, self.index0))  # fmt: skip

    def run(self, start: int, end: int, out: torch.Tensor | None = None, progress: torch.Tensor | None = None) -> None:
        """Update elements [start, end); with `out` (end - start elements of the plan's out dtype), write the new
        params there. `progress` (a 1-element int64 tensor), if given, grows by end - start once they are updated."""
        for x, name in ((start, "start"), (end, "end")):
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"{name} must be an int, got {type(x).__name__}")
        if not 0 <= start <= end <= self.numel:
            raise ValueError(f"start and end must satisfy 0 <= start <= end <= {self.numel}, got start={start}, "
                             f"end={end}")  # fmt: skip
        block = self.block
        if start % block or (end % block and end != self.numel):
            raise ValueError(f"start and end must be multiples of the 8-bit moments' block ({block}) (end may be "
                             f"numel), got start={start}, end={end}")  # fmt: skip
        out_addr = self._check_out(out, end - start, "out", start)
        param, grad, m, v = self._addresses(start)
        _cpu.adam_step(
            param, grad, self.grad_code, m, v, out_addr, _DTYPE_CODE[out.dtype] if out is not None else _NO_OUT,
            end - start, *self.args, progress=0 if progress is None else progress.data_ptr(),
            state=_state_args(*self.tensors[2:], start, self.seed, self.index0),
        )  # fmt: skip


def plan_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
    threads: int | None = None,
    isa: str | None = None,
    maximize: bool = False,
    seed: int = 0,
    index0: int = 0,
) -> AdamPlan:
    """Check every argument of a cpu_adam_step call (raising before anything is touched) and return its plan."""
    return _plan(param, grad, exp_avg, exp_avg_sq, None, step=step, lr=lr, betas=betas, eps=eps,
                 weight_decay=weight_decay, adamw=adamw, bias_correction=bias_correction, grad_scale=grad_scale,
                 out_dtype=out_dtype, threads=threads, isa=isa, maximize=maximize, seed=seed,
                 index0=index0)  # fmt: skip


def _plan(param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, param_out: Any, *, step: Any, lr: Any, betas: Any,
          eps: Any, weight_decay: Any, adamw: bool, bias_correction: bool, grad_scale: Any,
          out_dtype: torch.dtype | None, threads: int | None, isa: str | None,
          maximize: bool = False, seed: Any = 0, index0: Any = 0) -> AdamPlan:  # fmt: skip
    """plan_adam_step, also checking `param_out` (whose dtype then is the output dtype) with the other tensors."""
    n = _check_adam_tensors(param, grad, exp_avg, exp_avg_sq, param_out)
    if param_out is not None:
        out_dtype = param_out.dtype
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()  # torch keeps `step` as a float tensor
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (counted from 1), got {step}")
    if step > MAX_STEP:
        raise ValueError(f"step must be <= 2**63 - 1 (the kernel's int64), got {step}")
    lr, b1, b2, eps, weight_decay = check_hparams(lr, betas, eps, weight_decay)
    grad_scale = _real(grad_scale, "grad_scale")
    if grad_scale < 0:
        raise ValueError(f"grad_scale must be >= 0, got {grad_scale}")
    if not isinstance(maximize, bool):
        raise TypeError(f"maximize must be a bool, got {type(maximize).__name__}")
    if maximize:  # torch's maximize descends on -grad (before the L2 term): the kernel's first multiply negates it
        grad_scale = -grad_scale
    threads = _check_threads(threads)
    isa = best_isa() if isa is None else _check_isa(isa)
    if out_dtype is not None and out_dtype not in _DTYPE_CODE:
        raise TypeError(f"out_dtype must be torch.float32, torch.float16 or torch.bfloat16, got {out_dtype!r}")
    args = (step, lr, b1, b2, eps, weight_decay, grad_scale, bool(adamw), bool(bias_correction))
    args += (ISAS.index(isa), threads)
    seed = _check_seed(seed)
    if isinstance(index0, bool) or not isinstance(index0, int):
        raise TypeError(f"index0 must be an int, got {type(index0).__name__}")
    if not 0 <= index0 <= MAX_STEP:
        raise ValueError(f"index0 must be in [0, 2**63 - 1], got {index0}")
    return AdamPlan(n, (param, grad, exp_avg, exp_avg_sq), _DTYPE_CODE[grad.dtype], out_dtype, args, seed, index0)


def cpu_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor | Quantized8bit,
    exp_avg_sq: torch.Tensor | Quantized8bit,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    param_out: torch.Tensor | None = None,
    threads: int | None = None,
    isa: str | None = None,
    tile_numel: int | None = None,
    sink: Callable[[int, int], None] | None = None,
    maximize: bool = False,
    seed: int = 0,
    index0: int = 0,
) -> None:
    """One Adam/AdamW step in a single pass over memory, in place; optionally emits the new param in 16 bits.

    The moments are both fp32 tensors, both bf16 tensors (updated in fp32, stored with stochastic rounding:
    the random bits are a hash of (`seed`, `step`, `index0` + element index), so a rerun or a resume is bitwise
    identical, and calls over the parts of a tensor, each given its first element's index as `index0`, round as
    one call over all of it),
    or both `Quantized8bit` (exp_avg signed, exp_avg_sq unsigned, one block size; dequantized, updated in fp32
    and requantized block by block in the same pass, exp_avg's codes rounded stochastically with bits from the same
    (`seed`, `step`, `index0` + element index); `tile_numel` must then be a multiple of the block).

    `grad` (fp32/fp16/bf16) is multiplied by `grad_scale` first (by -grad_scale with `maximize`, as
    torch's). With `sink`, the tensor is processed in
    tiles of `tile_numel` elements and `sink(start, end)` is called after each tile is final (its
    `param_out` slice included), so the caller can copy tile t while tile t+1 is computed. `sink` may be a
    Python callable or a TileSink (`copy_tile_sink`, `Transport.tile_sink`, checked against this step): then the
    whole tile loop, sink calls included, runs in C++ without the GIL. Every argument is checked first.

    Interruption: the update is not transactional. If it fails after it started writing (a sink raised, a C
    sink failed, Ctrl-C between tiles), the exception carries `updated = (0, k)` (and a note saying so):
    elements [0, k) of param, exp_avg, exp_avg_sq and param_out hold the new step, [k, n) are untouched.
    A failed check raises before anything is written (then there is no `updated`).
    """
    plan = _plan(
        param, grad, exp_avg, exp_avg_sq, param_out, step=step, lr=lr, betas=betas, eps=eps,
        weight_decay=weight_decay, adamw=adamw, bias_correction=bias_correction, grad_scale=grad_scale,
        out_dtype=None, threads=threads, isa=isa, maximize=maximize, seed=seed, index0=index0,
    )  # fmt: skip
    c_sink = isinstance(sink, TileSink)
    if sink is not None and (not callable(sink) or type(sink).__name__ == "PyCapsule") and not c_sink:
        raise TypeError(f"sink must be callable(start, end) or a TileSink (copy_tile_sink), got {type(sink).__name__}")
    tile = _check_tile(tile_numel, plan.numel, sink, plan.block)
    if c_sink:
        sink.check(param_out if param_out is not None else param, plan.numel)
    _run_plan(plan, tile, sink, param_out)


def _run_plan(plan: AdamPlan, tile: int, sink: Any, param_out: torch.Tensor | None) -> None:
    """cpu_adam_step's update on a checked plan: `tile` elements at a time, `sink` after each (a TileSink: the whole
    loop in C++); an interruption says how far it got (`updated`), and what was written has its version bumped."""
    progress = torch.zeros(1, dtype=torch.int64)  # written by the kernel after each tile: exact under Ctrl-C
    try:
        if isinstance(sink, TileSink):
            plan.run_tiled(tile, sink, param_out, progress)
            return
        for start in range(0, plan.numel, tile):
            end = min(plan.numel, start + tile)
            plan.run(start, end, None if param_out is None else param_out[start:end], progress)
            if sink is not None:
                sink(start, end)
    except BaseException as e:
        done = int(progress)
        if done:
            e.updated = (0, done)
            if hasattr(e, "add_note"):
                e.add_note(f"cpu_adam_step: updated = (0, {done}): elements [0, {done}) hold the new step, "
                           f"[{done}, {plan.numel}) are untouched")  # fmt: skip
        raise
    finally:
        if int(progress):
            param, _, exp_avg, exp_avg_sq = plan.tensors
            bump_version(param, *moment_tensors(exp_avg, exp_avg_sq).values(), param_out)


def callers_fp_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, to run on another thread in this thread's floating-point mode: torch.set_flush_denormal sets
    flush-to-zero and denormals-are-zero for the calling thread only, and a pool thread made before keeps the mode it
    had (a delayed step's bits then differed from a synchronous one's). The kernels pass the mode to their own
    OpenMP workers."""
    mode = _cpu.fp_mode()

    def run(*args: Any, **kwargs: Any) -> Any:
        old = _cpu.set_fp_mode(mode)
        try:
            return fn(*args, **kwargs)
        finally:
            _cpu.set_fp_mode(old)

    return run


def bump_version(*tensors: torch.Tensor | None) -> None:
    """Tell autograd that these tensors were written in place (as torch's own in-place ops do): one call for all
    of them (torch >= 2.5 takes a list), not a Python call per tensor."""
    written = [t for t in tensors if t is not None and not t.is_inference()]
    if written:
        torch.autograd.graph.increment_version(written)


def stream_pass(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor | Quantized8bit,
    exp_avg_sq: torch.Tensor | Quantized8bit,
    *,
    param_out: torch.Tensor | None = None,
    threads: int | None = None,
    isa: str | None = None,
) -> None:
    """The bandwidth ceiling of cpu_adam_step: its exact loads and stores with trivial arithmetic (mutates!).

    Each moment format has its own ceiling: fp32 and bf16 moments are read and written as such (bf16 truncated,
    no hash); 8-bit codes are read, converted to fp32 and back unchanged and their scales rewritten, block by block.
    """
    n = _check_adam_tensors(param, grad, exp_avg, exp_avg_sq, param_out)
    threads = _check_threads(threads)
    isa = best_isa() if isa is None else _check_isa(isa)
    _cpu.stream_pass(
        param.data_ptr(), grad.data_ptr(), _DTYPE_CODE[grad.dtype], _moment_address(exp_avg, 0),
        _moment_address(exp_avg_sq, 0), param_out.data_ptr() if param_out is not None else 0,
        _DTYPE_CODE[param_out.dtype] if param_out is not None else _NO_OUT, n, ISAS.index(isa), threads,
        _state_args(exp_avg, exp_avg_sq, 0, 0),
    )  # fmt: skip
    bump_version(param, *moment_tensors(exp_avg, exp_avg_sq).values(), param_out)


def sum_squares(x: torch.Tensor, *, out: torch.Tensor | None = None, threads: int | None = None,
                isa: str | None = None) -> tuple[float, bool]:  # fmt: skip
    """(sum of squares, any inf/NaN) of a contiguous fp32/fp16/bf16 CPU tensor in one pass; copies x to `out`.

    fp32 partial sums over 4096-element chunks, combined in double (the gradient norm's pass). `out`, if
    given, receives a copy of x (same dtype and size) in the same pass: that is the CPU bucket pack.
    """
    _check_tensor(x, "x", tuple(_DTYPE_CODE), None)
    if out is not None:
        _check_tensor(out, "out", (x.dtype,), x.numel(), like="x", written=True)
        check_no_overlap({"x": x, "out": out})
    isa = best_isa() if isa is None else _check_isa(isa)
    threads = _check_threads(threads)
    y = 0 if out is None else out.data_ptr()
    result = _cpu.sum_squares(x.data_ptr(), y, _DTYPE_CODE[x.dtype], x.numel(), ISAS.index(isa), threads)
    bump_version(out)
    return result


def accumulate(acc: torch.Tensor, x: torch.Tensor, *, alpha: float = 1.0, threads: int | None = None,
               isa: str | None = None) -> torch.Tensor:  # fmt: skip
    """acc += alpha * x in one pass, each element fma(alpha, x, acc) (one rounding); returns acc.

    acc: contiguous fp32 CPU tensor; x: contiguous fp32/fp16/bf16 CPU tensor of as many elements, upcast exactly.
    torch's `acc.add_(x, alpha=alpha)` gives the same values (with alpha=1 bit for bit), but takes its mixed-dtype
    path for a 16-bit x: 4.5x slower on one core, 5-6x on two (bench/test_bench_cpu_adam.py -k accumulate).
    The optimizer's host sums of gradients (accumulation over micro-batches, selective's window) use it.
    """
    _check_tensor(acc, "acc", (torch.float32,), None, written=True)
    if acc.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("acc requires grad: it cannot be written in place here (use torch.no_grad() or "
                           "acc.detach())")  # fmt: skip
    _check_tensor(x, "x", tuple(_DTYPE_CODE), acc.numel(), like="acc")
    check_no_overlap({"acc": acc, "x": x})
    alpha = _real(alpha, "alpha")
    isa = best_isa() if isa is None else _check_isa(isa)
    threads = _check_threads(threads)
    _cpu.accumulate(acc.data_ptr(), x.data_ptr(), _DTYPE_CODE[x.dtype], alpha, acc.numel(), ISAS.index(isa), threads)
    bump_version(acc)
    return acc


class TileSink:
    """A C tile sink (what the C++ tile loop calls after each tile) and the tensors it copies between.

    It holds `dst` and `src`, so their memory lives as long as the sink; every use checks it against the step it
    serves: `src` must be what the step writes (its param_out, else param), and both storages must still be
    where, and as large as, they were when the sink was made.

    Args:
        capsule: the C sink (zo_kernels._cpu.copy_tile_sink, zo_kernels._cuda.h2d_tile_sink).
        dst: where the tiles go. src: where they are read, tile [start, end) of its elements.
    """

    def __init__(self, capsule: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.capsule, self.dst, self.src = capsule, dst, src
        self._addresses = (dst.data_ptr(), src.data_ptr())

    def check(self, written: torch.Tensor, numel: int) -> None:
        """Raise unless this sink can serve a step over `numel` elements that writes `written` each tile."""
        src = self.src
        if (src.data_ptr(), src.dtype, src.numel()) != (written.data_ptr(), written.dtype, numel):
            raise ValueError(f"sink copies {src.numel()} {src.dtype} elements at {src.data_ptr():#x}; this step "
                             f"writes {numel} {written.dtype} elements at {written.data_ptr():#x} (its param_out, "
                             "else param): make the sink from that tensor")  # fmt: skip
        for t, name, addr in ((self.dst, "dst", self._addresses[0]), (src, "src", self._addresses[1])):
            if t.data_ptr() != addr:
                raise ValueError(f"sink {name} was moved to other memory (set_) after the sink was made")
            check_memory(t, f"sink {name}", written=name == "dst" and t.device.type == "cpu")


def copy_tile_sink(dst: torch.Tensor, src: torch.Tensor) -> TileSink:
    """A C tile sink copying each finished tile of `src` to `dst` (host tensors of one dtype and size)."""
    _check_tensor(src, "src", tuple(_DTYPE_CODE), None)
    _check_tensor(dst, "dst", (src.dtype,), src.numel(), like="src", written=True)
    check_no_overlap({"dst": dst, "src": src})
    return TileSink(_cpu.copy_tile_sink(dst.data_ptr(), src.data_ptr(), src.element_size(), src.numel()), dst, src)


STATE_DTYPES = (torch.float32, torch.bfloat16, "8bit")
QUANT_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales", "quant_block")


def check_state_dtype(state_dtype: Any) -> torch.dtype | str:
    """Validate a moments' format: torch.float32, torch.bfloat16 or "8bit"."""
    if not any(state_dtype == d and type(state_dtype) is type(d) for d in STATE_DTYPES):
        raise ValueError(f"state_dtype must be torch.float32, torch.bfloat16 or '8bit', got {state_dtype!r}")
    return state_dtype


def zero_moments(p: torch.Tensor, state_dtype: torch.dtype | str) -> tuple[Any, Any]:
    """Zero (exp_avg, exp_avg_sq) for param p in the format `state_dtype`."""
    if state_dtype == "8bit":
        return Quantized8bit.empty(p.numel(), signed=True), Quantized8bit.empty(p.numel(), signed=False)
    return (torch.zeros(p.shape, dtype=state_dtype), torch.zeros(p.shape, dtype=state_dtype))


def check_saved_moments(st: dict[str, Any], numel: int, state_dtype: torch.dtype | str, where: str) -> None:
    """Raise ValueError unless a saved param state can be loaded as `state_dtype` moments of `numel` elements."""
    for key in ("exp_avg", "exp_avg_sq"):
        t = st.get(key)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{where}[{key!r}] must be a floating-point tensor, got {_describe(t)}")
        if t.numel() != numel:
            raise ValueError(f"{where}[{key!r}] has {t.numel()} elements, its param {numel}")
    if state_dtype != "8bit":
        return
    if _has_codes(st):
        from .quant8 import check_block, num_blocks

        block = st["quant_block"]
        try:
            check_block(block)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}['quant_block']: {e}") from None
        for key, n, lo, hi in (("exp_avg_codes", numel, -127, 127), ("exp_avg_sq_codes", numel, 0, 255),
                               ("exp_avg_scales", num_blocks(numel, block), None, None),
                               ("exp_avg_sq_scales", num_blocks(numel, block), None, None)):  # fmt: skip
            t = st[key]
            if not isinstance(t, torch.Tensor) or t.numel() != n:
                raise ValueError(f"{where}[{key!r}] must be a tensor of {n} elements, got {_describe(t)}")
            if lo is not None and t.numel() and not bool(((t == t.round()) & (t >= lo) & (t <= hi)).all()):
                raise ValueError(f"{where}[{key!r}] must hold integers in [{lo}, {hi}]")
        return
    m, v = st["exp_avg"], st["exp_avg_sq"]
    if not bool(torch.isfinite(m).all() and torch.isfinite(v).all()):
        raise ValueError(f"{where}: exp_avg and exp_avg_sq must be finite to be quantized to 8 bits")
    if bool((v < 0).any()):
        raise ValueError(f"{where}['exp_avg_sq'] must be >= 0 to be quantized to 8 bits")


def _has_codes(st: dict[str, Any]) -> bool:
    return all(k in st for k in QUANT_KEYS)


def moments_from_saved(st: dict[str, Any], p: torch.Tensor, state_dtype: torch.dtype | str) -> tuple[Any, Any]:
    """(exp_avg, exp_avg_sq) in format `state_dtype` from a saved (checked) param state."""
    m, v = st["exp_avg"], st["exp_avg_sq"]
    if state_dtype != "8bit":
        return (m.to(state_dtype).reshape(p.shape).contiguous(), v.to(state_dtype).reshape(p.shape).contiguous())
    m = m.float().reshape(-1).contiguous()
    v = v.float().reshape(-1).contiguous()
    if _has_codes(st):
        block = st["quant_block"]
        qm = Quantized8bit(st["exp_avg_codes"].reshape(-1).to(torch.int8), st["exp_avg_scales"].float().reshape(-1),
                           signed=True, block=block)  # fmt: skip
        qv = Quantized8bit(st["exp_avg_sq_codes"].reshape(-1).to(torch.uint8),
                           st["exp_avg_sq_scales"].float().reshape(-1), signed=False, block=block)  # fmt: skip
        # The codes are used only while they still decode to the fp32 moments (a torch.optim.AdamW that loaded
        # and stepped this state dict carries them along unchanged): the fp32 moments are the truth.
        if torch.equal(qm.to_float(), m) and torch.equal(qv.to_float(), v):
            return qm, qv
    return Quantized8bit.from_float(m, signed=True), Quantized8bit.from_float(v, signed=False)


def _check_threads(threads: int | None) -> int:
    if threads is None:
        return max(1, torch.get_num_threads())
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be an int or None, got {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if threads > MAX_THREADS:
        raise ValueError(f"threads must be <= {MAX_THREADS} (8 per CPU this process may run on, at least 256), got "
                         f"{threads}")  # fmt: skip
    return threads


def _check_tile(tile_numel: int | None, n: int, sink: Any, block: int = 1) -> int:
    if tile_numel is None:
        return max(1, DEFAULT_TILE_NUMEL // block * block if sink is not None else n)
    if isinstance(tile_numel, bool) or not isinstance(tile_numel, int):
        raise TypeError(f"tile_numel must be an int or None, got {type(tile_numel).__name__}")
    if tile_numel < 1:
        raise ValueError(f"tile_numel must be >= 1, got {tile_numel}")
    if tile_numel < n and tile_numel % block:
        raise ValueError(f"tile_numel must be a multiple of the 8-bit moments' block ({block}), got {tile_numel}")
    return min(tile_numel, max(1, n))


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over fp32 CPU parameters, one fused pass per parameter, drop-in for torch.optim.AdamW.

    State keys match torch.optim.Adam/AdamW (`step`, `exp_avg`, `exp_avg_sq`), so state dicts move
    between the two in both directions. Each group also carries torch's `decoupled_weight_decay` (= `adamw`).
    Loading a state dict keeps the algorithm, as torch's classes do: with adamw=True it stays AdamW (as
    torch.optim.AdamW), with adamw=False it follows the saved `decoupled_weight_decay` (as torch.optim.Adam).

    `state_dtype` stores the moments as fp32, bf16 (stochastic rounding, seeded by the parameter's position) or
    "8bit" (`Quantized8bit`, blocks of 256). Whatever the format, `state_dict()` holds `exp_avg` / `exp_avg_sq`
    dequantized to fp32 in the parameter's shape, so it loads into torch.optim.AdamW or a CPUAdam of any format
    (which rounds or quantizes them). An "8bit" one also holds `exp_avg_codes`, `exp_avg_scales`,
    `exp_avg_sq_codes`, `exp_avg_sq_scales` and `quant_block`: an "8bit" CPUAdam loads those instead (while they
    still decode to the fp32 moments), so a resume is bitwise (bf16 needs nothing more: bf16 -> fp32 -> bf16 is
    exact). A bad state dict is refused before anything changes.

    Args:
        params: iterable of fp32 CPU tensors, (name, tensor) pairs (`model.named_parameters()`) or param-group dicts.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decoupled (AdamW) when `adamw`, else L2 added to the gradient (Adam).
        adamw: decoupled weight decay as torch.optim.AdamW; False gives torch.optim.Adam.
        bias_correction: divide by 1 - beta^step as torch does; False skips it.
        maximize: ascend, as torch's maximize (the gradient is negated).
        amsgrad, foreach, fused, capturable, differentiable: torch's options, accepted at their defaults (and
            False); True is refused with the reason (see zo_kernels.optim_contract).
        state_dtype: torch.float32, torch.bfloat16 or "8bit": how exp_avg and exp_avg_sq are stored.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw: bool = True,
        bias_correction: bool = True,
        state_dtype: torch.dtype | str = torch.float32,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        if isinstance(params, torch.nn.Module):
            raise TypeError(f"params must be an iterable of parameters or param groups (model.parameters()), got a "
                            f"{type(params).__name__} module (ZeroOffloadAdamW is the one that takes the model)")
        self.state_dtype = check_state_dtype(state_dtype)
        check_hparams(lr, betas, eps, weight_decay)
        options = dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach, fused=fused, capturable=capturable,
                       differentiable=differentiable)  # fmt: skip
        options = check_torch_options(options, "CPUAdam")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=bool(adamw),
                        bias_correction=bool(bias_correction), **options,
                        decoupled_weight_decay=bool(adamw))  # fmt: skip
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, checking its tensors (fp32, CPU, contiguous) and hyper-parameters first."""
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError("param_group must be a dict with a 'params' key")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        tensors, _ = split_names(params, "param group")
        for i, p in enumerate(tensors):
            _check_tensor(p, f"params[{i}]", (torch.float32,), None)
        merged = {**self.defaults, **param_group}
        check_hparams(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
        check_torch_options(merged, "param group")
        group = {**param_group, "params": params}
        if "adamw" in param_group or "decoupled_weight_decay" in param_group:  # one algorithm, two names
            adamw = param_group.get("adamw", param_group.get("decoupled_weight_decay"))
            if param_group.get("decoupled_weight_decay", adamw) != adamw:
                raise ValueError("param group: adamw and decoupled_weight_decay differ (they name one choice)")
            group["adamw"] = group["decoupled_weight_decay"] = bool(adamw)
        super().add_param_group(group)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "state_dtype": self.state_dtype}  # (torch's keeps only its own three)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        adamw = self.defaults["adamw"]
        for group in self.param_groups:  # a loaded group (ours, or torch.optim.Adam/AdamW's): keep the algorithm
            if adamw:  # AdamW, as torch.optim.AdamW: decoupled whatever the saved group said
                decoupled = True
            else:  # Adam, as torch.optim.Adam: the saved group's choice
                decoupled = bool(group.get("decoupled_weight_decay", group.get("adamw", False)))
            group["adamw"] = group["decoupled_weight_decay"] = decoupled
            group.setdefault("bias_correction", self.defaults["bias_correction"])
            for key, default in TORCH_OPTIONS.items():
                group.setdefault(key, default)
            for p in group["params"]:  # an older torch's float step, as torch.optim.Adam converts it
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    def _check_state_dict(self, state_dict: Any) -> None:
        groups, state = check_state_dict_layout(state_dict, len(self.param_groups))
        for gi, (saved, group) in enumerate(zip(groups, self.param_groups)):
            where = f"state_dict param group {gi}"
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
                raise ValueError(f"{where} must be a dict with a 'params' list")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"{where} has {len(saved['params'])} params, this optimizer's {len(group['params'])}")
            check_group_keys(saved, ("lr", "betas", "eps", "weight_decay"), where, "Adam/AdamW")
            check_hparams(saved["lr"], saved["betas"], saved["eps"], saved["weight_decay"])
            check_torch_options(saved, where, loaded=True)
            for i, p in zip(saved["params"], group["params"]):
                st = state.get(i)
                if st is None:
                    continue
                if not isinstance(st, dict):
                    raise ValueError(f"state_dict state {i!r} must be a dict, got {type(st).__name__}")
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    if key not in st:
                        raise ValueError(f"state_dict state {i!r} has no {key!r} (keys {sorted(st)}): not an "
                                         "Adam/AdamW state dict?")  # fmt: skip
                for key in ("exp_avg", "exp_avg_sq"):
                    t = st[key]
                    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                        raise TypeError(f"state_dict state {i!r} {key!r} must be a floating-point tensor")
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"state_dict state {i!r} {key!r} has shape {tuple(t.shape)}, its param "
                                         f"{tuple(p.shape)}")  # fmt: skip
                step = st["step"]
                step = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
                if (isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step)
                        or step < 0 or step != int(step) or step >= MAX_STEP):  # fmt: skip
                    raise ValueError(f"state_dict state {i!r} 'step' must be a whole number in [0, {MAX_STEP}), got "
                                     f"{step!r}")  # fmt: skip

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        seeds = {p: i for i, p in enumerate(self._params())}
        for gi, group in enumerate(self.param_groups):  # check everything first: a bad group changes nothing
            check_torch_options(group, f"param group {gi}")
            check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"param group {gi} param {pi}: CPUAdam does not support sparse gradients")
                _check_tensor(p, f"param group {gi} param {pi}", (torch.float32,), None)
                if p.grad.shape != p.shape:
                    got, want = tuple(p.grad.shape), tuple(p.shape)
                    raise ValueError(f"param group {gi} param {pi}: grad shape {got} != param shape {want}")
                st = self.state.get(p)
                step = int(st["step"].item()) + 1 if st else 1
                if step > MAX_STEP:
                    raise ValueError(f"param group {gi} param {pi}: its next step would pass {MAX_STEP} (the kernel's "
                                     "int64)")  # fmt: skip
                # every kernel check too (writable, storage, overlap), once, in the plan: a later param refused
                # used to leave the earlier ones stepped
                m, v = (st["exp_avg"], st["exp_avg_sq"]) if st else zero_moments(p, self.state_dtype)
                try:
                    plan = _plan(
                        p, p.grad.contiguous(), m, v, None, step=step, lr=group["lr"], betas=group["betas"],
                        eps=group["eps"], weight_decay=group["weight_decay"], adamw=group["adamw"],
                        bias_correction=group["bias_correction"], grad_scale=1.0, out_dtype=None, threads=None,
                        isa=None, maximize=bool(group.get("maximize")), seed=seeds[p],
                    )  # fmt: skip
                except (TypeError, ValueError) as e:
                    raise type(e)(f"param group {gi} param {pi}: {e}") from None
                work.append((p, plan))
        for p, plan in work:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"], state["exp_avg_sq"] = plan.tensors[2:]
            _run_plan(plan, _check_tile(None, plan.numel, None, plan.block), None, None)
            state["step"] += 1
        return loss

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with exp_avg / exp_avg_sq as fp32 (plus the 8-bit codes and scales: see the class)."""
        sd = super().state_dict()
        if self.state_dtype == torch.float32:
            return sd
        params = self._params()
        state = {}
        for k, st in sd["state"].items():
            st = dict(st)
            shape = params[k].shape
            m, v = st.get("exp_avg"), st.get("exp_avg_sq")
            if isinstance(m, Quantized8bit):
                st.update(exp_avg_codes=m.codes, exp_avg_scales=m.scales, exp_avg_sq_codes=v.codes,
                          exp_avg_sq_scales=v.scales, quant_block=m.block)  # fmt: skip
                st["exp_avg"], st["exp_avg_sq"] = m.to_float().view(shape), v.to_float().view(shape)
            elif isinstance(m, torch.Tensor):
                st["exp_avg"], st["exp_avg_sq"] = m.float(), v.float()
            state[k] = st
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's or any CPUAdam's state dict, rounding or quantizing the moments to this format.

        The (pre-hooked) dict is checked first to be an Adam/AdamW state for these params: a state dict of another
        optimizer (SGD...) is refused before anything changes."""
        state_dict = run_load_pre_hooks(self, state_dict)
        self._check_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_id = dict(zip(ids, self._params()))
        for k, st in state_dict["state"].items():
            if k in by_id and isinstance(st, dict):
                check_saved_moments(st, by_id[k].numel(), self.state_dtype, f"state[{k!r}]")
        state_dict = {**state_dict, "param_groups": [keep_implementation(saved, group) for saved, group in
                                                     zip(state_dict["param_groups"], self.param_groups)]}  # fmt: skip
        hooks, self._optimizer_load_state_dict_pre_hooks = self._optimizer_load_state_dict_pre_hooks, OrderedDict()
        try:  # the pre-hooks ran above, once
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks
        for p in self._params():
            st = self.state.get(p)
            if st and "exp_avg" in st:
                st["exp_avg"], st["exp_avg_sq"] = moments_from_saved(st, p, self.state_dtype)
                for key in QUANT_KEYS:
                    st.pop(key, None)
