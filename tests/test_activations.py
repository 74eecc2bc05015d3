"""zo_kernels.checkpoint (issue 21): gradients bit for bit torch.utils.checkpoint's (use_reentrant=False), checkpoints
offloaded through the GPU-shaped transport (delayed copies: a missing wait fails), constant buffers, bad arguments.

The reference is torch's own checkpoint of the same function; no zo code runs in it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import zo_kernels as zk
from zo_kernels.activations import _ALIGN, ActivationBuffers, _size_class
from zo_kernels.transport import CopyEngineTransport, HostTransport

WIDTH = 48


class Block(torch.nn.Module):
    """A residual MLP block with dropout (RNG), a non-tensor argument and a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, scale: float = 1.0, *, p: float = 0.1) -> torch.Tensor:
        return x + scale * self.down(F.dropout(F.gelu(self.up(x)), p=p, training=True))


def blocks(n: int = 4) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(Block() for _ in range(n))


def run(model: torch.nn.ModuleList, ck, x0: torch.Tensor, **call) -> list[torch.Tensor]:
    """Forward through every block under `ck`, backward of a loss; the grads of every param and of the input."""
    for q in model.parameters():
        q.grad = None
    x = x0.detach().clone().requires_grad_()
    torch.manual_seed(1)
    h = x
    for b in model:
        h = ck(b, h, **call)
    (h * h).sum().backward()
    return [q.grad.clone() for q in model.parameters()] + [x.grad.clone()]


def torch_ck(fn, *args, **kwargs):
    return torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"grad {i} differs: max err {(a - b).abs().max()}"


def x_input(batch: int = 6) -> torch.Tensor:
    return torch.randn(batch, 5, WIDTH, generator=torch.Generator().manual_seed(2))


@pytest.fixture
def engine():
    tr = CopyEngineTransport(delay_s=0.002)
    yield tr
    tr.close()


@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("segments", [1, 4])
def test_gradients_bitwise_equal_torch_checkpoint(engine, offload, segments):
    """One and several segments, dropout (RNG restored as torch does), a non-tensor arg and a kwarg."""
    model, x = blocks(segments), x_input()
    want = run(model, torch_ck, x, scale=0.5, p=0.2)
    buf = ActivationBuffers("cpu", engine)
    ck = functools.partial(zk.checkpoint, offload=offload, buffers=buf)
    for _ in range(2):  # a second step reuses the blocks of the first
        same(run(model, ck, x, scale=0.5, p=0.2), want)
    assert not torch.equal(run(model, torch_ck, x, scale=0.5, p=0.0)[0], want[0]), "dropout had no effect"


def test_tuple_outputs_and_several_tensor_args(engine):
    """A segment taking two activations and a mask (int, kept by reference) and returning a tuple."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(WIDTH, WIDTH)

    def seg(a, b, mask, flag):
        y = F.dropout(lin(a) * b.sigmoid(), p=0.3, training=flag)
        return y.masked_fill(mask, 0.0), a - b

    a0, b0 = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    mask = torch.zeros(4, WIDTH, dtype=torch.bool)
    mask[:, ::3] = True

    def grads(ck):
        lin.zero_grad(set_to_none=True)
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        torch.manual_seed(5)
        for _ in range(3):
            a, b = ck(seg, a * 1.0, b * 1.0, mask, True)
        (a.square().sum() + b.sum()).backward()
        return [lin.weight.grad, lin.bias.grad]

    same(grads(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine))), grads(torch_ck))


def test_an_activation_passed_by_keyword_is_offloaded(engine):
    """HF's layers pass the activation by name (`hidden_states=`): a keyword tensor that needs a gradient is offloaded
    like a positional one (three D2H copies of its size for four segments: the newest stays), a float table that
    needs none is kept by reference (not copied once per segment), torch's own keywords (`determinism_check`) still
    reach torch's checkpoint; the gradients are torch's bit for bit."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(WIDTH, WIDTH)
    table = torch.randn(WIDTH)  # a constant passed to every layer (position table, additive mask)
    copied = []
    d2h = engine.d2h
    engine.d2h = lambda dst, src: (copied.append(src.numel()), d2h(dst, src))[1]

    def layer(*, hidden_states, table):
        return hidden_states + F.dropout(lin(hidden_states), p=0.2, training=True) * table

    x0 = torch.randn(3, 5, WIDTH)

    def grads(ck):
        lin.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        torch.manual_seed(7)
        h = x
        for _ in range(4):
            h = ck(layer, hidden_states=h, table=table, determinism_check="default")
        h.square().sum().backward()
        return [lin.weight.grad, lin.bias.grad, x.grad]

    want = grads(torch_ck)
    same(grads(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine))), want)
    assert copied == [x0.numel()] * 3, copied


def test_a_tensor_given_to_many_segments_is_copied_once(engine):
    """An encoder's output passed to every decoder layer, by keyword (BART's key_value_states) or by position: the
    first segment checkpoints it, the later ones keep it by reference (it lives on anyway): one D2H copy of it, not
    one per layer; the gradients are torch's bit for bit."""
    torch.manual_seed(0)
    lin, cross = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    copied = []
    d2h = engine.d2h
    engine.d2h = lambda dst, src: (copied.append(src.numel()), d2h(dst, src))[1]

    def by_keyword(h, *, memory):
        return h + lin(h) * cross(memory).mean(1, keepdim=True).sigmoid()

    def by_position(h, memory):
        return by_keyword(h, memory=memory)

    x0, m0 = torch.randn(3, 4, WIDTH), torch.randn(3, 6, WIDTH)

    def grads(ck, keyword):
        lin.zero_grad(set_to_none=True)
        cross.zero_grad(set_to_none=True)
        x, m = x0.clone().requires_grad_(), m0.clone().requires_grad_()
        memory = m * 2.0  # an activation: it needs a gradient
        h = x
        for _ in range(4):
            h = ck(by_keyword, h, memory=memory) if keyword else ck(by_position, h, memory)
        h.sum().backward()
        return [lin.weight.grad, cross.weight.grad, x.grad, m.grad]

    for keyword in (True, False):
        want = grads(torch_ck, keyword)
        copied.clear()
        same(grads(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine)), keyword), want)
        assert sorted(copied) == sorted([x0.numel()] * 3 + [m0.numel()]), (keyword, copied)


def test_keyword_tensors_off_the_buffers_device_or_without_buffers_stay_torchs():
    """Keyword tensors do not change which calls are refused: one on the CPU with no buffers falls back to torch's
    checkpoint (as before keyword activations were offloaded), one on another device than the buffers' is kept
    by reference."""
    lin = torch.nn.Linear(WIDTH, WIDTH)

    def f(ids, *, hidden_states):
        return lin(hidden_states) * ids.float().mean()

    ids, h = torch.ones(2, dtype=torch.long), torch.randn(2, WIDTH, requires_grad=True)
    want = torch.autograd.grad(torch_ck(f, ids, hidden_states=h).sum(), h)[0]
    assert torch.equal(torch.autograd.grad(zk.checkpoint(f, ids, hidden_states=h).sum(), h)[0], want)
    meta = ActivationBuffers("cpu", HostTransport())
    meta.device = torch.device("meta")  # (a buffers object for another device, without one to allocate on)
    assert torch.equal(torch.autograd.grad(zk.checkpoint(f, ids, hidden_states=h, buffers=meta).sum(), h)[0], want)


def test_one_tensor_passed_twice_is_one_checkpoint_and_one_tensor_again(engine):
    """Self-attention passes one tensor as query, key and value, and nn.MultiheadAttention takes its fused path
    when `query is key`: the checkpoint keeps that tensor once (one D2H copy per segment, not three) and gives the
    same tensor back in every place, in forward and in the recomputation, so the gradients are torch's bit for bit."""
    torch.manual_seed(0)
    attn = torch.nn.MultiheadAttention(WIDTH, 2, batch_first=True)
    paths = []
    copied = []
    d2h = engine.d2h
    engine.d2h = lambda dst, src: (copied.append(src.numel()), d2h(dst, src))[1]

    def layer(q, k, v):
        paths.append(q is k is v)
        return q + attn(q, k, v, need_weights=False)[0]

    x0 = torch.randn(3, 5, WIDTH)

    def grads(ck):
        attn.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        h = x
        for _ in range(3):
            h = ck(layer, h, h, h)
        h.square().sum().backward()
        return [p.grad for p in attn.parameters()] + [x.grad]

    want = grads(torch_ck)
    paths.clear()
    same(grads(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine))), want)
    assert paths == [True] * 6, paths  # 3 forwards, 3 recomputations: one tensor in all three places
    assert copied == [x0.numel()] * 2, copied  # 3 segments, the newest kept: 2 copies, each of one tensor


def test_an_argument_changed_in_place_inside_the_function_is_named(engine):
    """The function must leave its tensor arguments unchanged (the checkpoint is the argument as passed): changing
    one in place, positional or keyword, raises saying so, not autograd's words about an internal view."""
    lin = torch.nn.Linear(WIDTH, WIDTH)

    def positional(x):
        x.add_(1.0)
        return lin(x)

    def keyword(x, *, h):
        h.mul_(2.0)
        return lin(h) + x

    ck = functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine))
    a = torch.randn(2, WIDTH, requires_grad=True)
    for call in (lambda: ck(positional, a * 1.0), lambda: ck(keyword, a, h=a * 1.0)):
        with pytest.raises(RuntimeError, match="modified one of its tensor arguments in place"):
            call()


def test_an_input_that_needs_no_grad(engine):
    model, x = blocks(3), x_input()

    def grads(ck):
        for q in model.parameters():
            q.grad = None
        torch.manual_seed(1)
        h = x
        for b in model:
            h = ck(b, h)
        h.sum().backward()
        return [q.grad.clone() for q in model.parameters()]

    same(grads(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine))), grads(torch_ck))


def test_no_allocation_per_step_and_two_checkpoints_in_flight(engine):
    """After the first step the device and host blocks are reused: the allocation counters stay put, with the
    cyclic garbage collector off (nothing waits for it). Offloaded, six segments need two device slots."""
    model, x = blocks(6), x_input()
    want = run(model, torch_ck, x)
    buf = ActivationBuffers("cpu", engine)
    ck = functools.partial(zk.checkpoint, buffers=buf)
    gc.disable()
    try:
        same(run(model, ck, x), want)
        first = (buf.device_allocations, buf.host_allocations, engine.pool.reserved)
        for _ in range(3):
            same(run(model, ck, x), want)
        assert (buf.device_allocations, buf.host_allocations, engine.pool.reserved) == first
    finally:
        gc.enable()
    assert buf.device_allocations == 2, "one slot being recomputed, one being prefetched"
    assert buf.host_allocations == 5, "the newest segment's checkpoint stays on the device: backward needs it first"
    resident = ActivationBuffers("cpu", engine)
    run(model, functools.partial(zk.checkpoint, offload=False, buffers=resident), x)
    n = resident.device_allocations
    run(model, functools.partial(zk.checkpoint, offload=False, buffers=resident), x)
    assert resident.device_allocations == n == 6 and resident.host_allocations == 0


def test_batches_of_varying_length_reuse_host_blocks_by_size_class():
    """A bug hunt's find: the pool reuses host blocks of one size only, so every new batch length (a collator's
    dynamic padding) added a block per offloaded checkpoint: 171 blocks for lengths 1..57 over 4 blocks. A block is
    of its size class now (a quarter octave: at most 25% over): at most 3 x the classes spanned; gradients as
    torch's checkpoint."""
    model = blocks(4)
    tr = CopyEngineTransport()
    buf = ActivationBuffers("cpu", tr)
    ck = functools.partial(zk.checkpoint, buffers=buf)
    try:
        for seq in range(1, 58):
            x = torch.randn(6, seq, WIDTH, generator=torch.Generator().manual_seed(seq))
            same(run(model, ck, x), run(model, torch_ck, x))
        classes = {_size_class(6 * seq * WIDTH * 4) for seq in range(1, 58)}
        assert all(n <= _size_class(n) <= max(512, 1.25 * n) and _size_class(n) % 64 == 0 for n in range(1, 80_000))
        assert buf.host_allocations <= 3 * len(classes) < 3 * 57, buf.host_allocations
    finally:
        tr.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reserve_for_covers_checkpoints_of_any_dtype_and_small_sizes(dtype):
    """reserve() takes host blocks as fp16 of the given bytes: with blocks of a size class, the class is of the
    bytes (an element-count class made a 400-byte fp16 block 512 bytes and a 400-byte fp32 one 1024: the reserve
    missed). After reserve_for, a step allocates nothing."""
    tr = CopyEngineTransport()
    try:
        for hidden in (5, 48, 300):
            model = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(4)).to(dtype)
            buf = ActivationBuffers("cpu", tr)
            buf.reserve_for(5, 2, hidden, 4, dtype=dtype)
            before = buf.allocations
            x = torch.randn(2, 5, hidden, dtype=dtype, requires_grad=True)
            h = x
            for b in model:
                h = zk.checkpoint(b, h, buffers=buf)
            h.float().sum().backward()
            assert buf.allocations == before, (hidden, dtype)
    finally:
        tr.close()


def test_reserve_allocates_up_front(engine):
    model, x = blocks(4), x_input()
    want = run(model, torch_ck, x)
    nbytes = x.numel() * x.element_size()
    buf = ActivationBuffers("cpu", engine)
    buf.reserve([nbytes] * 2, [nbytes] * 4)
    before = buf.allocations
    run(model, functools.partial(zk.checkpoint, buffers=buf), x)
    assert buf.allocations == before == 6
    for offload in (True, False):  # the planner's sizes: a step after reserve_for allocates nothing
        tr = CopyEngineTransport()  # a pool of its own: host_allocations counts this pool's growth
        planned = ActivationBuffers("cpu", tr)
        planned.reserve_for(5, 6, WIDTH, 4, dtype=torch.float32, offload=offload)
        before = (planned.device_allocations, planned.host_allocations, tr.pool.reserved)
        assert before[:2] == ((2, 3) if offload else (4, 0))
        same(run(model, functools.partial(zk.checkpoint, offload=offload, buffers=planned), x), want)
        assert (planned.device_allocations, planned.host_allocations, tr.pool.reserved) == before
        tr.close()
    tr = CopyEngineTransport()  # two segments per layer: 4 layers' worth for 8 segments
    planned = ActivationBuffers("cpu", tr)
    planned.reserve_for(5, 6, WIDTH, 4, dtype=torch.float32, segments=2)
    before = (planned.device_allocations, planned.host_allocations, tr.pool.reserved)
    assert before[:2] == (2, 7)
    run(blocks(8), functools.partial(zk.checkpoint, buffers=planned), x)
    assert (planned.device_allocations, planned.host_allocations, tr.pool.reserved) == before
    tr.close()
    sh = zk.planner.ActivationShape(seq=5, batch=6, hidden=WIDTH, layers=4)
    assert sh.checkpoint_bytes() == x.numel() * 2  # 16-bit: the planner counts what reserve_for(bf16) reserves
    half = ActivationBuffers("cpu", engine)  # bf16 checkpoints of an odd element count: exact byte counts
    y = torch.randn(3, 7, WIDTH + 1, dtype=torch.bfloat16)
    half.reserve([], [y.numel() * 2])
    lin = torch.nn.Linear(WIDTH + 1, WIDTH + 1).to(torch.bfloat16)
    h = y.requires_grad_()
    for _ in range(2):
        h = zk.checkpoint(lin, h, buffers=half)
    h.sum().backward()
    assert half.host_allocations == 1 and half.device_allocations == 1


def test_the_previous_segment_is_prefetched_while_this_one_recomputes(engine):
    """The H2D copy of segment k-1 is queued when segment k starts recomputing, before segment k's backward; the
    newest segment, recomputed first, kept its checkpoint on the device (no H2D copy to wait for)."""
    log = []
    engine.h2d = (lambda h2d: lambda dst, src: (log.append(("h2d", src.data_ptr())), h2d(dst, src))[1])(engine.h2d)
    buf = ActivationBuffers("cpu", engine)
    model, x = blocks(3), x_input()
    for i, b in enumerate(model):
        b.up.register_full_backward_hook(lambda m, gi, go, i=i: log.append(("backward", i)))
    run(model, functools.partial(zk.checkpoint, buffers=buf), x)
    kinds = [k if k == "h2d" else f"b{i}" for k, i in log]
    assert kinds == ["h2d", "b2", "h2d", "b1", "b0"], kinds


def test_one_backward_copies_every_checkpoint_but_the_newest_once_each_way(engine):
    """Per step of six segments and one backward: five D2H copies and five H2D copies (the newest segment's input is
    read where it was made, never copied); with retain_graph the first backward sends it down too (a second may
    need it) and the second brings it back."""
    counts = {"d2h": 0, "h2d": 0}
    for kind in counts:
        setattr(engine, kind, (lambda f, k: lambda dst, src: (counts.__setitem__(k, counts[k] + 1), f(dst, src))[1])(
            getattr(engine, kind), kind))
    model, x = blocks(6), x_input()
    ck = functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine))
    for _ in range(2):
        counts.update(d2h=0, h2d=0)
        run(model, ck, x)
        assert counts == {"d2h": 5, "h2d": 5}, counts
    counts.update(d2h=0, h2d=0)
    torch.manual_seed(1)
    h = x.clone().requires_grad_()
    for b in model:
        h = ck(b, h)
    h.sum().backward(retain_graph=True)
    assert counts == {"d2h": 6, "h2d": 5}, counts
    h.square().sum().backward()
    assert counts == {"d2h": 6, "h2d": 11}, counts

def test_a_graphless_forward_in_between_leaves_the_held_checkpoint_on_the_device(engine):
    """A checkpointed forward that builds no graph (a frozen teacher on an input without grad) between a forward and
    its backward is never recomputed: the pending graph's newest checkpoint stays on the device (no copy down and
    back up), and the gradients are torch's."""
    log = []

    def logged(name: str):
        copy = getattr(engine, name)
        return lambda dst, src: (log.append(name), copy(dst, src))[1]

    engine.h2d, engine.d2h = logged("h2d"), logged("d2h")
    buf = ActivationBuffers("cpu", engine)
    model, x = blocks(3), x_input()
    teacher = blocks(1)[0].requires_grad_(False)

    def ck(b, h):
        out = zk.checkpoint(b, h, buffers=buf)
        if b is model[-1]:  # after the last block, before backward
            zk.checkpoint(teacher, x, buffers=buf)
        return out

    want = run(model, torch_ck, x)
    same(run(model, ck, x), want)
    assert log.count("d2h") == 2 and log.count("h2d") == 2, log  # the teacher's made none, nor sent one down


def test_a_missing_device_wait_is_caught():
    """The recomputation reads the device slot before its delayed H2D copy has landed: gradients differ."""
    model, x = blocks(4), x_input()
    want = run(model, torch_ck, x)
    tr = CopyEngineTransport(delay_s=0.05)
    tr.device_wait = lambda event: None  # a deliberately broken consumer
    try:
        got = run(model, functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", tr)), x)
    finally:
        tr.close()
    with pytest.raises(AssertionError, match="differs"):
        same(got, want)


def test_a_prefetch_is_ordered_after_the_checkpoints_d2h_copy_not_waited_for():
    """Two copy engines, as a GPU's two copy streams, the D2H copies slow: the prefetch's H2D copy reads the host
    block only once the D2H copy into it is done (transport.h2d_after), and the host does not wait for that D2H
    copy (no host wait inside a prefetch). Without the ordering the H2D copy reads the block before it is written:
    the gradients differ."""
    model, x = blocks(4), x_input()
    want = run(model, torch_ck, x)

    def offloaded(ordered: bool) -> tuple[list[torch.Tensor], list]:
        tr = CopyEngineTransport(delay_s=lambda dst, src: 0.05 if tr.pool.holds(dst) else 0.0)  # (D2H: dst pinned)
        assert tr.engines == 2
        if not ordered:
            tr.h2d_after = lambda events: None  # a deliberately broken producer
        d2h, waited = [], []
        tr.d2h = lambda dst, src, copy=tr.d2h: (d2h.append(copy(dst, src)), d2h[-1])[1]
        tr.wait = lambda event, wait=tr.wait: (waited.append(event), wait(event))[1]
        try:
            got = run(model, functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", tr)), x)
            return got, [ev for ev in waited if any(ev is e for e in d2h)]
        finally:
            tr.close()

    got, host_waited_for_d2h = offloaded(True)
    same(got, want)
    assert not host_waited_for_d2h  # (3 checkpoints went to the host: it waited for each in its prefetch before)
    broken, _ = offloaded(False)
    with pytest.raises(AssertionError, match="differs"):
        same(broken, want)


def test_a_dropped_prefetch_does_not_land_in_a_reused_block():
    """A graph dropped between a segment's prefetch and its restore (torch.autograd.grad into the segment after it;
    an error in backward) gives the segment's device block back while its H2D copy may still run. The next user of
    the block, here a resident checkpoint on the same buffers (default_buffers serves both modes), waits for that
    copy: it landed over the resident checkpoint before, and the gradients differed."""
    gate = threading.Event()
    tr = CopyEngineTransport(delay_s=lambda dst, src: 0.0 if not tr.pool.holds(src) else (gate.wait(30), 0.0)[1])
    buf = ActivationBuffers("cpu", tr)
    model = blocks(3)
    want = run(model, torch_ck, x_input())
    torch.manual_seed(1)
    outs = [x_input().requires_grad_()]
    for b in model:
        outs.append(zk.checkpoint(b, outs[-1], buffers=buf))
    torch.autograd.grad(outs[3].sum(), outs[2])  # recomputes segment 3, prefetches segment 2, never restores it
    del outs
    gc.collect()
    wait = tr.device_wait
    tr.device_wait = lambda event: (gate.set(), wait(event))[1]  # a consumer waiting for the stale copy lets it run
    for q in model.parameters():
        q.grad = None
    x = x_input().requires_grad_()
    torch.manual_seed(1)
    h = x
    for b in model:
        h = zk.checkpoint(b, h, offload=False, buffers=buf)
    gate.set()  # else it runs now, after the resident checkpoints were stored
    tr.synchronize()
    (h * h).sum().backward()
    tr.close()
    same([q.grad.clone() for q in model.parameters()] + [x.grad.clone()], want)

@pytest.mark.parametrize("offload", [True, False])
def test_nested_checkpoints(engine, offload):
    """A checkpoint inside a checkpoint (torch supports nesting): the inner one runs again in the recomputation."""
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    x0 = x_input(3)

    def grads(ck):
        l1.zero_grad(set_to_none=True)
        l2.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()

        def outer(h):
            return ck(lambda t: torch.tanh(l2(t)), F.dropout(torch.relu(l1(h)), p=0.2))

        torch.manual_seed(4)
        y = ck(outer, ck(outer, x))
        y.square().sum().backward()
        return [l1.weight.grad, l2.weight.grad, x.grad]

    buf = ActivationBuffers("cpu", engine)
    same(grads(lambda f, *a: zk.checkpoint(f, *a, offload=offload, buffers=buf)), grads(torch_ck))


def test_retain_graph_and_a_second_backward(engine):
    model, x0 = blocks(3), x_input()

    def twice(ck):
        for q in model.parameters():
            q.grad = None
        torch.manual_seed(1)
        h = x0
        for b in model:
            h = ck(b, h)
        h.sum().backward(retain_graph=True)
        h.square().sum().backward()
        return [q.grad.clone() for q in model.parameters()]

    same(twice(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine))), twice(torch_ck))


def _forward(model, ck, seed: int, requires_grad: bool = True) -> torch.Tensor:
    torch.manual_seed(seed)
    h = x_input().requires_grad_(requires_grad)
    for b in model:
        h = ck(b, h)
    return h


def _grads(model) -> list[torch.Tensor]:
    out = [q.grad.clone() for q in model.parameters()]
    for q in model.parameters():
        q.grad = None
    return out


def _two_forwards_then_backwards(model, ck, order):
    """Two graphs alive at once: the second forward sends the first one's held checkpoint to the host."""
    outs = [_forward(model, ck, 10 + k) for k in range(2)]
    grads = []
    for k in order:
        outs[k].square().sum().backward()
        grads += _grads(model)
    return grads


def _three_backwards(model, ck):
    """retain_graph: the held checkpoint goes to the host in the first backward; the next two restore it from there."""
    h = _forward(model, ck, 1)
    grads = []
    for i in range(3):
        (h.square() * (i + 1)).sum().backward(retain_graph=i < 2)
        grads += _grads(model)
    return grads


def _a_graphless_forward_in_between(model, ck):
    """A checkpointed forward that builds no graph (frozen weights, an input without grad: a teacher) between a
    forward and its backward, a graph dropped without backward and an evaluation under no_grad."""
    h = _forward(model, ck, 1)
    _forward(model, ck, 5).sum().backward()  # dropped after its own backward
    _grads(model)
    dropped = _forward(model, ck, 6)
    del dropped
    with torch.no_grad():  # an evaluation
        _forward(model, ck, 7, requires_grad=False)
    for q in model.parameters():
        q.requires_grad_(False)
    teacher = _forward(model, ck, 2, requires_grad=False)
    for q in model.parameters():
        q.requires_grad_(True)
    (h.square().sum() + (teacher * h).sum()).backward()
    return _grads(model)


def _two_buffers_interleaved(model, ck, ck2):
    torch.manual_seed(1)
    h = x_input().requires_grad_()
    for i, b in enumerate(model):
        h = (ck if i % 2 else ck2)(b, h)
    h.square().sum().backward()
    return _grads(model)


LIFECYCLES = {
    "two_forwards_backward_in_order": lambda m, ck, ck2: _two_forwards_then_backwards(m, ck, [0, 1]),
    "two_forwards_backward_newest_first": lambda m, ck, ck2: _two_forwards_then_backwards(m, ck, [1, 0]),
    "retain_graph_three_backwards": lambda m, ck, ck2: _three_backwards(m, ck),
    "graphless_forward_between": lambda m, ck, ck2: _a_graphless_forward_in_between(m, ck),
    "two_buffers_interleaved": _two_buffers_interleaved,
}


@pytest.mark.parametrize("lifecycle", list(LIFECYCLES))
def test_lifecycles_around_the_held_checkpoint(engine, lifecycle):
    """The newest segment's checkpoint stays on the device (held) until another segment is stored: graphs that
    overlap, backward several times, a forward building no graph in between, two buffers at once. Gradients bit for
    bit torch's checkpoint's, twice (the second time on reused blocks)."""
    model = blocks(3)
    want = LIFECYCLES[lifecycle](model, torch_ck, torch_ck)
    buf, buf2 = ActivationBuffers("cpu", engine), ActivationBuffers("cpu", engine)
    ck, ck2 = (functools.partial(zk.checkpoint, buffers=b) for b in (buf, buf2))
    for _ in range(2):
        same(LIFECYCLES[lifecycle](model, ck, ck2), want)
    assert buf.host_allocations + buf2.host_allocations > 0, "checkpoints went to the host"


def test_nested_checkpoints_backward_three_times(engine):
    """Nested checkpoints (the inner ones held in turn, recomputed inside the outer recomputation) and
    retain_graph: three backwards, gradients bit for bit torch's."""
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    x0 = x_input(3)

    def grads(ck):
        x = x0.clone().requires_grad_()

        def outer(h):
            return ck(lambda t: torch.tanh(l2(t)), F.dropout(torch.relu(l1(h)), p=0.2))

        torch.manual_seed(4)
        y = ck(outer, ck(outer, x))
        out = []
        for i in range(3):
            (y.square() * (i + 1)).sum().backward(retain_graph=i < 2)
            out += [l1.weight.grad.clone(), l2.weight.grad.clone(), x.grad.clone()]
            l1.zero_grad(set_to_none=True)
            l2.zero_grad(set_to_none=True)
        return out

    buf = ActivationBuffers("cpu", engine)
    same(grads(lambda f, *a: zk.checkpoint(f, *a, buffers=buf)), grads(torch_ck))

@pytest.mark.parametrize("changed", ["newest_input", "older_input", "after_its_copy", "through_its_base"])
def test_an_argument_changed_in_place_after_the_call_is_refused_at_backward(engine, changed):
    """torch's checkpoint refuses, at backward, an argument changed in place after the call (it saves the inputs).
    The held checkpoint is read at backward, and an older one is copied to the host when the next segment is stored:
    a change before then would give other gradients silently (it did: no error). An error as torch's instead. A
    change after that copy was queued raced with it (a bug hunt's find: other gradients, no error): refused at
    backward too, while the argument lives."""
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def backward(ck):
        base = x_input(2).requires_grad_() * 1.0
        x = base.view(-1, WIDTH)  # (its base lives on when x is gone)
        y = ck(lambda t: torch.tanh(l1(t)), x)
        if changed == "older_input":  # before the next segment sends x to the host
            with torch.no_grad():
                x.mul_(3.0)
        if changed == "through_its_base":  # the argument itself gone, its base changed before its copy
            del x
            with torch.no_grad():
                base.mul_(3.0)
        z = ck(lambda t: torch.tanh(l2(t)), y)
        if changed == "newest_input":  # y stays on the device (held) until backward reads it
            with torch.no_grad():
                y.mul_(3.0)
        if changed == "after_its_copy":  # x's copy to the host is queued (z's segment was stored)
            with torch.no_grad():
                x.mul_(3.0)
        z.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        backward(torch_ck)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        backward(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine)))

def test_plain_cpu_transport_and_no_grad():
    model, x = blocks(2), x_input()
    buf = ActivationBuffers("cpu", HostTransport())
    want = run(model, torch_ck, x)
    same(run(model, functools.partial(zk.checkpoint, buffers=buf), x), want)
    same(run(model, functools.partial(zk.checkpoint, offload=False), x), want)  # default buffers of the CPU
    with torch.no_grad():
        torch.manual_seed(1)
        y = zk.checkpoint(model[0], x, buffers=buf)
        torch.manual_seed(1)
        assert torch.equal(y, model[0](x))
    assert buf.allocations == 2  # the first block's input on the host and back; nothing stored under no_grad


def test_torch_compile_falls_back_to_eager(engine):
    """zk.checkpoint is a graph break for dynamo: the compiled model runs it eagerly, with torch's gradients."""
    model, x = blocks(2), x_input()
    buf = ActivationBuffers("cpu", engine)

    class Net(torch.nn.Module):
        def __init__(self, ck):
            super().__init__()
            self.blocks, self.ck = model, ck

        def forward(self, h):
            for b in self.blocks:
                h = self.ck(b, h)
            return h

    def grads(net):
        for q in model.parameters():
            q.grad = None
        torch.manual_seed(1)
        net(x.clone().requires_grad_()).sum().backward()
        return [q.grad.clone() for q in model.parameters()]

    torch._dynamo.reset()
    compiled = torch.compile(Net(functools.partial(zk.checkpoint, buffers=buf)), backend="eager")
    same(grads(compiled), grads(Net(torch_ck)))
    assert buf.allocations > 0, "the offloaded path ran"


def test_bad_arguments_are_refused_before_anything_changes(engine):
    buf = ActivationBuffers("cpu", engine)
    x = torch.randn(3, WIDTH, requires_grad=True)
    lin = torch.nn.Linear(WIDTH, WIDTH)
    before = (x.detach().clone(), buf.allocations, engine.pool.reserved)
    cases = [
        (TypeError, "function must be callable", lambda: zk.checkpoint(3, x, buffers=buf)),
        (TypeError, "offload must be a bool", lambda: zk.checkpoint(lin, x, offload="yes", buffers=buf)),
        (ValueError, "use_reentrant", lambda: zk.checkpoint(lin, x, use_reentrant=True, buffers=buf)),
        (TypeError, "buffers must be an ActivationBuffers", lambda: zk.checkpoint(lin, x, buffers=engine)),
        (ValueError, "needs CUDA tensors.*CopyEngineTransport", lambda: zk.checkpoint(lin, x)),
        (ValueError, "determinism_check", lambda: zk.checkpoint(lin, x, buffers=buf, determinism_check="bad")),
        (TypeError, "transport must be", lambda: ActivationBuffers("cpu", transport="fast")),
        (ValueError, "device must be", lambda: ActivationBuffers("meta")),
        (ValueError, "device_blocks", lambda: buf.reserve([-1])),
        (ValueError, "host_blocks: checkpoints are 16- or 32-bit", lambda: buf.reserve([], [3])),
        (ValueError, "seq must be an int >= 1", lambda: buf.reserve_for(0, 1, WIDTH, 2)),
        (ValueError, "segments must be an int >= 1", lambda: buf.reserve_for(4, 1, WIDTH, 2, segments=0)),
        (TypeError, "dtype must be", lambda: buf.reserve_for(4, 1, WIDTH, 2, dtype=torch.int64)),
        (TypeError, "offload must be a bool", lambda: buf.reserve_for(4, 1, WIDTH, 2, offload="no")),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
    assert torch.equal(x.detach(), before[0]) and (buf.allocations, engine.pool.reserved) == before[1:]
    assert x.grad is None and lin.weight.grad is None


# ---------------------------------------------------------------------- HF models with ZeroOffloadAdamW stage 3


def _hf_run(arch: str, func) -> tuple[list[float], dict, dict]:
    from clients_util import MODELS, enable_checkpointing, group, lm_loss, token_batches, train

    model = MODELS[arch](0)
    enable_checkpointing(model, False)
    if func is not None:  # the documented way to put zo's checkpoint in an HF model
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    opt = zk.ZeroOffloadAdamW(model, lr=3e-3, dtype=torch.bfloat16, max_grad_norm=1.0, bucket_numel=20_000,
                              stage=3, offload_param="cpu")  # fmt: skip
    losses, _ = train(model, opt, group(token_batches(6), 2), lm_loss)
    sd = opt.state_dict()
    opt.close()  # the model keeps its parameters, whole
    return losses, sd, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_stage3_offload_param_with_offloaded_activations(arch, engine):
    """HF GPT-2 and Llama (tiny, random weights), bf16, clipping, 2 micro-batches, ZeroOffloadAdamW stage 3 with
    the shards in host memory: zo's offloaded checkpoint trains bit for bit like torch's checkpoint."""
    pytest.importorskip("transformers")
    want = _hf_run(arch, None)
    buf = ActivationBuffers("cpu", engine)
    got = _hf_run(arch, functools.partial(zk.checkpoint, buffers=buf))
    assert buf.host_allocations == 1, "the first layer's input went to the host, the last one's stayed"
    assert got[0] == want[0], f"{arch}: losses {got[0]} vs {want[0]}"
    for i, st in want[1]["state"].items():
        for k, v in st.items():
            assert torch.equal(got[1]["state"][i][k], v), f"{arch}: param {i} {k}"
    for k, v in want[2].items():
        assert torch.equal(got[2][k], v), f"{arch}: model.{k}"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_attention_and_mlp_checkpointed_apart(arch, engine):
    """The README's recipe for finer segments in an HF model: torch's apply_activation_checkpointing around each
    attention and MLP module with zo's checkpoint as its checkpoint_fn. Gradients bit for bit those of torch's
    checkpoint_wrapper around the same modules; every segment's input but the newest goes to the host (Llama passes
    the attention's `hidden_states` by keyword, GPT-2 by position)."""
    pytest.importorskip("transformers")
    from clients_util import MODELS, lm_loss, token_batches
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    copied = []
    d2h = engine.d2h
    engine.d2h = lambda dst, src: (copied.append(src.numel()), d2h(dst, src))[1]
    ids = token_batches(1)[0]
    grads = {}
    for name in ("torch", "zo"):
        model = MODELS[arch](0)
        kinds = tuple({type(m) for n, m in model.named_modules() if n.endswith(("self_attn", ".attn", ".mlp"))})
        assert len(kinds) == 2, kinds
        wrap = checkpoint_wrapper
        if name == "zo":
            ck = functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine))
            wrap = functools.partial(checkpoint_wrapper, checkpoint_fn=ck)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap, check_fn=lambda m, k=kinds: isinstance(m, k))
        torch.manual_seed(0)
        lm_loss(model, ids).backward()
        grads[name] = [p.grad for p in model.parameters()]
    same(grads["zo"], grads["torch"])
    width = model.config.hidden_size
    assert copied == [ids.numel() * width] * 3, copied  # 2 layers x (attention, MLP): 4 segments, the newest stays


# ---------------------------------------------------------------------- the benchmark script, and CUDA


def test_activation_rows_script_runs_on_the_cpu(tmp_path):
    """bench/activation_rows.py, tiny, device = CPU: a row per provider, zo's with zero checkpoint allocations."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import activation_rows

    out = tmp_path / "activations.json"
    argv = [str(out), "--device", "cpu", "--layers", "3", "--hidden", "32", "--heads", "2", "--seq", "16",
            "--rounds", "1", "--profile", "--host-rounds", "1", "--wide", "2,64,2,1,32"]  # fmt: skip
    assert activation_rows.main(argv) == 0
    everything = json.loads(out.read_text())
    rows = {r["provider"]: r for r in everything if r.get("shape") == "main"}
    assert list(rows) == list(activation_rows.PROVIDERS) and all("step_ms" in r for r in rows.values()), rows
    wide = {r["provider"]: r for r in everything if r.get("shape") == "wide"}  # the second shape: timed only
    assert list(wide) == list(activation_rows.PROVIDERS) and all("step_ms" in r for r in wide.values()), wide
    assert wide["zo"]["hidden"] == 64 and wide["zo"]["seq"] == 32 and wide["torch"]["step_vs_torch_checkpoint"] == 1
    assert all("profile" not in r and "longest_seq" not in r for r in wide.values())
    host = [r for r in everything if r["provider"] == "host_overhead"]
    assert len(host) == 1 and set(host[0]["us_per_block"]) == set(activation_rows.HOST_PROVIDERS)
    assert all(v > 0 for v in host[0]["us_per_block"].values())
    assert host[0]["zo_over_torch_us"] == host[0]["us_per_block"]["zo"] - host[0]["us_per_block"]["torch"]
    prof = host[0]["profiled_top_us_per_block"]  # where the host time goes: zo's own functions apart
    assert prof["torch"]["zo_kernels_us"] == 0 and prof["zo"]["zo_kernels_us"] > 0
    assert any("activations.py" in name for name, _ in prof["zo"]["zo_kernels"]), prof["zo"]
    assert "device = CPU" in rows["zo"]["device"]
    for r in rows.values():  # the host's parts of a step: each within the step (medians: not a sum)
        assert all(0 <= r[k] <= r["step_ms"] for k in ("host_forward_ms", "host_backward_ms", "final_sync_ms")), r
    for name in ("zo", "zo_half", "zo_resident"):  # GPU-shaped copies: the host blocks on them (on the CPU the
        assert rows[name]["host_copy_wait_ms"] >= 0 and "host_copy_waits" in rows[name]  # device is the host)
    assert rows["zo"]["host_copy_waits"] > 0 and "host_copy_wait_ms" not in rows["torch"]
    for name in ("zo", "zo_half"):  # offloaded: two device slots, whatever the segmentation
        assert rows[name]["checkpoint_allocations_per_step"] == 0 and rows[name]["device_blocks"] == 2, rows[name]
    assert rows["zo_resident"]["device_blocks"] == 3 and rows["torch"]["step_vs_torch_checkpoint"] == 1.0
    # each zo row's own pool: 3 blocks, the newest segment's input kept: 2 to the host; halves: 6 segments, 5
    assert (rows["zo"]["host_blocks"], rows["zo_half"]["host_blocks"]) == (2, 5), rows
    assert rows["torch"]["peak_vs_torch_checkpoint"] == 1.0 and rows["zo_half"]["peak_vs_torch_checkpoint"] > 0
    profiled = [r for r in rows.values() if "profile" in r]  # no GPU: no busy time
    assert [r["provider"] for r in profiled] == [p for p in activation_rows.PROVIDERS if p in activation_rows.PROFILED]
    assert all(r["profile"]["wall_ms"] > 0 and r["profile"]["busy_ms"] is None for r in profiled)


def test_activation_rows_wait_clock_times_the_hosts_waits_and_comes_off():
    """WaitClock (bench/activation_rows.py): the host's time blocked in a transport's waits, a pool block's drain
    included; close() leaves the transport's own methods."""
    import os
    import sys
    import time

    from zo_kernels.transport import CopyEngineTransport

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import activation_rows

    tr = CopyEngineTransport(delay_s=0.05)
    try:
        own_wait, own_pool_wait = tr.wait, tr.pool._wait
        clock = activation_rows.WaitClock(tr)
        host = tr.pool.take(16, torch.float32)
        ev = tr.d2h(host, torch.ones(16))
        t0 = time.perf_counter()
        tr.wait(ev)
        assert clock.calls == 1 and 0.03 < clock.seconds <= time.perf_counter() - t0 + 1e-6, clock.seconds
        tr.d2h(host, torch.ones(16))
        tr.pool.give(host)
        tr.pool.take(16, torch.float32)  # the same block again: drained first, through the clock
        assert clock.calls == 2 and clock.seconds > 0.06
        clock.close()
        assert tr.wait == own_wait and tr.pool._wait == own_pool_wait and "wait" not in vars(tr)
    finally:
        tr.close()


def test_activation_rows_a_failed_profile_is_a_note(tmp_path, monkeypatch):
    """--profile has never run on a GPU: a profile that fails is the row's profile_error, and the script goes on
    (on a GPU, to the longest-sequence searches) and ends with every row written."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import activation_rows

    def broken(*args):
        raise KeyError("traceEvents")

    monkeypatch.setattr(activation_rows, "profiled_step", broken)
    out = tmp_path / "activations.json"
    argv = [str(out), "--device", "cpu", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16",
            "--rounds", "1", "--profile", "--providers", "torch,zo", "--host-rounds", "0"]  # fmt: skip
    assert activation_rows.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["provider"] for r in rows] == ["torch", "zo"]
    assert all("KeyError" in r["profile_error"] and "profile" not in r for r in rows), rows


def test_activation_rows_half_blocks_are_the_block():
    """The bench model's halves compose to its block, and every provider's step gives the gradients of the plain
    step, bit for bit: the rows compare the same training step."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import activation_rows as ar

    torch.manual_seed(0)
    model = ar.Stack(3, 32, 2)
    x = torch.randn(2, 16, 32)
    assert torch.equal(model.blocks[0].mlp(model.blocks[0].attention(x)), model.blocks[0](x))
    tr = CopyEngineTransport(delay_s=0.001)
    try:
        grads = {}
        for name in ar.PROVIDERS:
            model.wrap, ctx, _ = ar.provider_setup(name, torch.device("cpu"), tr)
            torch.manual_seed(1)  # (make_step draws the input)
            step = ar.make_step(model, torch.device("cpu"), torch.float32, 2, 16, 32, ctx)
            step()
            grads[name] = [p.grad.clone() for p in model.parameters()]
            step()  # the gradients are zeroed in place, not accumulated across steps
            same([p.grad for p in model.parameters()], grads[name])
        for name in ar.PROVIDERS:
            same(grads[name], grads["none"])
    finally:
        model.wrap = None
        tr.close()


def test_activation_rows_torch_offload_sends_each_checkpoint_through_save_on_cpu(monkeypatch):
    """The torch_offload row is transformers 5's offloaded checkpoint: torch's checkpoint inside save_on_cpu, which
    then packs each block's input (the checkpoint) and nothing else; the other rows pack nothing through it."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import activation_rows as ar

    real, packed = torch.autograd.graph.save_on_cpu, []

    class Counting(real):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory, device_type)
            inner = self.pack_hook

            def pack(t):
                packed.append(tuple(t.shape))
                return inner(t)

            self.pack_hook = pack

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    torch.manual_seed(0)
    model = ar.Stack(3, 32, 2)
    for name, want in (("torch_offload", [(2, 16, 32)] * 3), ("torch", [])):
        packed.clear()
        model.wrap, ctx, _ = ar.provider_setup(name, torch.device("cpu"), None)
        ar.make_step(model, torch.device("cpu"), torch.float32, 2, 16, 32, ctx)()
        assert packed == want, (name, packed)
    model.wrap = None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs it)")


@needs_cuda
def test_cuda_offload_bitwise_no_per_step_allocation_and_lower_peak():
    """NEVER RUN (written without a GPU). CudaTransport: gradients bitwise torch's (CUDA dropout RNG restored),
    zo's blocks allocated once, no new CUDA segment per step, a lower activation peak than torch's checkpoint."""
    model = blocks(8).cuda()
    x = torch.randn(64, 256, WIDTH, device="cuda", generator=torch.Generator("cuda").manual_seed(2))

    def peak_run(ck):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        grads = run(model, ck, x)
        torch.cuda.synchronize()
        return grads, torch.cuda.max_memory_allocated() - before

    want, torch_peak = peak_run(torch_ck)
    buf = zk.activations.default_buffers("cuda")
    same(peak_run(zk.checkpoint)[0], want)  # the first step allocates the blocks
    allocs, segments = buf.allocations, torch.cuda.memory_stats()["segment.all.allocated"]
    got, zo_peak = peak_run(zk.checkpoint)
    same(got, want)
    assert buf.allocations == allocs and buf.device_allocations == 2
    assert torch.cuda.memory_stats()["segment.all.allocated"] == segments, "a cudaMalloc in a warm step"
    assert zo_peak + buf.device_bytes < torch_peak, (zo_peak, buf.device_bytes, torch_peak)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_offload_adamw_every_stage(stage, engine):
    """ZeroOffloadAdamW stages 1, 2, 3 (bf16, 2 micro-batches): zo's offloaded checkpoint trains bit for bit like
    torch's checkpoint."""

    def train(ck):
        model = blocks(3)
        opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.bfloat16, bucket_numel=5_000, stage=stage)
        losses = []
        for step in range(2):
            for micro in range(2):
                torch.manual_seed(10 * step + micro)
                h = x_input(2).to(torch.bfloat16).requires_grad_()
                for b in model:
                    h = ck(b, h)
                loss = h.float().square().mean()
                losses.append(loss.item())
                (loss / 2).backward()
            opt.step()
            opt.zero_grad()
        with opt.gathered() if stage == 3 else contextlib.nullcontext():
            params = [q.detach().clone() for q in model.parameters()]
        opt.close()
        return losses, params

    want = train(torch_ck)
    got = train(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine)))
    assert got[0] == want[0]
    same(got[1], want[1])


class OwnWeight(torch.nn.Module):
    """A layer checkpointing a function of its own weight (or of a view of it, or a detached alias), passed
    positionally to the checkpointed function."""

    def __init__(self, ck, how: str = "itself") -> None:
        super().__init__()
        self.weight, self.ck, self.how = torch.nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.2), ck, how

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = {"itself": self.weight, "transposed": self.weight.t(), "sliced": self.weight[: WIDTH // 2],
             "detached": self.weight.detach()}[self.how]  # fmt: skip
        if self.how == "transposed":
            return self.ck(lambda a, w: F.gelu(a @ w), h, w)
        if self.how == "sliced":
            return self.ck(lambda a, w: torch.cat([F.gelu(a @ w.t())] * 2, -1), h, w)
        return self.ck(lambda a, w: F.gelu(a @ w.t()), h, w)


@pytest.mark.parametrize("how", ["itself", "transposed", "sliced", "detached"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_parameter_passed_to_the_function_is_kept_by_reference(stage, how, engine):
    """A parameter given to the checkpointed function, or a view or a detached alias of it, is kept by reference,
    as torch keeps it: at stage 3 its storage is freed once its unit's forward is over, and the copy of it that zo
    queued when the next segment was stored read freed memory (a segmentation fault on the GPU-shaped transport's
    copy thread; a view of it, a reviewer's find, the same; a detached alias, which looks like any tensor, stays
    held where its memory was freed under it). Training is bit for bit torch's checkpoint's, and no host block
    holds a parameter or a view of one."""
    buf = ActivationBuffers("cpu", engine)

    def train(ck):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(OwnWeight(ck, how) for _ in range(3)))
        opt = zk.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32, stage=stage)
        for step in range(2):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step), requires_grad=True)
            opt.backward(model(x).square().mean())
            opt.step()
        with opt.gathered() if stage == 3 else contextlib.nullcontext():
            params = [q.detach().clone() for q in model.parameters()]
        opt.close()
        return params

    want = train(torch_ck)
    same(train(functools.partial(zk.checkpoint, buffers=buf)), want)
    if how != "detached":  # (a detached alias looks like any tensor: copied where its memory holds its values)
        # two activations' blocks (one per step in flight), each of its size class
        assert buf.transport.pool.reserved == 2 * _size_class(4 * WIDTH * 4)


@pytest.mark.parametrize("offload", [True, False])
def test_an_argument_not_dense_in_memory_is_kept_by_reference(engine, offload):
    """A slice of a wider tensor (non-contiguous, not a permutation): copied into a block it was contiguous in the
    recomputation, F.linear took another path and torch's check of the recomputed tensors refused it. Kept by
    reference, as torch keeps it: the gradients bit for bit torch's."""
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(3))

    def grads(ck):
        lin.zero_grad()
        h = x.clone().requires_grad_()
        g = h
        for _ in range(3):
            g = torch.cat([ck(lin, g[..., :8]), g[..., 8:]], -1)
        g.square().sum().backward()
        return [lin.weight.grad.clone(), lin.bias.grad.clone(), h.grad.clone()]

    want = grads(torch_ck)
    same(grads(functools.partial(zk.checkpoint, offload=offload, buffers=ActivationBuffers("cpu", engine))), want)


def test_device_blocks_are_reused_smallest_fit_first():
    """take_device hands back the smallest free block that fits (an exact size first), allocating only when none
    does; a block given back is taken again, not a new one."""
    buf = ActivationBuffers("cpu")
    big, small = buf.take_device(3 * _ALIGN), buf.take_device(_ALIGN)
    buf.give_device(big)
    buf.give_device(small)
    assert buf.take_device(_ALIGN // 2).data_ptr() == small.data_ptr()  # the smallest that fits
    assert buf.take_device(2 * _ALIGN).data_ptr() == big.data_ptr()  # no exact size free: the next larger
    before = buf.device_allocations
    third = buf.take_device(_ALIGN)  # none free: a new block
    assert buf.device_allocations == before + 1 and third.numel() == _ALIGN
    buf.give_device(third)
    assert buf.take_device(_ALIGN).data_ptr() == third.data_ptr() and buf.device_allocations == before + 1


@pytest.mark.parametrize("offload", [False, True])
def test_a_block_seen_in_many_shapes_gives_each_step_its_own(engine, offload):
    """The device blocks' typed views are cached per block and shape: ten shapes of one byte size (one block each
    step), one after another and back, each step's gradients bit for bit torch's, and no block keeps more than 8
    views (a cache keyed by the block alone would hand a step the last step's shape)."""
    model = blocks(3)
    buf = ActivationBuffers("cpu", engine)
    shapes = [(1, 30), (2, 15), (3, 10), (5, 6), (6, 5), (10, 3), (15, 2), (30, 1), (1, 2, 15), (2, 3, 5), (1, 30)]
    for lead in shapes + shapes[::-1]:
        x = torch.randn(*lead, WIDTH, generator=torch.Generator().manual_seed(len(lead) * 31 + lead[-1]))
        same(run(model, functools.partial(zk.checkpoint, offload=offload, buffers=buf), x), run(model, torch_ck, x))
    assert buf.device_allocations == (2 if offload else 3), buf.device_allocations  # one size: the blocks reused
    assert 0 < max(len(v) for v in buf._views.values()) <= 8


def test_host_work_per_segment_does_not_grow_with_the_chain(engine, monkeypatch):
    """A forward of 60 offloaded segments asks each earlier segment to go to the host once (when the next one has
    run), not every segment before it at every call (60 * 59 / 2 asks): the bookkeeping is O(1) per segment. The
    gradients stay torch's."""
    from zo_kernels import activations

    asks = []
    real = activations._Segment.to_host
    monkeypatch.setattr(activations._Segment, "to_host", lambda self: (asks.append(1), real(self))[1])
    model, x = blocks(60), x_input(2)
    want = run(model, torch_ck, x)
    asks.clear()
    same(run(model, functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine)), x), want)
    assert len(asks) <= 2 * 60, len(asks)


def test_offloaded_checkpoints_leave_the_device_memory():
    """The CPU's measure of the activation peak (bench/activation_rows.py: the profiler's memory events, in units
    of one [batch, seq, hidden] tensor): 8 more layers add about 8 units to torch's checkpoint (every block input
    stays) and almost nothing to zo's offloaded one; at 12 layers zo's half-block segments peak lowest."""
    import argparse
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import activation_rows as ar

    a = argparse.Namespace(batch=1, seq=256, hidden=64)
    units = {}
    for layers in (4, 12):
        torch.manual_seed(0)
        model = ar.Stack(layers, 64, 2)
        units[layers] = {n: ar.cpu_peak_units(n, model, a) for n in ("torch", "zo", "zo_half")}
    if units[4]["torch"] is None:
        pytest.skip("this torch's profiler exposes no memory events (kineto_results)")
    assert units[12]["torch"] - units[4]["torch"] > 7.5, units
    assert units[12]["zo"] - units[4]["zo"] < 2, units
    assert units[12]["zo_half"] < units[12]["zo"] < units[12]["torch"], units


def test_activation_rows_copy_host_time_on_a_stand_in(monkeypatch):
    """bench/activation_rows.py's copy_host_us (CUDA only: never run here) against a stand-in of CudaTransport's
    surface, torch.cuda's calls stubbed: every part is timed and named, the transport closed (the code path a GPU
    run takes, short of the device)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import activation_rows as ar

    calls = []

    class Stream:
        def wait_stream(self, other):
            calls.append("wait_stream")

    class Cu:
        def pointer_kind(self, addr):
            calls.append("pinned_check")
            return 1

    class StandIn(HostTransport):
        h2d_stream = Stream()
        _cu = Cu()

        def _after_compute(self, stream):
            calls.append("order")

        def _check_endpoints(self, dst, src, to_device):
            calls.append("checks")

        def _event(self, stream):
            calls.append("event")
            return None

        def close(self):
            calls.append("close")
            super().close()

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: calls.append("record_stream"))
    got = ar.copy_host_us(StandIn(), calls=3)
    assert set(got) == {"d2h", "h2d", "checks", "order", "wait_stream", "event", "event_and_device_wait",
                        "record_stream", "pinned_check", "pool_take_give"}, got
    assert all(v > 0 for v in got.values()) and calls[-1] == "close" and calls.count("checks") == 4
    assert calls.count("record_stream") == calls.count("pinned_check") == 4  # (one warm-up call, three timed)


def test_activation_rows_a_failed_new_stage_is_a_row(tmp_path, monkeypatch):
    """The wide shape has never run on a GPU (the host-overhead row first ran on the H200 in the sixth run): either
    failing (the wide model out of memory, say) is a row that says why, and the script goes on to the rest (the
    profile, on a GPU the searches)."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import activation_rows

    def broken(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(activation_rows, "host_overhead", broken)
    monkeypatch.setattr(activation_rows, "measure_wide", broken)
    out = tmp_path / "activations.json"
    argv = [str(out), "--device", "cpu", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16",
            "--rounds", "1", "--providers", "torch,zo", "--host-rounds", "1", "--wide", "2,64,2,1,32",
            "--profile"]  # fmt: skip
    assert activation_rows.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["provider"] for r in rows] == ["torch", "zo", "host_overhead", "wide"], rows
    assert all("OutOfMemoryError" in r["error"] for r in rows[2:]) and rows[3]["shape"] == "wide"
    assert all("profile" in r for r in rows[:2])  # the profile ran after them


def test_double_backward_through_offloaded_checkpoints(engine):
    """A gradient penalty (torch.autograd.grad with create_graph=True, then backward through it) over 4 offloaded
    segments: torch's gradients, bit for bit. The first backward gave each segment's device blocks back while the
    higher-order graph still read the restored checkpoint, and the next segment's prefetch copied into them (autograd
    caught the overwrite as an in-place change here; unseen, the gradients would have been wrong)."""
    torch.manual_seed(0)
    lins = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)]
    x0 = x_input(4)

    def grads(ck):
        x = x0.clone().requires_grad_()
        h = x * 1.0
        for lin in lins:
            h = ck(lambda t, lin=lin: torch.tanh(lin(t)) * t, h)
        (g,) = torch.autograd.grad(h.square().sum(), x, create_graph=True)
        g.square().sum().backward()
        out = [x.grad, *(q.grad for lin in lins for q in lin.parameters())]
        for lin in lins:
            lin.zero_grad()
        return out

    same(grads(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine))), grads(torch_ck))


def test_one_tensor_passed_by_position_and_by_name_stays_one_tensor(engine):
    """The same tensor, needing no gradient, passed positionally and by keyword (self-attention's query, key and
    value): one tensor in every place in the recomputation too, as torch's checkpoint gives it (the keyword places
    were left out of its group: nn.MultiheadAttention's recomputation took another path, "Recomputed values ...
    different metadata", and a function branching on `q is k` gave other gradients)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(WIDTH, WIDTH)
    x = x_input(4)  # needs no grad

    def fn(q, key=None, value=None):
        return torch.tanh(lin(q)) if (q is key and key is value) else torch.sigmoid(lin(q))  # (each saves its output)

    def grads(ck):
        lin.zero_grad()
        ck(fn, x, key=x, value=x).sum().backward()
        return [q.grad.clone() for q in lin.parameters()]

    want = grads(torch_ck)
    for offload in (True, False):
        same(grads(functools.partial(zk.checkpoint, offload=offload, buffers=ActivationBuffers("cpu", engine))), want)


def test_a_function_returning_its_argument_as_is_returns_that_argument(engine):
    """nn.Identity, dropout in eval, a function returning its input in a tuple: the output is the argument itself,
    as torch's checkpoint returns it, and it can be changed in place (it was a view made inside the offload's
    custom Function: "Output 0 of _Release is a view and is being modified inplace"); gradients as torch's."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(WIDTH, WIDTH)
    x0 = x_input(4)

    def grads(ck, fn):
        lin.zero_grad()
        h = lin(x0)
        y = ck(fn, h)
        y = y[0] if isinstance(y, tuple) else y
        assert y is h
        y.mul_(2.0)
        lin(y).sum().backward()
        return [q.grad.clone() for q in lin.parameters()]

    for fn in (torch.nn.Identity(), lambda t: F.dropout(t, 0.1, training=False), lambda t: (t, t.sum())):
        want = grads(torch_ck, fn)
        same(grads(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine)), fn), want)


def test_a_failed_reservation_counts_only_the_blocks_it_made_and_keeps_them():
    """reserve() with a block the allocator refuses (out of memory): the counters hold only the blocks that exist
    (they counted the refused one: 4.6e18 bytes), and the blocks made before it are free blocks for later segments
    (they were dropped)."""
    buf = ActivationBuffers("cpu", HostTransport())
    with pytest.raises(RuntimeError):
        buf.reserve([1024, 2**62])
    assert (buf.device_allocations, buf.device_bytes) == (1, 1024)
    block = buf.take_device(1024)  # the reserved one, not a new allocation
    assert buf.device_allocations == 1 and block.numel() == 1024


def test_an_error_about_another_view_is_not_blamed_on_the_arguments(engine):
    """An in-place change of a view some other custom Function made (of a parameter) inside the function: autograd's
    own error, naming that view, as torch's checkpoint gives it (it was rewritten into "the function modified one of
    its tensor arguments in place")."""

    class Same(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    w0 = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))

    def fn(t):
        w = Same.apply(w0)
        w.mul_(1.0)
        return t @ w

    x = x_input(2).requires_grad_() * 1.0
    with pytest.raises(RuntimeError, match="custom Function") as e:
        zk.checkpoint(fn, x, buffers=ActivationBuffers("cpu", engine))
    assert "tensor arguments" not in str(e.value)


def test_selective_activation_checkpointing_context_fn_with_offload(engine):
    """torch's selective activation checkpointing (context_fn=create_selective_checkpoint_contexts, addmm saved,
    the rest recomputed) with offloaded segments: torch's gradients, bit for bit. The restore's own view and copy
    ops ran inside the recomputation's policy mode, which refused them ("aten.slice.Tensor encountered during
    backward but not found in storage")."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *a, **k):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    torch.manual_seed(0)
    lins = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)]

    def grads(ck):
        x = x_input(4).requires_grad_()
        h = x * 1.0
        for lin in lins:
            h = ck(lambda t, lin=lin: torch.tanh(lin(t)), h, context_fn=context_fn)
        h.sum().backward()
        out = [x.grad, *(q.grad.clone() for lin in lins for q in lin.parameters())]
        for lin in lins:
            lin.zero_grad()
        return out

    want = grads(torch_ck)
    for offload in (True, False):
        same(grads(functools.partial(zk.checkpoint, offload=offload, buffers=ActivationBuffers("cpu", engine))), want)


def test_channels_last_inputs_are_restored_with_their_strides(engine):
    """A conv stack on channels_last inputs: torch's gradients bit for bit (offloaded and resident). The checkpoint
    was made contiguous (NCHW), so the recomputation ran the convolution in another memory format and its weight
    gradient differed by ~1e-6; now the block holds the input as it lies and gives its strides back."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    x0 = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(3)).to(memory_format=torch.channels_last)

    def grads(ck):
        conv.zero_grad(set_to_none=True)
        h = x0.clone(memory_format=torch.channels_last).requires_grad_()
        for _ in range(3):
            h = ck(lambda t: torch.tanh(conv(t)), h)
        h.square().sum().backward()
        return [conv.weight.grad.clone(), conv.bias.grad.clone()]

    want = grads(torch_ck)
    for offload in (True, False):
        same(grads(functools.partial(zk.checkpoint, offload=offload, buffers=ActivationBuffers("cpu", engine))), want)


def test_activation_rows_profile_takes_no_garbage_collection():
    """bench/activation_rows.py's cProfile list: a full collection (~0.1 s with torch imported) landing in the three
    profiled steps is charged to whatever Python function allocated then (the H200's sixth run: 1,617 us a block in
    torch's pack_hook for zo, 124 for torch). The list starts collected and runs with the collector off, then turns
    it back on; a collector that was off stays off."""
    import gc
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import activation_rows as ar

    collections, stepping, before = [], [False], []

    def count(phase, info):
        if phase == "start":
            collections.append((info["generation"], stepping[0]))

    def step():
        stepping[0] = True
        before.append(len(collections))
        for _ in range(20_000):  # cyclic garbage: enough to trigger the young generation many times over
            a = []
            a.append(a)
        stepping[0] = False

    gc.callbacks.append(count)
    try:
        assert gc.isenabled()
        ar._top_functions(step, layers=1)
        inside = [g for g, in_step in collections if in_step]
        first = before[0]
        assert gc.isenabled()
        gc.disable()
        try:
            ar._top_functions(step, layers=1)
            assert not gc.isenabled()
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(count)
    assert first >= 1 and collections[first - 1][0] == 2, "a full collection before the profiled steps"
    assert inside == [], f"collections inside the profiled steps (generations): {inside}"


class _VersionKeepingEngine(CopyEngineTransport):
    """The GPU-shaped transport whose copies leave the destination's version counter as CudaTransport's raw copies
    do: a block overwritten under a graph that reads it gives wrong numbers here, not autograd's in-place error."""

    def _copy(self, dst, src):
        with torch.autograd._unsafe_preserve_version_counter(dst):
            dst.copy_(src)


@pytest.fixture
def raw_engine():
    tr = _VersionKeepingEngine(delay_s=0.002)
    yield tr
    tr.close()


def test_a_leaf_inputs_segment_keeps_its_blocks_until_its_backward_is_done(engine):
    """(A bug hunt's case, against a gradient-hook release: a leaf's gradient is accumulated as soon as it is ready,
    so a hook on it freed the segment's blocks while nodes of the segment not leading to it still read the restored
    checkpoint, and a nested checkpoint restored into them.) torch's gradients, bit for bit."""
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    x0 = torch.randn(4, WIDTH)

    def grads(ck):
        l1.zero_grad(set_to_none=True)
        l2.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()

        def outer(t):
            w = l1(t.detach())  # a use of the checkpoint that does not lead to its input
            u = ck(lambda s: torch.tanh(l2(s)), torch.sigmoid(t.detach()))  # nested, the same buffers
            return w + u + t.square()

        ck(outer, x).square().sum().backward()
        return [x.grad, l1.weight.grad, l1.bias.grad, l2.weight.grad]

    same(grads(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", engine))), grads(torch_ck))


@pytest.mark.parametrize("between", ["through_the_input_only", "through_the_segments"])
def test_a_plain_backward_after_create_graph_keeps_the_blocks_the_higher_order_graph_reads(raw_engine, between):
    """torch.autograd.grad(create_graph=True) builds a graph that reads the restored checkpoints; a plain backward
    after it (through the segments, a bug hunt's find: it gave their blocks back; or only through their input)
    must not give them back: another step's prefetch copied into them and the higher-order backward read its values
    (wrong gradients with copies that leave version counters, as on a GPU). torch's gradients, bit for bit."""
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    x0, x1 = torch.randn(4, WIDTH), 100 * torch.randn(4, WIDTH)

    def forward(ck, x):
        h0 = x * 1.0
        return h0, ck(lambda t: torch.tanh(l2(t)) * t, ck(lambda t: torch.tanh(l1(t)) * t, h0))

    def grads(ck):
        l1.zero_grad(set_to_none=True)
        l2.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        h0, y = forward(ck, x)
        (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        ((h0 * 3).sum() if between == "through_the_input_only" else y.sum()).backward(retain_graph=True)
        forward(ck, x1.clone().requires_grad_())[1].sum().backward()  # another step on the same buffers
        g.square().sum().backward()
        return [x.grad, l1.weight.grad, l2.weight.grad]

    same(grads(functools.partial(zk.checkpoint, buffers=ActivationBuffers("cpu", raw_engine))), grads(torch_ck))


@pytest.mark.parametrize("offload", [True, False])
def test_an_argument_changed_in_place_inside_the_function_after_a_nested_checkpoint_is_named(engine, offload):
    """A bug hunt's find: the nested checkpoint's store sent the outer segment to the host, emptying the arguments
    it checks (and a resident segment checked nothing), so the outer function's later in-place change of its
    argument (one needing no gradient: no autograd view to refuse it) went unseen: other gradients than the
    forward's, where torch raises. Named when the function returns (each argument's version counter as it was
    taken); a forward whose output needs no gradient (a frozen teacher's) may change its input, as torch's
    checkpoint lets it."""
    torch.manual_seed(0)
    l2 = torch.nn.Linear(WIDTH, WIDTH)
    ck = functools.partial(zk.checkpoint, offload=offload, buffers=ActivationBuffers("cpu", engine))

    def outer(t):
        u = ck(lambda s: torch.tanh(l2(s)), t + 1.0)
        t.mul_(2.0)
        return u * t

    with pytest.raises(RuntimeError, match="modified one of its tensor arguments in place"):
        ck(outer, torch.randn(4, WIDTH)).square().sum()
    teacher = torch.nn.Linear(WIDTH, WIDTH).requires_grad_(False)
    x = torch.randn(4, WIDTH)
    got = ck(lambda t: teacher(t.clamp_(-1.0, 1.0)), x.clone())
    assert torch.equal(got, torch_ck(lambda t: teacher(t.clamp_(-1.0, 1.0)), x.clone()))
