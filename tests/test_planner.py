"""The planner's stage-3, CPU-offload and ZeRO-Infinity rows, against hand-computed formulas and published figures."""

import pytest

from zo_kernels.cli import main
from zo_kernels.planner import plan

GiB, TiB = 2**30, 2**40
BUCKETS_70B = 2 * 2 * 2**26  # ZeroOffloadAdamW's default for a model over 2**31 params: two bf16 buckets of 2**26


def rows_of(text):
    """The table's lines by strategy name (the first 18 columns)."""
    return {line[:18].strip(): line for line in text.splitlines()}


def test_headline_70b_fits_one_80gb_gpu_only_with_zero_infinity(capsys):
    """Issue 13: 70B params, one 80 GiB GPU, 512 GiB host, 4 TB NVMe: ZeRO-Infinity fits, ZeRO-2 + offload does not."""
    argv = ["plan", "--params", "70e9", "--gpus", "1", "--gpu-mem", "80GiB", "--host-mem", "512GiB", "--nvme", "4TB"]
    assert main([*argv, "--max"]) == 0
    rows = rows_of(capsys.readouterr().out)
    assert "  yes " in rows["ZeRO-Infinity"] and "  yes " in rows["ZeRO-Inf (opt)"]
    # and so does this library's own mode (gradients in host memory: 140 GB of g16 in 512 GiB)
    assert "  yes " in rows["zo Infinity"]
    zo = plan(70e9, 1, "80GiB", "512GiB", nvme="4TB").row("zo Infinity")
    assert zo.host == pytest.approx(2 * 70e9 + 2**30) and zo.nvme == pytest.approx(14 * 70e9)
    assert "no (GPU)" in rows["ZeRO-2 + offload"] and "no (host)" in rows["ZeRO-3 + offload"]
    for name in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"):
        assert "no (GPU)" in rows[name], rows[name]
    # --max, ZeRO-Infinity: NVMe-bound, 4e12 B / 16 B per param = 250B (GPU-bound at 406B, host unbounded)
    assert rows["ZeRO-Infinity"].endswith("250.00B")

    p = plan(70e9, 1, "80GiB", "512GiB", nvme="4TB")
    inf = p.row("ZeRO-Infinity")
    layer = 70e9 / 32  # no --layer-params: one block of a 32-block model
    assert inf.working_set == pytest.approx((2 * (1 + 1) + 2) * layer, rel=1e-12)
    assert inf.gpu_states == 0
    assert inf.gpu_total == pytest.approx(inf.working_set + BUCKETS_70B + 4 * GiB + 1 * GiB, rel=1e-12)
    assert inf.gpu_total < 80 * GiB * 0.95
    assert inf.host == 1 * GiB and inf.nvme == pytest.approx(16 * 70e9, rel=1e-12)
    assert p.row("ZeRO-Inf (opt)").host == pytest.approx(2 * 70e9 + GiB, rel=1e-12)
    assert p.row("ZeRO-Inf (opt)").nvme == pytest.approx(14 * 70e9, rel=1e-12)
    assert p.row("ZeRO-3 + offload").host == pytest.approx(16 * 70e9, rel=1e-12)
    assert p.row("ZeRO-2 + offload").gpu_states == 140e9


def test_without_nvme_the_nvme_rows_do_not_fit(capsys):
    """The issue's starting point: no --nvme, nothing fits a 70B model on one 80 GiB GPU + 512 GiB host."""
    assert main(["plan", "--params", "70e9", "--gpu-mem", "80GiB", "--host-mem", "512GiB"]) == 0
    rows = rows_of(capsys.readouterr().out)
    assert "no (NVMe)" in rows["ZeRO-Infinity"] and "no (NVMe)" in rows["ZeRO-Inf (opt)"]
    assert not any(p.fits for p in plan(70e9, 1, "80GiB", "512GiB").strategies)


# ZeRO-Infinity paper (Rajbhandari et al., SC'21, arXiv 2104.07857), Table 1: Transformer models of 12 nl hd^2
# params; "model states" = 20 bytes per param (fp16 p and g, fp32 p, m, v, g: 2 + 2 + K with K = 16), "model
# state working memory per GPU" = fp16 params + grads of the largest operator (the hd x 4hd linear) = 16 hd^2.
# Its TB and GB are 2^40 and 2^30 bytes (that is what the printed digits give). Columns: params (trillions),
# layers, hidden size, model states (TB), model state working memory per GPU (GB).
INFINITY_TABLE_1 = [
    (0.50, 100, 20 * 1024, 9.16, 6.25),
    (1.01, 128, 25 * 1024, 18.31, 9.77),
    (10.05, 195, 64 * 1024, 182.81, 64.00),
    (101.47, 315, 160 * 1024, 1845.70, 400.00),
]


@pytest.mark.parametrize("trillions, layers, hidden, states_tb, working_gb", INFINITY_TABLE_1)
def test_zero_infinity_table_1(trillions, layers, hidden, states_tb, working_gb):
    """Reproduce the ZeRO-Infinity paper's Table 1 within the rounding of its printed digits (+-0.005)."""
    params = 12 * layers * hidden**2
    assert params / 1e12 == pytest.approx(trillions, abs=0.005)
    p = plan(params, 1, "80GiB", "1GiB", k=16, nvme=1e16, layer_params=4 * hidden**2, prefetch=0, io_pool=0)
    inf = p.row("ZeRO-Infinity")
    states = inf.gpu_states + inf.host + inf.nvme  # all model states, wherever they are
    assert states / TiB == pytest.approx(states_tb, abs=0.005)
    assert inf.working_set / GiB == pytest.approx(working_gb, abs=0.005)
    for name in ("ZeRO-3 + offload", "ZeRO-Inf (opt)"):  # every placement holds the same 20 bytes per param
        r = p.row(name)
        assert r.gpu_states + r.host + r.nvme - p.io_pool * (name != "ZeRO-3 + offload") == pytest.approx(states)


def test_a_trillion_parameters_fit_one_dgx2_node_only_with_nvme():
    """ZeRO-Infinity paper: the 1T model (Table 1, 128 x 25K) trains on one DGX-2 node: 16 x V100 32 GB,
    1.5 TB of CPU memory, 28 TB of NVMe. CPU offload alone cannot hold it; NVMe offload can, with K = 12 and
    with the paper's 20 bytes per param (K = 16)."""
    hidden = 25 * 1024
    for k in (12, 16):
        p = plan(12 * 128 * hidden**2, 16, "32GiB", "1.5TB", k=k, nvme="28TB", layer_params=4 * hidden**2)
        assert p.row("ZeRO-Infinity").fits, p.row("ZeRO-Infinity")
        assert p.row("ZeRO-Inf (opt)").fits_gpu and not p.row("ZeRO-Inf (opt)").fits_host  # 2 TB of fp16 params
        assert not p.row("ZeRO-3 + offload").fits_host and not p.row("ZeRO-3").fits_gpu
        assert not p.row("ZeRO-2 + offload").fits_gpu


def test_zero3_matches_the_zero_paper_trillion_on_1024_gpus():
    """ZeRO (Rajbhandari et al., 2020): a 1T model on 1024 GPUs at stage 3 holds (2 + 2 + 12) x 1T / 1024 = 16 G."""
    p = plan(1e12, 1024, "32GB")
    assert p.row("ZeRO-3").gpu_states == 16e12 / 1024
    assert round(p.row("ZeRO-3").gpu_states / 2**30) == 15 and round(p.row("ZeRO-3").gpu_states / 1e9) == 16


def test_working_set_grows_with_prefetch_and_stays_out_of_the_states():
    """Stage 3's GPU total = states + (2 (1 + prefetch) + 2) x largest layer + buckets + activations + workspace."""
    layer = 1.5e9
    for prefetch in (0, 1, 3):
        p = plan(70e9, 8, "80GiB", "1TiB", layer_params=layer, prefetch=prefetch, bucket_bytes="64MiB")
        for name in ("ZeRO-3", "ZeRO-3 + offload", "ZeRO-Inf (opt)", "ZeRO-Infinity"):
            r = p.row(name)
            assert r.working_set == (2 * (1 + prefetch) + 2) * layer
            assert r.gpu_total == pytest.approx(r.gpu_states + r.working_set + 64 * 2**20 + 5 * GiB, rel=1e-12)
        for name in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-2 + offload"):
            assert p.row(name).working_set == 0
    assert plan(70e9, 8, "80GiB", layer_params=layer).row("ZeRO-3").gpu_states == 16 * 70e9 / 8


def test_max_params_per_row():
    """--max: the bound that binds. A given layer stays fixed as the model grows; params / 32 grows with it."""
    p = plan(70e9, 1, "80GiB", "512GiB", nvme="4TB", layer_params=1e9)
    usable = 80 * GiB * 0.95 - 5 * GiB
    assert p.row("ZeRO-3 + offload").max_params == pytest.approx(512 * GiB / 16, rel=1e-12)  # host-bound
    assert p.row("ZeRO-Inf (opt)").max_params == pytest.approx((512 * GiB - GiB) / 2, rel=1e-12)  # host-bound
    assert p.row("ZeRO-Infinity").max_params == pytest.approx(4e12 / 16, rel=1e-12)  # NVMe-bound
    zero3 = (usable - BUCKETS_70B - 6 * 1e9) / 16
    assert p.row("ZeRO-3").max_params == pytest.approx(zero3, rel=1e-12)
    guessed = plan(70e9, 1, "80GiB", "512GiB", nvme="4TB")
    assert guessed.row("ZeRO-3").max_params == pytest.approx((usable - BUCKETS_70B) / (16 + 6 / 32), rel=1e-12)
    big = plan(70e9, 1, "80GiB", "512GiB", nvme="1000TB", io_pool=0)  # only the GPU binds: layer = params / 32
    assert big.row("ZeRO-Infinity").max_params == pytest.approx((usable - BUCKETS_70B) / (6 / 32), rel=1e-12)
    assert plan(70e9, 1, "80GiB", "512GiB", nvme="1000TB", layer_params=1e9).row("ZeRO-Infinity").max_params == (
        pytest.approx(1e15 / 16, rel=1e-12)
    )


def test_nvme_and_host_are_shared_by_the_gpus_of_a_host():
    """--nvme is per host like --host-mem: 8 GPUs on one host share it; one GPU per host gets all of it."""
    shared = plan(140e9, 8, "80GiB", "512GiB", nvme="2TB")
    alone = plan(140e9, 8, "80GiB", "512GiB", nvme="2TB", gpus_per_host=1)
    assert shared.row("ZeRO-Infinity").nvme == alone.row("ZeRO-Infinity").nvme == 16 * 140e9 / 8
    assert not shared.row("ZeRO-Infinity").fits_nvme and alone.row("ZeRO-Infinity").fits_nvme


def test_a_layer_too_large_to_gather_does_not_fit():
    """Memory-centric tiling is not modelled: a layer whose gathered copies exceed the GPU does not fit."""
    p = plan(100e9, 64, "80GiB", "1TiB", nvme="30TB", layer_params=20e9)
    assert not p.row("ZeRO-Infinity").fits_gpu and p.row("ZeRO-Infinity").max_params == 0


# ---------------------------------------------------------------------- activations (issue 21)

LLAMA70 = dict(seq=4096, batch=1, hidden=8192, layers=80)  # Llama-2/3 70B's width and depth


def test_activation_modes_by_hand():
    """Per GPU, 16-bit, flash attention: a layer keeps 34 sbh; its checkpoint is its input, 2 sbh."""
    s, b, h, n = 4096, 2, 8192, 80
    sbh = s * b * h
    for mode, gpu, host in (("none", n * 34 * sbh, 0), ("checkpoint", n * 2 * sbh + 34 * sbh, 0),
                            ("offload", 2 * 2 * sbh + 34 * sbh, (n - 1) * 2 * sbh)):  # fmt: skip
        p = plan(70e9, 1, "80GiB", "512GiB", nvme="4TB", seq=s, batch=b, hidden=h, layers=n, activation_mode=mode)
        assert (p.activations, p.activation_host) == (gpu, host), mode
        for r in p.strategies:  # the derived activations replace the 4 GiB default; offloaded ones go to the host
            base = plan(70e9, 1, "80GiB", "512GiB", nvme="4TB", activations=gpu).row(r.strategy)
            assert r.gpu_total == base.gpu_total and r.host == base.host + host
    eager = plan(70e9, seq=s, batch=b, hidden=h, layers=n, heads=64, attention="eager", activation_mode="none")
    assert eager.activations == n * (34 * sbh + 5 * 64 * s * s * b)
    logits = plan(70e9, seq=s, batch=b, hidden=h, layers=n, vocab=128256, activation_mode="offload")
    assert logits.activations == 2 * 2 * sbh + 34 * sbh + 6 * s * b * 128256


def test_half_layer_offload_by_hand(capsys):
    """A checkpoint around each attention and each MLP, offloaded: the larger half recomputed (the MLP's 19 sbh +
    its layernorm's 2; attention's 11 + 2 unless eager attention's scores make it the larger), two half-layer inputs
    in flight, the other 2 L - 1 on the host. The CLI's `--activation-offload half` uses it and prints its row."""
    s, b, h, n = 4096, 2, 8192, 80
    sbh = s * b * h
    p = plan(70e9, 1, "80GiB", "512GiB", nvme="4TB", seq=s, batch=b, hidden=h, layers=n, activation_mode="offload_half")
    assert (p.activations, p.activation_host) == (2 * 2 * sbh + 21 * sbh, (2 * n - 1) * 2 * sbh)
    eager = plan(70e9, seq=s, batch=b, hidden=h, layers=n, heads=64, attention="eager", activation_mode="offload_half")
    assert eager.activations == 2 * 2 * sbh + 13 * sbh + 5 * 64 * s * s * b
    argv = ["plan", "--params", "70e9", "--gpu-mem", "80GiB", "--host-mem", "512GiB", "--nvme", "4TB", "--seq",
            "4096", "--batch", "1", "--hidden", "8192", "--layers", "80", "--activation-offload", "half"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "half layers + offload (used)" in out and "per GPU: activations (half layers + offload)" in out
    # beside zo's row (it ties with ZeRO-Inf (opt) and ZeRO-Infinity on the GPU), with what bounds each sequence:
    # half layers take twice the host bytes of per-layer offload, so the host fills first here
    assert "longest seq beside zo Infinity" in out
    assert "215,669 (GPU full)" in out and "156,880 (host full)" in out  # (216,316 with 64 MiB of buckets)
    p = plan(70e9, 1, "80GiB", "512GiB", nvme="4TB", activation_mode="offload_half", **LLAMA70)
    assert p.longest_seq_bound("offload_half", "ZeRO-Infinity")[1] == "host"
    assert p.longest_seq_bound("checkpoint", "zo Infinity") == (p.longest_seq("checkpoint", "zo Infinity"), "GPU")
    assert main(argv[:-1]) == 0 and "checkpointing + offload (used)" in capsys.readouterr().out  # bare flag: per layer
    assert main([*argv[:-1], "quarter"]) == 2 and "invalid choice: 'quarter'" in capsys.readouterr().err


def test_headline_70b_row_with_checkpointing_and_offload(capsys):
    """The 70B headline on one 80 GiB GPU at seq 4096: activations derived; zo Infinity's GPU total is the stage-3
    working set + buckets + workspace + one layer's activations + two checkpoints; the checkpoints but the last
    layer's (5.3 GB) are in host memory. Offload trains a sequence >= 2x longer than checkpointing alone (5x: 216k vs
    42k tokens)."""
    argv = ["plan", "--params", "70e9", "--gpu-mem", "80GiB", "--host-mem", "512GiB", "--nvme", "4TB", "--seq",
            "4096", "--batch", "1", "--hidden", "8192", "--layers", "80", "--activation-offload"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = rows_of(out)
    assert rows["zo Infinity"].endswith("  yes") and rows["ZeRO-Infinity"].endswith("  yes")
    assert "checkpointing + offload (used)" in out and "per GPU: activations (checkpointing + offload)" in out
    p = plan(70e9, 1, "80GiB", "512GiB", nvme="4TB", activation_mode="offload", **LLAMA70)
    sh = 4096 * 8192
    zo = p.row("zo Infinity")
    assert zo.gpu_total == pytest.approx(zo.working_set + BUCKETS_70B + GiB + 38 * sh, rel=1e-12)
    assert zo.host == pytest.approx(2 * 70e9 + GiB + 79 * 2 * sh, rel=1e-12)
    assert round(79 * 2 * sh / 1e9, 1) == 5.3
    longest = {m: p.longest_seq(m, "zo Infinity") for m in ("none", "checkpoint", "offload")}
    assert longest["offload"] >= 2 * longest["checkpoint"] > 2 * longest["none"] > 0, longest
    left = 80 * GiB * 0.95 - (zo.gpu_total - p.activations)
    assert 38 * 8192 * longest["offload"] <= left < 38 * 8192 * (longest["offload"] + 1)
    for m in ("none", "checkpoint", "offload"):
        assert f"{longest[m]:,}" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--hidden", "8192"], "--hidden describes the activations"),
    (["--seq", "4096", "--hidden", "8192"], "--layers: needed with seq"),
    (["--seq", "4096", "--hidden", "8192", "--layers", "80", "--activations", "4GiB"], "--activations: give either"),
    (["--seq", "4096", "--hidden", "8192", "--layers", "80", "--attention", "eager"], "--heads: needed"),
    (["--seq", "0", "--hidden", "8192", "--layers", "80"], "--seq must be an int >= 1"),
    (["--seq", "4k", "--hidden", "8192", "--layers", "80"], "--seq"),
])  # fmt: skip
def test_activation_options_are_checked(capsys, argv, message):
    assert main(["plan", "--params", "70e9", *argv]) == 2
    assert message in capsys.readouterr().err
def test_stage3_working_set_measured_is_one_checkpointed_block_and_the_prefetched_unit():
    """ZeroOffloadAdamW(stage=3, prefetch=1) training a GPT whose blocks are checkpointed holds at its peak one block's
    units (the recompute keeps them until their gradients arrive) and the unit prefetched next (the next block's
    first LayerNorm), measured by its device-bytes counter. The planner with prefetch_params is within 10%; counting
    (1 + prefetch) whole layers (the formula without it) it was 2x off (issue 23)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    import zo_kernels as zk
    from zo_kernels.gpt import GPT, GPTConfig

    c = GPTConfig(vocab=61, context=16, layers=3, width=64, heads=2)
    torch.manual_seed(0)
    model = GPT(c)
    opt = zk.ZeroOffloadAdamW(model, lr=1e-3, stage=3, offload_param="cpu", prefetch=1)
    try:
        x = torch.randint(0, c.vocab, (2, c.context + 1))
        for _ in range(2):  # the first records the order; the second prefetches along it
            opt.device_bytes.reset_peak()
            h = model.tok(x[:, :-1]) + model.pos(torch.arange(c.context))
            for block in model.blocks:
                h = checkpoint(block, h, use_reentrant=False)
            loss = torch.nn.functional.cross_entropy(model.head(model.ln(h)).float().flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
        measured = opt.device_bytes.peak  # one CPU rank: no buckets; the shard in host memory
    finally:
        opt.close()
    block = 12 * c.width**2 + 13 * c.width
    params = sum(p.numel() for p in model.parameters())
    gathered = lambda row, layer: row.working_set - 2 * layer  # noqa: E731  (less the layer's gradient: autograd's)
    new = plan(params, 1, "1GiB", "1GiB", layer_params=block, prefetch=1, prefetch_params=2 * c.width, bucket_bytes=0)
    old = plan(params, 1, "1GiB", "1GiB", layer_params=block, prefetch=1, bucket_bytes=0)
    assert measured >= 2 * block  # one whole block is gathered at once
    assert gathered(new.row("ZeRO-3 + offload"), block) == pytest.approx(measured, rel=0.10)
    assert gathered(old.row("ZeRO-3 + offload"), block) > 1.9 * measured
    assert new.working_set == 4 * block + 2 * 2 * c.width and old.working_set == 6 * block


def test_prefetch_params_is_checked():
    with pytest.raises(ValueError, match="prefetch_params"):
        plan(1e9, prefetch_params=2e9)
    with pytest.raises(ValueError, match="prefetch_params"):
        plan(1e9, prefetch_params="lots")
    guessed = plan(64e9, prefetch=2, prefetch_params=1e6)  # no layer_params: params / 32 per layer, units fixed
    assert guessed.working_set == 4 * 2e9 + 2 * 2 * 1e6


def test_selective_adds_its_buffers_to_the_zero2_offload_row_only(capsys):
    """--selective 0.1 on 1.3B, 4 GPUs: the ZeRO-2 + offload row's GPU gets (12 + 8 + 4) B per selected element
    (+ 4 with accumulation), its host 8 + 2 B per partition element and 20 per selected one, and a second gradient
    landing buffer (2 B, + a second fp32 accumulator, 4 B, with accumulation: the window sum reads one beside the next
    backward); the other rows stay."""
    n, f, phi = 4, 0.1, 1.3e9
    for acc in (False, True):
        off, on = plan(phi, n, accumulation=acc), plan(phi, n, accumulation=acc, selective=f)
        before, after = off.row("ZeRO-2 + offload"), on.row("ZeRO-2 + offload")
        assert after.gpu_states - before.gpu_states == pytest.approx((28 if acc else 24) * f * phi / n, rel=1e-12)
        assert after.host - before.host == pytest.approx((10 + 2 + (4 if acc else 0) + 20 * f) * phi / n, rel=1e-12)
        for a, b in zip(off.strategies, on.strategies):
            assert a == b or a.strategy == "ZeRO-2 + offload"
    assert main(["plan", "--params", "1.3B", "--selective", "0.1"]) == 0
    assert "selective 0.1: the ZeRO-2 + offload row" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--selective", "1.5"], "--selective must be in [0, 1]"),
    (["--selective", "x"], "--selective"),
    (["--selective", "0.1", "--dpu"], "--selective is refused with gpu_fraction > 0, dpu"),
    (["--selective", "0.1", "--gpu-fraction", "0.2"], "--selective is refused"),
    (["--selective", "0.1", "--state-dtype", "bf16"], "--selective is refused"),
    (["--selective", "0.1", "--auto", "--fwd-bwd-ms", "10"], "--auto picks a gpu_fraction, which --selective refuses"),
])  # fmt: skip
def test_selective_options_are_checked(capsys, argv, message):
    assert main(["plan", "--params", "1.3B", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_default_buckets_grow_with_the_model():
    """Without bucket_bytes the offload rows hold ZeroOffloadAdamW's default buckets for the model (two bf16 buckets:
    2**24 elements up to 32 x 2**24 params, 2**25 up to 32 x 2**25, 2**26 above), and max_params lets them grow:
    on 2.2 GiB of GPU at 2 B/param the largest model is 32 x 2**25 (with 2**25-element buckets; one more param
    would take 2**26-element ones, which no longer fit)."""
    small, mid, large = (plan(n, 1, "80GiB", "1TiB").row("ZeRO-2 + offload").gpu_total for n in (5e8, 1e9, 2e9))
    base = (4 + 1) * GiB
    assert (small - base - 2 * 5e8, mid - base - 2 * 1e9, large - base - 2 * 2e9) == pytest.approx(
        (4 * 2**24, 4 * 2**25, 4 * 2**26), rel=1e-9)
    p = plan(1e9, 1, "2.2GiB", "100TiB", activations="0", workspace="0", reserve=0)
    assert p.row("ZeRO-2 + offload").max_params == 32 * 2**25
    given = plan(1e9, 1, "2.2GiB", "100TiB", activations="0", workspace="0", reserve=0, bucket_bytes="64MiB")
    assert given.row("ZeRO-2 + offload").max_params == pytest.approx((2.2 * GiB - 64 * 2**20) / 2, rel=1e-12)


def test_the_largest_model_with_growing_buckets_against_a_search():
    """planner._largest_by_size against a binary search for the largest n with per_param * n + fixed + the two
    default buckets of a model of n (by hand: 2 x 2 B x max(2**24, next power of two >= n / 32, capped at 2**26), or
    the largest parameter where larger) <= cap, on caps around each step of the bucket."""
    from zo_kernels import planner

    def buckets(n, largest):
        size = 1 << 24
        while size < -(-n // 32) and size < 1 << 26:
            size *= 2
        return 4 * max(size, largest)

    def search(cap, pp, fixed, largest):
        if pp * 0 + fixed + buckets(0, largest) > cap:
            return 0
        lo, hi = 0, 1 << 45
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if pp * mid + fixed + buckets(mid, largest) <= cap else (lo, mid - 1)
        return lo

    cases = []
    for step in (32 << 24, 32 << 25):  # models at the bucket's steps, bytes at 2 B/param
        for d in (-3 * 2**26, -2**25, -1, 0, 1, 2**25, 3 * 2**26):
            cases.append((2 * step + d + 4 * 2**25, 2.0, 0.0, 0))
    cases += [(10 * GiB, 2.0, GiB, 0), (10 * GiB, 2.0, GiB, 300_000_000), (2**26, 2.0, 0.0, 0), (80 * GiB, 14.0, 0, 0)]
    for cap, pp, fixed, largest in cases:
        got = planner._largest_by_size(cap, pp, fixed, largest)
        want = search(cap, pp, fixed, largest)
        assert want <= got < want + 1, (cap, pp, fixed, largest, got, want)


def test_every_size_in_the_printout_is_in_the_tables_unit_family(capsys):
    """An audit's find: with --units GiB the header and the assumptions were printed in GB (1e9) beside a table in
    GiB, and a 20 TiB NVMe as '21,990.2 GB'; small models printed as '0M params'."""
    assert main(["plan", "--params", "13e9", "--gpu-mem", "80GiB", "--nvme", "20TiB", "--units", "GiB"]) == 0
    head = capsys.readouterr().out.split("\n\n")[0]
    assert "GB" not in head.replace("GiB", ""), head
    assert "80.00 GiB" in head and "20,480.00 GiB" in head
    assert main(["plan", "--params", "137000"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model 137,000 params") and " 0M" not in out


def test_a_model_smaller_than_the_default_bucket_is_planned_with_buckets_of_its_size():
    """An audit's find: for a model under the default bucket (64 MiB of bf16 gradients: ~33.5M elements) the planner
    counted two 64 MiB buckets (31 B/param at 2.16M params) where the optimizer's two hold the model's size (4 B/param:
    zo_kernels.offload.layout's buckets end with the last parameter). The optimizer's own layout is the reference."""
    import zo_kernels as zk

    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    n = sum(p.numel() for p in model.parameters())
    opt = zk.ZeroOffloadAdamW(model, dtype=torch.bfloat16)
    largest = max(b.hi - b.lo for b in opt.layout.buckets)
    opt.close()
    assert plan(n).bucket_bytes == 2 * 2 * largest == 4 * n
