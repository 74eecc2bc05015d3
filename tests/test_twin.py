"""gpu_fraction (Twin-Flow): the tail of each rank's partition kept and updated on the device by torch's fused AdamW,
beside CPU Adam on the rest.

The oracle matrix (tests/test_oracle_matrix.py) crosses gpu_fraction (0, 0.5, 1) with every other option against plain
PyTorch. Here: a few stronger cases against the same oracle, the tail's gradients never reaching the host, checkpoints
that do not depend on the fraction or the world size, the memory report, the refused combinations, and the GPU-shaped
run in which a missing wait on the device stream fails the comparison.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import pytest
import torch
from dist_worker import spawn_ranks
from oracle import FeatureNet
from test_oracle_matrix import ADAMW, DTYPES, Case, check_case, run_oracle, run_zo
from torch.utils._python_dispatch import TorchDispatchMode

import zo_kernels as zk
from zo_kernels.offload.twin import TwinUpdate, check_gpu_fraction, device_split, split_runs
from zo_kernels.transport import CopyEngineTransport

BASE = dict(index=900, dtype="fp32", micro=1, clip=None, scale=None, dpu=None, world=1, groups=None, frozen=False,
            tied=False, unused=False, buffers=False, inf=None, transport="host", stage="2")  # fmt: skip


def case(**kw) -> Case:
    return Case(**{**BASE, **kw})


def judge(c: Case, zo: list[dict]) -> list[str]:
    """What differs between the run and the oracle (tests/test_oracle_matrix.py's check_case)."""
    dtype = DTYPES[c.dtype]
    threads = torch.get_num_threads()
    torch.set_num_threads(zo[0]["threads"])
    try:
        want = run_oracle(c, dtype)
        if dtype == torch.float32:
            other = run_oracle(c, dtype, foreach=True, reverse_sums=True, nudge=True)
        else:
            other = run_oracle(c, torch.float32)
    finally:
        torch.set_num_threads(threads)
    return check_case(c, zo, want, other)


# Stronger than the matrix's pairs where the tail meets the rest of the step: the norm and the overflow flag over both
# parts, accumulation on the device, a param cut by the split, and DPU's delay on the tail.
STRONG = [
    case(gpu_fraction=0.3, micro=3, clip="norm", scale="dynamic", dpu=0, groups="all", unused=True),
    case(gpu_fraction=0.7, dtype="bf16", micro=2, clip="framework", inf="late", dpu=2, transport="copy_engine"),
    case(gpu_fraction=0.01, dtype="fp16", scale="static", stage="3+cpu", frozen=True, tied=True),
    case(gpu_fraction=1.0, micro=2, clip="norm", inf="early", stage="1", offload="nvme", buffers=True),
]


@pytest.mark.parametrize("c", STRONG, ids=[c.id for c in STRONG])
def test_matches_the_oracle(c: Case) -> None:
    errors = judge(c, [run_zo(c, 0, None)])
    assert not errors, "\n".join(errors[:8])


def test_split_and_runs():
    assert device_split(1024, 0.0, 8) == 1024 and device_split(1024, 1.0, 8) == 0
    assert device_split(1024, 0.3, 8) == 1024 - 304 and device_split(1024, 0.3, 8) % 8 == 0
    head, tail = split_runs([(0, 0, 100, 1, 1.0), (1, 100, 300, 2, 0.5), (1, 400, 500, 2, 1.0)], 200)
    assert head == [(0, 0, 100, 1, 1.0), (1, 100, 200, 2, 0.5)]
    assert tail == [(1, 0, 100, 2, 0.5), (1, 200, 300, 2, 1.0)]


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf"), "0.3", True, None])
def test_bad_gpu_fraction_is_refused_before_the_model_is_touched(bad):
    model = FeatureNet(frozen=True, buffers=True)
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()}
    with pytest.raises((TypeError, ValueError), match="gpu_fraction") as info:
        zk.ZeroOffloadAdamW(model, gpu_fraction=bad)
    assert isinstance(info.value, ValueError if isinstance(bad, float) else TypeError)
    for k, v in model.state_dict().items():
        assert v.dtype == before[k][0] and torch.equal(v, before[k][1]), f"{k} changed"
    assert all(p.grad is None and not p._backward_hooks for p in model.parameters())
    with pytest.raises(type(info.value), match="gpu_fraction"):
        check_gpu_fraction(bad)


@pytest.mark.parametrize("kw", [dict(stage=3, offload_param="nvme", offload_optimizer="nvme")],
                         ids=["shard-on-nvme"])  # fmt: skip
def test_refused_combinations_name_gpu_fraction(kw, tmp_path):
    model = FeatureNet()
    if "nvme_dir" not in kw and kw.get("offload_optimizer") == "nvme":
        kw = {**kw, "nvme_dir": str(tmp_path), "dtype": torch.bfloat16}
    with pytest.raises(ValueError, match="gpu_fraction"):
        zk.ZeroOffloadAdamW(model, gpu_fraction=0.5, **kw)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="gpu_fraction"):
        zk.ZeroOffloadAdafactor(FeatureNet(), gpu_fraction=0.5)


# ---------------------------------------------------------------------- where the tail's gradients go


def test_the_tails_gradients_never_reach_the_host():
    """GPU-shaped run (CopyEngineTransport: every host<->device copy recorded): the D2H copies of a step land exactly
    the head [0, split) of the partition; the host's landing buffer has only those elements."""
    seen = []

    def delay(dst, src):
        seen.append((dst, src))
        return 0.0

    tr = CopyEngineTransport(delay_s=delay)
    model = FeatureNet()
    opt = zk.ZeroOffloadAdamW(model, **ADAMW, transport=tr, bucket_numel=1000, gpu_fraction=0.4)
    assert 0 < opt.split < opt.part and opt.grads.landing[0].numel() == opt.split
    seen.clear()
    x = torch.randint(0, 37, (3, 5))
    opt.backward(model(x, x))
    landing = opt.grads.landing[0]
    d2h = [d for d, _ in seen if tr.pool.holds(d) and landing.data_ptr() <= d.data_ptr() < landing.data_ptr()
           + landing.nbytes]  # fmt: skip
    assert sum(d.numel() for d in d2h) == opt.split, "the head lands on the host, nothing more"
    assert sum(d.numel() for d, _ in seen) == opt.split, "no other copy left the device"
    opt.step()
    report = opt.memory_report()
    assert report.device_state == 12 * (opt.part - opt.split)
    assert opt.device_bytes.now == report.device_bytes, "the device counter misses the tail"
    opt.close()
    tr.close()


# ---------------------------------------------------------------------- checkpoints


def _train(fraction: float, steps: int = 3, **kw) -> tuple[FeatureNet, zk.ZeroOffloadAdamW]:
    model = FeatureNet(unused=True)
    opt = zk.ZeroOffloadAdamW(model, **ADAMW, bucket_numel=1000, gpu_fraction=fraction, **kw)
    g = torch.Generator().manual_seed(5)
    for s in range(steps):
        x, y = torch.randint(0, 37, (3, 5), generator=g), torch.randint(0, 37, (3, 5), generator=g)
        opt.backward(model(x, y, branch=s == 1))
        opt.step()
    return model, opt


def assert_same_state(a: dict, b: dict, what: str) -> None:
    assert a["state"].keys() == b["state"].keys(), what
    for i, st in a["state"].items():
        assert st.keys() == b["state"][i].keys(), f"{what}: param {i} keys"
        for k, v in st.items():
            assert torch.equal(v, b["state"][i][k]), f"{what}: param {i} {k} differs"
    exact = a["zero_offload"].get("moments")  # 8-bit: the codes and scales, bit for bit
    assert (exact is None) == (b["zero_offload"].get("moments") is None), what
    for i, raw in (exact or {}).items():
        for k, v in raw.items():
            assert torch.equal(v, b["zero_offload"]["moments"][i][k]), f"{what}: param {i} {k} differs"


FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": "8bit"}
K = {"fp32": 12, "bf16": 8, "8bit": 6.03125}  # bytes per element of p32, m, v in the format (8-bit: one scale per 256)


def _load_on_two_ranks(rank: int, world: int, path: str, fraction: float, out: str, fmt: str) -> None:
    model = FeatureNet(unused=True)
    opt = zk.ZeroOffloadAdamW(model, **ADAMW, bucket_numel=1000, gpu_fraction=fraction, state_dtype=FORMATS[fmt])
    opt.load_state_dict(torch.load(path, weights_only=False))
    sd = opt.state_dict()
    if rank == 0:
        torch.save(sd, out)
    opt.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoints_do_not_depend_on_the_fraction_or_the_world_size(fmt, tmp_path):
    """Saved at 0.3, loaded at 0, 0.7, 1 and on two ranks at 0.5: the same state dict bit for bit, torch's keys only
    (as saved at 0), and with 8-bit moments the same codes and scales."""
    sd = FORMATS[fmt]
    _, opt = _train(0.3, delay_update_after=1, state_dtype=sd)  # (saved between a delayed update and its writeback)
    saved = opt.state_dict()
    opt.close()
    _, plain = _train(0.0, state_dtype=sd)
    assert saved["state"].keys() == plain.state_dict()["state"].keys()
    assert all(st.keys() == {"step", "exp_avg", "exp_avg_sq", "master"} for st in saved["state"].values())
    plain.close()
    for fraction in (0.0, 0.7, 1.0):
        _, other = _train(fraction, steps=0, state_dtype=sd)
        other.load_state_dict(saved)
        assert_same_state(other.state_dict(), saved, f"loaded at gpu_fraction={fraction}")
        other.close()
    path, out = str(tmp_path / "sd.pt"), str(tmp_path / "out.pt")
    torch.save(saved, path)
    spawn_ranks(_load_on_two_ranks, 2, tmp_path, path, 0.5, out, fmt)
    assert_same_state(torch.load(out, weights_only=False), saved, "two ranks at gpu_fraction=0.5")


def test_resumed_at_another_fraction_trains_on_as_the_oracle():
    """Saved at 0.3 after 3 steps, resumed at 0.8 for 3 more: the same masters as 6 steps at 0 within fp32 noise (the
    fused and the CPU kernel round differently: not bitwise)."""
    _, a = _train(0.3)
    sd = a.state_dict()
    a.close()
    model, b = _train(0.8, steps=0)
    b.load_state_dict(sd)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(b.state[p]["master"].view_as(p))
    g = torch.Generator().manual_seed(5)
    for s in range(6):
        x, y = torch.randint(0, 37, (3, 5), generator=g), torch.randint(0, 37, (3, 5), generator=g)
        if s >= 3:
            b.backward(model(x, y, branch=s == 1))
            b.step()
    _, ref = _train(0.0, steps=6)
    got, want = b.state_dict()["state"], ref.state_dict()["state"]
    for i in want:
        for k in ("master", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[i][k], want[i][k], rtol=1e-5, atol=1e-6)
    b.close()
    ref.close()


# ---------------------------------------------------------------------- memory


@pytest.mark.parametrize("kw", [dict(), dict(delay_update_after=0), dict(stage=3, offload_param="cpu"),
                                dict(stage=1, transport="copy_engine"), dict(state_dtype="8bit"),
                                dict(state_dtype=torch.bfloat16, delay_update_after=0)],
                         ids=["zero2", "dpu", "zero3+cpu", "zero1", "8bit", "bf16-dpu"])  # fmt: skip
def test_memory_report_accounts_the_tail(kw):
    """measured == formula for every term, the tail's K bytes per element on the device (12 with fp32 moments, 8
    bf16, 6.03 8-bit), the host's state shrunk as much."""
    k = K[{torch.float32: "fp32", torch.bfloat16: "bf16", "8bit": "8bit"}[kw.get("state_dtype", torch.float32)]]
    tr = CopyEngineTransport() if kw.pop("transport", None) else None
    reports = {}
    for fraction in (0.0, 0.5):
        model, opt = _train(fraction, steps=1, transport=tr, **kw)
        x = torch.randint(0, 37, (3, 5))
        opt.backward(model(x, x))
        opt.backward(model(x, x))  # accumulation: the fp32 accumulators exist
        opt.step()
        r = opt.memory_report()
        for t in r.terms:
            assert t.measured == t.formula_bytes, f"gpu_fraction={fraction}: {t}"
        assert r.formula_device == r.device_bytes and r.formula_host == r.host_bytes
        reports[fraction] = (r, opt.part, opt.split)
        opt.close()
    if tr is not None:
        tr.close()
    (r0, part, _), (r5, _, split) = reports[0.0], reports[0.5]
    tail = part - split
    assert tail == part // 2 or abs(tail - part / 2) <= opt.align
    assert r5.device_state == k * tail and r5.host_state == r0.host_state - k * tail
    assert r5.host_bytes < r0.host_bytes and r5.device_bytes > r0.device_bytes
    assert f"{k:g}D" in r5.formula("device") and "(P-D)" in r5.formula("host")


# ---------------------------------------------------------------------- the GPU-shaped schedule


def _gpu_shaped(c: Case, stream_delay_s: float) -> list[dict]:
    """run_zo with the tail's device stream running each update `stream_delay_s` late (the CPU stand-in)."""
    launch = TwinUpdate._launch

    def late(self, *args):
        self.stream.delay_s = stream_delay_s
        launch(self, *args)

    TwinUpdate._launch = late
    try:
        return [run_zo(c, 0, None)]
    finally:
        TwinUpdate._launch = launch


GPU_SHAPED = case(gpu_fraction=0.5, transport="copy_engine", micro=2, clip="norm")


def test_the_gpu_shaped_schedule_matches_the_oracle():
    """CopyEngineTransport's late copies and a device stream whose updates land 20 ms late: still the oracle's run."""
    errors = judge(GPU_SHAPED, _gpu_shaped(GPU_SHAPED, 0.02))
    assert not errors, "\n".join(errors[:8])


@pytest.mark.parametrize("dpu", [None, 1])
def test_a_missing_wait_on_the_device_stream_is_caught(dpu, monkeypatch):
    """The tail's parameters written without waiting for its update (the forward then reads the old ones): the
    comparison with the oracle fails, synchronous and delayed."""

    def no_wait(self):  # _write_tail without self._wait_device()
        self.own[self.split :].copy_(self.device_state.master)

    monkeypatch.setattr(TwinUpdate, "_write_tail", no_wait)
    c = dataclasses.replace(GPU_SHAPED, dpu=dpu)
    errors = judge(c, _gpu_shaped(c, 0.05))
    assert any("losses" in e or "working params" in e or "model." in e for e in errors), errors[:4]


def test_the_next_backward_waits_for_the_device_update_reading_the_tail(monkeypatch):
    """The tail has one gradient buffer (and one accumulator) also under DPU: the device's update of step i reads it
    while backward i+1 would land there. With the device stream 50 ms late the run is still the oracle's; with the
    backward's wait removed (GradPath.tail_free) it lands over the gradient the late update has not read yet, and
    the comparison fails."""
    c = dataclasses.replace(GPU_SHAPED, dpu=0, micro=2)
    errors = judge(c, _gpu_shaped(c, 0.05))
    assert not errors, "\n".join(errors[:8])
    monkeypatch.setattr(TwinUpdate, "wait_device", lambda self: None)
    errors = judge(c, _gpu_shaped(c, 0.05))
    assert any("losses" in e or "master" in e or "model." in e for e in errors), errors[:4]


def test_device_stream_failure_makes_the_optimizer_unusable():
    model, opt = _train(0.5, steps=1)

    def boom():
        raise RuntimeError("device kernel failed")

    opt.update.stream.launch(boom)
    with pytest.raises(RuntimeError, match="device kernel failed"):
        opt.synchronize()
    x = torch.randint(0, 37, (3, 5))
    with pytest.raises(RuntimeError, match="unusable"):
        opt.backward(model(x, x))
    opt.close()


def test_fraction_one_holds_nothing_on_the_host():
    model, opt = _train(1.0, steps=2)
    assert opt.split == 0 and opt.update.host is None and opt.memory_report().host_state == 0
    assert not any(math.isnan(v) for st in opt.state_dict()["state"].values() for v in st["master"].flatten().tolist())
    opt.close()



@pytest.mark.parametrize("fmt", FORMATS)
def test_the_tail_update_in_chunks_is_bitwise_the_same(fmt, monkeypatch):
    """The tail's fused AdamW runs CHUNK_NUMEL elements per call (bounded device workspace; a quarter of it with bf16
    and 8-bit moments): elementwise (8-bit: by whole blocks; bf16's random bits hashed from the element's index in the
    tail), so chunks give the same bits. (Chunks whose size is a multiple of the vector width, as CHUNK_NUMEL = 2**24
    is: torch's CPU kernel computes a chunk's last partial vector differently, measured: chunks of 100 differ in the
    last bit.)"""
    import zo_kernels.offload.device_adam as device_adam

    _, whole = _train(0.5, steps=3, max_grad_norm=0.5, state_dtype=FORMATS[fmt])
    want = whole.state_dict()
    whole.close()
    monkeypatch.setattr(device_adam, "CHUNK_NUMEL", 64)  # (compressed moments: chunks of 256, one block)
    _, chunked = _train(0.5, steps=3, max_grad_norm=0.5, state_dtype=FORMATS[fmt])
    assert_same_state(chunked.state_dict(), want, "chunks of 64 elements")
    chunked.close()


def test_the_masters_compare_keeps_a_gpus_temporaries_under_a_mebibyte():
    """state_dict() compares the tail's masters with the model on the device (the edited parameters' masters are
    taken from the model): a chunk's cast, the parameters' copy where they lie elsewhere and the bool result stay
    within 1 MiB there (tests/test_gpu.py's bound; 4M-element chunks peaked 2.7 MiB above an 8-bit tail's memory on
    the H100), while the host keeps its large chunks. Chunks of any size find the same parameters."""
    from zo_kernels.offload.update import DEVICE_COMPARE_BYTES, HOST_COMPARE_CHUNK, compare_chunk, differing

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for where in ("meta", "cpu"):
            master = torch.empty(0, device="meta")
            own = torch.empty(0, dtype=dtype, device=where)
            size = own.element_size()
            per = 1 + (size if dtype != torch.float32 else 0) + (size if where == "cpu" else 0)
            n = compare_chunk(master, own)
            assert n * per <= 1 << 20 and n >= 1 << 16, (dtype, where, n)
        assert compare_chunk(torch.empty(0), torch.empty(0, dtype=dtype)) == HOST_COMPARE_CHUNK
    # the real peak of the compare's temporaries at a GPU's chunk (the same ops on host tensors), edits in every chunk
    for dtype in (torch.bfloat16, torch.float32):
        n = 3 * compare_chunk(torch.empty(0, device="meta"), torch.empty(0, dtype=dtype, device="meta")) + 5
        master = torch.randn(n, generator=torch.Generator().manual_seed(1))
        own = master.to(dtype, copy=True)
        own[:: n // 7] += 1
        chunk = compare_chunk(torch.empty(0, device="meta"), own.to("meta"))
        with _LiveBytes(master, own) as live:
            got = differing(master, own, [(0, n)], 0, chunk)
        # (+ 4 KiB: the 0-dim results of any(), 512 bytes each in CUDA's caching allocator)
        assert got == [(0, n)] and live.peak <= DEVICE_COMPARE_BYTES + 4096, (dtype, live.peak, DEVICE_COMPARE_BYTES)
    g = torch.Generator().manual_seed(0)
    master = torch.randn(1000, generator=g)
    own = master.to(torch.bfloat16)
    ranges = [(a, b) for a, b in zip(range(40, 1040, 100), range(140, 1140, 100))]  # offset 40: the partition's
    for i in (0, 99, 100, 555, 999):
        own[i] += 1
    want = [(40, 140), (140, 240), (540, 640), (940, 1040)]
    for chunk in (None, 1, 7, 100, 1000):
        assert differing(master, own, ranges, 40, chunk) == want, chunk


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the storages that ops make while it is active and that are still alive (each freed once
    its last tensor is: a view's storage counted once, with its base)."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.alive: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.device.type != "meta":
                st = o.untyped_storage()
                key = st.data_ptr()
                if key not in self.known and key not in self.alive and st.nbytes():
                    self.alive[key] = st.nbytes()
                    weakref.finalize(st, self.alive.pop, key, None)  # (the storage object lives with its tensors)
                    self.peak = max(self.peak, sum(self.alive.values()))
        return out
