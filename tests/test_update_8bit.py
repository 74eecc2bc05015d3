"""The in-memory update of 8-bit moments (offload/update.py, _update_8bit): its kernel has no random bits, so it is
called once per span of free staging instead of once per tile, and with a transport that has a C tile sink (CUDA's)
the synchronous step's tiles are updated and queued by one C++ loop. Judged against the per-tile path it replaced,
bit for bit (the same runs through a transport without a sink, and the tiled writeback of 2 tiles a kernel call
each), itself judged against the format oracle in tests/test_state_formats.py."""

import pytest
import torch
from offload_ref import make_data, make_model

import zo_kernels as zk
from zo_kernels.cpu_adam import copy_tile_sink
from zo_kernels.offload import update as update_module
from zo_kernels.transport import CopyEngineTransport

TILE = 4096


class SinkTransport(CopyEngineTransport):
    """The GPU-shaped transport with a C tile sink, as CUDA's: each finished tile copied from C++ (here a memcpy
    right away, the stand-in for a queued H2D copy); counts the sinks made."""

    def __init__(self) -> None:
        super().__init__()
        self.sinks = 0

    def tile_sink(self, dst: torch.Tensor, src: torch.Tensor):
        self.sinks += 1
        return copy_tile_sink(dst, src)


def run(transport, delayed: bool, monkeypatch) -> tuple[list[float], torch.Tensor, list[int]]:
    """Losses, masters and the kernel calls of each step() of a 4-step 8-bit run."""
    calls: list[int] = []
    real = update_module.cpu_adam_step

    def counted(*a, **k):
        calls[-1] += 1
        return real(*a, **k)

    monkeypatch.setattr(update_module, "cpu_adam_step", counted)
    model = make_model(seed=0)
    opt = zk.ZeroOffloadAdamW(model, lr=2e-3, weight_decay=0.01, bucket_numel=50_000, tile_numel=TILE,
                              transport=transport, state_dtype="8bit",
                              delay_update_after=0 if delayed else None)  # fmt: skip
    losses = []
    for step in make_data(4, batch=4, seed=3):
        loss = model(step[0][:, :-1], step[0][:, 1:])
        losses.append(loss.item())
        opt.backward(loss)
        calls.append(0)
        opt.step()
        opt.synchronize()  # (the delayed update's calls counted with its step)
    masters = torch.cat([s["master"].reshape(-1) for s in opt.state_dict()["state"].values()])
    opt.close()
    transport.close()
    return losses, masters, calls


@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "dpu"])
def test_8bit_update_in_spans_equals_the_per_tile_update(delayed, monkeypatch):
    with monkeypatch.context() as m:  # the per-tile loop it replaced
        m.setattr(update_module.HostUpdate, "_tile_update", _per_tile_only(update_module.HostUpdate._tile_update))
        per_tile = run(CopyEngineTransport(), delayed, m)
    monkeypatch.undo()
    spans = run(CopyEngineTransport(), delayed, monkeypatch)
    assert spans[0] == per_tile[0], "losses differ"
    assert torch.equal(spans[1], per_tile[1]), "masters differ"
    assert max(per_tile[2]) > 4 * len(set(per_tile[2])), f"per tile: {per_tile[2]} kernel calls a step"
    if delayed:  # the copies of the last writeback have landed: one span a run
        assert max(spans[2]) < max(per_tile[2]) / 4, f"spans {spans[2]} vs per tile {per_tile[2]} calls a step"


def test_8bit_synchronous_update_through_a_c_tile_sink(monkeypatch):
    """With a C tile sink the tile loop runs in C++: no kernel call from Python, the same values bit for bit."""
    python = run(CopyEngineTransport(), False, monkeypatch)
    monkeypatch.undo()
    tr = SinkTransport()
    sink = run(tr, False, monkeypatch)
    assert tr.sinks > 0 and sink[2] == [0] * len(sink[2]), f"{tr.sinks} sinks, {sink[2]} Python kernel calls"
    assert sink[0] == python[0], "losses differ"
    assert torch.equal(sink[1], python[1]), "masters differ"


def _per_tile_only(tile_update):
    """_tile_update with the 8-bit format taking the generic per-tile loop (the code before _update_8bit)."""

    def update(self, *args, **kwargs):
        fmt, self.fmt = self.fmt, "8bit-per-tile"
        try:
            return tile_update(self, *args, **kwargs)
        finally:
            self.fmt = fmt

    return update
