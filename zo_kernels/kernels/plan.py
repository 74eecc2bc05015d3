"""The launch plan of one bucket: its layout validated, its tables built and uploaded once, reused every call.

A plan is built for tensors of given sizes and dtypes on one device. Each call checks that the tensors still have
those sizes and dtypes, are contiguous and on the plan's device, and reads their addresses: in one C++ call (a
layout guard, see layout_guard.py) while they keep the exact layout last validated, else in a few C-level passes
over the list (no Python loop per tensor). The addresses usually repeat (the same parameters, or
gradients the caching allocator puts where it put them last step); only when they change is the table
rebuilt: alignment and overlap checked (sorted by address, O(n log n)) and the addresses written into one of the
plan's two pinned host tables, copied over its one device table in stream order. Nothing else of a call grows with
the tensor count but the C++ copy calls of the CPU path.
This module does not import triton on the CPU path; a plan for CUDA tensors asks its version (versions.default_impl).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, NamedTuple

import torch

from .. import _cpu
from ..cpu_adam import ISAS, _real, best_isa, bump_version, check_memory, sum_squares
from ..versions import default_impl
from .layout_guard import guard as layout_guard

CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_DTYPE, _CPU, _NEEDS_GRAD = attrgetter("dtype"), attrgetter("is_cpu"), attrgetter("requires_grad")
_INFERENCE = torch.Tensor.is_inference


def _scale(scale: Any) -> float:
    """pack's scale: a finite float within fp32's range, as it is, the fast way; anything else through _real."""
    return scale if type(scale) is float and -3.4e38 < scale < 3.4e38 else _real(scale, "scale")


def _where(out: torch.Tensor, into: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int, int, int]:
    """Where pack_step's trusted buffers lie: out's address and storage size, the totals' addresses."""
    return out.data_ptr(), out.untyped_storage().nbytes(), into[0].data_ptr(), into[1].data_ptr()


class _Trusted:
    """One (out, into) pair pack_step checked: where their memory was then, the bucket's slice of out, the
    addresses out was last found apart from, the launch's key."""

    __slots__ = ("out", "into", "where", "flat", "apart", "key")

    def __init__(self, out: torch.Tensor, into: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.out, self.into = out, into
        self.where: tuple[int, int, int, int] | None = None
        self.flat: torch.Tensor | None = None
        self.apart: tuple[int, ...] | None = None
        self.key: tuple | None = None


def check_float(t, name: str) -> None:
    """t is a dense contiguous fp32/fp16/bf16 tensor (TypeError/ValueError naming it otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in CODE:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense strided tensor, got layout {t.layout}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")


def check_writable(t: torch.Tensor, name: str) -> None:
    """An output must not need grad: autograd would refuse the write halfway (after earlier outputs changed)."""
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{name} requires grad: it cannot be written in place here (use torch.no_grad() or "
                           f"{name}.detach())")  # fmt: skip
    if t.is_inference() and not torch.is_inference_mode_enabled():
        _refuse_written(t, name)
    check_memory(t, name, written=t.device.type == "cpu")


def check_out(out, dtype: torch.dtype, numel: int, device: torch.device, name: str = "out",
              memory: bool = True) -> None:  # fmt: skip
    """out is a writable 1-D `dtype` tensor of at least `numel` elements on `device` (memory: check its storage)."""
    check_float(out, name)
    if out.dtype != dtype:
        raise TypeError(f"{name} has dtype {out.dtype}, expected {dtype}")
    if out.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(out.shape)}")
    if out.numel() < numel:
        raise ValueError(f"{name} has {out.numel()} elements, needs at least {numel}")
    if out.device != device:
        raise ValueError(f"{name} is on {out.device}, the tensors on {device}")
    if out.requires_grad and torch.is_grad_enabled():
        check_writable(out, name)
    if out.is_neg() or out.is_inference():  # (every call: the memory check below runs once per address)
        _refuse_written(out, name)
    if memory:
        check_memory(out, name, written=out.device.type == "cpu")


def _refuse_written(t: torch.Tensor, name: str) -> None:
    """A negated view or an inference tensor cannot be written here (check_out's and unpack's refusal)."""
    if t.is_neg():
        raise ValueError(f"{name} is a negated or conjugated view; pass {name}.resolve_neg()")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{name} is an inference tensor: outside inference mode it cannot be written in place")


def check_into(into, device: torch.device) -> None:
    """into is (sum_sq, found_inf): 0-dim fp32 and bool tensors on `device` that can be written in place (every call;
    the usual case is one expression of attribute reads, ~0.5 us)."""
    try:
        s, f = into
        cuda = device.type == "cuda"
        here = (s.is_cuda and f.is_cuda and s.get_device() == f.get_device() == device.index if cuda
                else s.is_cpu and f.is_cpu)  # (a meta tensor is neither)  # fmt: skip
        if (type(into) is tuple and here and s.dtype is torch.float32 and f.dtype is torch.bool and not s.dim()
                and not f.dim() and not (s.requires_grad or f.requires_grad or s.is_neg() or s.is_inference()
                                         or f.is_inference()) and s.data_ptr() != f.data_ptr()):  # fmt: skip
            return
    except (TypeError, ValueError, AttributeError):
        pass
    _refuse_into(into, device)


def _refuse_into(into, device: torch.device) -> None:
    """check_into's slow path: raise naming what is wrong (or return: a tensor that requires grad, grad disabled)."""
    if not (isinstance(into, tuple) and len(into) == 2 and all(isinstance(t, torch.Tensor) for t in into)):
        raise TypeError(f"into must be a tuple (sum_sq, found_inf) of two tensors, got {type(into).__name__}")
    cuda = device.type == "cuda"
    for t, name, dtype in ((into[0], "into[0] (sum_sq)", torch.float32), (into[1], "into[1] (found_inf)", torch.bool)):
        here = t.is_cuda and t.get_device() == device.index if cuda else t.is_cpu
        if t.dtype != dtype or t.dim() != 0 or not here:
            raise ValueError(f"{name} must be a 0-dim {dtype} tensor on {device}, got a {t.dim()}-dim {t.dtype} "
                             f"tensor on {t.device}")  # fmt: skip
        if t.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{name} requires grad: it cannot be written in place here (use torch.no_grad())")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{name} is an inference tensor: outside inference mode it cannot be written in place")
        if t.is_neg():
            raise ValueError(f"{name} is a negated view; pass {name}.resolve_neg()")
    if into[0].data_ptr() == into[1].data_ptr():
        raise ValueError("into: sum_sq and found_inf must be two tensors of their own")


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t in pinned memory when it goes to a GPU (so the copy is asynchronous and never from pageable memory)."""
    return t.pin_memory() if device.type == "cuda" else t


class Packed(NamedTuple):
    """The result of `pack`.

    Args:
        flat: 1-D bucket of the packed values (a view of `out` when one was given).
        offsets: where each tensor starts in `flat` (multiples of `align`).
        found_inf: 0-dim bool tensor on the device: some scaled value is inf/NaN or overflows the dtype.
        sum_sq: 0-dim fp32 tensor on the device: sum of squares of the scaled values, accumulated in fp32.
    """

    flat: torch.Tensor
    offsets: tuple[int, ...]
    found_inf: torch.Tensor
    sum_sq: torch.Tensor


class PackPlan:
    """How to pack tensors of these sizes and dtypes into (and unpack them from) a flat bucket of `dtype`.

    Build it with `zo_kernels.buckets.plan` (it validates), keep it, and call `pack` / `unpack` with tensors of
    the same sizes and dtypes every time (e.g. each step's gradients of one bucket). One plan is used in stream
    order: its scratch (the partial sums and the ticket counter) is shared by its launches.

    Args:
        numels, dtypes: of the tensors, in order.
        dtype: the bucket's dtype.
        offsets, segs: where each tensor's segment starts in the bucket, and its length (>= numel: pack zeroes
            the rest).
        total: the bucket's size.
        device: where the tensors and the bucket are.
        name: how errors name the tensor list.
    """

    def __init__(self, numels: tuple[int, ...], dtypes: tuple[torch.dtype, ...], dtype: torch.dtype,
                 offsets: tuple[int, ...], segs: tuple[int, ...], total: int, device: torch.device,
                 name: str = "tensors") -> None:  # fmt: skip
        self.numels, self.dtypes, self.dtype, self.offsets, self.total = numels, dtypes, dtype, offsets, total
        self.device, self.name, self.n, self.segs = device, name, len(numels), segs
        self.codes = tuple(CODE[d] for d in dtypes)
        self.gaps = [(o + n, o + s) for o, n, s in zip(offsets, numels, self.segs) if s > n]
        self.same_dtype = all(d == dtype for d in dtypes)
        self._device_index = device.index if device.type == "cuda" else None
        self._ptrs: tuple[int, ...] | None = None  # the addresses the table and the overlap check are for
        self._starts: list[int] = []  # the union of the tensors' spans, sorted, disjoint: the overlap check of `out`
        self._ends: list[int] = []
        self._overlap: tuple[int, int] | None = None  # two tensors sharing memory (pack reads them; unpack refuses)
        self._device_tables = None  # (work, n_work, part, count, pack work, unpack work) once on a GPU
        self._kernels = None  # the Triton kernels' module (kernels/pack.py), imported with the first tables
        self._table: torch.Tensor | None = None  # the tensor table on the device, made once (_upload)
        self._table_stale = True  # it does not hold the addresses of the last check (_upload rewrites it)
        self._host_tables: list[torch.Tensor] = []  # its pinned host copies, written in place in turn
        self._uploaded: list = []  # CUDA events: the last copy out of each host copy
        self._out_checked: tuple | None = None  # (address, numel, storage bytes) of an `out` whose memory was checked
        self._apart_checked: tuple | None = None  # ((address, numel) of out, the tensors' addresses) found apart
        self._into_checked: tuple | None = None  # an `into` pair's addresses and out's span, their memory checked
        self._writable = False  # the tensors at these addresses were checked writable (unpack on the CPU)
        self._gap_index: torch.Tensor | None = None
        self.uploads = 0  # tensor tables uploaded (a test counts them)
        self._guard = None  # layout_guard of the tensors last validated: while it holds, only addresses are read
        self.full_checks = 0  # calls whose tensors went through the full check (a test counts them)
        self.impl = default_impl(device.type)
        self._trusted: list[_Trusted] = []  # pack_step's (out, into) pairs checked once, newest last (at most 4)

    # ------------------------------------------------------------------ per-call checks

    def check(self, tensors: Sequence[torch.Tensor], written: bool = False) -> tuple[tuple[int, ...], Sequence]:
        """(addresses, tensors) after checking they still fit the plan (O(n) in C-level passes); negated views
        are resolved (copied) when only read, refused when written."""
        name = self.name
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
        if len(tensors) != self.n:
            raise ValueError(f"{name} has {len(tensors)} tensors, the plan {self.n}")
        if self._guard is not None and self._guard.check(*tensors):  # the layout validated last time, exactly
            return self._addresses(tensors, written)
        self.full_checks += 1
        try:
            numels = tuple(map(torch.Tensor.numel, tensors))  # the descriptor refuses anything but a tensor
        except TypeError:
            i = next(i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor))
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(tensors[i]).__name__}") from None
        if numels != self.numels or tuple(map(_DTYPE, tensors)) != self.dtypes:
            i = next(i for i, t in enumerate(tensors) if (t.dtype, t.numel()) != (self.dtypes[i], self.numels[i]))
            raise ValueError(f"{name}[{i}] is {tensors[i].dtype} with {tensors[i].numel()} elements; the plan was "
                             f"built for {self.dtypes[i]} with {self.numels[i]} (build a new plan)")  # fmt: skip
        if self.device.type == "cpu":
            right = all(map(_CPU, tensors))
        elif self._device_index is None:
            right = all(t.device == self.device for t in tensors)
        else:
            right = set(map(torch.Tensor.get_device, tensors)) <= {self._device_index}
        if not right:
            i = next(i for i, t in enumerate(tensors) if t.device != self.device)
            raise ValueError(f"{name}[{i}] is on {tensors[i].device}; the plan is for tensors on {self.device}")
        if not all(map(torch.Tensor.is_contiguous, tensors)):
            i = next(i for i, t in enumerate(tensors) if not t.is_contiguous())
            t = tensors[i]
            raise ValueError(f"{name}[{i}] must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
        if any(map(torch.Tensor.is_neg, tensors)):
            if written:
                i = next(i for i, t in enumerate(tensors) if t.is_neg())
                raise ValueError(f"{name}[{i}] is a negated view; pass {name}[{i}].resolve_neg()")
            tensors = [t.resolve_neg() for t in tensors]  # the kernels read raw values (copies: no guard for them)
        else:
            self._guard = layout_guard(tensors)
        return self._addresses(tensors, written)

    def _addresses(self, tensors: Sequence[torch.Tensor], written: bool) -> tuple[tuple[int, ...], Sequence]:
        """(addresses, tensors): new addresses checked and the table rebuilt; shared memory refused where written."""
        ptrs = tuple(map(torch.Tensor.data_ptr, tensors))
        if ptrs != self._ptrs:
            self._readdress(tensors, ptrs)
        if written and self._overlap:
            self._refuse_overlap()
        return ptrs, tensors

    def _readdress(self, tensors: Sequence[torch.Tensor], ptrs: tuple[int, ...]) -> None:
        """New addresses: check them (alignment, storage; overlap, sorted, O(n log n): fine to read (pack), refused
        to write (unpack)); the table is rebuilt."""
        name = self.name
        for i, t in enumerate(tensors):
            check_memory(t, f"{name}[{i}]")
        spans = sorted((p, p + n * t.element_size(), i) for i, (p, n, t) in enumerate(zip(ptrs, self.numels, tensors))
                       if n)  # fmt: skip
        starts, ends, overlap, reach = [], [], None, -1  # the union of the spans, disjoint and sorted (check_apart)
        for lo, hi, i in spans:
            if starts and lo < ends[-1]:
                overlap = overlap or (reach, i)  # i starts inside the span of `reach`, the furthest-reaching so far
                if hi > ends[-1]:
                    ends[-1], reach = hi, i
            else:
                starts.append(lo)
                ends.append(hi)
                reach = i
        self._starts, self._ends, self._overlap = starts, ends, overlap
        self._ptrs, self._table_stale, self._writable = ptrs, True, False

    def _refuse_overlap(self) -> None:
        i, j = sorted(self._overlap)
        raise ValueError(f"{self.name}[{i}] and {self.name}[{j}] overlap in memory; each must be its own buffer to "
                         "be written")

    def check_apart(self, buf: torch.Tensor, name: str) -> None:
        """buf shares no memory with the tensors of the last check (O(log n): their spans are sorted, disjoint)."""
        if not buf.numel() or not self._starts:
            return
        lo = buf.data_ptr()
        hi = lo + buf.numel() * buf.element_size()
        i = bisect.bisect_left(self._starts, hi)
        if i and self._ends[i - 1] > lo:
            raise ValueError(f"{name} and a tensor of {self.name} overlap in memory; each must be its own buffer")

    # ------------------------------------------------------------------ device tables

    def _tables(self, ptrs: tuple[int, ...]):
        """(tensor table, work table, programs, partials, counter) on the device; uploaded once per address set."""
        if self._device_tables is None:
            from . import pack as kpack

            self._kernels = kpack  # (a function-level import costs ~0.6 us a call: the pack call's is this)
            rows = kpack.work_rows(self.segs)
            work = _pinned(torch.tensor(rows, dtype=torch.int64).reshape(-1, 2), self.device)
            n_work = len(rows)
            self._device_tables = (
                work.to(self.device, non_blocking=True), n_work,
                torch.empty(2 * max(n_work, 1), dtype=torch.float32, device=self.device),
                torch.zeros(1, dtype=torch.int32, device=self.device),
            )  # fmt: skip
        if self._table_stale:
            self._upload(ptrs)
        return self._table, *self._device_tables

    def _upload(self, ptrs: tuple[int, ...]) -> None:
        """The tensor table (self._table) with these addresses, on the device. Its pinned host copies (two, used in
        turn) and the device table are made once; new addresses are written into a host copy's address column, once
        the copy from it two uploads ago has read it (its event), and copied over the device table in stream order
        (the launches that read the old table were queued before the copy). A new pinned tensor per upload went
        through the caching host allocator, which page-locks a new block while the last copy from a cached one is
        pending; the H200's 1.3B step rows uploaded 13-41 tables a step (the gradients' addresses move)."""
        cuda = self.device.type == "cuda"
        if self._table is None:
            from . import pack as kpack

            rows = [(0, n, o, c, s) for n, o, c, s in zip(self.numels, self.offsets, self.codes, self.segs)]
            host = torch.tensor(rows, dtype=torch.int64).reshape(-1, kpack.NCOL)
            self._host_tables = [host.pin_memory(), host.pin_memory()] if cuda else [host]  # (each a pinned copy)
            self._uploaded = [torch.cuda.Event(), torch.cuda.Event()] if cuda else []
            self._table = torch.empty_like(host, device=self.device) if cuda else host
        k = self.uploads % len(self._host_tables)
        if cuda:
            self._uploaded[k].synchronize()  # the copy from this host table two uploads ago has read it
        self._host_tables[k][:, 0] = torch.tensor(ptrs, dtype=torch.int64)
        if cuda:
            with torch.cuda.device(self.device):
                self._table.copy_(self._host_tables[k], non_blocking=True)
                self._uploaded[k].record()
        self.uploads += 1
        self._table_stale = False

    def _gaps(self) -> torch.Tensor:
        if self._gap_index is None:
            idx = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in self.gaps])
            self._gap_index = idx.to(self.device)
        return self._gap_index

    # ------------------------------------------------------------------ the calls

    def pack(self, tensors: Sequence[torch.Tensor], *, scale: float = 1.0, out: torch.Tensor | None = None,
             impl: str | None = None, into: tuple[torch.Tensor, torch.Tensor] | None = None) -> Packed:  # fmt: skip
        """Pack `tensors` (sizes and dtypes as planned) into `out[:total]` or a new bucket; see buckets.pack.
        impl: "triton" or "torch"; None: the kernels on a GPU with triton installed, else torch.
        into: (sum_sq, found_inf), 0-dim fp32 and bool tensors on the plan's device: this call's Σx² is added to
        sum_sq (one fp32 addition) and its flag ORed into found_inf, in place (on a GPU inside the launch: no
        allocation, no further kernel), and the result holds these two tensors; None: new ones."""
        ptrs, tensors = self.check(tensors)
        scale = _scale(scale)
        span = None if out is None else (out.data_ptr(), out.numel(), out.untyped_storage().nbytes())
        if into is not None:
            check_into(into, self.device)
            where = (into[0].data_ptr(), into[1].data_ptr(), span)  # (the packed tensors: at a new into or out)
            if where != self._into_checked:  # their storage (bounds, alignment, writable), once per addresses
                for t, name in zip(into, ("into[0] (sum_sq)", "into[1] (found_inf)")):
                    check_memory(t, name, written=t.device.type == "cpu")
                self._check_into_apart(into, out)
                self._into_checked = where
        if out is None:
            flat = torch.empty(self.total, dtype=self.dtype, device=self.device)
        else:  # (the storage's size in the key: one resized at the same address is checked again)
            check_out(out, self.dtype, self.total, self.device, memory=span != self._out_checked)
            self._out_checked = span  # its storage (bounds, writable) is checked once per address
            if (span, ptrs) != self._apart_checked:  # (the same bucket and addresses as the last call: still apart)
                self.check_apart(out, "out")
                self._apart_checked = (span, ptrs)
            flat = out if out.numel() == self.total else out[: self.total]
        if (impl or self.impl) == "triton":
            table, work, n_work, part, count = self._tables(ptrs)
            if into is not None:
                sum_sq, found = into
            else:  # new ones: the launch writes them (zeros where there is nothing to launch)
                new = torch.empty if n_work else torch.zeros
                sum_sq = new((), dtype=torch.float32, device=self.device)
                found = new((), dtype=torch.bool, device=self.device)
            if n_work:  # (nothing to pack: the totals gain 0 and no flag)
                self._kernels.pack(table, work, n_work, flat, scale, part, count, sum_sq, found,
                                   accumulate=into is not None)  # fmt: skip
                bump_version(flat, *(into or ()))
            return Packed(flat, self.offsets, found, sum_sq)
        packed = self._pack_host(ptrs, tensors, flat, scale, into)
        return packed if into is None else Packed(flat, self.offsets, into[1], into[0])

    def pack_step(self, tensors: Sequence[torch.Tensor], out: torch.Tensor, into: tuple[torch.Tensor, torch.Tensor],
                  scale: float = 1.0) -> None:  # fmt: skip
        """pack(tensors, scale=scale, out=out, into=into) for a caller that packs into the same buffers call after
        call (the offload step: a view of its bucket buffer, or of either landing slot under DPU, and its running
        Σg² and flag). The first call with an `out` and `into` pair (these very objects) is pack's, checks and all;
        later calls with the same pair trust it while its memory stays where it was checked (the addresses of out
        and the totals, out's storage size: else pack's checks again), and check only the tensors, as pack does, and
        out apart from them when their addresses change. Nothing is returned, and on a GPU no version counter is
        bumped (the caller's buffers are in no autograd graph). Python run inside backward's hooks costs several
        times what it costs alone (5-9x on the 2-core CPU): per bucket, what counts is how much of it runs. Not
        thread-safe (nor is pack: one plan, one caller at a time)."""
        t = next((t for t in self._trusted if t.out is out and t.into is into), None)
        if t is None or t.where != _where(out, into):
            self.pack(tensors, scale=scale, out=out, into=into)  # (raises before anything is trusted)
            if t is None:
                if len(self._trusted) >= 4:
                    del self._trusted[0]
                t = _Trusted(out, into)
                self._trusted.append(t)
            t.where, t.apart, t.key = _where(out, into), self._ptrs, None
            t.flat = out if out.numel() == self.total else out[: self.total]
            return
        ptrs, tensors = self.check(tensors)
        if t.apart is not self._ptrs:  # (check read new addresses)
            self.check_apart(out, "out")
            t.apart = self._ptrs
        scale = _scale(scale)
        if self.impl == "triton":
            table, work, n_work, part, count = self._tables(ptrs)
            if n_work:
                if t.key is None:
                    t.key = self._kernels.pack_key(table, work, n_work, t.flat, part, count, *into, True)
                self._kernels.pack(table, work, n_work, t.flat, scale, part, count, *into, accumulate=True, key=t.key)
            return
        self._pack_host(ptrs, tensors, t.flat, scale, into)

    def _check_into_apart(self, into: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None) -> None:
        """The two totals share no byte with each other, with the bucket (out[:total]) or with the tensors packed."""
        (s, f), spans = into, []
        for t, name in ((s, "into[0] (sum_sq)"), (f, "into[1] (found_inf)")):
            lo = t.data_ptr()
            spans.append((lo, lo + t.element_size(), name))
            self.check_apart(t, name)
        if spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]:
            raise ValueError("into: sum_sq and found_inf overlap in memory; each must be its own buffer")
        if out is not None:  # (the bucket: out[:total]; what lies past it is the caller's)
            lo = out.data_ptr()
            hi = lo + self.total * out.element_size()
            for a, b, name in spans:
                if a < hi and lo < b:
                    raise ValueError(f"{name} and out overlap in memory; each must be its own buffer")

    def _pack_host(self, ptrs: tuple[int, ...], tensors: Sequence[torch.Tensor], flat: torch.Tensor, scale: float,
                   into: tuple[torch.Tensor, torch.Tensor] | None) -> Packed:  # fmt: skip
        """pack's and pack_step's path without Triton (the exact C++ copy on the CPU, else torch's passes): the call's
        own result, its Σx² and flag also added into `into` when given."""
        if self.device.type == "cpu" and scale == 1.0 and self.same_dtype:
            packed = self._pack_cpu_exact(ptrs, flat)
        else:
            packed = self._pack_torch(tensors, flat, scale)
        if into is not None:
            into[0].add_(packed.sum_sq)
            into[1].logical_or_(packed.found_inf)
        return packed

    def _pack_cpu_exact(self, ptrs: tuple[int, ...], flat: torch.Tensor) -> Packed:
        """The bucket holds the values unchanged (the offload step's case): one C++ pass per tensor copies it,
        sums its squares (fp32 partials, combined in double) and flags inf/NaN."""
        isa, threads = ISAS.index(best_isa()), max(1, torch.get_num_threads())
        base, esize = flat.data_ptr(), flat.element_size()
        squares, bad = 0.0, False
        for p, n, c, o in zip(ptrs, self.numels, self.codes, self.offsets):
            if n:
                s, b = _cpu.sum_squares(p, base + o * esize, c, n, isa, threads)
                squares, bad = squares + s, bad or b
        if self.gaps:
            flat.index_fill_(0, self._gaps(), 0)
        bump_version(flat)
        return Packed(flat, self.offsets, torch.tensor(bad), torch.tensor(squares, dtype=torch.float32))

    def _pack_torch(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor, scale: float) -> Packed:
        """The multi-pass torch path: any device, any dtypes and scale; exact (rounds once, from fp32)."""
        device = self.device
        sum_sq = torch.zeros((), dtype=torch.float32, device=device)
        for t, off in zip(tensors, self.offsets):
            v = t.reshape(-1).float() * scale
            flat[off : off + t.numel()].copy_(v)
            sum_sq += v.square().sum()
        if self.gaps:
            flat.index_fill_(0, self._gaps(), 0)
        if device.type == "cpu":
            found = torch.tensor(bool(self.total) and sum_squares(flat)[1])
        else:
            found = ~torch.isfinite(flat).all() if self.total else torch.zeros((), dtype=torch.bool, device=device)
        return Packed(flat, self.offsets, found, sum_sq)

    def unpack(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], *, impl: str | None = None) -> None:
        """tensors[i] <- flat[offsets[i]:][:numels[i]], cast to tensors[i].dtype."""
        ptrs, tensors = self.check(tensors, written=True)
        if any(map(_INFERENCE, tensors)) and not torch.is_inference_mode_enabled():  # (written: refused before any)
            i = next(i for i, t in enumerate(tensors) if t.is_inference())
            _refuse_written(tensors[i], f"{self.name}[{i}]")
        if torch.is_grad_enabled() and any(map(_NEEDS_GRAD, tensors)):
            i = next(i for i, t in enumerate(tensors) if t.requires_grad)
            raise RuntimeError(f"{self.name}[{i}] requires grad: it cannot be written in place here (use "
                               f"torch.no_grad() or {self.name}[{i}].detach())")  # fmt: skip
        if self.device.type == "cpu" and not self._writable:  # new addresses: foreign memory must be writable
            for i, t in enumerate(tensors):
                check_memory(t, f"{self.name}[{i}]", written=True)
            self._writable = True
        check_float(flat, "flat")
        check_memory(flat, "flat")  # (the kernel reads flat's elements by address)
        if flat.dim() != 1 or flat.dtype not in CODE or flat.device != self.device:
            raise ValueError(f"flat must be a 1-D tensor on {self.device}, got shape {tuple(flat.shape)} on "
                             f"{flat.device}")  # fmt: skip
        if flat.numel() < self.total:
            raise ValueError(f"flat has {flat.numel()} elements, the plan's bucket {self.total}")
        self.check_apart(flat, "flat")
        if (impl or self.impl) == "triton":
            table, work, n_work, _, _ = self._tables(ptrs)
            if n_work:
                self._kernels.unpack(table, work, n_work, flat)
                bump_version(*tensors)
            return
        for t, off in zip(tensors, self.offsets):
            t.copy_(flat[off : off + t.numel()].reshape(t.shape))
