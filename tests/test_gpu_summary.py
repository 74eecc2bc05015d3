"""gpu_check.sh's summary.json: bench/summary.py builds it from the step and anchor rows, the committed GPU results
parse with the keys issue 17 names, and the dashboard renders them beside the CPU benchmark runs."""

import glob
import json
import os
import sys

import pytest

from zo_kernels import dashboard

HERE = os.path.dirname(__file__)
BENCH = os.path.join(HERE, "..", "bench")
sys.path.insert(0, BENCH)

import summary  # noqa: E402  (bench/summary.py)

TOP = {"device", "date", "commit", "pack", "step", "anchors"}
STEP = {"params", "mode", "zo_ms", "fwd_bwd_ms", "cpu_adam_ms", "zo_peak_gib", "torch_fused_ms", "torch_peak_gib",
        "phases"}  # fmt: skip
ANCHOR = {"system", "params", "ms", "peak_gib", "host_gib", "note"}


def step_row(mode: str, zo_ms: float) -> dict:
    row = {"params": 1000, "mode": mode, "zo_ms": zo_ms, "fwd_bwd_ms": 4.0, "cpu_adam_ms": 6.0, "zo_peak_gib": 0.1,
           "torch_fused_ms": 3.0, "torch_peak_gib": 1.0, "phases": {"offload": 0.5, "step": 6.1}}  # fmt: skip
    bar = 1.10 if mode == "sync" else 1.15
    value = zo_ms / (10.0 if mode == "sync" else 6.0)
    row["targets"] = {"t": {"value": value, "bar": bar, "met": value <= bar}}
    return row


def test_summary_json_collects_the_rows_and_judges_the_targets(tmp_path):
    rows = [step_row("sync", 10.5), step_row("dpu", 7.5)]
    (tmp_path / "step.json").write_text(json.dumps(rows))
    anchors = [{"system": "deepspeed", "params": None, "ms": None, "peak_gib": None, "host_gib": None,
                "note": "NOT INSTALLED: no module named deepspeed"}]  # fmt: skip
    (tmp_path / "anchors.json").write_text(json.dumps(anchors))
    data = summary.summary_json(str(tmp_path), "GPU X", "abc", "2026-01-02")
    assert TOP <= data.keys() and data["device"] == "GPU X" and data["commit"] == "abc"
    assert data["step"] == rows and data["anchors"] == anchors
    assert data["pack"] == ([] if not hasattr(summary, "pack_rows") else data["pack"])
    worst = data["targets"]["step"]["t"]
    assert worst["value"] == 7.5 / 6.0 and worst["met"] is False  # the worse of the two rows


def test_summary_json_without_rows_is_empty_not_an_error(tmp_path):
    data = summary.summary_json(str(tmp_path))
    assert data["step"] == [] and data["anchors"] == [] and data["targets"] == {"step": {}, "activations": {}}
    assert data["scale"] == []


SCALE = {"params", "setting", "tokens_per_s", "tflops", "mfu", "peak_gib", "host_gib", "loss_first", "loss_last",
         "planner_params"}  # fmt: skip (issue 23)


def scale_row(setting: str, mismatch: list[str]) -> dict:
    return {"setting": setting, "params": 9.1e9, "planner_params": 9.4e9, "tokens_per_s": 4000.0, "tflops": 250.0,
            "mfu": 0.33, "peak_gib": 40.2, "planner_peak_gib": 41.0, "host_gib": 101.0, "planner_host_gib": 103.0,
            "loss_first": 10.4, "loss_last": 8.9, "mismatch": mismatch}  # fmt: skip


def test_scale_rows_reach_the_summary_its_text_and_the_dashboard(tmp_path, capsys):
    rows = [scale_row("s2-8bit", []), scale_row("s3-cpu", ["host_gib: planner 80, measured 101 (-21%)"]),
            {"setting": "s2-fp32", "error": "timed out after 200s"}]  # fmt: skip
    (tmp_path / "scale.json").write_text(json.dumps(rows))
    assert summary.main(["--summary-json", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["scale"] == rows and all(SCALE <= r.keys() for r in rows[:2])
    text = capsys.readouterr().out
    assert "scale s2-8bit: 9.10B params (planner 9.40B)" in text and "33% of the measured matmul" in text
    assert "MISMATCH host_gib" in text and "timed out after 200s" in text and "3 scale rows" in text
    page = dashboard.render([tmp_path / "summary.json"])
    assert "scale: the largest model per setting" in page and "s3-cpu" in page and "timed out" in page


def test_the_update_probe_reaches_the_scale_line():
    """A scale row's update probe (bench/update_probe.py) in summary.py's line: the worst step against its bound, and
    a flag where a window went past it or a device value was not the master's cast."""
    fine = [{"update_over_lr": 1.0, "update_bound": 1.0, "beyond_bound": [], "writeback_mismatches": 0},
            {"update_over_lr": 1.2, "update_bound": 1.5, "beyond_bound": [], "writeback_mismatches": 0}]  # fmt: skip
    text = summary.scale_line({**scale_row("s2-8bit-sync", []), "update_probe": fine})
    assert "masters moved <= 1.00 x lr (bound 1.00)" in text and "UPDATE PROBE" not in text
    bad = fine + [{"update_over_lr": 17.4, "update_bound": 1.0, "beyond_bound": ["blocks.8.out.weight[0:1024]: 17.4"],
                   "writeback_mismatches": 3}]  # fmt: skip
    text = summary.scale_line({**scale_row("s2-8bit-sync", []), "update_probe": bad})
    assert "17.40 x lr (bound 1.00): UPDATE PROBE 1 windows beyond the bound, 3 device values" in text
    assert "masters moved" not in summary.scale_line(scale_row("s2-8bit", []))


def test_committed_gpu_results_have_the_issue_keys():
    paths = sorted(glob.glob(os.path.join(BENCH, "results", "gpu-*.json")))
    assert paths, "bench/results/ holds at least the converted 2026-11-22 H100 run"
    for p in paths:
        data = json.load(open(p))
        assert TOP <= data.keys(), p
        for r in data["step"]:  # (a row that failed or was not run says why instead)
            assert "error" in r or "skipped" in r or STEP <= r.keys(), (p, sorted(STEP - r.keys()))
        for r in data["anchors"]:
            assert ANCHOR <= r.keys(), (p, sorted(ANCHOR - r.keys()))
        for r in data.get("scale", []):
            assert "error" in r or SCALE <= r.keys(), (p, sorted(SCALE - r.keys()))
        assert dashboard.is_gpu_summary(p)


def test_dashboard_renders_gpu_summaries_beside_the_cpu_runs(tmp_path):
    cpu_runs = [os.path.join(HERE, "data", f) for f in ("bench_run1.json", "bench_run2.json")]
    gpu = tmp_path / "gpu-2026-01-02-H100.json"
    gpu.write_text(json.dumps({"device": "H100", "date": "2026-01-02", "commit": "abc", "pack": [],
                               "host": {"cpu_model": "Xeon Q", "cpus": 16, "threads_per_core": 2},
                               "step": [step_row("sync", 12.0)],
                               "anchors": [{"system": "torchao", "params": 1000, "ms": 9.0, "peak_gib": 1.5,
                                            "host_gib": 2.0, "note": "fp32 params"}]}))  # fmt: skip
    both = dashboard.render([*cpu_runs, gpu])
    only_cpu = dashboard.render(cpu_runs)
    assert both.count("<section>") == only_cpu.count("<section>") + 1
    assert "GPU: gpu-2026-01-02-H100.json" in both and "torchao" in both and "MISSED" in both
    assert "host Xeon Q, 16 CPUs, 2 threads per core" in both
    alone = dashboard.render([gpu])
    assert "GPU: gpu-2026-01-02-H100.json" in alone and "<script" not in alone


def test_dashboard_renders_the_pack_host_time_and_the_activation_rows(tmp_path):
    """issue 17's host time per pack call and issue 21's activation rows are in summary.json: the page shows them."""
    gpu = tmp_path / "gpu-2026-01-03-H200.json"
    gpu.write_text(json.dumps({"device": "H200", "date": "2026-01-03", "commit": "abc", "pack": [], "step": [],
                               "pack_host": {"host_us": 27.5, "host_us_launch_stubbed": 16.25,
                                             "host_us_through_triton": 31.75, "launch": "real (CUDA)"},
                               "activations": [{"provider": "zo", "seq": 2048, "step_ms": 41.5,
                                                "peak_activation_gib": 0.3125, "longest_seq": 16384,
                                                "profile": {"wall_ms": 43.25, "busy_ms": 30.5,
                                                            "gaps": [{"ms": 1.5, "host_op": "aten::copy_"}],
                                                            "runtime": {}}},
                                               {"provider": "save_on_cpu", "seq": 2048, "error": "OOM"}]}))  # fmt: skip
    page = dashboard.render([gpu])
    for text in ("host time per call", "27.5", "16.25", "31.75", "host_us_through_triton", "activations",
                 "save_on_cpu", "0.3125", "16384", "OOM", "profiled_ms", "43.25", "device_busy_ms",
                 "30.5"):  # fmt: skip
        assert text in page, text
    assert "aten::copy_" not in page  # the profile's gaps stay in the JSON, not in a table cell
    gpu.write_text(json.dumps({"step": [], "activations": {"not": "a list"}}))
    with pytest.raises(ValueError, match="activations must be a list of objects"):
        dashboard.load_gpu_summary(gpu)


def test_summary_json_judges_the_activation_rows(tmp_path):
    """Issue 21: zo's offloaded checkpoint against torch's checkpoint and save_on_cpu, from activations.json."""
    rows = [{"provider": "torch", "seq": 4096, "step_ms": 100.0, "longest_seq": 40_000},
            {"provider": "save_on_cpu", "seq": 4096, "step_ms": 150.0},
            {"provider": "zo", "seq": 4096, "step_ms": 104.0, "longest_seq": 60_000,
             "checkpoint_allocations_per_step": 0.0},
            {"provider": "zo_resident", "seq": 4096, "error": "OutOfMemoryError: ..."}]  # fmt: skip
    (tmp_path / "activations.json").write_text(json.dumps(rows))
    data = summary.summary_json(str(tmp_path))
    assert data["activations"] == rows
    t = data["targets"]["activations"]
    assert t["step_vs_torch_checkpoint"] == {"value": 1.04, "bar": 1.05, "met": True}
    assert t["step_vs_save_on_cpu"]["met"] and t["checkpoint_allocations_per_step"]["met"]
    assert t["longest_seq_vs_torch_checkpoint"] == {"value": 1.5, "bar": 2.0, "met": False, "providers": "zo / torch"}
    assert "step_vs_torch_offload" not in t  # (no such row)
    rows.append({"provider": "torch_offload", "seq": 4096, "step_ms": 130.0})  # transformers 5's offload
    (tmp_path / "activations.json").write_text(json.dumps(rows))
    t = summary.summary_json(str(tmp_path))["targets"]["activations"]
    assert t["step_vs_torch_offload"] == {"value": 0.8, "bar": 1.0, "met": True}
    # the half-block rows: each side's longest sequence of its segmentations, and zo_half's step judged too
    rows += [{"provider": "torch_half", "seq": 4096, "step_ms": 101.0, "longest_seq": 30_000},
             {"provider": "zo_half", "seq": 4096, "step_ms": 110.0, "longest_seq": 90_000}]  # fmt: skip
    (tmp_path / "activations.json").write_text(json.dumps(rows))
    t = summary.summary_json(str(tmp_path))["targets"]["activations"]
    assert t["longest_seq_vs_torch_checkpoint"] == {"value": 2.25, "bar": 2.0, "met": True,
                                                    "providers": "zo_half / torch"}  # fmt: skip
    assert t["half_step_vs_torch_checkpoint"] == {"value": 1.1, "bar": 1.05, "met": False}
    rows[0]["longest_seq_search_ended"] = False  # torch's search cut short: its sequence is a lower bound
    (tmp_path / "activations.json").write_text(json.dumps(rows))
    t = summary.summary_json(str(tmp_path))["targets"]["activations"]["longest_seq_vs_torch_checkpoint"]
    assert t["value"] == 2.25 and not t["met"] and "at most" in t["note"]


def test_summary_judges_the_wide_shape_apart_and_reads_the_host_row(tmp_path, capsys):
    """activation_rows.py's wide rows (a model whose step the device sets) are judged against torch's checkpoint of
    the same shape, as wide_*; they never stand in for the main shape's; the host-overhead row is printed, not
    judged."""
    main = [{"provider": "torch", "seq": 4096, "step_ms": 100.0, "shape": "main"},
            {"provider": "zo", "seq": 4096, "step_ms": 120.0, "shape": "main"}]
    wide = [{"provider": "torch", "seq": 4096, "step_ms": 300.0, "shape": "wide", "layers": 8, "hidden": 4096},
            {"provider": "zo", "seq": 4096, "step_ms": 306.0, "shape": "wide", "layers": 8, "hidden": 4096},
            {"provider": "torch_offload", "seq": 4096, "step_ms": 360.0, "shape": "wide", "layers": 8,
             "hidden": 4096}]  # fmt: skip
    host = {"provider": "host_overhead", "us_per_block": {"none": 200.0, "torch": 600.0, "zo_resident": 640.0,
                                                          "zo": 700.0},
            "zo_over_torch_us": 100.0, "zo_resident_over_torch_us": 40.0, "torch_over_none_us": 400.0}  # fmt: skip
    (tmp_path / "activations.json").write_text(json.dumps(main + [host] + wide))
    t = summary.summary_json(str(tmp_path))["targets"]["activations"]
    assert t["step_vs_torch_checkpoint"] == {"value": 1.2, "bar": 1.05, "met": False}  # the main shape's alone
    assert t["wide_step_vs_torch_checkpoint"] == {"value": 1.02, "bar": 1.05, "met": True}
    assert t["wide_step_vs_torch_offload"] == {"value": 0.85, "bar": 1.0, "met": True}
    assert "step_vs_torch_offload" not in t  # (the main shape has no torch_offload row)
    wide.append({"provider": "zo_half", "seq": 4096, "step_ms": 330.0, "shape": "wide", "layers": 8, "hidden": 4096})
    wide.append({"provider": "save_on_cpu", "seq": 4096, "error": "OutOfMemoryError", "shape": "wide"})
    (tmp_path / "activations.json").write_text(json.dumps(main + [host] + wide))
    t = summary.summary_json(str(tmp_path))["targets"]["activations"]
    assert t["wide_half_step_vs_torch_checkpoint"] == {"value": 1.1, "bar": 1.05, "met": False}
    assert "half_step_vs_torch_checkpoint" not in t  # (the main shape has no zo_half row)
    assert summary.main(["--summary-json", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "host time per block: none 200.0 us" in out and "zo above torch's checkpoint 100.0 us" in out
    assert "zo (wide: 8 x 4096) seq 4096: 306.0 ms" in out and "save_on_cpu (wide): OutOfMemoryError" in out
    host["profiled_top_us_per_block"] = {"zo": {"all": [["checkpoint.py:1165(unpack_hook)", 58.4]],
                                                "zo_kernels": [], "zo_kernels_us": 12.5}}  # fmt: skip
    gpu = tmp_path / "gpu-2026-01-05-H200.json"
    gpu.write_text(json.dumps({"device": "H200", "date": "2026-01-05", "commit": "abc", "step": [],
                               "activations": main + [host] + wide}))  # fmt: skip
    page = dashboard.render([gpu])  # the host row's figures in the table, its function lists only in the JSON
    assert "host_overhead" in page and "zo_resident 640" in page and "wide" in page
    assert "unpack_hook" not in page and "profiled_top_us_per_block" not in page


def test_dashboard_tells_rows_of_one_size_and_mode_apart_and_reads_targets(tmp_path):
    """Two step rows of one size and mode differ by gpu_fraction: the step, phases and targets tables show it (a new
    user read them as duplicates); a pack row's target shows as MET/MISSED with its bars, not a Python dict."""
    rows = [{**step_row("sync", 12.0), "gpu_fraction": 0.0}, {**step_row("sync", 9.0), "gpu_fraction": 0.59}]
    gpu = tmp_path / "gpu-2026-01-04-H200.json"
    gpu.write_text(json.dumps({"device": "H200", "date": "2026-01-04", "commit": "abc", "step": rows,
                               "pack": [{"numel": 10_000_000, "zo_ms": 0.1, "copy_ms": 0.024,
                                         "target": {"min_of_copy": 0.6, "faster_than_torch_ref": True,
                                                    "met": False}}]}))  # fmt: skip
    page = dashboard.render([gpu])
    for table in page.split("<h3>")[1:4]:  # train step, phases, targets
        assert "<th>gpu_fraction</th>" in table and "0.59" in table, table[:200]
    assert "MISSED; min_of_copy 0.6; faster_than_torch_ref True" in page
    assert "{&#x27;" not in page and "{'" not in page


def test_host_info_reads_smt_siblings_numa_and_the_cgroup_quota(tmp_path, monkeypatch):
    """summary.json's "host": 8 CPUs as 4 cores of 2 SMT siblings, 2 NUMA nodes, a cgroup quota of 6 CPUs."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cpuinfo").write_text(
        "".join(f"processor\t: {c}\nmodel name\t: Test Xeon\nflags\t\t: fpu sse avx2 avx512f\n\n" for c in range(8)))
    cpu = tmp_path / "sys" / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text("0-7\n")
    for c in range(8):  # Linux numbers siblings apart: cpu c and c + 4 share a core
        (cpu / f"cpu{c}" / "topology").mkdir(parents=True)
        (cpu / f"cpu{c}" / "topology" / "thread_siblings_list").write_text(f"{c % 4},{c % 4 + 4}\n")
    (tmp_path / "sys" / "devices" / "system" / "node").mkdir()
    (tmp_path / "sys" / "devices" / "system" / "node" / "online").write_text("0-1\n")
    (tmp_path / "sys" / "fs" / "cgroup").mkdir(parents=True)
    (tmp_path / "sys" / "fs" / "cgroup" / "cpu.max").write_text("600000 100000\n")
    got = summary.host_info(str(tmp_path))
    assert got == {"cpu_model": "Test Xeon", "cpus": 8, "threads_per_core": 2, "physical_cores": 4, "numa_nodes": 2,
                   "cgroup_cpus": 6.0, "avx512": True}  # fmt: skip
    (cpu / "cpu3" / "topology" / "thread_siblings_list").unlink()  # a system that does not say
    assert summary.host_info(str(tmp_path))["threads_per_core"] is None
    (tmp_path / "sys" / "fs" / "cgroup" / "cpu.max").unlink()  # cgroup v1
    (tmp_path / "sys" / "fs" / "cgroup" / "cpu").mkdir()
    (tmp_path / "sys" / "fs" / "cgroup" / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "sys" / "fs" / "cgroup" / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert summary.host_info(str(tmp_path))["cgroup_cpus"] == 4.0
    (tmp_path / "sys" / "fs" / "cgroup" / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert summary.host_info(str(tmp_path))["cgroup_cpus"] is None
    assert summary.host_info()["cpus"] >= 1  # this machine
    monkeypatch.setattr(summary, "host_info", lambda: int("x"))  # a system that reads differently
    assert summary.summary_json(str(tmp_path))["host"] == {"error": "ValueError: invalid literal for int() with base "
                                                                    "10: 'x'"}  # fmt: skip


def test_pack_rows_keep_the_back_to_back_figures_and_the_table_shows_them():
    """bench/summary_pack.py: a case's back-to-back figures (one pair of events around a run of calls) reach the row
    and the table's "b2b of copy" column; a case from before them shows "-" there."""
    import summary_pack

    info = {"numel": 10_000_000, "tensors": 64, "align": 1, "zo_ms": 0.056, "copy_ms": 0.021, "torch_ref_ms": 0.179,
            "timer": "cuda events", "zo_back_to_back_ms": 0.035, "copy_back_to_back_ms": 0.021,
            "back_to_back_of_copy": 0.6}  # fmt: skip
    old = {k: v for k, v in info.items() if "back_to_back" not in k} | {"align": 8}
    rows = summary_pack.pack_rows({"benchmarks": [{"extra_info": info}, {"extra_info": old}]})
    assert rows[0]["back_to_back_of_copy"] == 0.6 and rows[0]["zo_back_to_back_ms"] == 0.035
    assert "back_to_back_of_copy" not in rows[1]
    assert rows[0]["target"]["met"] is False  # (the target is judged on the per-call medians: 38% of copy)
    lines = summary_pack.table(rows).splitlines()
    assert "b2b of copy" in lines[0]
    assert lines[1].split()[8] == "60%" and lines[2].split()[8] == "-"


def test_the_host_row_keeps_every_host_figure_the_benchmark_writes():
    """An audit's find: bench/summary_pack.py's host row listed its keys, and host_us_pack_step (added to the
    benchmark later) never reached summary.json: every host_us* figure now, with cpu_path_us and launch."""
    import summary_pack

    info = {"provider": "zo", "host_us": 22.5, "host_us_into": 19.7, "host_us_pack_step": 13.6, "host_us_later": 1.0,
            "cpu_path_us": 91.7, "launch": "stubbed (no GPU)", "host_us_launch_stubbed": None}
    row = summary_pack.host_row({"benchmarks": [{"extra_info": {"numel": 1}}, {"extra_info": info}]})
    assert row == {k: v for k, v in info.items() if k != "provider"}


def test_a_benchmark_with_no_timing_is_left_out(tmp_path, capsys):
    """An audit's find: bench/summary.py died with a TypeError on a benchmark whose stats are null (it failed or
    was skipped before timing), where the dashboard turns the same file into a one-line error: left out now."""
    bench = {"machine_info": {}, "benchmarks": [
        {"group": "g", "name": "a", "extra_info": {"provider": "zo"}, "stats": {"min": 0.002, "rounds": 5}},
        {"group": "g", "name": "b", "extra_info": {"provider": "torch"}, "stats": None}]}  # fmt: skip
    (tmp_path / "b.json").write_text(json.dumps(bench))
    assert summary.main([str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "\n  zo " in out and "\n  torch " not in out
