"""The in-memory update of bf16 and 8-bit moments (offload/update.py, _tile_update): the kernel is called once per
span of free staging instead of once per tile, and with a transport that has a C tile sink (CUDA's) the synchronous
step's tiles are updated and queued by one C++ loop. That is exact because the values do not depend on the split:
the stochastic roundings (bf16, 8-bit exp_avg) take their bits from each element's partition offset (before, each
tile's call was seeded by its start, so another tiling rounded otherwise). Judged here by runs that differ only in
how the update is cut (tile_numel, a C sink or copies from Python, DPU spans), bit for bit; the values themselves
by the format oracle (tests/test_state_formats.py) and the NVMe path, bit for bit the in-memory one
(tests/test_offload_nvme.py)."""

import pytest
import torch
from offload_ref import make_data, make_model

import zo_kernels as zk
from zo_kernels.cpu_adam import copy_tile_sink
from zo_kernels.offload import formats
from zo_kernels.offload import update as update_module
from zo_kernels.offload.device_adam import DeviceState
from zo_kernels.transport import CopyEngineTransport

FORMATS = ["bf16", "8bit"]


class SinkTransport(CopyEngineTransport):
    """The GPU-shaped transport with a C tile sink, as CUDA's: each finished tile copied from C++ (here a memcpy
    right away, the stand-in for a queued H2D copy); counts the sinks made."""

    def __init__(self) -> None:
        super().__init__()
        self.sinks = 0

    def tile_sink(self, dst: torch.Tensor, src: torch.Tensor):
        self.sinks += 1
        return copy_tile_sink(dst, src)


def run(transport, fmt: str, delayed: bool, monkeypatch, tile: int = 4096):
    """Losses, masters, moments and the Python kernel calls of each step() of a 4-step run."""
    calls: list[int] = []
    real = update_module.cpu_adam_step

    def counted(*a, **k):
        calls[-1] += 1
        return real(*a, **k)

    monkeypatch.setattr(update_module, "cpu_adam_step", counted)
    model = make_model(seed=0)
    opt = zk.ZeroOffloadAdamW(model, lr=2e-3, weight_decay=0.01, bucket_numel=50_000, tile_numel=tile,
                              transport=transport, state_dtype=fmt,
                              delay_update_after=0 if delayed else None)  # fmt: skip
    losses = []
    for step in make_data(4, batch=4, seed=3):
        loss = model(step[0][:, :-1], step[0][:, 1:])
        losses.append(loss.item())
        opt.backward(loss)
        calls.append(0)
        opt.step()
        opt.synchronize()  # (the delayed update's calls counted with its step)
    state = opt.state_dict()["state"]
    flat = torch.cat([torch.cat([s[k].reshape(-1).float() for k in ("master", "exp_avg", "exp_avg_sq")])
                      for s in state.values()])  # fmt: skip
    opt.close()
    transport.close()
    monkeypatch.undo()
    return losses, flat, calls


def assert_same(a, b, what):
    assert a[0] == b[0], f"{what}: losses differ"
    assert torch.equal(a[1], b[1]), f"{what}: state differs"


@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "dpu"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_update_does_not_depend_on_how_it_is_cut(fmt, delayed, monkeypatch):
    """Tiles of 4096 and of 65536 elements give the same run bit for bit (bf16 failed it with per-tile seeds); under
    DPU, with the last writeback landed, the update is a few kernel calls, not one per tile."""
    small = run(CopyEngineTransport(), fmt, delayed, monkeypatch, tile=4096)
    large = run(CopyEngineTransport(), fmt, delayed, monkeypatch, tile=1 << 16)
    assert_same(small, large, f"{fmt} tiles of 4096 vs 65536")
    tiles = small[1].numel() // 3 // 4096  # the partition's update tiles
    if delayed:
        assert max(small[2]) < tiles / 4, f"{small[2]} kernel calls a step for {tiles} tiles"
    else:  # copies from Python, tile by tile
        assert min(small[2][1:]) >= tiles, f"{small[2]} kernel calls a step for {tiles} tiles"


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_synchronous_update_through_a_c_tile_sink(fmt, monkeypatch):
    """With a C tile sink the tile loop runs in C++: no kernel call from Python, the same values bit for bit."""
    python = run(CopyEngineTransport(), fmt, False, monkeypatch)
    tr = SinkTransport()
    sink = run(tr, fmt, False, monkeypatch)
    assert tr.sinks > 0 and sink[2] == [0] * len(sink[2]), f"{tr.sinks} sinks, {sink[2]} Python kernel calls"
    assert_same(sink, python, f"{fmt} C sink vs copies from Python")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_phase_is_timed_with_staging_in_place(fmt):
    """On the plain CPU transport (the update writes the parameters in place: nothing to send) the step's phases
    still count the kernel apart from the writeback, as for fp32 moments (the span loop timed it only when it sent
    copies, and booked the whole update as writeback)."""
    from zo_kernels.transport import HostTransport

    model = make_model(seed=0)
    opt = zk.ZeroOffloadAdamW(model, lr=2e-3, transport=HostTransport(), state_dtype=fmt)
    for step in make_data(2, batch=4, seed=3):
        opt.backward(model(step[0][:, :-1], step[0][:, 1:]))
        opt.step()
    assert opt.stats.get("time_kernel", 0) > 0, opt.stats
    assert opt.stats["time_writeback"] < opt.stats["time_cpu_update"] / 2, opt.stats
    opt.close()


def test_no_kernel_call_crosses_a_multiple_of_the_rounding_period():
    """The stochastic rounding's random bits hash a 32-bit index: calls are cut at multiples of 2**32 and each
    piece's seed carries its multiple, so elements 2**32 apart in a partition (a model over 4.3B parameters on one
    rank) round apart; the device tail cuts its pieces by partition offset as the host does."""
    p = formats.SR_PERIOD
    assert list(formats.sr_pieces(p - 10, 2 * p + 5)) == [(p - 10, p), (p, 2 * p), (2 * p, 2 * p + 5)]
    assert list(formats.sr_pieces(3, 3)) == [] and list(formats.sr_pieces(0, 7)) == [(0, 7)]

    class Fake:
        layout = type("L", (), {"rank": 1})()

    sr = update_module.HostUpdate._sr
    assert sr(Fake(), 5) == {"seed": 1 << 40, "index0": 5}
    assert sr(Fake(), p + 5) == {"seed": (1 << 40) + 1, "index0": 5}
    tail = DeviceState("bf16", torch.zeros(20), seed=1 << 40, offset=p - 7)
    assert tail._pieces(0, 20) == [(0, 7, sr(Fake(), p - 7)), (7, 20, sr(Fake(), p))]
    assert tail._pieces(2, 12, size=4) == [(2, 6, sr(Fake(), p - 5)), (6, 7, sr(Fake(), p - 1)),
                                           (7, 11, sr(Fake(), p)), (11, 12, sr(Fake(), p + 4))]  # fmt: skip
