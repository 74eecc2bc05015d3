"""The delayed update's writeback tiled under the next forward (offload/fence.py), on the GPU's data flow without a
GPU: CopyEngineTransport queues every copy to a thread that runs it later, after a delay, so a reader that does not
wait for its tiles reads the old parameters. The reference is the same run on the plain CPU transport (whose copies
are synchronous), itself judged against tests/oracle.py by the oracle matrix's DPU cases."""

import copy
import functools
import sys
from collections import Counter

import pytest
import torch
from offload_ref import make_data, make_model

import zo_kernels as zk
from zo_kernels.offload import update as update_module
from zo_kernels.offload.fence import ForwardWaits, TileFence
from zo_kernels.offload.grads import GradPath
from zo_kernels.transport import CopyEngineTransport, HostTransport

TILE = 4096
STEPS = 4


class LoggingTransport(CopyEngineTransport):
    """CopyEngineTransport that logs each copy into `watched` (the device's flat buffer) as it lands."""

    def __init__(self, log: list, delay_s: float) -> None:
        super().__init__(delay_s=lambda dst, src: delay_s if self._in_watched(dst) else 0.0)
        self.log, self.watched, self.staging = log, None, None

    def _in_watched(self, dst: torch.Tensor) -> bool:
        w = self.watched
        return w is not None and w.data_ptr() <= dst.data_ptr() < w.data_ptr() + w.nbytes

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        super()._copy(dst, src)
        if self._in_watched(dst):
            lo = (dst.data_ptr() - self.watched.data_ptr()) // dst.element_size()
            self.log.append(("landed", lo, lo + dst.numel()))


def train(transport, steps=STEPS, stage=2, on_forward=None, **kw):
    """Losses, final state and device parameters of a DPU run (delayed from the first step)."""
    model = make_model(seed=0)
    opt = zk.ZeroOffloadAdamW(model, lr=2e-3, weight_decay=0.01, bucket_numel=50_000, tile_numel=TILE,
                              transport=transport, delay_update_after=0, stage=stage, dpu_writeback="per_module",
                              **kw)  # fmt: skip
    if on_forward is not None:
        on_forward(model, opt)
    losses = []
    for step in make_data(steps, batch=4, seed=3):
        loss = model(step[0][:, :-1], step[0][:, 1:])
        losses.append(loss.item())
        opt.backward(loss)
        opt.step()
    opt.synchronize()
    state = opt.state_dict()["state"]
    with opt.gathered():
        params = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    opt.close()
    return losses, state, params


@functools.cache
def reference(stage: int, state_dtype: torch.dtype = torch.float32):
    """train() on the plain CPU transport (synchronous copies), once per stage and moments' format."""
    return train(HostTransport(), stage=stage, state_dtype=state_dtype)


def assert_same_run(a, b):
    assert a[0] == b[0], "losses differ"
    assert torch.equal(a[2], b[2]), "device params differ"
    for i in a[1]:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[1][i][key], b[1][i][key]), f"param {i} {key} differs"


def ordered_run(monkeypatch, delay_s: float = 0.004):
    """A DPU run on LoggingTransport with each writeback's start, each module's forward (after the optimizer's
    wait) and each span of the background update's kernel logged (whether it writes the buffer the last writeback
    copies from): the log, the model's modules and their own parameters' flat ranges (one rank: flat = partition
    coordinates)."""
    log: list = []
    tr = LoggingTransport(log, delay_s)
    ranges = {}
    kernel = update_module.cpu_adam_step

    def logged_kernel(*args, param_out, **kw):
        source = tr.staging  # the buffer the last writeback's copies read
        lo = param_out.data_ptr() - (source.data_ptr() if source is not None else 0)
        inside = source is not None and 0 <= lo < source.nbytes
        log.append(("adam", inside, lo // param_out.element_size(), lo // param_out.element_size() + param_out.numel()))
        return kernel(*args, param_out=param_out, **kw)

    monkeypatch.setattr(update_module, "cpu_adam_step", logged_kernel)

    def on_forward(model, opt):
        tr.watched = opt.flat
        for name, m in model.named_modules():
            own = [p for p in m.parameters(recurse=False)]
            if own:
                ranges[name] = [(opt._offset[p], opt._offset[p] + p.numel()) for p in own]
                m.register_forward_pre_hook(lambda m, a, name=name: log.append(("forward", name)))
        write_tiles = opt.update._write_tiles

        def logged_write_tiles():
            log.append(("writeback",))
            tr.staging = opt.update.out_buf
            return write_tiles()

        opt.update._write_tiles = logged_write_tiles

    train(tr, on_forward=on_forward)
    tr.close()
    return log, ranges


def cycles(log: list) -> list[list]:
    """The log cut at each writeback: what happened until the next one (its tiles landing, the next forward, the
    next update)."""
    out: list[list] = [[]]
    for e in log:
        if e[0] == "writeback":
            out.append([])
        else:
            out[-1].append(e)
    return out


def early(cycle: list, kind: str, ranges: dict | None = None) -> list:
    """Forwards of a module ("forward") that began before a tile covering their range had landed (read the old
    parameters), or spans of the update ("adam") written into the writeback's source before the tiles covering
    them had landed (changed what is copied)."""
    landed: list[tuple[int, int]] = []
    tiles = [e[1:] for e in cycle if e[0] == "landed"]
    bad = []
    for e in cycle:
        if e[0] == "landed":
            landed.append(e[1:])
        elif e[0] == kind and (kind == "forward" or e[1]):
            for a, b in ranges[e[1]] if kind == "forward" else [e[2:]]:
                if any(lo < b and a < hi and (lo, hi) not in landed for lo, hi in tiles):
                    bad.append(e[1:])
    return bad


def test_forward_and_update_start_before_the_last_tile_landed_and_after_their_own(monkeypatch):
    """The ordering log of each DPU writeback: the next forward's first module runs, and the next update starts,
    while later tiles are still being copied; no module's forward runs before the tiles covering it have landed.
    The update writes its parameters over its own gradients, in the other landing buffer than the one the
    writeback copies from (update.py, params_over_grads): it never writes the copies' source."""
    log, ranges = ordered_run(monkeypatch)
    assert len(cycles(log)) == STEPS + 1  # a writeback at steps 2..STEPS and at synchronize()
    forwards = updates = 0
    tiles = sum(e[0] == "landed" for e in cycles(log)[1])  # of one writeback (the next forward waits for them all)
    assert tiles > 10, "the writeback was not tiled"
    for cycle in cycles(log)[1:]:
        for kind in ("forward", "adam"):
            seen = [i for i, e in enumerate(cycle) if e[0] == kind]
            if seen:  # (the last update may outrun its writeback: the next one's marker comes before its tiles)
                before = sum(e[0] == "landed" for e in cycle[: seen[0]])
                assert before < tiles, f"{kind} waited for the whole writeback"
                assert not early(cycle, kind, ranges), f"{kind} before its tiles landed: {early(cycle, kind, ranges)}"
        assert not any(e[0] == "adam" and e[1] for e in cycle), "the update wrote the writeback's source"
        forwards += any(e[0] == "forward" for e in cycle)
        updates += any(e[0] == "adam" for e in cycle)
    assert forwards == STEPS - 2 and updates == STEPS - 1  # the writebacks of steps 2..STEPS-1 / 2..STEPS


def test_a_missing_forward_wait_is_caught(monkeypatch):
    """With the per-module wait removed, forward reads tiles that have not landed: the ordering check and the
    comparison with the CPU run both fail (the end of forward still waits for every tile)."""
    monkeypatch.setattr(ForwardWaits, "_wait", lambda self, ranges: None)
    log, ranges = ordered_run(monkeypatch)
    assert any(early(c, "forward", ranges) for c in cycles(log)), "a module read its tiles before they landed"
    tr = CopyEngineTransport(delay_s=0.004)
    got = train(tr)
    tr.close()
    with pytest.raises(AssertionError, match="differ"):
        assert_same_run(got, reference(2))


@pytest.mark.parametrize("stage, state_dtype", [(2, torch.float32), (3, torch.float32), (2, torch.bfloat16)],
                         ids=["stage2", "stage3", "stage2-bf16-moments"])  # fmt: skip
def test_tiled_dpu_run_is_bit_identical_to_the_cpu_run(stage, state_dtype):
    tr = CopyEngineTransport(delay_s=0.001)
    fences = []
    got = train(tr, stage=stage, state_dtype=state_dtype,
                on_forward=lambda model, opt: fences.append(opt.update.fence))  # fmt: skip
    tr.close()
    assert isinstance(fences[0], TileFence), "the writeback was not tiled"
    assert_same_run(got, reference(stage, state_dtype))


def test_a_zero_grad_that_does_not_wait_for_the_copies_out_of_its_landing_buffer_is_caught(monkeypatch):
    """zero_grad(set_to_none=False) right after step() zeroes the landing buffer the writeback is still copying the
    new parameters from (tiles in flight under per-module waits): it waits for those copies first. Without that wait
    the device gets zeros for the tiles not yet copied and the run differs from the CPU run."""

    def run(transport):
        model = make_model(seed=0)
        opt = zk.ZeroOffloadAdamW(model, lr=2e-3, weight_decay=0.01, bucket_numel=50_000, tile_numel=TILE,
                                  transport=transport, delay_update_after=0, dpu_writeback="per_module")  # fmt: skip
        losses = []
        for step in make_data(STEPS, batch=4, seed=3):
            loss = model(step[0][:, :-1], step[0][:, 1:])
            losses.append(loss.item())
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=False)
        opt.synchronize()
        params = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        opt.close()
        return losses, params

    ref = run(HostTransport())
    tr = CopyEngineTransport(delay_s=0.004)
    got = run(tr)
    assert got[0] == ref[0] and torch.equal(got[1], ref[1])
    monkeypatch.setattr(GradPath, "landing_free", lambda self, s, host=False: None)
    got = run(tr)
    tr.close()
    assert got[0] != ref[0], "the broken run was not caught"


def test_a_missing_gather_wait_is_caught(monkeypatch):
    """Stage 3: a unit's gather that does not wait for its tiles of the writeback copies the old shard."""
    monkeypatch.setattr(TileFence, "wait", lambda self, ranges: None)
    tr = CopyEngineTransport(delay_s=0.004)
    got = train(tr, stage=3)
    tr.close()
    with pytest.raises(AssertionError, match="differ"):
        assert_same_run(got, reference(3))


def test_reads_outside_forward_wait_for_every_tile():
    """model.state_dict() right after a step, then opt.synchronize(), see the new parameters (as on the CPU
    transport, whose copies are synchronous)."""

    def run(transport):
        model = make_model(seed=0)
        opt = zk.ZeroOffloadAdamW(model, lr=2e-3, tile_numel=TILE, transport=transport, delay_update_after=0,
                                  dpu_writeback="per_module")  # fmt: skip
        for step in make_data(3, batch=2, seed=3):
            opt.backward(model(step[0][:, :-1], step[0][:, 1:]))
            opt.step()
        fence = opt.update.fence
        pending = fence.pending if fence is not None else None
        after_step = {k: v.clone() for k, v in model.state_dict().items()}
        assert fence is None or fence.pending == 0
        opt.synchronize()
        assert fence is None or fence.pending == 0
        after_sync = {k: v.clone() for k, v in model.state_dict().items()}
        opt.close()
        return pending, after_step, after_sync

    tr = CopyEngineTransport(delay_s=0.003)
    pending, got_step, got_sync = run(tr)
    tr.close()
    _, ref_step, ref_sync = run(HostTransport())
    assert pending > 0, "every tile had landed before the read: nothing was tested"
    for got, ref in ((got_step, ref_step), (got_sync, ref_sync)):
        for k in ref:
            assert torch.equal(got[k], ref[k]), k


def test_by_default_a_read_right_after_step_sees_the_whole_writeback():
    """dpu_writeback="whole" (the default) at stage 2: a direct read of every parameter right after step() (an EMA
    would do this, bypassing the modules' forward) sees the new values, with copies delayed as over a slow link;
    with "per_module" the same read may find tiles still in flight (the documented contract: synchronize first)."""

    def run(transport, mode):
        model = make_model(seed=0)
        opt = zk.ZeroOffloadAdamW(model, lr=2e-3, tile_numel=TILE, transport=transport, delay_update_after=0,
                                  dpu_writeback=mode)  # fmt: skip
        for step in make_data(3, batch=2, seed=3):
            opt.backward(model(step[0][:, :-1], step[0][:, 1:]))
            opt.step()
        read = [p.detach().clone() for p in model.parameters()]  # no synchronize, no module forward
        fence = opt.update.fence
        pending = fence.pending if fence is not None else 0
        opt.close()
        return read, pending

    ref, _ = run(HostTransport(), "whole")
    tr = CopyEngineTransport(delay_s=0.003)
    got, pending = run(tr, "whole")
    _, pending_tiled = run(tr, "per_module")
    tr.close()
    assert pending == 0 and pending_tiled > 0, (pending, pending_tiled)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("value", ["tiles", "", None, 1, "WHOLE"])
def test_bad_dpu_writeback_is_refused_before_the_model_is_touched(value):
    model = make_model(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="dpu_writeback"):
        zk.ZeroOffloadAdamW(model, lr=1e-3, delay_update_after=0, dpu_writeback=value)
    with pytest.raises(ValueError, match="dpu_writeback='per_module' needs the delayed"):
        zk.ZeroOffloadAdamW(model, lr=1e-3, dpu_writeback="per_module")
    assert all(p.dtype == b.dtype and torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ---------------------------------------------------------------- the host syncs left on the critical path


def _caller(depth: int = 2) -> tuple[str, str]:
    f = sys._getframe(depth)
    return f.f_globals.get("__name__", ""), f.f_code.co_name


def test_the_steps_host_syncs_are_the_listed_ones(monkeypatch):
    """In a steady-state DPU iteration (forward, backward, step) at stage 2 on the GPU's data flow, the main thread
    blocks on the device only where the list below says (each is a sync on CUDA): a new `.item()`, `.tolist()`,
    `torch.cuda.synchronize` or host wait on a copy in the library fails this test.
      - step() (GradPath._global_checks): the sum of squares and the overflow flag (on CUDA one `.tolist()` of both).
    Not host syncs: the forward's waits for its tiles (device_wait: a stream wait on CUDA), the background update's
    waits for the gradient's copies (GradPath.defer_copies) and for the copies out of staging (its own thread),
    step()'s wait for the background update (host work). Until 2026-11-27 the end of backward waited for every copy
    (GradPath._end_micro's transport.synchronize: 2.3 ms of the H200's 95M DPU step)."""
    import threading

    calls: Counter = Counter()
    main = threading.main_thread()

    def counting(name, fn):
        def wrapper(*a, **kw):
            mod, func = _caller()
            if mod.startswith("zo_kernels") and mod != "zo_kernels.transport" and threading.current_thread() is main:
                calls[(func, name)] += 1
            return fn(*a, **kw)

        return wrapper

    for name in ("item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("cuda.synchronize", torch.cuda.synchronize))
    tr = CopyEngineTransport(delay_s=0.001)
    for name in ("wait", "synchronize"):
        monkeypatch.setattr(tr, name, counting(name, getattr(tr, name)))
    model = make_model(seed=0)
    opt = zk.ZeroOffloadAdamW(model, lr=2e-3, tile_numel=TILE, transport=tr, delay_update_after=0,
                              dpu_writeback="per_module",
                              bucket_numel=50_000)  # fmt: skip
    per_step = []
    for step in make_data(4, batch=2, seed=3):
        calls.clear()
        opt.backward(model(step[0][:, :-1], step[0][:, 1:]))
        opt.step()
        per_step.append(dict(calls))
    opt.close()
    tr.close()
    expected = {("_global_checks", "item"): 2}
    assert per_step[2:] == [expected] * 2


def test_a_load_under_the_writeback_does_not_change_what_its_copies_send():
    """A state saved between a delayed update and its writeback (staged), loaded while the tiles of a later writeback
    are still being copied (a step that wrote update 2 and then overflowed: no update runs after it): resume()
    rewrites staging only after those copies have read it, so the device holds what that writeback sent, as on the
    CPU transport."""

    def run(transport):
        model = make_model(seed=0)
        opt = zk.ZeroOffloadAdamW(model, lr=2e-3, tile_numel=TILE, transport=transport, delay_update_after=0,
                                  dpu_writeback="per_module")  # fmt: skip
        saved = None
        for i, step in enumerate(make_data(3, batch=2, seed=3)):
            loss = model(step[0][:, :-1], step[0][:, 1:])
            opt.backward(loss * float("inf") if i == 2 else loss)  # the third step writes update 2, then overflows
            opt.step()
            if i == 0:
                saved = copy.deepcopy(opt.state_dict())  # update 1 done, not yet written: staged
        assert saved["zero_offload"]["staged"] and opt.stats["skip_reason"] == "overflow"
        pending = opt.update.fence.pending if opt.update.fence is not None else None
        opt.load_state_dict(saved)
        device = {k: v.clone() for k, v in model.state_dict().items()}
        opt.close()
        return pending, device

    tr = CopyEngineTransport(delay_s=0.003)
    pending, got = run(tr)
    tr.close()
    _, ref = run(HostTransport())
    assert pending > 0, "every tile had landed before the load: nothing was tested"
    for k in ref:
        assert torch.equal(got[k], ref[k]), f"{k} differs"


def test_a_writeback_is_at_most_max_writeback_tiles_of_whole_update_tiles():
    """Each writeback queues at most update.MAX_WRITEBACK_TILES copies (on the H200, 626 queued at once held step()
    for the whole copy), each a whole number of update tiles but the last. Before, one copy per update tile (228
    for this model)."""
    seen = []

    def watch(model, opt):
        fence = opt.update.fence
        model.register_forward_pre_hook(lambda *a: seen.append(list(zip(fence._lo, fence._hi))))

    train(CopyEngineTransport(), steps=3, on_forward=watch)
    tiles = [t for t in seen if t][-1]
    assert 1 < len(tiles) <= getattr(update_module, "MAX_WRITEBACK_TILES", 32), f"{len(tiles)} tiles"
    assert all((hi - lo) % TILE == 0 for lo, hi in tiles[:-1]) and tiles[0][0] == 0
    assert all(a[1] == b[0] for a, b in zip(tiles, tiles[1:])), "the tiles do not cover the partition in order"
