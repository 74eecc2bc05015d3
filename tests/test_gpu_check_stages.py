"""What bench/gpu_check.sh's stages leave when their time limit cuts them short (`timeout -s INT`: a KeyboardInterrupt
in Python), checked with device = CPU: the rows that finished are in the stage's JSON, and no child outlives it."""

from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import step_rows  # noqa: E402  (bench/step_rows.py)


def test_step_rows_cut_short_keep_every_finished_row(tmp_path, monkeypatch):
    """The 1.3B size outlasts its stage on a GPU (4 optimizer rows of ~30 s): a row is written when it is done, not
    when its size is, so an interrupt in the second row leaves the first in OUT.json."""
    real, calls = step_rows.zo_step, []

    def interrupted(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt  # gpu_check.sh's limit, during the DPU row
        return real(*args, **kwargs)

    def probe_fails(*args, **kwargs):
        raise RuntimeError("no libgomp here")

    monkeypatch.setattr(step_rows, "zo_step", interrupted)
    monkeypatch.setattr(step_rows, "launch_probe", probe_fails)  # a diagnosis that fails costs no row
    out = tmp_path / "step.json"
    argv = [str(out), "--sizes", "2e5", "--device", "cpu", "--batch", "2", "--context", "16", "--rounds", "2",
            "--modes", "sync,dpu"]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        step_rows.main(argv)
    assert calls == ["sync", "dpu"]
    (row,) = json.loads(out.read_text())
    assert row["mode"] == "sync" and row["zo_ms"] > 0 and row["torch_fused_ms"] > 0
    assert row["launch_probe"] == {"error": "RuntimeError: no libgomp here"}


def test_step_rows_checkpointed_rows_train_the_same_model(tmp_path):
    """--checkpoint: the checkpointed forward is the model's own loss bit for bit, and its gradients are; each row
    gets the ckpt_* figures and their targets beside the plain ones."""
    import torch

    from zo_kernels.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32, context=16, layers=2, width=32, heads=2))
    x = torch.randint(0, 32, (2, 17))
    plain = model(x[:, :-1], x[:, 1:])
    plain.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ck = step_rows.checkpointed(model, x[:, :-1], x[:, 1:])
    ck.backward()
    assert torch.equal(ck, plain)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    out = tmp_path / "step.json"
    argv = [str(out), "--sizes", "2e5", "--device", "cpu", "--batch", "2", "--context", "16", "--rounds", "2",
            "--modes", "sync,dpu,selective", "--checkpoint"]  # fmt: skip
    assert step_rows.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["sync", "dpu", "selective"]
    assert all(r.get("state_dtype", "fp32") == "fp32" for r in rows)
    keys = {"sync": "ckpt_sync_vs_fwd_bwd_plus_adam", "dpu": "ckpt_dpu_vs_max_fwd_bwd_adam",
            "selective": "ckpt_tokens_per_s_vs_torch"}  # fmt: skip
    for r in rows:
        assert r["ckpt_zo_ms"] > 0 and r["ckpt_fwd_bwd_ms"] > 0
        assert r["targets"][keys[r["mode"]]]["value"] > 0
        assert r["mode"] == "selective" or r["pack_table_uploads_per_step"] >= 0
        if r["mode"] != "selective":  # the host's own time too (the device synchronized before each launch: a
            # no-op here), a target of its own; every pack call's tensors passed the layout guard (no full check)
            assert r["orchestration_isolated_ms"] >= 0 and set(r["isolated_phases"]) == set(step_rows.PHASES)
            assert r["targets"]["orchestration_isolated_of_step"]["bar"] == 0.05
            assert r["pack_full_checks_per_step"] == 0, r["pack_full_checks_per_step"]
            # the checkpointed steps' phases (where their time over forward + backward goes) and orchestration
            assert set(r["ckpt_phases"]) == set(step_rows.PHASES) and r["ckpt_orchestration_ms"] >= 0
            assert r["ckpt_phases"]["offload"] > 0 and r["ckpt_phases"]["hooks"] > 0
            assert r["buckets"] >= 1
        assert r["mode"] == "selective" or r["cpu_after_step"]["cpu_ms"] >= 0
        probe = r["launch_probe"]  # once per size, in every row of it
        assert probe["synced_ms"] > 0 and probe["after_update_ms"] > 0 and probe["threads"] >= 1
        assert probe["beside_update_ms"] and all(v > 0 for v in probe["beside_update_ms"].values())
        if step_rows.OmpRelease.find() is not None:  # (where libgomp is loaded: torch's wheels carry one)
            assert probe["after_update_released_ms"] > 0 and set(probe["released_by"].values()) == {0}
        assert probe["beside_update_adam_ns_per_param"].keys() == probe["beside_update_ms"].keys()


def test_before_launch_runs_before_each_bucket_outside_its_phase_times():
    """GradPath.before_launch (isolated_phases' device synchronize): called once per bucket's launch, first, and not
    counted in the offload phase (its time is the device's, not the host's)."""
    import time

    import torch

    import zo_kernels as zk
    from zo_kernels.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32, context=16, layers=2, width=32, heads=2))
    opt = zk.ZeroOffloadAdamW(model.parameters(), bucket_numel=4096)
    x = torch.randint(0, 32, (2, 17))
    calls = []

    def slow() -> None:
        assert opt.grads.in_backward  # (inside the backward's hooks, before the bucket is packed)
        calls.append(opt.grads._next_bucket)
        time.sleep(0.02)

    try:
        opt.grads.before_launch = slow
        opt.backward(model(x[:, :-1], x[:, 1:]))
        opt.step()
        buckets = len(opt.grads.layout.buckets)
        assert buckets >= 3 and calls == list(range(buckets)), (calls, buckets)
        assert opt.stats["time_offload"] < 0.02 * buckets / 2, opt.stats["time_offload"]
    finally:
        opt.close()


def test_pack_alone_keeps_a_plan_per_bucket_as_backward_does(monkeypatch):
    """step_rows.pack_alone packs each bucket through a plan of its own, built once, its Σg² added into running
    totals, as GradPath does: zk.pack's cache keyed plans by sizes, so identical blocks shared one plan, which on a
    GPU re-uploaded its address table at every call (the 1.3B GPT's pack "alone" 12-22 ms on the H100)."""

    import zo_kernels as zk
    from zo_kernels.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab=32, context=16, layers=3, width=32, heads=2))
    opt = zk.ZeroOffloadAdamW(model.parameters(), bucket_numel=4096)
    built, shared = [], []
    real_plan = zk.buckets.plan

    def plan(*a, **k):
        built.append(real_plan(*a, **k))
        return built[-1]

    monkeypatch.setattr(zk.buckets, "plan", plan)
    monkeypatch.setattr(zk, "pack", lambda *a, **k: shared.append(1))
    try:
        assert step_rows.pack_alone(opt, 2) > 0
        assert len(built) == len(opt.layout.buckets) >= 3 and not shared
        assert len({id(p) for p in built}) == len(built)
    finally:
        opt.close()


def test_cpu_after_counts_what_other_threads_burn_once_the_step_is_over():
    """step_rows.cpu_after: a thread left spinning after fn() shows as CPU time, this thread's own sleep does not."""
    import threading
    import time

    import torch

    stop = threading.Event()

    def spinner() -> None:
        while not stop.is_set():
            pass

    def leaves_a_spinner() -> None:
        threading.Thread(target=spinner, daemon=True).start()

    try:
        busy = step_rows.cpu_after(leaves_a_spinner, torch.device("cpu"), window_s=0.1)
    finally:
        stop.set()
    time.sleep(0.05)
    idle = step_rows.cpu_after(lambda: None, torch.device("cpu"), window_s=0.1)
    assert busy["cpu_ms"] > 10 and busy["window_ms"] == 100, busy  # (the spinner holds the GIL: ~100 ms idle)
    assert idle["cpu_ms"] < busy["cpu_ms"] - 15, (idle, busy)


def test_step_rows_with_compressed_moments_and_auto(tmp_path):
    """--state-dtype 8bit: the DPU rows (fraction 0, then auto) run with 8-bit moments on the host and in the tail;
    auto's rate is the tail's in that format."""
    out = tmp_path / "step.json"
    argv = [str(out), "--sizes", "2e5", "--device", "cpu", "--batch", "2", "--context", "16", "--rounds", "2",
            "--modes", "dpu", "--gpu-fractions", "0,0.5", "--state-dtype", "8bit"]  # fmt: skip
    assert step_rows.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["state_dtype"], r["gpu_fraction"]) for r in rows] == [("8bit", 0.0), ("8bit", 0.5)]
    assert all(r["cpu_adam_kernel_ms"] > 0 and r["zo_ms"] > 0 for r in rows)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # (a zombie is dead: no one reaps it)
    except FileNotFoundError:
        return False


def test_anchors_timeout_kills_the_systems_children_too(tmp_path, monkeypatch):
    """A system past its timeout (DeepSpeed building its CPU Adam with ninja on first use) is killed with every
    process it started: the compilers must not run on under the next systems' measurements. Its row says why, with
    issue 17's keys."""
    import anchors  # (bench/anchors.py)

    pidfile = tmp_path / "grandchild.pid"
    child = tmp_path / "child.sh"  # stands for `python anchors.py --one ...`: starts a compiler, then waits for it
    child.write_text(f"#!/bin/bash\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    child.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(child))
    out = tmp_path / "anchors.json"
    assert anchors.main([str(out), "--systems", "deepspeed", "--device", "cpu", "--timeout-s", "3"]) == 0
    pid = int(pidfile.read_text())
    try:
        assert not _alive(pid), "the system's child process outlived its timeout"
    finally:
        if _alive(pid):
            os.kill(pid, 9)
    (row,) = json.loads(out.read_text())
    assert row["note"].startswith("FAILED: did not finish within 3 s"), row
    assert {"system", "params", "ms", "peak_gib", "host_gib", "note"} <= row.keys()


def test_anchors_rows_not_run_have_the_issue_keys(tmp_path):
    """NOT RUN / NOT INSTALLED rows (DeepSpeed, torchao, FSDP2 on the CPU) carry every key of issue 17's schema."""
    import anchors

    out = tmp_path / "anchors.json"
    assert anchors.main([str(out), "--systems", "torchao,fsdp2", "--device", "cpu", "--timeout-s", "120"]) == 0
    rows = json.loads(out.read_text())
    assert [r["system"] for r in rows] == ["torchao", "fsdp2"]
    for r in rows:
        assert {"system", "params", "ms", "peak_gib", "host_gib", "note"} <= r.keys(), r
        assert r["note"].startswith("NOT RUN") and r["ms"] is None


def _stand_in_gpu_check(tmp_path, mode: str, budget_s: int, **env_extra: str) -> dict[str, tuple[int, str]]:
    """bench/gpu_check.sh OUT MODE on a pretend GPU machine (a stand-in interpreter that answers the GPU probes and
    runs nothing): {stage: (its `timeout` limit, its command)}."""
    import re
    import subprocess

    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\ncase \"$*\" in\n  *get_device_name*) echo 'NVIDIA H100 80GB HBM3' ;;\n"
                    "  *torch.__version__*) echo '2.11.0 13.0' ;;\nesac\nexit 0\n")  # fmt: skip
    fake.chmod(0o755)
    out = tmp_path / f"out-{mode}"
    env = {**os.environ, "PYTHON": str(fake), "ZO_CHECK_BUDGET_S": str(budget_s), **env_extra}
    script = os.path.join(HERE, "..", "bench", "gpu_check.sh")
    subprocess.run(["bash", script, str(out), mode], env=env, capture_output=True, text=True, timeout=300)
    stages = re.findall(r"^=== (.*?): timeout -s INT -k 5 (\d+) (.*)$", (out / "gpu_check.log").read_text(), re.M)
    return {name: (int(limit), cmd) for name, limit, cmd in stages}


def _budget_under_limit(stages: dict[str, tuple[int, str]], name: str) -> None:
    import re

    assert name in stages, (name, sorted(stages))
    limit, cmd = stages[name]
    budget = re.search(r"--budget-s (\S+)", cmd)
    assert budget and float(budget.group(1)) < limit, (name, limit, budget and budget.group(1))


def test_gpu_check_gives_each_script_a_budget_under_its_stage_limit(tmp_path):
    """Every script's own --budget-s is below the `timeout` its stage runs under, so the script ends itself, rows
    written, instead of being cut by the limit. With a 180 s budget the anchors' stage gets 175 s and the
    activations' 30 s (they were told 190 and 45)."""
    stages = _stand_in_gpu_check(tmp_path, "default", 180)
    for name in ("bench: activations (issue 21)", "bench: anchors (same GPT)", "bench: step in parts (step_rows)"):
        _budget_under_limit(stages, name)
    # the default run's activations have ~60 s: no wide shape (its ~25 s would leave the searches nothing)
    assert stages["bench: activations (issue 21)"][1].endswith("--profile --wide none")


def test_gpu_check_anchors_mode_runs_the_last_two_stages_alone(tmp_path):
    """`gpu_check.sh OUT anchors`: build, then the step rows at batch 32, the activations and the anchors with the
    whole budget (in the default run the last two get what is left of it), in the order of what was never measured
    on a GPU, each script's budget under its stage's limit, 150 s per anchor system (ZO_SKIP_BUILD=1: a second
    command on a warm machine), then the step under torch.profiler with what is left. The step rows leave 70 s of
    the budget to the later stages, the activations 40 s."""
    stages = _stand_in_gpu_check(tmp_path, "anchors", 500)
    step = "bench: step rows at batch 32"
    profile = "bench: the step under torch.profiler"
    assert list(stages) == ["build (pip install -e .)", step, "bench: activations (issue 21)",
                            "bench: anchors (same GPT)", profile]  # fmt: skip
    assert stages[profile][0] == 120 and "bench/profile_step.py" in stages[profile][1]  # (what the others leave)
    assert stages[step][0] == 150 and stages["bench: activations (issue 21)"][0] == 120
    assert "--wide" not in stages["bench: activations (issue 21)"][1]  # (the wide shape, the script's default)
    assert stages["bench: anchors (same GPT)"][0] == 170 and "--timeout-s 150" in stages["bench: anchors (same GPT)"][1]
    assert "--batch 32" in stages[step][1] and "--checkpoint" in stages[step][1]
    assert "--state-dtype 8bit" in stages[step][1]  # (issue 20: the host moves fewer bytes, the tail holds fewer)
    for name in ("bench: activations (issue 21)", "bench: anchors (same GPT)", step):
        _budget_under_limit(stages, name)
    # the reserves (the stand-in's stages take no time): with 100 s, the step rows leave 70 s to the later stages,
    # the activations 40 s to the anchors
    (tmp_path / "out-anchors").rename(tmp_path / "first")
    stages = _stand_in_gpu_check(tmp_path, "anchors", 100, ZO_SKIP_BUILD="1")
    assert 25 <= stages[step][0] <= 30 and 55 <= stages["bench: activations (issue 21)"][0] <= 60
    assert 90 <= stages["bench: anchors (same GPT)"][0] <= 95
    assert "--sizes 95M,1.3B" in stages[profile][1]  # (the 95M DPU step is the one near its bar)
    # under 45 s left the profile is not started (22 s wrote a third of one row on the H100): said, not a failure
    (tmp_path / "out-anchors").rename(tmp_path / "second")
    stages = _stand_in_gpu_check(tmp_path, "anchors", 40, ZO_SKIP_BUILD="1")
    assert "bench: anchors (same GPT)" in stages and profile not in stages, stages
    text = (tmp_path / "out-anchors" / "summary.txt").read_text()
    assert "the step under torch.profiler" in text and "NOT RUN" in text and "it needs 45" in text, text


def _pretend_search(monkeypatch, seconds, failure):
    """bench/activation_rows.py's longest_seq on a pretend clock: a try at `seq` takes seconds(seq) and raises
    failure(seq) when that is not None. Returns search(deadline) -> (seq, ended, why) and the clock."""
    import argparse
    import types

    import activation_rows
    import torch

    clock = [0.0]

    def make_step(model, device, dtype, batch, seq, hidden, ctx):
        def step():
            clock[0] += seconds(seq)
            error = failure(seq)
            if error is not None:
                raise error

        return step

    monkeypatch.setattr(activation_rows, "make_step", make_step)
    monkeypatch.setattr(activation_rows, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    model = activation_rows.Stack(1, 8, 2)
    a = argparse.Namespace(seq=1024, batch=1, hidden=8)

    def search(deadline):
        clock[0] = 0.0
        return activation_rows.longest_seq("none", model, torch.device("cpu"), torch.float32, a, None, deadline)

    return search, clock


def test_longest_seq_starts_no_try_that_would_end_past_its_deadline(monkeypatch):
    """bench/activation_rows.py's longest-sequence search (CUDA only), on a pretend clock: each try takes
    seq / 1000 s and sequences past 20000 run out of memory. With 10 s for the search, the try at 4096 (estimated
    from the try at 2048 by the square of the ratio: 8.2 s, started at 3.1 s) could end past 10 s, in the stage's
    limit; it is not started: the answer 2048 comes, cut short, in time."""
    import torch

    search, clock = _pretend_search(monkeypatch, lambda seq: seq / 1000,
                                    lambda seq: torch.OutOfMemoryError("pretend") if seq > 20000 else None)
    seq, ended, why = search(10.0)
    assert clock[0] <= 10.0, f"the search ended at {clock[0]:.1f} s, past its 10 s deadline"
    assert (seq, ended, why) == (2048, False, None)
    seq, ended, why = search(1e9)
    assert ended and 17000 < seq <= 20000 and why is None  # time enough: the search ends, to 1/8


def test_longest_seq_estimates_tries_by_the_square_and_stops_at_the_host(monkeypatch):
    """Attention makes a try's time grow with the square of the sequence: with tries of (seq / 1000)^2 s and 30 s
    for the search, 1024..4096 take 22 s and the try at 8192 (64 s) is not started. A try that runs out of pinned
    host memory ends the search there with what was found, saying so, instead of counting as the device's cap."""
    host = RuntimeError("CUDA error: out of memory (cudaHostAlloc of a pinned block)")
    search, clock = _pretend_search(monkeypatch, lambda seq: (seq / 1000) ** 2,
                                    lambda seq: host if seq > 6000 else None)
    seq, ended, why = search(30.0)
    assert clock[0] <= 30.0 and (seq, ended, why) == (4096, False, None), (clock[0], seq, ended, why)
    seq, ended, why = search(1e9)
    assert (seq, ended) == (4096, True) and why.startswith("host memory"), (seq, ended, why)


def test_anchors_system_dies_with_a_parent_killed_outright(tmp_path):
    """A system runs in a session of its own (so that its children can be killed together), which `timeout`'s
    SIGKILL to gpu_check.sh's process group no longer reaches: a parent killed outright takes it down all the same
    (it would otherwise hold the GPU into the next command)."""
    import subprocess
    import time

    pidfile = tmp_path / "child.pid"
    child = tmp_path / "child.sh"
    child.write_text(f"#!/bin/bash\necho $$ > {pidfile}\nexec sleep 300\n")
    child.chmod(0o755)
    code = (f"import os, sys; sys.path.insert(0, {os.path.join(HERE, '..', 'bench')!r}); import anchors; "
            f"anchors.run_child([{str(child)!r}], dict(os.environ), 600)")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(600):  # the parent imports torch first: up to 60 s on a loaded machine
            if pidfile.exists() and pidfile.read_text().strip():
                break
            time.sleep(0.1)
        pid = int(pidfile.read_text())
        parent.kill()
        parent.wait()
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.1)
        alive = _alive(pid)
        if alive:
            os.kill(pid, 9)
        assert not alive, "the system outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_gpu_check_tests_stage_names_tests_that_exist(tmp_path):
    """The GPU tests stage names files and one test by node id: a renamed test would make pytest refuse the whole
    command (exit 4, nothing run) on the GPU machine. Every path it names collects here."""
    import subprocess

    stages = _stand_in_gpu_check(tmp_path, "default", 500)
    paths = [w for name in ("tests: GPU, CUDA", "tests: two ranks on one GPU") for w in stages[name][1].split()
             if w.startswith("tests/")]  # fmt: skip
    assert len(paths) >= 4 and any("::" in p for p in paths), paths
    root = os.path.join(HERE, "..")
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
                       cwd=root, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode in (0, 5) and "not found" not in r.stdout + r.stderr, (r.returncode, r.stdout[-2000:])


def test_step_rows_a_failing_row_leaves_the_others(tmp_path, monkeypatch):
    """gpu_fraction "auto" (and selective), written without a GPU (they ran on the H200 since): one that fails there
    is a row saying why, and the size's other rows (here the DPU ones) are still measured; the script exits 1."""
    def broken(row, device):
        raise RuntimeError("injected: auto's pick failed")

    monkeypatch.setattr(step_rows, "auto_pick", broken)
    out = tmp_path / "step.json"
    argv = [str(out), "--sizes", "2e5", "--device", "cpu", "--batch", "2", "--context", "16", "--rounds", "2",
            "--modes", "sync,dpu", "--gpu-fractions", "0,auto"]  # fmt: skip
    assert step_rows.main(argv) == 1
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["gpu_fraction_choice"], "error" in r) for r in rows] == [
        ("sync", "0", False), ("sync", "auto", True), ("dpu", "0", False), ("dpu", "auto", True)]
    assert "injected" in rows[1]["error"] and rows[2]["zo_ms"] > 0
    print("\n" + "\n".join(step_rows.line(r) for r in rows))


def test_gpu_check_leaves_the_compile_to_ci_and_can_reuse_a_build(tmp_path):
    """The default run does not compile the Triton kernels for sm_80/sm_90 (CI does, on the CPU; 57 s of the H200's
    470 s budget) unless ZO_CHECK_COMPILE=1; ZO_SKIP_BUILD=1 uses the build already there (the anchors mode after a
    default run on the same machine: its build, cut at 22 s by the budget's reserves, failed there)."""
    compile_stage, build = "triton kernels -> cubin sm_80/90", "build (pip install -e .)"
    for sub in "abc":
        (tmp_path / sub).mkdir()
    plain = _stand_in_gpu_check(tmp_path / "a", "default", 480)
    assert build in plain and compile_stage not in plain, sorted(plain)
    assert compile_stage in _stand_in_gpu_check(tmp_path / "b", "default", 480, ZO_CHECK_COMPILE="1")
    reused = _stand_in_gpu_check(tmp_path / "c", "anchors", 230, ZO_SKIP_BUILD="1")
    assert build not in reused and "bench: anchors (same GPT)" in reused, sorted(reused)


def test_orchestration_leaves_out_the_wait_for_the_background_update():
    """A DPU step()'s wait for the background CPU Adam is the kernel's time, not orchestration (the H200's 1.3B DPU
    row: offload 45.95, reduce 0.41, step 251.35 of which dpu_wait 201.36, no kernel inside step())."""
    import torch

    dpu = {"offload": 45.95, "reduce": 0.41, "step": 251.35, "kernel": 0.0, "dpu_wait": 201.36}
    assert abs(step_rows.orchestration_ms(dpu, 0.0, torch.device("cuda")) - 96.35) < 1e-9
    sync = {"offload": 2.33, "reduce": 0.19, "step": 22.34, "kernel": 21.31, "dpu_wait": 0.0}
    assert abs(step_rows.orchestration_ms(sync, 0.0, torch.device("cuda")) - 3.55) < 1e-9
    assert abs(step_rows.orchestration_ms(sync, 1.0, torch.device("cpu")) - 2.55) < 1e-9


def test_orchestration_leaves_out_the_global_checks_read_once_counted_twice():
    """The global checks' read (a wait for the backward's last kernels at one rank, where the DPU backward's end no
    longer waits for the copies) is in both "reduce" and "step": left out of both. The sixth run's 95M DPU row:
    offload 3.30, reduce 0.24, step 1.37, global_checks 0.23, hooks 0.81, dpu_wait 0.01 -> 5.23 ms (it read 5.70)."""
    import torch

    row = {"offload": 3.295469, "reduce": 0.236563, "step": 1.367201, "kernel": 0.0, "dpu_wait": 0.014265,
           "hooks": 0.812038, "global_checks": 0.233675}  # fmt: skip
    want = 3.295469 + (0.236563 - 0.233675) + (1.367201 - 0.233675) - 0.014265 + 0.812038
    assert abs(step_rows.orchestration_ms(row, 0.0, torch.device("cuda")) - want) < 1e-9
    slow = {**row, "global_checks": 2.233675, "reduce": 2.236563, "step": 3.367201}  # the same step, 2 ms of waiting
    assert abs(step_rows.orchestration_ms(slow, 0.0, torch.device("cuda")) - want) < 1e-9


def test_omp_release_ends_the_update_threads():
    """launch_probe's after_update_released_ms ends the OpenMP workers a CPU Adam call left (libgomp's
    omp_pause_resource_all): the process has fewer threads after it."""
    import torch

    import zo_kernels as zk

    release = step_rows.OmpRelease.find()
    if release is None:
        pytest.skip("no libgomp loaded in this process (torch's wheels carry one)")
    n = 1 << 20
    p, g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    zk.cpu_adam_step(p, g, m, v, step=1, lr=1e-3, threads=4)  # a team of 4: 3 workers
    before = len(os.listdir("/proc/self/task"))
    assert set(release()) == {0}
    assert len(os.listdir("/proc/self/task")) <= before - 3


def test_launch_probe_waits_for_the_rows_when_time_is_short():
    """Under PROBE_MARGIN_S before the rows' deadline the probe is skipped, saying why; the rows still run."""
    import time

    import torch

    rows = step_rows.measure("2e5", ["sync"], torch.device("cpu"), 2, 16, 2, deadline=time.perf_counter() + 30)
    assert rows[0]["launch_probe"] == {"skipped": "under 60 s left for this size's rows"} and rows[0]["zo_ms"] > 0


def test_gpu_check_stops_after_the_build_when_there_is_none_to_import(tmp_path):
    """Without an importable build (the build NOT RUN under a budget below its reserve, or failed) the GPU modes stop
    there and say why: the H200 run of 2026-11-27 (ZO_CHECK_BUDGET_S=235 in scale mode, then a default run with
    ZO_SKIP_BUILD=1) went on through ten stages that each failed in seconds."""
    import subprocess

    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\ncase \"$*\" in\n  *get_device_name*) echo 'NVIDIA H100 80GB HBM3' ;;\n"
                    "  *torch.__version__*) echo '2.11.0 13.0' ;;\n  *zo_kernels._cpu*) exit 1 ;;\n"
                    "  *pip*install*) exit 1 ;;\nesac\nexit 0\n")  # fmt: skip
    fake.chmod(0o755)
    script = os.path.join(HERE, "..", "bench", "gpu_check.sh")
    for mode, budget in (("scale", 235), ("default", 400), ("anchors", 400)):
        out = tmp_path / f"out-{mode}"
        env = {**os.environ, "PYTHON": str(fake), "ZO_CHECK_BUDGET_S": str(budget), "ZO_SKIP_BUILD": "1"}
        run = subprocess.run(["bash", script, str(out), mode], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 1, (mode, run.stdout)
        log = (out / "gpu_check.log").read_text()
        ran = [line for line in log.splitlines() if line.startswith("=== ")]
        assert all(line.startswith("=== build") for line in ran), (mode, ran)
        assert "no importable build" in (out / "summary.txt").read_text(), mode


def test_gpu_session_runs_its_parts_in_order_within_one_command(tmp_path):
    """bench/gpu_session.sh OUTDIR [PLAN] on a stand-in GPU machine: one build, then each part with its weight's share
    of the command's time left when it starts (what a part leaves unused goes to the later ones), each gpu_check
    part with ZO_SKIP_BUILD=1 and a budget under its share, the scale part's later settings allowed to start with
    90 s left; what comes back fits the device tool (at most 8 files, plain names); an unknown part is refused before
    anything runs; no scratch directory is left behind (a refused plan left an empty one in /tmp)."""
    import re
    import subprocess

    fake = tmp_path / "python"
    calls = tmp_path / "calls.txt"
    fake.write_text(f"#!/bin/bash\necho \"$*\" >> {calls}\ncase \"$*\" in\n"
                    "  *get_device_name*) echo 'NVIDIA H100 80GB HBM3' ;;\n"
                    "  *torch.__version__*) echo '2.11.0 13.0' ;;\nesac\nexit 0\n")  # fmt: skip
    fake.chmod(0o755)
    script = os.path.join(HERE, "..", "bench", "gpu_session.sh")
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    env = {**os.environ, "PYTHON": str(fake), "ZO_SESSION_S": "570", "TMPDIR": str(scratch)}
    out = tmp_path / "out"
    run = subprocess.run(["bash", script, str(out), "scale,tests,profile,anchors"], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    text = (out / "session.txt").read_text()
    shares = re.findall(r"^--- (\S+): (\d+)s$", text, re.M)
    assert [p for p, _ in shares] == ["scale", "tests", "profile", "anchors"], text
    # each part its weight's share of what is left when it starts (the stand-in's parts take about no time, so each
    # later part has nearly the whole rest): of 560 s after the 10 s for the archive, scale 6/15 (224), tests 3/9 of
    # what is left then (186), profile 2/6 (186), anchors all of it (560); a loaded machine's seconds of bash take a
    # little off each
    scale_s, tests_s, profile_s, anchors_s = (int(s) for _, s in shares)
    assert 205 <= scale_s <= 224 and 170 <= tests_s <= 187 and 170 <= profile_s <= 187, shares
    assert 520 <= anchors_s <= 560, shares
    made = calls.read_text().splitlines()
    assert sum("pip install" in c and "-e ." in c for c in made) == 1, made  # one build, the parts reuse it
    scale = next(c for c in made if "bench/scale_check.py" in c)
    assert "--settings s2-8bit,s2-fp32,s3-cpu" in scale and "--min-share-s 90" in scale, scale
    assert int(re.search(r"--budget-s (\d+)", scale).group(1)) < 280, scale
    assert text.count("skipped (ZO_SKIP_BUILD=1") == 3, text  # every part, a gpu_check.sh run, reuses the build
    assert any("tests/test_gpu.py" in c for c in made) and any("tests/test_gpu_two_ranks.py" in c for c in made)
    # the profile part: the 95M rows first, then the 1.3B ones with the DPU step at 0.8 first; the anchors part
    # skips its own profile (the stand-in's gpu_check runs would have called it once more)
    profiles = [c for c in made if "bench/profile_step.py" in c]
    assert len(profiles) == 2, profiles
    assert "--sizes 95M" in profiles[0] and "--gpu-fractions 0 " in profiles[0] + " " and "--batch 32" in profiles[0]
    assert "--sizes 1.3B --modes dpu,sync --gpu-fractions 0.8,0" in profiles[1]
    assert (out / "profile.json").exists() or "profile: rc" in text
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(re.fullmatch(r"[\w.-]+", p.name) for p in files), files
    assert (out / "session.tgz").stat().st_size > 0, run.stdout
    # the default plan (after the sixth run, whose four parts cut three): the tests, then the anchors with the rest
    default = subprocess.run(["bash", script, str(tmp_path / "default")], env=env, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    text = (tmp_path / "default" / "session.txt").read_text()
    shares = re.findall(r"^--- (\S+): (\d+)s$", text, re.M)
    assert [p for p, _ in shares] == ["tests", "anchors"], (text, default.stderr)
    assert 215 <= int(shares[0][1]) <= 240, shares  # 3/7 of 560 s
    # the host part: bench/bucket_host.py with the default buckets and 2**24-element ones, its rows' lines kept
    host = subprocess.run(["bash", script, str(tmp_path / "host"), "host"], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    ran = [c for c in calls.read_text().splitlines() if "bench/bucket_host.py" in c]
    assert len(ran) == 1 and "--sizes 1.3B,95M --modes dpu --bucket-numels default,16777216" in ran[0], ran
    assert str(tmp_path / "host" / "bucket_host.json") in ran[0] and host.returncode == 0, host.stdout
    bad = subprocess.run(["bash", script, str(tmp_path / "bad"), "scale,bogus"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "unknown part 'bogus'" in bad.stderr
    assert not (tmp_path / "bad" / "session.tgz").exists()
    assert not list(scratch.iterdir()), list(scratch.iterdir())
