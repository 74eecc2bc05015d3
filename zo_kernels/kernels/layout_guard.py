"""One C-level call that says whether a list of tensors still has the layout a plan validated.

A launch plan checks, on every call, that its tensors have the dtypes, sizes, device and contiguity it was built
for and are not negated views: six passes over the list from Python, ~18 us for 64 tensors on a 2-core VM, most of
a pack call's host time. torch's compiler checks the same facts for its compiled graphs with one C++ call over all
the tensors (`torch._C._dynamo.guards.TensorGuards`: Python type, dispatch keys (device type, negation), dtype,
device index, requires_grad, sizes and strides). A plan builds one from tensors it has just validated; while it
answers True the tensors have that layout exactly (the same strides, so still contiguous), and only their addresses
are read. It never accepts what the full check would refuse: anything it rejects (another dtype, a view, a
subclass, a change of grad mode's keys) goes through the full check, which raises or builds a new guard.

It is torch's private API, so it is used only where a self-test of this torch passes (it accepts the same
tensors and rejects each kind of change the plan must see); elsewhere `guard` returns None and the plan keeps its
passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_WORKS: bool | None = None  # the self-test's verdict, once per process


def _make(tensors: Sequence[torch.Tensor]):
    from torch._C._dynamo.guards import TensorGuards

    # both keywords always (older torch reads them from a dict that must exist); None: static shapes
    return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)


def _self_test() -> bool:
    """The guard accepts the tensors it was built from and rejects every change a plan must refuse or re-check."""
    try:
        a, b = torch.arange(6, dtype=torch.float32), torch.zeros(4, dtype=torch.float16)
        g = _make([a, b])
        changed = [
            torch.arange(7, dtype=torch.float32)[:6].clone().reshape(2, 3),  # other sizes, same numel
            a.double(),  # dtype
            torch.arange(12, dtype=torch.float32)[::2],  # not contiguous
            torch._neg_view(a),  # negated view
            torch.nn.Parameter(a.clone()),  # subclass
            torch.empty(6, device="meta"),  # device
        ]  # fmt: skip
        return g.check(a, b) and g.check(a.clone(), b.clone()) and not any(g.check(c, b) for c in changed)
    except Exception:  # noqa: BLE001 (missing, renamed, another signature: the plan keeps its passes)
        return False


def guard(tensors: Sequence[torch.Tensor]):
    """A guard over these (validated, non-negated) tensors, or None where torch has no working one."""
    global _WORKS
    if _WORKS is None:
        _WORKS = _self_test()
    if not _WORKS:
        return None
    try:
        return _make(tensors)
    except Exception:  # noqa: BLE001
        return None
