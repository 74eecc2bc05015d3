"""The GPU path on a CUDA device: compiled Triton kernels bitwise against torch, copy ordering under injected
delays, ZeroOffloadAdamW against the oracle, peak device memory, pinned memory over many constructions.

NEVER RUN: written on a machine without a GPU (bench/gpu_check.sh runs it on one). Skipped without CUDA.
"""

import gc
import math
import time

import pytest
import torch
from helpers import WhereBlocked, assert_bits_equal
from offload_ref import Reference, flat, make_data, make_model

import zo_kernels as zk
from zo_kernels.transport import CudaTransport, Staging, tiled_writeback

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: none is visible here (bench/gpu_check.sh runs these on one)",
                allow_module_level=True)  # fmt: skip

DEV = torch.device("cuda")
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
SLEEP_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: far longer than any copy or kernel below


def sizes(count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [int(n) for n in torch.randint(1, 5000, (count,), generator=g)]


@pytest.mark.parametrize("count", [1, 1000])
@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
def test_compiled_pack_and_unpack_match_torch_bitwise(count, align, out_dtype):
    ns = sizes(count)
    tensors = [(torch.randn(n, device=DEV) * 100).to(FLOATS[i % 3]) for i, n in enumerate(ns)]
    p = zk.pack(tensors, dtype=out_dtype, align=align, scale=0.37, impl="triton")
    ref = torch.zeros_like(p.flat)
    for t, off in zip(tensors, p.offsets):
        ref[off : off + t.numel()] = (t.float() * 0.37).to(out_dtype)
    assert_bits_equal(p.flat, ref, "flat")
    want_sq = sum(float(((t.float() * 0.37).double() ** 2).sum()) for t in tensors)
    assert abs(p.sum_sq.item() - want_sq) <= 1e-5 * want_sq
    again = zk.pack(tensors, dtype=out_dtype, align=align, scale=0.37, impl="triton")
    assert again.sum_sq.view(torch.int32).item() == p.sum_sq.view(torch.int32).item(), "sum of squares not bitwise"
    outs = [torch.full_like(t, float("nan")) for t in tensors]
    zk.unpack(p.flat, outs, offsets=p.offsets, impl="triton")
    for i, (o, t) in enumerate(zip(outs, tensors)):
        assert_bits_equal(o, ref[p.offsets[i] : p.offsets[i] + t.numel()].to(t.dtype), f"unpack {i}")


def test_moving_addresses_rewrite_the_table_in_stream_order():
    """Two sets of tensors alternating through one plan behind a sleeping stream: each call writes the new addresses
    into one of the plan's two pinned host tables (in turn) and copies it over its one device table, in stream order.
    The host must not rewrite a host table before the copy from it read it (the plan waits for its event) and the
    copy must land after the launch that read the old table: either slip packs the other set's values somewhere."""
    ns = sizes(64, seed=5)
    sets = [[torch.randn(n, device=DEV) * (k + 1) for n in ns] for k in range(2)]
    plan = zk.buckets.plan(sets[0], dtype=torch.bfloat16, align=8)
    outs = [torch.empty(plan.total, dtype=torch.bfloat16, device=DEV) for _ in range(6)]
    tables = set()
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        torch.cuda._sleep(SLEEP_CYCLES // 20)  # the device behind the host: every upload is queued behind a launch
        plan.pack(sets[i % 2], out=out, impl="triton")
        tables.add(plan._table.data_ptr())
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        want = zk.pack(sets[i % 2], dtype=torch.bfloat16, align=8, impl="torch").flat
        assert torch.equal(out, want), f"call {i} packed the other set's values"
    assert plan.uploads == 6 and len(tables) == 1, (plan.uploads, len(tables))


def test_pack_reduction_over_thousands_of_programs_and_its_flag():
    """The in-launch reduction (each program's partials, the last ticket sums them) with more programs than the last
    program's RBLOCK lanes take in one pass (~3k, run concurrently), launched back to back through one plan: the sum
    of squares the same bits each launch and within fp32 rounding of float64's; one inf (in the head, in an unmasked
    vector block, in the masked tail) raises the flag, and the next clean launch lowers it again (counter and
    partials reset). No other GPU test has more than ~1k programs or an inf (written without a GPU)."""
    from zo_kernels.kernels import pack as kpack

    n = (3 * kpack.RBLOCK + 1) * kpack.CHUNK - 7
    x = torch.randn(n, device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    plan = zk.buckets.plan([x], dtype=torch.bfloat16)
    want = float((x.double() * 0.5).square().sum())
    first = plan.pack([x], scale=0.5, impl="triton")
    sq, flag = first.sum_sq.clone(), bool(first.found_inf)
    assert not flag and abs(sq.item() - want) <= 1e-4 * want, (sq.item(), want)
    for _ in range(3):
        again = plan.pack([x], scale=0.5, impl="triton")
        assert again.sum_sq.view(torch.int32).item() == sq.view(torch.int32).item(), "sum of squares not bitwise"
    # the first element (chunk 0's head), one inside an unmasked 16-byte block mid-tensor, one in the masked tail
    for where in (0, 1000 * kpack.CHUNK + kpack.BLOCK + 5, n - 3):
        keep = x[where].item()
        x[where] = float("inf")
        assert bool(plan.pack([x], scale=0.5, impl="triton").found_inf), f"an inf at {where} went unflagged"
        x[where] = keep
        clean = plan.pack([x], scale=0.5, impl="triton")
        assert not bool(clean.found_inf), f"the flag stayed raised after a clean launch (inf was at {where})"
        assert clean.sum_sq.view(torch.int32).item() == sq.view(torch.int32).item(), "sum of squares changed"
    assert_bits_equal(clean.flat, (x * 0.5).to(torch.bfloat16), "flat")


def test_pack_into_running_totals_on_cuda():
    """into=(sum_sq, found_inf), the offload step's call, compiled (the ACCUMULATE variant): over several buckets the
    running sum is the plain launches' sums added in fp32, bit for bit, the flag their OR, the buckets the plain
    ones; the flag a bool at an odd address (its own byte). Written without a GPU."""
    g = torch.Generator(DEV).manual_seed(5)
    calls = [[torch.randn(n, device=DEV, generator=g) for n in (70001, 3)], [torch.randn(1, device=DEV, generator=g)],
             [torch.randn(4099, device=DEV, generator=g)]]  # fmt: skip
    calls[1][0][0] = float("inf")
    raw = torch.zeros(8, dtype=torch.uint8, device=DEV)
    sum_sq, found = torch.full((), 0.25, device=DEV), raw[3:4].view(torch.bool)[0]
    want_sum, want_found = torch.full((), 0.25, device=DEV), torch.zeros((), dtype=torch.bool, device=DEV)
    for k, tensors in enumerate(calls):
        plan = zk.buckets.plan(tensors, dtype=torch.bfloat16, align=8)
        plain = plan.pack(tensors, scale=0.5, impl="triton")
        flat = plain.flat.clone()
        want_sum += plain.sum_sq
        want_found |= plain.found_inf
        got = plan.pack(tensors, scale=0.5, impl="triton", into=(sum_sq, found))
        assert got.sum_sq is sum_sq and got.found_inf is found
        assert torch.equal(got.flat.view(torch.int16), flat.view(torch.int16)), f"bucket {k}"
        assert sum_sq.view(torch.int32).item() == want_sum.view(torch.int32).item(), f"sum after bucket {k}"
        assert bool(found) is bool(want_found) is (k >= 1)
    assert raw[[0, 1, 2, 4, 5, 6, 7]].eq(0).all(), "the flag's neighbours were written"


def test_pack_step_on_cuda_is_pack_call_after_call():
    """PackPlan.pack_step, the offload step's pack since 2026-11-28 (its bucket view and totals trusted after the
    first call, the launch key kept), compiled: call after call, with the gradients at new addresses every other
    call and an inf in one, the bucket and the running Σg² bit for bit pack(..., out=, into=)'s, the flag the same;
    one runner per key (no launch through Triton after the first two). Written without a GPU."""
    from zo_kernels.kernels import pack as kpack

    g = torch.Generator(DEV).manual_seed(7)
    sizes_ = (70001, 3, 4099)
    plan = zk.buckets.plan([torch.randn(n, device=DEV) for n in sizes_], dtype=torch.bfloat16, align=8)
    ref_plan = zk.buckets.plan([torch.randn(n, device=DEV) for n in sizes_], dtype=torch.bfloat16, align=8)
    out = torch.empty(plan.total, dtype=torch.bfloat16, device=DEV)
    ref = torch.empty(plan.total, dtype=torch.bfloat16, device=DEV)
    totals = (torch.full((), 0.25, device=DEV), torch.zeros((), dtype=torch.bool, device=DEV))
    want = (torch.full((), 0.25, device=DEV), torch.zeros((), dtype=torch.bool, device=DEV))
    kept = [torch.randn(n, device=DEV, generator=g) for n in sizes_]
    before = kpack._PACK.through_triton
    for k in range(6):
        ts = kept if k % 2 else [torch.randn(n, device=DEV, generator=g) for n in sizes_]
        if k == 4:
            ts[1][0] = float("inf")
        plan.pack_step(ts, out, totals, scale=0.5)
        ref_plan.pack(ts, scale=0.5, out=ref, into=want)
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), f"call {k}"
        assert totals[0].view(torch.int32).item() == want[0].view(torch.int32).item(), f"sum after call {k}"
        assert bool(totals[1]) is bool(want[1]) is (k >= 4)
    assert kpack._PACK.through_triton - before <= 2


@pytest.mark.parametrize("direct", ["1", "0"], ids=["runner", "through-triton"])
def test_later_launches_through_the_runner_match_triton_bitwise(direct, monkeypatch):
    """kernels/launch.py: a plan's launches after the first call the compiled kernel's runner (or, with
    ZO_TRITON_DIRECT_LAUNCH=0, Triton's launch each time); both give the bits of torch's reference, also when the
    bucket moves to an address 2 bytes off (another specialization: through Triton again, then its own runner)."""
    from zo_kernels.kernels import pack as kpack
    from zo_kernels.kernels.launch import Launches

    monkeypatch.setenv("ZO_TRITON_DIRECT_LAUNCH", direct)
    monkeypatch.setattr(kpack, "_PACK", Launches(kpack._pack_kernel))
    monkeypatch.setattr(kpack, "_UNPACK", Launches(kpack._unpack_kernel))
    tensors = [(torch.randn(n, device=DEV) * 10).to(FLOATS[i % 3]) for i, n in enumerate(sizes(64, seed=3))]
    plan = zk.buckets.plan(tensors, dtype=torch.bfloat16, align=1)
    ref = torch.zeros(plan.total, dtype=torch.bfloat16, device=DEV)
    for t, off in zip(tensors, plan.offsets):
        ref[off : off + t.numel()] = (t.float() * 0.25).to(torch.bfloat16)
    want_sq = None
    buf = torch.empty(plan.total + 8, dtype=torch.bfloat16, device=DEV)
    for out in [buf[: plan.total]] * 3 + [buf[1 : plan.total + 1]] * 3:
        out.fill_(float("nan"))
        p = plan.pack(tensors, scale=0.25, out=out, impl="triton")
        assert_bits_equal(p.flat, ref, "flat")
        sq = p.sum_sq.view(torch.int32).item()
        assert want_sq in (None, sq), "sum of squares not bitwise across launches"
        want_sq = sq
        back = [torch.full_like(t, float("nan")) for t in tensors]
        plan.unpack(p.flat, back, impl="triton")
        for i, (b, t) in enumerate(zip(back, tensors)):
            assert_bits_equal(b, ref[plan.offsets[i] : plan.offsets[i] + t.numel()].to(t.dtype), f"unpack {i}")
    through = 2 if direct == "1" else 6
    assert kpack._PACK.through_triton == through and kpack._UNPACK.through_triton == through


def test_offsets_past_2_31():
    big = torch.zeros((1 << 31) + 5, dtype=torch.bfloat16, device=DEV)
    small = torch.randn(3000, device=DEV)
    p = zk.pack([big, small], dtype=torch.bfloat16, impl="triton")
    assert p.offsets[1] > 2**31
    assert_bits_equal(p.flat[p.offsets[1] :], small.to(torch.bfloat16), "segment past 2^31")
    out = torch.empty_like(small)
    zk.unpack(p.flat, [big, out], offsets=p.offsets, impl="triton")
    assert_bits_equal(out, small.to(torch.bfloat16).float(), "unpack past 2^31")


def test_kernels_launch_on_the_tensors_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: the wrong-device launch cannot happen")
    x = torch.randn(5000, device="cuda:1")
    with torch.cuda.device(0):
        assert_bits_equal(zk.cast(x, torch.bfloat16, impl="triton"), x.to(torch.bfloat16), "cast on cuda:1")


def test_transport_on_cuda_without_an_index_is_the_current_device():
    tr = CudaTransport("cuda")
    assert tr.device == torch.device("cuda", torch.cuda.current_device())
    host = tr.pool.take(1000, torch.float32)
    dev = torch.randn(1000, device=DEV)
    tr.wait(tr.d2h(host, dev))
    assert torch.equal(host, dev.cpu())
    tr.close()


def test_d2h_waits_for_a_delayed_producer():
    tr = CudaTransport()
    n = 1 << 22
    host = tr.pool.take(n, torch.float32)
    host.fill_(float("nan"))
    x = torch.empty(n, device=DEV)
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy: the producer below runs late
    x.fill_(3.0)
    ev = tr.d2h(host, x)
    tr.wait(ev)
    assert (host == 3.0).all()
    tr.close()


@pytest.mark.parametrize("full", [True, False], ids=["full-staging", "ring"])
def test_writebacks_wait_for_a_delayed_h2d_stream(full):
    """Two consecutive writebacks behind a sleeping H2D stream, destinations prefilled with NaN: every slot
    is reused only after its copy, and the compute stream reads dst only after device_wait."""
    tr = CudaTransport()
    n, tile = 1 << 20, 1 << 16
    g = torch.Generator().manual_seed(0)
    p, m, v = torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n)
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(2)]
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    ref = torch.empty(n, dtype=torch.bfloat16)
    for step, gr in enumerate(grads, 1):
        zk.cpu_adam_step(rp, gr, rm, rv, step=step, lr=1e-2, param_out=ref)
    dst = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=DEV)
    staging = Staging(tr.pool.take(n if full else 2 * tile, torch.bfloat16), tile)
    for step, gr in enumerate(grads, 1):
        with torch.cuda.stream(tr.h2d_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        for ev in tiled_writeback(tr, p, gr, m, v, dst=dst, staging=staging, step=step, lr=1e-2):
            tr.device_wait(ev)
    assert_bits_equal(dst.cpu(), ref, "dst after two delayed writebacks")
    tr.close()


def test_h2d_tiles_one_event_per_tile_behind_a_sleeping_stream():
    """CudaTransport.h2d_tiles (the DPU writeback's batched copies): each tile lands where it belongs and nothing
    else is written; every tile's event is pending while the H2D stream sleeps; the compute stream reads a tile
    only after device_wait on its event."""
    tr = CudaTransport()
    n = 1 << 20
    src = tr.pool.take(n, torch.bfloat16)
    src.copy_(torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16))
    dst = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=DEV)
    tiles = [(0, 1000), (4096, 70000), (70000, n - 7)]
    with torch.cuda.stream(tr.h2d_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    for bad in ([(5, 5)], [(0, 10), (5, 20)], [(n - 1, n + 1)]):
        with pytest.raises(ValueError, match="tiles"):
            tr.h2d_tiles(dst, src, bad)
    seen = []
    events = tr.h2d_tiles(dst, src, tiles, on_tile=lambda a, b, ev: seen.append((a, b, ev)))
    assert len(events) == len(tiles) and not any(ev.done() for ev in events), "a tile landed behind a sleep"
    assert [(a, b) for a, b, _ in seen] == tiles and [ev for _, _, ev in seen] == events
    assert tr.pool.events(src) == [events[-1]], "the pinned block is not fenced by the last copy"
    tr.device_wait(events[1])
    second = dst[4096:70000].clone()  # on the compute stream, after tile 1's copy
    tr.synchronize()
    want = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    for a, b in tiles:
        want[a:b] = src[a:b]
    assert_bits_equal(dst.cpu(), want, "dst after h2d_tiles")
    assert_bits_equal(second.cpu(), src[4096:70000], "tile 1 read after device_wait")
    tr.close()


def test_synchronize_waits_for_both_streams():
    tr = CudaTransport()
    n = 1 << 22
    host_in, host_out = tr.pool.take(n, torch.float32), tr.pool.take(n, torch.float32)
    host_in.fill_(1.0)
    host_out.fill_(float("nan"))
    dev = torch.full((n,), 2.0, device=DEV)
    with torch.cuda.stream(tr.d2h_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    tr.d2h(host_out, dev)
    tr.h2d(torch.empty(n, device=DEV), host_in)  # the last copy queued, on the other stream
    tr.synchronize()
    assert (host_out == 2.0).all()
    tr.close()


SCENARIOS = {
    "synchronous": dict(),
    "dpu": dict(delay_update_after=1),
    "accumulation": dict(micro=2),
    "fp16-dynamic": dict(dtype=torch.float16, loss_scale="dynamic"),
    "clip": dict(max_grad_norm=0.5),
}


def run(scenario, steps=6):
    kw = dict(SCENARIOS[scenario])
    micro = kw.pop("micro", 1)
    model = make_model(seed=0).to(DEV)
    data = make_data(steps, batch=4, micro=micro, seed=2)
    ref = Reference(model, zk.CPUAdam, dtype=kw.get("dtype", torch.bfloat16), lr=2e-3, weight_decay=0.01,
                    **{k: v for k, v in kw.items() if k != "dtype"})  # fmt: skip
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=2e-3, weight_decay=0.01, bucket_numel=100_000, **kw)
    losses, ref_losses = [], []
    for step in data:
        mb = [(x[:, :-1].to(DEV), x[:, 1:].to(DEV)) for x in step]
        ref_losses.append(ref.train_step(mb))
        total = 0.0
        for x, y in mb:
            loss = model(x, y)
            total += loss.item()
            opt.backward(loss)
        opt.step()
        losses.append(total)
    opt.synchronize()
    sd = opt.state_dict()
    got = torch.cat([sd["state"][i]["master"].reshape(-1) for i in range(len(sd["state"]))])
    opt.close()
    return got, flat(ref.master.parameters()).cpu(), losses, ref_losses


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_offload_on_cuda_against_the_oracle(scenario):
    torch.use_deterministic_algorithms(True, warn_only=True)
    got, want, losses, ref_losses = run(scenario)
    again, _, losses2, _ = run(scenario)
    assert torch.equal(got, again) and losses == losses2, "two identical GPU runs differ"
    if scenario != "clip":  # the same update kernel on the same gradients: bit for bit (the clip coefficient
        # comes from a sum of squares taken in another order, so it may differ in its last bit)
        assert torch.equal(got, want), f"not bit-identical to the CPUAdam oracle: max err {(got - want).abs().max()}"
    for a, b in zip(losses, ref_losses):
        assert math.isclose(a, b, rel_tol=1e-3), (losses, ref_losses)
    init = flat(make_model(seed=0).parameters())
    travelled = (want - init).norm()
    assert (got - want).norm() <= 0.1 * travelled, f"masters off the oracle by {(got - want).norm() / travelled:.3f}"


def test_peak_device_memory_of_a_step():
    """At most 2 bytes x params (the flat 16-bit parameters) + the two buckets + the model's activations
    and gradients of one bucket, plus a stated margin of 64 MiB (allocator rounding, workspaces)."""
    model = make_model(seed=0).to(DEV)
    phi = sum(p.numel() for p in model.parameters())
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-3, bucket_numel=100_000)
    x = make_data(1, batch=4)[0][0].to(DEV)
    opt.backward(model(x[:, :-1], x[:, 1:]))  # warm-up: kernels compiled, workspaces allocated
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    opt.backward(model(x[:, :-1], x[:, 1:]))
    opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    buckets = opt.memory_report().device_buckets
    margin = 64 << 20
    assert peak <= 2 * phi + buckets + margin, f"step peak {peak:,} B > 2 x {phi:,} + {buckets:,} + {margin:,}"
    opt.close()


@pytest.mark.parametrize("stage", ["1", "3", "3+cpu"])
def test_stages_on_cuda_bitwise_equal_stage_2(stage):
    """One GPU: stage 1, 3 and 3 with the shards in pinned host memory give stage 2's masters and losses bit for bit
    (the same values through other buffers); stage 3's device memory after a step holds no gathered unit."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    results = {}
    for s in ("2", stage):
        model = make_model(seed=0).to(DEV)
        kw = {"stage": int(s[0]), **({"offload_param": "cpu"} if s.endswith("+cpu") else {})}
        opt = zk.ZeroOffloadAdamW(model, lr=2e-3, weight_decay=0.01, bucket_numel=100_000, **kw)
        losses = []
        for step in make_data(4, batch=4, seed=2):
            x = step[0].to(DEV)
            loss = model(x[:, :-1], x[:, 1:])
            losses.append(loss.item())
            opt.backward(loss)
            opt.step()
        if s.startswith("3"):
            torch.cuda.synchronize()
            assert opt.device_bytes.now == opt.memory_report().device_bytes, "a gathered unit outlived the step"
        sd = opt.state_dict()
        results[s] = (losses, torch.cat([sd["state"][i]["master"].reshape(-1) for i in range(len(sd["state"]))]))
        opt.close()
    assert results[stage][0] == results["2"][0], "losses differ"
    assert torch.equal(results[stage][1], results["2"][1]), "masters differ"


def _not_landed(fence) -> int | None:
    return None if fence is None else sum(not ev.done() for ev in fence._events)


def test_tiled_dpu_writeback_on_cuda_equals_the_whole_one():
    """DPU with the model known (the writeback in tiles, each module's forward or unit gather waiting for its own
    tiles: stages 2 and 3) against the same run waited whole (stage 2 given only the parameters: no module to hook),
    the H2D stream put to sleep before each step so that a missing wait reads old parameters: losses and masters
    bit for bit; the forward started before the last tile landed (tiles in flight when its first module came)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    results = {}
    for name, stage in (("whole", 2), ("tiled", 2), ("tiled", 3)):
        model = make_model(seed=0).to(DEV)
        tr = CudaTransport()
        opt = zk.ZeroOffloadAdamW(model.parameters() if name == "whole" else model, lr=2e-3, weight_decay=0.01,
                                  bucket_numel=100_000, tile_numel=1 << 14, delay_update_after=0, stage=stage,
                                  transport=tr, dpu_writeback="per_module")  # fmt: skip
        assert (opt.update.fence is None) == (name == "whole")
        losses, in_flight, where = [], [], []
        # the batches on the device first: a pageable copy between step() and the forward would block the host
        # until its stream is idle (and, sharing a hardware queue with the sleeping H2D stream, maybe behind it)
        xs = [step[0].to(DEV) for step in make_data(5, batch=4, seed=2)]
        torch.cuda.synchronize()
        for x in xs:
            fence = opt.update.fence
            # (if the forward finds none in flight: the tiles queued, those not landed, then step()'s seconds)
            where.append([None if fence is None else fence.tiles, _not_landed(fence)])
            loss = model(x[:, :-1], x[:, 1:])
            fence = opt.update.fence
            if fence is not None and fence.in_flight is not None:  # of the writeback this forward waited for
                in_flight.append(fence.in_flight)
            losses.append(loss.item())
            opt.backward(loss)
            with torch.cuda.stream(tr.h2d_stream):
                torch.cuda._sleep(SLEEP_CYCLES)
            t0 = time.perf_counter()
            with WhereBlocked() as blocked:
                opt.step()
            seconds = time.perf_counter() - t0
            where[-1].append(round(seconds, 3))  # (>= 0.1 s: step() waited for the sleeping stream)
            if seconds > 0.05:  # where it waited, and the step's phases over 10 ms
                where[-1] += [blocked.top(2), {k: round(v, 3) for k, v in opt.stats.items()
                                               if k.startswith("time_") and isinstance(v, float) and v > 0.01}]
        opt.synchronize()
        sd = opt.state_dict()
        masters = torch.cat([sd["state"][i]["master"].reshape(-1) for i in range(len(sd["state"]))])
        results[name, stage] = (losses, masters)
        opt.close()
        tr.close()
        if name == "tiled":
            assert in_flight and max(in_flight) > 0, ("the forward never started before the last tile landed; per "
                                                      f"step: tiles queued, not landed before the forward, step() "
                                                      "seconds: "
                                                      f"{where}")
    for key in (("tiled", 2), ("tiled", 3)):
        assert results[key][0] == results["whole", 2][0], f"{key}: losses differ"
        assert torch.equal(results[key][1], results["whole", 2][1]), f"{key}: masters differ"


def _formats_run(state_dtype, dpu: int | None, sleep_cycles: int) -> tuple[list[float], torch.Tensor]:
    """A GPT trained 4 steps on CUDA with moments in `state_dtype`, both copy streams held `sleep_cycles` before each
    step (torch.cuda._sleep): the losses and the masters."""
    tr = CudaTransport()
    model = make_model(seed=0).to(DEV)
    opt = zk.ZeroOffloadAdamW(model, lr=2e-3, weight_decay=0.01, bucket_numel=100_000, tile_numel=1 << 14,
                              state_dtype=state_dtype, delay_update_after=dpu, transport=tr)  # fmt: skip
    losses = []
    for step in make_data(4, batch=4, seed=2):
        for stream in (tr.h2d_stream, tr.d2h_stream):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(sleep_cycles)
        x = step[0].to(DEV)
        loss = model(x[:, :-1], x[:, 1:])
        losses.append(loss.item())
        opt.backward(loss)
        opt.step()
    opt.synchronize()
    sd = opt.state_dict()
    masters = torch.cat([sd["state"][i]["master"].reshape(-1) for i in range(len(sd["state"]))])
    opt.close()
    tr.close()
    return losses, masters


@pytest.mark.parametrize("dpu", [None, 1], ids=["sync", "dpu"])
@pytest.mark.parametrize("state_dtype", ["8bit", torch.bfloat16], ids=["8bit", "bf16"])
def test_compressed_moments_on_cuda_under_late_copies(state_dtype, dpu):
    """The scale check's formats (8-bit, bf16 moments: the update tile by tile, each tile's copy queued at once, the
    new parameters over the gradients in the pinned landing buffer) on CUDA, never run on a GPU before: with both copy
    streams held ~0.1 s before each step, the run is bit for bit the same (a parameter read before its copy landed,
    or a landing buffer rewritten under a copy still reading it, would change it)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    want = _formats_run(state_dtype, dpu, 0)
    got = _formats_run(state_dtype, dpu, SLEEP_CYCLES)
    assert got[0] == want[0], f"losses differ: {got[0]} vs {want[0]}"
    assert torch.equal(got[1], want[1]), "masters differ"


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_pinned_memory_flat_over_40_constructions():
    """40 transports, 32 MiB pinned each, closed and dropped: resident memory flat (a leaked block per construction
    would add 1.25 GiB). One gc.collect() at each end, not one per construction: with torch's CUDA build imported a
    collection costs ~0.1 s, and 100 of them cut this test at its 20 s twice on the H200 of 2026-11-27."""

    def once():
        tr = CudaTransport()
        bufs = [tr.pool.take(1 << 22, torch.bfloat16) for _ in range(4)]  # 32 MiB pinned
        tr.wait(tr.d2h(bufs[0], torch.zeros(1 << 22, dtype=torch.bfloat16, device=DEV)))
        tr.close()
        del bufs, tr

    for _ in range(3):
        once()
    gc.collect()
    before = _rss()
    for _ in range(40):
        once()
    gc.collect()
    grown = _rss() - before
    assert grown < 64 << 20, f"resident memory grew by {grown:,} B over 40 constructions (32 MiB pinned each)"


def _twin_run(delay_cycles: int, dpu: int | None) -> tuple[list[float], torch.Tensor]:
    """gpu_fraction 0.5 on the GPU, the tail's side stream held `delay_cycles` before each update (torch.cuda._sleep):
    the losses and the masters."""
    from zo_kernels.offload.twin import DeviceStream

    launch = DeviceStream.launch

    def late(self, job):
        launch(self, lambda: (torch.cuda._sleep(delay_cycles), job()))

    DeviceStream.launch = late
    try:
        model = make_model(seed=0).to(DEV)
        opt = zk.ZeroOffloadAdamW(model, lr=2e-3, weight_decay=0.01, bucket_numel=100_000, gpu_fraction=0.5,
                                  delay_update_after=dpu)  # fmt: skip
        losses = []
        for step in make_data(4, batch=4, seed=2):
            x = step[0].to(DEV)
            loss = model(x[:, :-1], x[:, 1:])
            losses.append(loss.item())
            opt.backward(loss)
            opt.step()
        sd = opt.state_dict()
        opt.close()
    finally:
        DeviceStream.launch = launch
    return losses, torch.cat([sd["state"][i]["master"].reshape(-1) for i in range(len(sd["state"]))])


@pytest.mark.parametrize("dpu", [None, 1])
def test_gpu_fraction_waits_for_its_side_stream(dpu, monkeypatch):
    """issue 20 (passed on the H200): the tail's update held on its side stream ~0.1 s changes nothing, bit for bit;
    with the compute stream's wait for it removed, the forward reads the tail's old parameters and the losses
    differ."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    want = _twin_run(0, dpu)
    losses, masters = _twin_run(SLEEP_CYCLES, dpu)
    assert losses == want[0] and torch.equal(masters, want[1]), "a late side stream changed the run"
    from zo_kernels.offload.twin import TwinUpdate

    def no_wait(self):  # _write_tail without self._wait_device()
        self.own[self.split :].copy_(self.device_state.master)

    monkeypatch.setattr(TwinUpdate, "_write_tail", no_wait)
    broken = _twin_run(SLEEP_CYCLES, dpu)
    assert broken[0] != want[0], "a missing wait on the side stream went unnoticed"


@pytest.mark.parametrize("fmt", ["8bit", "bf16", "fp32"])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_adam_kernel_is_the_host_kernel_bit_for_bit(fmt, gdtype):
    """gpu_fraction's tail (passed on the H200): zo_kernels/kernels/adam.py compiled, four
    steps against cpu_adam_step from the same state: masters, codes, scales, bf16 bits equal bit for bit (1M
    elements: thousands of programs, a call ending inside its last block)."""
    from zo_kernels.kernels.adam import adam_step
    from zo_kernels.offload.device_adam import sr_key

    n = (1 << 20) + 77
    g_ = torch.Generator().manual_seed(4)
    p_host = torch.randn(n, generator=g_)
    p_dev = p_host.to(DEV)
    if fmt == "8bit":
        m, v = zk.Quantized8bit.empty(n, signed=True), zk.Quantized8bit.empty(n, signed=False)
        host = lambda: [m.codes, m.scales, v.codes, v.scales]  # noqa: E731
    elif fmt == "bf16":
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        host = lambda: [m.view(torch.int16), v.view(torch.int16)]  # noqa: E731
    else:
        m, v = torch.zeros(n), torch.zeros(n)
        host = lambda: [m, v]  # noqa: E731
    dev = [torch.zeros_like(t, device=DEV) for t in host()]
    dev = [t.view(torch.bfloat16) for t in dev] if fmt == "bf16" else dev
    hp = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for step in range(1, 5):
        g = (torch.randn(n, generator=g_) * torch.logspace(-4, 1, n)).to(gdtype)
        zk.cpu_adam_step(p_host, g, m, v, step=step, **hp, grad_scale=0.25, seed=5)
        adam_step(p_dev, g.to(DEV), dev, fmt, step=step, **hp, grad_scale=0.25, key=sr_key(5, step))
    torch.cuda.synchronize()
    assert torch.equal(p_dev.cpu(), p_host), "masters differ"
    for a, b in zip(dev, host()):
        assert torch.equal(a.cpu().view(b.dtype), b)


@pytest.mark.parametrize("state_dtype", ["8bit", torch.bfloat16, torch.float32], ids=["8bit", "bf16", "fp32"])
def test_gpu_fraction_is_the_host_only_run_on_cuda(state_dtype):
    """(Passed on the H200.) The tail updated by the compiled kernel on CUDA: gpu_fraction 0.5 gives the masters and
    moments (8-bit: codes and scales; bf16 bits) of gpu_fraction 0, bit for bit."""
    sds = []
    for fraction in (0.0, 0.5):
        model = make_model(seed=0).to(DEV)
        opt = zk.ZeroOffloadAdamW(model, lr=2e-3, weight_decay=0.01, bucket_numel=100_000, gpu_fraction=fraction,
                                  state_dtype=state_dtype)  # fmt: skip
        for step in make_data(3, batch=4, seed=2):
            x = step[0].to(DEV)
            opt.backward(model(x[:, :-1], x[:, 1:]))
            opt.step()
        sds.append(opt.state_dict())
        opt.close()
    for i, st in sds[0]["state"].items():
        for k, t in st.items():
            assert torch.equal(t, sds[1]["state"][i][k]), (i, k)
        for k, t in sds[0]["zero_offload"].get("moments", {}).get(i, {}).items():
            assert torch.equal(t, sds[1]["zero_offload"]["moments"][i][k]), (i, k)


def test_8bit_moments_decode_on_cuda_as_on_the_host():
    """(Passed on the H200.) quant8.dequantize on CUDA divides the scale by a tensor: a tensor divided by a Python
    number is a multiplication by its rounded reciprocal on CUDA, and differed from the host's division for 4.5% of
    the /127 scales and 72% of the /255 ones (emulated): the checkpoint's fp32 moments of a tail are the host's."""
    from zo_kernels.quant8 import dequantize

    g_ = torch.Generator().manual_seed(0)
    scales = torch.rand(4096, generator=g_) * 2.0 ** torch.randint(-30, 5, (4096,), generator=g_)
    for signed, dtype in ((True, torch.int8), (False, torch.uint8)):
        codes = torch.randint(-127 if signed else 0, 128 if signed else 256, (4096 * 256,), generator=g_).to(dtype)
        host = dequantize(codes, scales, signed=signed, block=256)
        dev = dequantize(codes.to(DEV), scales.to(DEV), signed=signed, block=256).cpu()
        assert torch.equal(dev, host)


def test_loading_a_state_into_an_8bit_tail_allocates_nothing_on_the_device():
    """(Passed on the H200; failed on the H100 2026-11-28, 2.7 MiB over: state_dict()'s per-parameter compare of the
    tail's masters cast 4M-element chunks on the device; its chunks there are now bounded, not re-run on a GPU.)
    load_state_dict and state_dict decode and encode the tail's moments on the host: the device's allocation peak
    during them stays within 1 MiB of what it holds (the fp32 values of the whole tail would be 8 bytes per
    element)."""
    model = make_model(seed=0).to(DEV)
    opt = zk.ZeroOffloadAdamW(model, lr=2e-3, bucket_numel=100_000, gpu_fraction=1.0, state_dtype="8bit")
    x = next(iter(make_data(1, batch=4, seed=2)))[0].to(DEV)
    opt.backward(model(x[:, :-1], x[:, 1:]))
    opt.step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 1 << 20
    opt.close()


def test_a_job_that_fails_midway_is_still_waited_for():
    """(Passed on the H200.) gpu_fraction's device stream: a job that queued work and then raised (a compile error,
    Ctrl-C, out of memory) leaves an event behind its queued kernels, so the next wait covers them."""
    from zo_kernels.offload.twin import DeviceStream

    stream = DeviceStream(DEV, timeout_s=60.0)
    x = torch.zeros(1 << 20, device=DEV)

    def job():
        torch.cuda._sleep(SLEEP_CYCLES)
        x.add_(1.0)
        raise RuntimeError("failed midway")

    with pytest.raises(RuntimeError, match="midway"):
        stream.launch(job)
    stream.wait()
    assert bool((x == 1.0).all()), "the compute stream did not wait for the failed job's kernels"
    stream.close()
