"""The memory formulas that memory_report() prints equal what the optimizer holds, in every documented configuration.

"What it holds" is measured here without the optimizer's report: every tensor reachable from the optimizer's
attributes, its storage's address range, aliases counted once (the model's parameters alias the flat buffer). The
expected bytes are written out from docs/design.md's table (symbols F, P, B, T, e) with the layout's sizes.
"""

import math
import os

import pytest
import torch
from offload_ref import make_data, make_model

import zo_kernels as zk
from zo_kernels.param_views import MovedGrad
from zo_kernels.transport import CopyEngineTransport

LR = dict(lr=1e-3, weight_decay=0.01)
SMALL = 64  # scalars and flags (found_inf, Σg², a few bytes) are not model state


def held_bytes(opt) -> int:
    """Bytes of the memory under every tensor reachable from `opt` (its parts' attributes, lists, dicts), overlaps
    counted once. Stops at modules and parameters' owners: the model's own tensors are not the optimizer's."""
    spans, seen, todo = [], set(), [opt]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (torch.nn.Module, MovedGrad, type)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.nbytes() >= SMALL and o.device.type != "meta":
                spans.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        elif isinstance(o, (list, tuple, set, frozenset)):
            todo.extend(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif type(o).__module__.startswith("zo_kernels") and hasattr(o, "__dict__"):
            todo.extend(vars(o).values())
    total, end = 0, -1
    for a, b in sorted(spans):
        total += max(0, b - max(a, end))
        end = max(end, b)
    return total


def train(opt, model, steps: int, micro: int) -> None:
    for step in make_data(steps, batch=2, micro=micro):
        for x in step:
            opt.backward(model(x[:, :-1], x[:, 1:]))
        opt.step()
    opt.synchronize()


def check(opt, device: int, host: int, nvme: int = 0, text: tuple[str, ...] = ()) -> None:
    """The report's formulas, its measured bytes and the bytes found by walking the optimizer all agree."""
    rep = opt.memory_report()
    assert (rep.formula_device, rep.formula_host, rep.formula_nvme) == (device, host, nvme), str(rep)
    assert (rep.device_bytes, rep.host_bytes, rep.nvme_bytes) == (device, host, nvme), str(rep)
    assert held_bytes(opt) == device + host, f"the optimizer holds {held_bytes(opt):,} B, its formulas say " \
                                             f"{device + host:,} B\n{rep}"
    for t in text:
        assert t in str(rep), (t, str(rep))


def sizes(opt) -> tuple[int, int, int]:
    """F, P, B of this optimizer's layout."""
    return opt.flat_numel, opt.part, max(b.hi - b.lo for b in opt._buckets)


@pytest.mark.parametrize("dtype, e", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_stage2_one_cpu_rank(dtype, e):
    """The demo's setting: no bucket (gradients pack into the landing buffer), no staging (the update writes in
    place): device eF, host 12P + eP."""
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model, dtype=dtype, **LR)
    train(opt, model, 2, 1)
    f, p, _ = sizes(opt)
    check(opt, e * f, 12 * p + e * p, text=(f"{e}F (parameters, flat)", f"12P (p32, m, v) + {e}P (gradient landing)"))


def test_accumulation_adds_the_fp32_buffer():
    """Two backward passes per step: the host holds 4P more (before the fix no formula counted it: 18 B/param
    measured next to a printed 16)."""
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model, **LR)
    train(opt, model, 2, 2)
    f, p, _ = sizes(opt)
    check(opt, 2 * f, 12 * p + 2 * p + 4 * p, text=("4P (fp32 accumulation)",))


def test_dpu_doubles_landing_and_stages():
    """DPU: two landing buffers and no staging buffer (the update writes the new parameters over the gradients it
    read, in their landing buffer): 12P + 2·2P = 16 B/param (18 with a staging buffer, before)."""
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model, delay_update_after=1, **LR)
    train(opt, model, 3, 1)
    f, p, _ = sizes(opt)
    check(opt, 2 * f, 12 * p + 2 * 2 * p, text=("2·2P (gradient landing x2, DPU)",))
    assert "staging" not in str(opt.memory_report())


def test_dpu_with_accumulation_has_one_accumulator_per_landing_buffer():
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model, delay_update_after=1, **LR)
    train(opt, model, 4, 2)
    f, p, _ = sizes(opt)
    check(opt, 2 * f, 12 * p + 2 * 2 * p + 2 * 4 * p, text=("2·4P (fp32 accumulation x2)",))


def test_gpu_shaped_transport_has_buckets_and_no_staging():
    """As on a GPU: two device buckets (2·eB); on the host no p16 staging buffer (the new parameters go over the
    gradients in the landing buffer): 12 + 2 = 14 B/param."""
    model = make_model()
    transport = CopyEngineTransport()
    opt = zk.ZeroOffloadAdamW(model, transport=transport, bucket_numel=1 << 16, **LR)
    train(opt, model, 2, 1)
    f, p, b = sizes(opt)
    check(opt, 2 * f + 2 * 2 * b, 12 * p + 2 * p, text=("2·2B (two gradient buckets)",))
    assert "staging" not in str(opt.memory_report())
    opt.close()
    transport.close()


@pytest.mark.parametrize("micro", [1, 2])
def test_selective_holds_its_selection_on_both_sides(micro):
    """selective (GPU-shaped): on the device the selection's p32, m, v (12S), index (8S) and gathered fp32 gradient
    (4S, + 4S once accumulated); on the host two fp32 window sums (8P), the p16 staging (2P), the selection's index
    (8S), its pinned shuttle (12S) and a second gradient landing buffer (2P: the window sum reads one beside the next
    backward; with accumulation, an fp32 accumulator for each, 2·4P). S: the selection's elements, one rank (k of c
    columns x rows per param; the 0/1-dim params whole). Before: none of it was counted (14 B/param printed)."""
    model = make_model()
    transport = CopyEngineTransport()
    frac = 0.25
    opt = zk.ZeroOffloadAdamW(model, transport=transport, bucket_numel=1 << 16,
                              selective={"fraction": frac, "select_every": 2, "apply_every": 2}, **LR)  # fmt: skip
    train(opt, model, 3, micro)
    f, p, b = sizes(opt)
    s = sum(math.ceil(frac * (q.numel() // q.shape[0])) * q.shape[0] if q.dim() > 1 else q.numel()
            for q in model.parameters())  # fmt: skip
    acc = 2 * 4 * p if micro > 1 else 0
    check(opt, 2 * f + 2 * 2 * b + (12 + 8 + 4) * s + (4 * s if micro > 1 else 0),
          12 * p + 2 * 2 * p + 2 * p + 8 * p + (8 + 12) * s + acc,
          text=("12S (p32, m, v of the selection)", "8S (selection index)", "4S (selected gradient)",
                "2·4P (fp32 window sums x2)", "12S (selection shuttle, pinned)",
                "2·2P (gradient landing x2, selective's sums)"))  # fmt: skip
    assert opt.device_bytes.now == opt.memory_report().device_bytes - (4 * s if micro > 1 else 0)
    opt.close()
    transport.close()


@pytest.mark.parametrize("offload_param", [None, "cpu"])
def test_stage3(offload_param):
    """Stage 3: the shard (eP) on the device, or in host memory with offload_param="cpu"."""
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model, stage=3, offload_param=offload_param, **LR)
    train(opt, model, 2, 1)
    _, p, _ = sizes(opt)
    if offload_param is None:
        check(opt, 2 * p, 12 * p + 2 * p, text=("2P (parameter shard)",))
    else:
        check(opt, 0, 12 * p + 2 * p + 2 * p, text=("2P (parameter shard)",))
    opt.close()


def test_nvme_optimizer_state(tmp_path):
    """offload_optimizer="nvme": the host holds the swapper's pool (3 slots x 12T), NVMe 12P (files in 4 KiB)."""
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model, offload_optimizer="nvme", nvme_dir=str(tmp_path), tile_numel=1 << 16, **LR)
    train(opt, model, 2, 1)
    f, p, _ = sizes(opt)
    t = opt.update.swapper.tile_numel
    files = 3 * (-(-4 * p // 4096) * 4096)
    check(opt, 2 * f, 3 * 12 * t + 2 * p, files, text=("3·12T (NVMe pool)", "12P (p32, m, v files)"))
    on_disk = sum(e.stat().st_size for e in os.scandir(opt.update.swapper.path) if e.name.endswith(".bin"))
    assert on_disk == files
    opt.close()


def test_zero_infinity(tmp_path):
    """stage 3 with the shard and the state on NVMe: pool 3 x 14T, landing 2P on the host; 12P + 2P on NVMe."""
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model, stage=3, offload_param="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                              tile_numel=1 << 16, **LR)  # fmt: skip
    train(opt, model, 2, 1)
    _, p, _ = sizes(opt)
    t = opt.update.swapper.tile_numel
    up = lambda n: -(-n // 4096) * 4096  # noqa: E731
    # the blocks each gather read a shard into stay in the pinned pool for the next gather: one per distinct size
    # of a unit's piece (two where two units of one size were in flight at once), so at most the shard, 2P
    kept = opt.transport.pool.free_bytes
    distinct = {u.piece[1] - u.piece[0] for u in opt.shards.units}
    assert 2 * sum(distinct) <= kept <= 2 * p, (kept, 2 * sum(distinct), 2 * p)
    check(opt, 0, 3 * 14 * t + 2 * p + kept, 3 * up(4 * p) + up(2 * p),
          text=("3·14T (NVMe pool)", "2P (parameter shard file)", "pinned blocks"))
    opt.close()


def test_device_bytes_prints_readably():
    model = make_model()
    opt = zk.ZeroOffloadAdamW(model, stage=3, **LR)
    text = repr(opt.device_bytes)
    assert text.startswith("DeviceBytes(now=") and "MiB" in text and "peak=" in text and " at 0x" not in text
    opt.close()


@pytest.mark.parametrize("stage, row", [(2, "ZeRO-2 + offload"), (3, "ZeRO-3 + offload")])
@pytest.mark.parametrize("accumulation", [False, True])
@pytest.mark.parametrize("dpu", [False, True])
@pytest.mark.parametrize("gpu_fraction", [0.0, 0.5])
def test_the_planner_counts_what_the_optimizer_holds_on_a_gpu(stage, row, accumulation, dpu, gpu_fraction):
    """The planner's offload rows (one GPU) equal the host formula of the optimizer in the GPU-shaped mode, with
    and without accumulation and DPU (before: the planner printed 16 B/param whatever the setting); with
    gpu_fraction, the tail's bytes on the device too."""
    from zo_kernels.planner import plan

    model = make_model()
    transport = CopyEngineTransport()
    kw = dict(stage=3, offload_param="cpu") if stage == 3 else {}
    opt = zk.ZeroOffloadAdamW(model, transport=transport, delay_update_after=1 if dpu else None,
                              gpu_fraction=gpu_fraction, **kw, **LR)  # fmt: skip
    train(opt, model, 3 if dpu else 1, 2 if accumulation else 1)
    p = opt.part
    f = (p - opt.split) / p  # the fraction the layout kept (the tail is cut on a 16-byte boundary)
    planned = plan(p, 1, "80GiB", "1TiB", accumulation=accumulation, dpu=dpu, gpu_fraction=f).row(row)
    rep = opt.memory_report()
    assert rep.formula_host == pytest.approx(planned.host, rel=1e-12), str(rep)
    assert held_bytes(opt) - rep.device_bytes == pytest.approx(planned.host, rel=1e-12)
    tail = rep.device_state + rep.device_grads  # what the planner adds to the GPU: its states beyond the p16 ones
    assert tail == pytest.approx(planned.gpu_states - (2 * p if stage == 2 else 0), rel=1e-12, abs=1e-6), str(rep)
    opt.close()
    transport.close()


@pytest.mark.parametrize("accumulation", [False, True])
def test_the_planner_counts_what_selective_holds(accumulation):
    """--selective F: the ZeRO-2 + offload row's GPU and host bytes equal the optimizer's formulas in the GPU-shaped
    mode, F the measured share S/P (the 0/1-dim params are selected whole)."""
    from zo_kernels.planner import plan

    model = make_model()
    transport = CopyEngineTransport()
    opt = zk.ZeroOffloadAdamW(model, transport=transport, selective={"fraction": 0.1}, **LR)
    train(opt, model, 2, 2 if accumulation else 1)
    p, s = opt.part, opt.grads.selected.capacity
    planned = plan(p, 1, "80GiB", "1TiB", accumulation=accumulation, selective=s / p).row("ZeRO-2 + offload")
    rep = opt.memory_report()
    assert rep.formula_host == pytest.approx(planned.host, rel=1e-12), str(rep)
    assert held_bytes(opt) - rep.device_bytes == pytest.approx(planned.host, rel=1e-12)
    assert rep.device_state + rep.device_grads == pytest.approx(planned.gpu_states - 2 * p, rel=1e-12), str(rep)
    opt.close()
    transport.close()
