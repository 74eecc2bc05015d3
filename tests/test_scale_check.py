"""bench/scale_check.py end to end on the CPU (device = CPU, a few million parameters): every setting planned,
built on the meta device, trained for 5 steps (6 under DPU, delayed after 3) with checkpointing, measured and compared
with the planner; the host bytes the planner predicts within 10% of the peak RSS the run measured."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import scale_check  # noqa: E402  (bench/scale_check.py)

from zo_kernels.gpt import GPT, num_params  # noqa: E402

ROW = {"params", "setting", "tokens_per_s", "tflops", "mfu", "peak_gib", "host_gib", "loss_first", "loss_last",
       "planner_params"}  # fmt: skip (issue 23's keys)
# ~5.5M parameters (--max-params): their peak RSS spreads by ~4 MiB between identical runs, under the 8 MiB floor below
# which a byte figure is not flagged (scale_check.MISMATCH_FLOOR_GIB); the planner's host bytes read 4-5% (~5.6 MiB)
# over it for s2-fp32 and s3-cpu on a quiet machine. At ~3.7M (--max-params 4e6, until 2026-11-28) the same ~5.6 MiB
# was 6.6%, and a loaded CI run read s3-cpu 9.1 MiB (12%) under the planner: past both bars, a failure by noise
CPU_ARGS = ["--device", "cpu", "--max-params", "6e6", "--context", "32", "--vocab", "256", "--tokens", "128",
            "--steps", "5", "--host-reserve-gib", "0"]  # fmt: skip


def test_every_setting_end_to_end_on_the_cpu(tmp_path):
    """Each setting in a process of its own, as gpu_check.sh runs them: the host figure is the process's peak RSS
    growth, which inside a long-lived process (this test run's) reuses memory freed by earlier tests and reads low
    (it read 0.08 GiB against 0.12 in a full run, in process)."""
    out = tmp_path / "scale.json"
    rc = scale_check.main([str(out), *CPU_ARGS, "--budget-s", "300"])
    rows = json.loads(out.read_text())
    assert [r["setting"] for r in rows] == list(scale_check.SETTINGS)
    assert rc == 0, [r.get("error") for r in rows]
    assert not [p for p in os.listdir(tmp_path) if p != "scale.json"]  # no part files left
    for r in rows:
        assert ROW <= r.keys(), sorted(ROW - r.keys())
        n = scale_check.DPU_AFTER + 3 if scale_check.DPU[r["setting"]] else 5  # (DPU: two steady delayed steps)
        assert r["steps"] == n and len(r["losses"]) == n and all(math.isfinite(x) for x in r["losses"])
        first = scale_check.DPU_AFTER + 1 if scale_check.DPU[r["setting"]] else 2  # the steady steps: the timed ones
        assert r["timed_steps"] == n - first and "step_note" not in r
        assert r["step_s"] == statistics.median(r["step_times_s"][first:])
        assert r["loss_falls"] and r["loss_last"] < r["loss_first"]
        synchronous = scale_check.DPU_AFTER if scale_check.DPU[r["setting"]] else n
        assert len(r["update_probe"]) == synchronous  # (its windows around each synchronous step)
        for pr in r["update_probe"]:
            assert 0 < pr["update_over_lr"] <= 1.001 * pr["update_bound"] and not pr["beyond_bound"], pr
            assert pr.get("writeback_mismatches", 0) == 0, pr
        held = r["held_out_losses"]  # before the first step, then after each
        assert len(held) == n + 1 and all(math.isfinite(x) for x in held)
        assert r["held_out_falls"] == (held[-1] < held[0]) and r["held_out_falls"]
        assert 0 < r["held_out_tokens"] <= r["tokens_per_step"]
        assert 1e6 < r["params"] <= 6e6 < r["planner_params"]  # --max-params chose the size, not the planner
        assert r["tflops"] == pytest.approx(6 * r["params"] * r["tokens_per_step"] / r["step_s"] / 1e12)
        assert 0 < r["mfu"] == pytest.approx(r["tflops"] / r["matmul_tflops"])
        assert r["peak_gib"] is None and r["planner_peak_gib"] is None  # no device memory apart from the host's
        assert r["host_gib"] > 0 and r["planner_host_gib"] > 0
        assert r["device_states_gib"] > 0 and r["planner_device_states_gib"] > 0  # flat buffer, or gathered units
        if scale_check.DPU[r["setting"]]:
            assert r["dpu_wait_s"] >= 0 and isinstance(r["adam_hidden"], bool) and r["dpu_after_steps"] == 3
        else:  # without DPU nothing is waited for: no claim that the update hides
            assert "dpu_wait_s" not in r and "adam_hidden" not in r, r
        assert r["cpu_update_s"] > 0 and r["cpu_update_ns_per_param"] > 0
        assert r["lr"] == min(3e-4, 0.075 / r["width"]) and r["spec_tflops"] is None and r["mfu_peak"] is None
        assert r["warmup_steps"] == n and r["lr_per_step"] == pytest.approx([r["lr"] * k / n for k in range(1, n + 1)])
        assert not r["mismatch"], r["mismatch"]  # host bytes and the optimizer's device buffers within 10%
        off = r["planner_host_gib"] - r["host_gib"]
        assert abs(off) <= max(scale_check.MISMATCH * r["host_gib"], scale_check.MISMATCH_FLOOR_GIB), off
    sync8, q8, fp32, s3 = rows
    # 8.03, 10.03, 16, 20 B/param
    assert sync8["planner_host_gib"] < q8["planner_host_gib"] < fp32["planner_host_gib"] < s3["planner_host_gib"]


def test_mismatches_flag_each_figure_beyond_ten_percent():
    row = {"params": 100, "planner_params": 125, "max_params": 1e12, "peak_gib": 10.0, "planner_peak_gib": 10.9,
           "host_gib": 50.0, "planner_host_gib": 40.0}  # fmt: skip
    got = scale_check.mismatches(row)
    assert [m.split(":")[0] for m in got] == ["params", "host_gib"]
    assert "+25%" in got[0] and "-20%" in got[1]
    assert scale_check.mismatches({**row, "max_params": 110}) == got[1:]  # capped: params not the planner's choice


def test_mismatches_leave_byte_figures_off_by_less_than_the_floor():
    """CI's loaded run read 0.04042 GiB of peak RSS against the planner's 0.04508 (+12%, 4.8 MiB): under the 8 MiB
    floor, not flagged; 9 MiB off at that size is, and a GB-scale figure 10.5% off still is."""
    mib = 1 / 1024
    assert scale_check.MISMATCH_FLOOR_GIB == 8 * mib
    assert scale_check.mismatches({"host_gib": 0.04042, "planner_host_gib": 0.04508}) == []
    assert scale_check.mismatches({"host_gib": 0.04042, "planner_host_gib": 0.04042 + 9 * mib})[0].startswith("host")
    assert scale_check.mismatches({"peak_gib": 0.02, "planner_peak_gib": 0.02 + 7 * mib}) == []
    assert len(scale_check.mismatches({"peak_gib": 30.0, "planner_peak_gib": 33.15, "device_states_gib": 1.0,
                                       "planner_device_states_gib": 0.85})) == 2  # fmt: skip
    assert scale_check.mismatches({"params": 100, "planner_params": 111})  # params: no floor


def test_the_shape_search_takes_the_largest_gpt_the_planner_fits():
    args = argparse.Namespace(device="cuda", vocab=32000, context=2048, tokens=8192, max_params=1e13,
                              host_reserve_gib=10.0)  # fmt: skip
    mach = {"device_total": 80 * 2**30, "host_available": 120 * 2**30, "disk_free": 60 * 2**30}
    for setting in scale_check.SETTINGS:
        c, tokens, figures = scale_check.choose_model(setting, mach, 1e-9, 700.0, args)
        n = scale_check.gpt_params(c)
        assert tokens == 8192 and n <= figures["planner_params"] < n * 1.1, (setting, n, figures)
        bigger = scale_check.config_for(c.width + 128, c.layers, args)
        assert not scale_check.plan_for(bigger, setting, tokens, mach, args)[0]
    with torch.device("meta"):
        assert scale_check.gpt_params(c) == num_params(GPT(c))
    c8 = scale_check.choose_model("s2-8bit", mach, 1e-9, 700.0, args)[0]
    c32 = scale_check.choose_model("s2-fp32", mach, 1e-9, 700.0, args)[0]
    assert scale_check.gpt_params(c8) > 1.4 * scale_check.gpt_params(c32)  # 10.03 against 16 host bytes per param


def test_a_given_shape_is_trained_as_given_and_its_params_not_compared():
    """--shape WIDTHxLAYERS (a narrow proxy of a large row): that GPT, the planner's figures beside it, its params not
    flagged against the planner's max (the planner did not choose them); a malformed shape refused by name."""
    args = argparse.Namespace(device="cpu", vocab=256, context=64, tokens=128, max_params=1e13, host_reserve_gib=0.0,
                              shape="5376x2")  # fmt: skip
    mach = {"device_total": 24 * 2**30, "host_available": 24 * 2**30, "disk_free": 60 * 2**30}
    c, tokens, figures = scale_check.choose_model("s2-8bit-sync", mach, 1e-9, 1.0, args)
    assert (c.width, c.layers, c.heads, tokens) == (5376, 2, 42, 128)
    assert figures["planner_params"] > 0
    row = {"params": 100, "planner_params": 1e4, "max_params": 1e13, "host_gib": 1.0, "planner_host_gib": 1.0}
    assert scale_check.mismatches(row)[0].startswith("params")
    assert scale_check.mismatches({**row, "shape": "5376x2"}) == []
    for bad in ("5376", "5376x0", "100x2", "ax2", "64x2x3"):
        with pytest.raises(ValueError, match="--shape"):
            scale_check.parse_shape(bad)
    for argv in (["--shape", "5376"], ["--head-width", "-1"]):
        with pytest.raises(SystemExit):
            scale_check.main(["unused.json", *argv])
    # every option reaches the setting's own process: its parser reads back what the parent was given
    parent = ["out.json", "--device", "cpu", "--shape", "5376x2", "--head-width", "0", "--steps", "7", "--lr", "1e-5",
              "--warmup-steps", "3", "--tokens", "1024", "--context", "512", "--vocab", "999", "--max-params", "5e9",
              "--host-reserve-gib", "2.5"]  # fmt: skip
    seen = {}
    real_parse = argparse.ArgumentParser.parse_args

    def capture(self, argv=None, namespace=None):
        ns = real_parse(self, argv, namespace)
        seen.setdefault("parent" if ns.child is None else "child", ns)
        if ns.child is None:  # the parent: build its child's command line, parse it as the child would
            cmd = scale_check.child_command(ns, "s2-8bit", "part.json", 100.0)
            assert cmd[1] == os.path.abspath(scale_check.__file__)
            real = real_parse(self, cmd[2:])
            seen["child"] = real
            raise SystemExit(0)
        return ns

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(SystemExit):
            scale_check.main(parent)
    p, ch = vars(seen["parent"]), vars(seen["child"])
    assert ch.pop("child") == "s2-8bit" and ch.pop("out") == "part.json" and ch.pop("budget_s") == 100.0
    for key in ("out", "child", "budget_s", "settings", "in_process", "min_share_s"):  # (the parent's own)
        p.pop(key)
    ch.pop("settings"), ch.pop("in_process"), ch.pop("min_share_s")
    assert ch == p


def test_the_default_learning_rate_shrinks_with_the_width():
    """min(3e-4, 0.075 / width): five steps of Adam at 1e-4 raised a 1.6B GPT's loss on the CPU (10.76 -> 11.55
    without warm-up; up 0.57 in one step at 9.2e-5 with it), 3e-5 with the warm-up lowered it every step."""
    args = argparse.Namespace(vocab=256, context=64)
    assert scale_check.default_lr(scale_check.config_for(128, 2, args)) == 3e-4
    assert scale_check.default_lr(scale_check.config_for(2496, 20, args)) == pytest.approx(3.005e-5, rel=1e-3)
    assert scale_check.default_lr(scale_check.config_for(5120, 40, args)) == pytest.approx(1.465e-5, rel=1e-3)


def test_every_searched_width_splits_into_whole_heads():
    """The CPU's search steps widths by 32: from 1024 up, a width 128 does not divide keeps heads of 32 (width 1312
    was given 10 heads of 131.2 and the first forward raised)."""
    args = argparse.Namespace(vocab=256, context=64)
    for width in range(32, 8193, 32):
        c = scale_check.config_for(width, 2, args)
        assert c.width % c.heads == 0, (width, c.heads)
    assert scale_check.config_for(2048, 16, args).heads == 16  # heads of 128 where they fit (the GPU's step)


def test_out_of_memory_halves_the_tokens_once_and_a_failure_is_a_row(tmp_path, monkeypatch):
    """Step 1 out of device memory: retried with half the tokens (the planner's figures for those). A setting that
    fails is a row with its error; the next one still runs."""
    real, calls = scale_check.train_step, []

    def flaky(model, opt, c, tokens, gen, device):
        calls.append((opt.stage, tokens))
        if opt.stage == 3:
            raise RuntimeError("injected")
        if len(calls) == 4:  # the warm-up's three steps, then step 1
            raise torch.OutOfMemoryError("injected")
        return real(model, opt, c, tokens, gen, device)

    monkeypatch.setattr(scale_check, "train_step", flaky)
    out = tmp_path / "scale.json"
    args = [*CPU_ARGS, "--max-params", "2e6", "--settings", "s2-fp32,s3-cpu", "--budget-s", "300", "--in-process"]
    assert scale_check.main([str(out), *args]) == 1
    ok, failed = json.loads(out.read_text())
    assert ok["tokens_halved"] == 1 and ok["tokens_per_step"] == 64 and ok["steps"] == 6 and "error" not in ok
    assert [t for _, t in calls[3:5]] == [128, 64]
    assert failed["setting"] == "s3-cpu" and "injected" in failed["error"] and "steps" not in failed


def test_the_retry_after_out_of_memory_runs_once_the_failed_step_is_freed(tmp_path, monkeypatch):
    """The retry with half the tokens must not run inside the except block: there the traceback holds the failed
    step's frames, so on a GPU its graph and activations would still fill the device during the retry."""
    import weakref

    real, calls, freed = scale_check.train_step, [], []

    class Activations:  # stands for what the failed step held on the device
        pass

    def flaky(model, opt, c, tokens, gen, device):
        calls.append(tokens)
        if len(calls) == 4:  # the warm-up's three steps, then step 1
            held = Activations()
            freed.append(weakref.ref(held))
            raise torch.OutOfMemoryError("injected")
        if len(calls) == 5:  # the retry
            freed.append(freed[0]() is None)
        return real(model, opt, c, tokens, gen, device)

    monkeypatch.setattr(scale_check, "train_step", flaky)
    out = tmp_path / "scale.json"
    args = [*CPU_ARGS, "--max-params", "2e6", "--settings", "s2-fp32", "--steps", "1", "--budget-s", "300",
            "--in-process"]  # fmt: skip
    assert scale_check.main([str(out), *args]) == 0
    (row,) = json.loads(out.read_text())
    assert row["tokens_halved"] == 1 and calls[3:5] == [128, 64]
    assert freed[1] is True, "the failed step's frames were still alive when the retry began"


def test_memory_cgroup_limit_and_datasheet_peaks(tmp_path):
    """A container's memory limit bounds the host memory the plan may use (/proc/meminfo shows the node); v2's
    "max" and v1's huge number mean none. The datasheet peak is found by device name, the PCIe H100 apart."""
    limit, usage, stat = tmp_path / "memory.max", tmp_path / "memory.current", tmp_path / "memory.stat"
    files = ((str(limit), str(usage), str(stat), "inactive_file"),)
    limit.write_text("137438953472\n")  # 128 GiB
    usage.write_text(str(8 * 2**30) + "\n")
    assert scale_check.cgroup_available(files) == 120 * 2**30  # (no memory.stat: all usage counted)
    stat.write_text(f"anon 1\ninactive_file {3 * 2**30}\nactive_file 5\n")  # reclaimable page cache: not used
    assert scale_check.cgroup_available(files) == 123 * 2**30
    limit.write_text("max\n")
    assert scale_check.cgroup_available(files) is None
    limit.write_text(str(2**63 - 4096))
    assert scale_check.cgroup_available(files) is None
    assert scale_check.cgroup_available(((str(tmp_path / "none"), str(usage), str(stat), "x"),)) is None
    assert scale_check.spec_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert scale_check.spec_tflops("NVIDIA H100 PCIe") == 756.0 and scale_check.spec_tflops("NVIDIA H200") == 989.4
    assert scale_check.spec_tflops("NVIDIA H200 NVL") == 835.0
    assert scale_check.spec_tflops("CPU") is None


def test_a_later_setting_starts_only_with_its_minimum_left(tmp_path, monkeypatch):
    """The headline runs with whatever the budget leaves; a later setting with less than MIN_SHARE_S left is a
    NOT RUN row, not a process killed mid-build (on a GPU machine the time lost to the settings before it)."""
    import types

    clock, ran = [0.0], []

    def run(s, args, part):  # each setting takes 100 pretend seconds
        ran.append((s, args.budget_s))
        clock[0] += 100

    monkeypatch.setattr(scale_check, "run_setting", run)
    monkeypatch.setattr(scale_check, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(scale_check, "MIN_SHARE_S", {"cuda": 150, "cpu": 150})
    out = tmp_path / "scale.json"
    settings = "s2-8bit-sync,s2-8bit,s2-fp32,s3-cpu"
    scale_check.main([str(out), *CPU_ARGS, "--settings", settings, "--budget-s", "380", "--in-process"])
    rows = json.loads(out.read_text())
    # 380 s: the first gets 380 (0.75 of it for its steps), the second the 280 left, the third 180, the last 80 < 150
    assert ran == [("s2-8bit-sync", 285.0), ("s2-8bit", 210.0), ("s2-fp32", 135.0)], ran
    assert [r["setting"] for r in rows] == settings.split(",")
    assert "NOT RUN" in rows[3]["error"] and "needs 150s" in rows[3]["error"], rows[3]
    clock[0], ran[:] = 0.0, []
    scale_check.main([str(out), *CPU_ARGS, "--settings", settings, "--budget-s", "60", "--in-process"])
    assert ran == [("s2-8bit-sync", 45.0)]  # the headline runs whatever is left; nothing after it
    # --min-share-s (gpu_check's ZO_SCALE_MIN_SHARE_S; bench/gpu_session.sh gives 90): the last one's 80 s do not
    # reach 90 either, 70 let it start
    for least, last in ((90, False), (70, True)):
        clock[0], ran[:] = 0.0, []
        scale_check.main([str(out), *CPU_ARGS, "--settings", settings, "--budget-s", "380", "--in-process",
                          "--min-share-s", str(least)])  # fmt: skip
        assert [s for s, _ in ran] == settings.split(",")[: 4 if last else 3], (least, ran)
    with pytest.raises(SystemExit):
        scale_check.main([str(out), *CPU_ARGS, "--min-share-s", "-1"])


def test_sync_tokens_grow_where_the_device_has_room():
    """Without DPU CPU Adam adds to the step: the headline takes up to 5x its time in forward + backward tokens
    where the device has room (MFU u x 6/8 x cover / (cover + 1)); with DPU 1.25x stays; a device with room for
    neither more keeps 3x."""
    args = argparse.Namespace(device="cuda", vocab=32000, context=2048, tokens=0, max_params=1e13,
                              host_reserve_gib=10.0)  # fmt: skip
    per = 1e-9 * 0.5 * 700e12 / 8  # tokens per unit of cover at 1 ns/param and 700 TFLOP/s

    def tokens(cover: float) -> int:
        return math.ceil(cover * per / 2048) * 2048

    roomy = {"device_total": 1000 * 2**30, "host_available": 120 * 2**30, "disk_free": 60 * 2**30}
    assert scale_check.choose_model("s2-8bit-sync", roomy, 1e-9, 700.0, args)[1] == tokens(5)
    c = scale_check.choose_model("s2-8bit-sync", roomy, 1e-9, 700.0, args)[0]
    adam_s = 1e-9 * scale_check.gpt_params(c)  # (~14.6 s: five steps at cover 5 take 6 x 5 x that)
    short = argparse.Namespace(**vars(args), steps=5, budget_s=5 * 5.1 * adam_s / 0.6)  # room for cover 4, not 5
    assert scale_check.choose_model("s2-8bit-sync", roomy, 1e-9, 700.0, short)[1] == tokens(4)
    assert scale_check.choose_model("s2-8bit", roomy, 1e-9, 700.0, args)[1] == tokens(1.25)
    tight = {**roomy, "device_total": 40 * 2**30}  # the device bounds the model (2.1B at 3x): no room for more
    c, t, _ = scale_check.choose_model("s2-8bit-sync", tight, 1e-9, 700.0, args)
    assert t == tokens(3) and not scale_check.plan_for(c, "s2-8bit-sync", tokens(4), tight, args)[0]


def test_a_dpu_row_cut_before_a_steady_step_says_its_time_is_not_one(tmp_path, monkeypatch):
    """A DPU setting killed (here: failing) at its first delayed step keeps the row written after step 3, whose
    step_s is then the synchronous steps' median: flagged (step_note, timed_steps 0), never passed off as DPU's."""
    real, calls = scale_check.train_step, []

    def fails_at_step_4(model, opt, c, tokens, gen, device):
        calls.append(tokens)
        if len(calls) == 3 + 4:  # the warm-up's three steps, then steps 1-3
            raise RuntimeError("injected at step 4")
        return real(model, opt, c, tokens, gen, device)

    monkeypatch.setattr(scale_check, "train_step", fails_at_step_4)
    out = tmp_path / "scale.json"
    args = [*CPU_ARGS, "--max-params", "2e6", "--settings", "s2-fp32", "--budget-s", "300", "--in-process"]
    assert scale_check.main([str(out), *args]) == 1
    (row,) = json.loads(out.read_text())
    assert "injected at step 4" in row["error"] and row["steps"] == 3 and row["timed_steps"] == 0
    assert row["step_note"].startswith("no steady step finished yet")


@pytest.mark.parametrize("state_dtype", [torch.float32, "8bit"])
def test_the_update_probe_sees_a_move_beyond_the_bound_and_a_device_value_not_the_masters_cast(state_dtype):
    """bench/update_probe.py around one step of a small GPT (device = CPU): within the bound, no mismatch; the same
    step told a 10x smaller lr reads 10x over the bound; a device parameter changed after the step is a mismatch."""
    from update_probe import UpdateProbe

    import zo_kernels as zk
    from zo_kernels.gpt import GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, context=16, layers=1, width=64, heads=2))
    opt = zk.ZeroOffloadAdamW(model, lr=1e-3, dtype=torch.bfloat16, state_dtype=state_dtype)
    probe = UpdateProbe(opt, model)
    x = torch.randint(0, 64, (2, 16))
    wd = opt.param_groups[0]["weight_decay"]  # (the decay's factor stays lr x wd: told lr / 10, wd x 10)

    def step(lr_told: float) -> dict:
        probe.before()
        model(x, x).backward()
        opt.step()
        return probe.after(step=opt.update.steps[0], lr=lr_told, betas=(0.9, 0.999), weight_decay=wd * 1e-3 / lr_told)

    ok = step(1e-3)
    assert 0.5 < ok["update_over_lr"] <= 1.001 * ok["update_bound"] and not ok["beyond_bound"], ok
    assert ok["writeback_mismatches"] == 0
    told_less = step(1e-4)  # (step 2: the real lr is 10x what the probe is told)
    assert told_less["update_over_lr"] > 5 * told_less["update_bound"] and told_less["beyond_bound"], told_less
    probe.before()
    model(x, x).backward()
    opt.step()
    with torch.no_grad():
        model.head.weight.view(-1)[3] += 1.0  # (a misplaced writeback)
    bad = probe.after(step=3, lr=1e-3, betas=(0.9, 0.999), weight_decay=wd)
    assert bad["writeback_mismatches"] == 1, bad
    opt.close()


def test_the_update_probe_counts_a_move_less_the_masters_rounding():
    """At lr 1e-6 a LayerNorm weight of 1.0 moves by 1e-6 and is rounded by up to 3e-8 (half an fp32 ulp below 1):
    exact Adam's step 1, not a move beyond its bound (the probe read 1.03 x lr on a 1B GPT on the CPU)."""
    from update_probe import UpdateProbe

    import zo_kernels as zk
    from zo_kernels.gpt import GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, context=16, layers=1, width=64, heads=2))
    opt = zk.ZeroOffloadAdamW(model, lr=1e-6, weight_decay=0.0, dtype=torch.bfloat16)
    probe = UpdateProbe(opt, model)
    x = torch.randint(0, 64, (2, 16))
    probe.before()
    model(x, x).backward()
    opt.step()
    got = probe.after(step=1, lr=1e-6, betas=(0.9, 0.999))
    assert 0.9 < got["update_over_lr"] <= 1.001 * got["update_bound"] and not got["beyond_bound"], got
    opt.close()


def test_the_lm_head_starts_at_gpt2_smalls_logit_scale_at_any_width():
    """init_fn: weights N(0, 0.02) but the LM head N(0, 0.02 x sqrt(768 / width)) past width 768 (its logits' std stays
    ~0.55), LayerNorm weights 1, biases left as ParamInit hands them over (zeros)."""
    gen = torch.Generator().manual_seed(0)
    for width in (512, 768, 3072, 5376):
        head, qkv = torch.empty(4096, width), torch.empty(width, 3 * width)
        scale_check.init_fn("head.weight", head, gen)
        scale_check.init_fn("blocks.0.qkv.weight", qkv, gen)
        want = 0.02 * min(1.0, (768 / width) ** 0.5)
        assert head.std().item() == pytest.approx(want, rel=0.02) and qkv.std().item() == pytest.approx(0.02, rel=0.02)
        logits = head @ torch.nn.functional.layer_norm(torch.randn(64, width), (width,)).T
        assert logits.std().item() == pytest.approx(want * width**0.5, rel=0.05)
    head = torch.empty(4096, 5376)  # --head-width 0: GPT-2's N(0, 0.02) at any width (the H200's first scale run)
    scale_check.init_fn("head.weight", head, gen, head_width=0)
    assert head.std().item() == pytest.approx(0.02, rel=0.02)
    bias, ln = torch.zeros(10), torch.zeros(10)
    scale_check.init_fn("blocks.0.qkv.bias", bias, gen)
    scale_check.init_fn("blocks.0.ln1.weight", ln, gen)
    assert not bias.any() and (ln == 1).all()


def test_the_activation_estimate_matches_the_h200_rows():
    """activation_bytes against the activations the H200's scale rows measured (bench/results, 2026-11-27: 15.3B at
    32768 tokens, 12.0B at 8192): within 5% (the estimate before read 1.13 and 1.30 of them)."""
    path = os.path.join(HERE, "..", "bench", "results", "gpu-2026-11-27-H200-scale.json")
    rows = [r for r in json.load(open(path))["scale"] if r.get("activations_gib")]
    assert len(rows) == 2
    for r in rows:
        c = scale_check.GPTConfig(vocab=r["vocab"], context=r["context"], layers=r["layers"], width=r["width"],
                                  heads=r["heads"])  # fmt: skip
        estimate = scale_check.activation_bytes(c, r["tokens_per_step"], cuda=True) / 2**30
        assert estimate == pytest.approx(r["activations_gib"], rel=0.05), (r["setting"], estimate)
