"""Hardening: a bad-input battery over every entry point, an overflow soak, crash-safe checkpoints under
SIGKILL, bitwise resume, failures in the background update and in another rank, and a leak soak."""

import gc
import os
import random
import re
import signal
import time
import traceback

import pytest
import torch
from helpers import digest
from offload_ref import flat, make_data, make_model

import zo_kernels as zk
from zo_kernels.cli import main as cli
from zo_kernels.offload import scaler as offload_scaler
from zo_kernels.offload import update as offload_update
from zo_kernels.transport import HostPool, HostTransport, Staging, tiled_writeback


def tiny(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 16))


def tiny_batch(step, seed=7):
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def tiny_loss(model, step):
    x, y = tiny_batch(step)
    out = model(x.to(next(model.parameters()).dtype))
    return ((out.float() - y) ** 2).mean()


# ---------------------------------------------------------------- the bad-input battery


def _battery():
    """(id, build) pairs; build() -> (call, tensors to hash, expected exception, message regex)."""
    t = lambda *s, dt=torch.float32: torch.randn(*s).to(dt)  # noqa: E731
    cases = []

    def case(name, exc, match):
        def deco(build):
            cases.append(pytest.param(build, exc, match, id=name))
            return build

        return deco

    # the kernel
    @case("kernel-grad-size", ValueError, r"grad has 9 elements, expected 10")
    def _():
        p, g, m, v = t(10), t(9), t(10), t(10)
        return lambda: zk.cpu_adam_step(p, g, m, v, step=1, lr=1e-3), [p, g, m, v]

    @case("kernel-grad-int", TypeError, r"grad must have dtype float32, float16, bfloat16")
    def _():
        p, g, m, v = t(10), torch.ones(10, dtype=torch.int32), t(10), t(10)
        return lambda: zk.cpu_adam_step(p, g, m, v, step=1, lr=1e-3), [p, g, m, v]

    @case("kernel-out-overlap", ValueError, r"param and param_out overlap")
    def _():
        p, g, m, v = t(10), t(10), t(10), t(10)
        return lambda: zk.cpu_adam_step(p, g, m, v, step=1, lr=1e-3, param_out=p), [p, g, m, v]

    @case("kernel-step-0", ValueError, r"step must be >= 1")
    def _():
        p, g, m, v = t(10), t(10), t(10), t(10)
        return lambda: zk.cpu_adam_step(p, g, m, v, step=0, lr=1e-3), [p, g, m, v]

    @case("kernel-eps-nan", ValueError, r"eps must be finite")
    def _():
        p, g, m, v = t(10), t(10), t(10), t(10)
        return lambda: zk.cpu_adam_step(p, g, m, v, step=1, lr=1e-3, eps=float("nan")), [p, g, m, v]

    @case("kernel-noncontig", ValueError, r"exp_avg must be contiguous")
    def _():
        p, g, m, v = t(10), t(10), t(20)[::2], t(10)
        return lambda: zk.cpu_adam_step(p, g, m, v, step=1, lr=1e-3), [p, g, m, v]

    @case("sum_squares-out-dtype", TypeError, r"out must have dtype bfloat16")
    def _():
        x, o = t(10, dt=torch.bfloat16), t(10)
        return lambda: zk.sum_squares(x, out=o), [x, o]

    # CPUAdam
    @case("cpuadam-half-param", TypeError, r"params\[0\] must have dtype float32")
    def _():
        p = torch.zeros(3, dtype=torch.float16, requires_grad=True)
        return lambda: zk.CPUAdam([p]), [p]

    @case("cpuadam-beta", ValueError, r"betas\[0\] must be in \[0, 1\)")
    def _():
        p = torch.zeros(3, requires_grad=True)
        return lambda: zk.CPUAdam([p], betas=(1.5, 0.9)), [p]

    # cast / pack / unpack
    @case("cast-out-numel", ValueError, r"out has 4 elements, x has 5")
    def _():
        x, o = t(5), t(4, dt=torch.float16)
        return lambda: zk.cast(x, torch.float16, out=o), [x, o]

    @case("cast-dtype", TypeError, r"dtype must be torch.float32, torch.float16 or torch.bfloat16")
    def _():
        x = t(5)
        return lambda: zk.cast(x, torch.int32), [x]

    @case("pack-out-small", ValueError, r"out has 7 elements, needs at least 8")
    def _():
        a, b, o = t(3), t(5), t(7)
        return lambda: zk.pack([a, b], out=o), [a, b, o]

    @case("pack-align-0", ValueError, r"align must be >= 1")
    def _():
        a = t(3)
        return lambda: zk.pack([a], align=0), [a]

    @case("pack-devices", ValueError, r"tensors\[1\] is on meta but tensors\[0\] is on cpu")
    def _():
        a = t(3)
        return lambda: zk.pack([a, torch.empty(2, device="meta")]), [a]

    @case("unpack-offsets", ValueError, r"offsets\[0\] \+ tensors\[0\].numel\(\) = 13 > flat.numel\(\) = 12")
    def _():
        f, a = t(12), t(4)
        return lambda: zk.unpack(f, [a], offsets=[9]), [f, a]

    # the copy interface
    @case("copy-size-mismatch", ValueError, r"dst has 4 elements \(16 bytes\) but src has 5 \(20 bytes\)")
    def _():
        d, s = t(4), t(5)
        return lambda: HostTransport().h2d(d, s), [d, s]

    @case("copy-dtype-mismatch", TypeError, r"dst is torch.float32 but src is torch.float16")
    def _():
        d, s = t(4), t(4, dt=torch.float16)
        return lambda: HostTransport().d2h(d, s), [d, s]

    @case("copy-freed-buffer", ValueError, r"src lies in a pool buffer that was given back")
    def _():
        tr = HostTransport()
        buf = tr.pool.take(8, torch.float32)
        tr.pool.give(buf)
        d = t(8)
        return lambda: tr.h2d(d, buf), [d, buf]

    @case("pool-bound", MemoryError, r"host pool bound of 64 bytes exceeded")
    def _():
        alloc = lambda n: (lambda x: (x.data_ptr(), x))(torch.empty(n, dtype=torch.uint8))  # noqa: E731
        pool = HostPool(64, alloc, lambda a, o: None)
        return lambda: pool.take(17, torch.float32), []

    @case("writeback-staging-dtype", TypeError, r"staging is torch.float16 but dst is torch.bfloat16")
    def _():
        p, g, m, v = t(10), t(10), t(10), t(10)
        dst, st = torch.zeros(10, dtype=torch.bfloat16), Staging(torch.zeros(10, dtype=torch.float16), 5)
        return (lambda: tiled_writeback(HostTransport(), p, g, m, v, dst=dst, staging=st, step=1, lr=1e-3),
                [p, g, m, v, dst, st.buf])  # fmt: skip

    # ZeroOffloadAdamW
    @case("zo-duplicate", ValueError, r"param group 0 param 1 appears more than once")
    def _():
        p = torch.nn.Parameter(torch.randn(3))
        return lambda: zk.ZeroOffloadAdamW([p, p]), [p]

    @case("zo-dtype", TypeError, r"dtype must be torch.bfloat16, torch.float16 or torch.float32")
    def _():
        m = tiny()
        return lambda: zk.ZeroOffloadAdamW(m.parameters(), dtype=torch.float64), list(m.parameters())

    @case("zo-bucket", ValueError, r"bucket_numel must be >= 1, got 0")
    def _():
        m = tiny()
        return lambda: zk.ZeroOffloadAdamW(m.parameters(), bucket_numel=0), list(m.parameters())

    @case("zo-timeout", ValueError, r"collective_timeout_s must be > 0")
    def _():
        m = tiny()
        return lambda: zk.ZeroOffloadAdamW(m.parameters(), collective_timeout_s=0), list(m.parameters())

    @case("zo-nonscalar-loss", ValueError, r"loss must be a scalar tensor")
    def _():
        m = tiny()
        opt = zk.ZeroOffloadAdamW(m.parameters())
        out = m(torch.randn(2, 16, dtype=torch.bfloat16))
        return lambda: opt.backward(out), [opt.master, opt.exp_avg, opt.exp_avg_sq, opt.flat]

    @case("zo-state-shape", ValueError, r"param 0: saved exp_avg has shape \(2, 2\)")
    def _():
        m = tiny()
        opt = zk.ZeroOffloadAdamW(m.parameters())
        sd = opt.state_dict()
        sd["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2, 2), "exp_avg_sq": torch.zeros(2, 2)}}
        return lambda: opt.load_state_dict(sd), [opt.master, opt.exp_avg, opt.exp_avg_sq, opt.flat]

    # checkpoints
    @case("ckpt-path-type", TypeError, r"path must be a str or os.PathLike, got int")
    def _():
        m = tiny()
        return lambda: zk.save_checkpoint(3, m), list(m.parameters())

    @case("ckpt-model-type", TypeError, r"model must be a torch.nn.Module, got dict")
    def _():
        return lambda: zk.save_checkpoint("/tmp/x.pt", {}), []

    @case("ckpt-missing-dir", FileNotFoundError, r"path: directory /nonexistent/dir does not exist")
    def _():
        m = tiny()
        return lambda: zk.save_checkpoint("/nonexistent/dir/x.pt", m), list(m.parameters())

    @case("ckpt-missing-file", FileNotFoundError, r"path: no checkpoint at")
    def _():
        m = tiny()
        return lambda: zk.load_checkpoint("/nonexistent.pt", m), list(m.parameters())

    @case("ckpt-optimizer-type", TypeError, r"optimizer must be a torch.optim.Optimizer or None, got str")
    def _():
        m = tiny()
        return lambda: zk.load_checkpoint("/tmp/x.pt", m, "adam"), list(m.parameters())

    # the command line: errors are one line and exit 2 (state: no file is written)
    @case("cli-plan-gpus", SystemExit, r"2")
    def _():
        return lambda: _exit(cli(["plan", "--params", "1e9", "--gpus", "-3"])), []

    @case("cli-dashboard-missing", SystemExit, r"2")
    def _():
        return lambda: _exit(cli(["dashboard", "/nonexistent.json", "-o", "/tmp/never.html"])), []

    @case("cli-demo-steps", SystemExit, r"2")
    def _():
        return lambda: _exit(cli(["demo", "--steps", "-1"])), []

    return cases


def _exit(code):
    raise SystemExit(code)


BATTERY = _battery()


def test_battery_has_at_least_30_distinct_cases():
    assert len(BATTERY) >= 30 and len({c.id for c in BATTERY}) == len(BATTERY)


@pytest.mark.parametrize("build, exc, match", BATTERY)
def test_bad_input_battery(build, exc, match, capsys):
    call, tensors = build()
    before = digest(*tensors)
    with pytest.raises(exc, match=match):
        call()
    assert digest(*tensors) == before, "a refused call modified a tensor"
    if exc is SystemExit:
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


# ---------------------------------------------------------------- overflow soak


def test_overflow_soak_500_fp16_steps(monkeypatch):
    monkeypatch.setattr(offload_scaler, "SCALE_INTERVAL", 25)  # exercise the growth rule within the soak
    model = tiny()
    opt = zk.ZeroOffloadAdamW(model.parameters(), dtype=torch.float16, loss_scale="dynamic", lr=1e-3)
    rng = random.Random(0)
    poisoned = set(rng.sample(range(500), 50))
    scale, good = 2.0**16, 0
    params = list(model.parameters())
    for step in range(500):
        hook = None
        if step in poisoned:
            bad = float("nan") if rng.random() < 0.5 else float("inf")
            victim = params[rng.randrange(len(params))]
            hook = victim.register_hook(lambda g, bad=bad: g.index_fill(0, torch.tensor([0]), bad))
            before = digest(opt.master, opt.exp_avg, opt.exp_avg_sq, opt.flat)
            steps = [g.get("step") for g in opt.param_groups]
        opt.backward(tiny_loss(model, step))
        if hook:
            hook.remove()
        opt.step()
        if step in poisoned:
            assert opt.stats["skipped"] and opt.stats["skip_reason"] == "overflow", step
            assert digest(opt.master, opt.exp_avg, opt.exp_avg_sq, opt.flat) == before, f"step {step} changed state"
            assert [g.get("step") for g in opt.param_groups] == steps
            scale, good = scale / 2, 0
        else:
            assert not opt.stats["skipped"], step
            good += 1
            if good == 25:
                scale, good = scale * 2, 0
        assert opt.loss_scale == scale, f"step {step}: scale {opt.loss_scale} != {scale}"
        assert torch.isfinite(opt.master).all() and torch.isfinite(opt.exp_avg_sq).all()
    assert opt.param_groups[0]["step"] == 450


# ---------------------------------------------------------------- checkpoints


def _saver(path: str, ready_fd: int) -> None:
    """Child process: save checkpoints of a growing counter forever, reporting each completed save."""
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP thread pools
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-3)
    i = 0
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(i % 200))
        opt.refresh_masters_from_model()  # a consistent (weights, masters) pair per counter value
        zk.save_checkpoint(path, model, opt, counter=i)
        os.write(ready_fd, f"{i}\n".encode())
        i += 1


def test_sigkill_during_save_never_corrupts_the_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    rng = random.Random(1)
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model.parameters(), lr=1e-3)
    landed = 0
    for trial in range(20):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never returns
            os.close(r)
            try:
                _saver(path, w)
            finally:
                os._exit(1)
        os.close(w)
        reports = b""
        while reports.count(b"\n") < 1 + trial % 3:  # let it finish a few saves, then kill it mid-way
            reports += os.read(r, 64)
        time.sleep(rng.uniform(0.0, 0.08))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        done = [int(x) for x in reports.split()]
        # a kill during a save leaves its temporary file behind: proof that saves were really interrupted
        landed += any(f.endswith(".tmp") for f in os.listdir(tmp_path))
        extra = zk.load_checkpoint(path, model, opt)  # must load intact (and removes the killed save's temp file)
        assert extra["counter"] >= done[-1], f"trial {trial}: lost a completed save"
        for p in model.parameters():
            assert torch.all(p == float(extra["counter"] % 200)), f"trial {trial}: torn checkpoint"
        assert torch.all(opt.master[: opt.numel] == float(extra["counter"] % 200))
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    print(f"{landed} of 20 kills landed mid-save")
    assert landed >= 5, f"only {landed} of 20 kills landed mid-save"


@pytest.mark.parametrize("kw", [dict(dtype=torch.float16, loss_scale="dynamic"), dict(delay_update_after=3)],
                         ids=["fp16-dynamic", "dpu"])  # fmt: skip
def test_resume_is_bitwise_identical(tmp_path, kw):
    data = make_data(12, batch=4)

    def train(model, opt, steps):
        for s in steps:
            x = data[s][0]
            opt.backward(model(x[:, :-1], x[:, 1:]))
            opt.step()

    model_a = make_model()
    opt_a = zk.ZeroOffloadAdamW(model_a.parameters(), lr=2e-3, **kw)
    train(model_a, opt_a, range(12))
    opt_a.synchronize()

    model_b = make_model()
    opt_b = zk.ZeroOffloadAdamW(model_b.parameters(), lr=2e-3, **kw)
    train(model_b, opt_b, range(6))
    zk.save_checkpoint(tmp_path / "c.pt", model_b, opt_b, step=6)
    model_c = make_model(seed=99)  # different weights: everything must come from the checkpoint
    opt_c = zk.ZeroOffloadAdamW(model_c.parameters(), lr=2e-3, **kw)
    assert zk.load_checkpoint(tmp_path / "c.pt", model_c, opt_c) == {"step": 6}
    train(model_c, opt_c, range(6, 12))
    opt_c.synchronize()
    assert torch.equal(opt_a.master, opt_c.master) and torch.equal(opt_a.exp_avg_sq, opt_c.exp_avg_sq)
    assert torch.equal(flat(model_a.parameters()), flat(model_c.parameters()))
    assert opt_a.loss_scale == opt_c.loss_scale


def test_checkpoint_refuses_other_shapes_and_changes_nothing(tmp_path):
    from zo_kernels.gpt import GPT, GPTConfig

    model = make_model()
    opt = zk.ZeroOffloadAdamW(model.parameters())
    zk.save_checkpoint(tmp_path / "c.pt", model, opt)
    other = GPT(GPTConfig(vocab=96, context=32, layers=2, width=128, heads=4))
    opt2 = zk.ZeroOffloadAdamW(other.parameters())
    before = digest(opt2.master, opt2.exp_avg, opt2.flat)
    shapes = r"checkpoint model\['tok.weight'\] has shape \(96, 192\), the model's has \(96, 128\)"
    with pytest.raises(ValueError, match=shapes):
        zk.load_checkpoint(tmp_path / "c.pt", other, opt2)
    assert digest(opt2.master, opt2.exp_avg, opt2.flat) == before
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not a readable checkpoint"):
        zk.load_checkpoint(tmp_path / "junk.pt", model, opt)


def test_model_only_checkpoint_refreshes_the_masters(tmp_path):
    src = make_model(seed=3)
    zk.save_checkpoint(tmp_path / "w.pt", src)  # weights only, fp32
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model.parameters())
    with pytest.warns(UserWarning, match="fp32 masters were refreshed from the loaded weights"):
        zk.load_checkpoint(tmp_path / "w.pt", model, opt)
    expected = flat(p.to(torch.bfloat16) for p in src.parameters())
    assert torch.equal(opt.master[: opt.numel], expected), "masters are not stale: they follow the loaded model"


# ---------------------------------------------------------------- failures in the background update


def test_background_update_exception_surfaces_at_next_step(monkeypatch):
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model.parameters(), delay_update_after=1)
    real = offload_update.cpu_adam_step
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ArithmeticError("disk on fire in the worker")
        return real(*args, **kwargs)

    monkeypatch.setattr(offload_update, "cpu_adam_step", failing)
    x = make_data(1)[0][0]
    for _ in range(3):  # step 1 synchronous; step 2 starts update #1 (ok), step 3 update #2 (fails in background)
        opt.backward(model(x[:, :-1], x[:, 1:]))
        opt.step()
    opt.backward(model(x[:, :-1], x[:, 1:]))
    with pytest.raises(ArithmeticError, match="disk on fire") as info:
        opt.step()
    frames = "".join(traceback.format_tb(info.value.__traceback__))
    assert "failing" in frames and "cpu_update" in frames, "the original traceback is kept"
    with pytest.raises(RuntimeError, match="stopped midway.*load a checkpoint with the optimizer.s state"):
        opt.step()


def test_background_update_that_hangs_times_out(monkeypatch):
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model.parameters(), delay_update_after=0, update_timeout_s=0.3)
    monkeypatch.setattr(offload_update, "cpu_adam_step", lambda *a, **k: time.sleep(3))
    x = make_data(1)[0][0]
    opt.backward(model(x[:, :-1], x[:, 1:]))
    opt.step()  # starts the (stuck) background update
    opt.backward(model(x[:, :-1], x[:, 1:]))
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"did not finish within 0.3 s"):
        opt.step()
    assert time.perf_counter() - t0 < 2.0


def test_one_rank_failing_makes_the_other_fail_not_hang(tmp_path):
    from dist_worker import run_failing

    outcome = run_failing(str(tmp_path), timeout_s=5.0)
    assert outcome["type"] == "RuntimeError", outcome
    expected = r"rank 0: .* failed or did not finish within 5 s; another rank has probably failed"
    assert re.search(expected, outcome["msg"]), outcome
    # (a two-rank hunt's note: state_dict() called on rank 0 only timed out saying only that a rank had failed)
    assert "or did not make the same call (every rank makes the optimizer's collective calls" in outcome["msg"]
    assert outcome["seconds"] < 30


# ---------------------------------------------------------------- leak soak


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s*(\d+)", f.read()).group(1)) * 1024


def test_leak_soak_2000_steps():
    model = tiny()
    opt = zk.ZeroOffloadAdamW(model.parameters(), delay_update_after=10, lr=1e-4)
    pool = opt.transport.pool
    for step in range(2000):
        opt.backward(tiny_loss(model, step))
        opt.step()
        if step == 299:
            gc.collect()
            rss0, pool0 = _rss(), (pool.reserved, len(pool._live))
    gc.collect()
    growth = (_rss() - rss0) / rss0
    assert growth < 0.01, f"resident memory grew {growth:.2%} over 1,700 steps after warm-up"
    assert (pool.reserved, len(pool._live)) == pool0, "the host pool changed"
    opt.close()
