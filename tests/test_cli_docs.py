"""The command line as the README shows it: every --help shows units and defaults, every bench suite runs or says
in one line why it cannot here, and the planner figures the README quotes come out of the commands it shows."""

import re

import pytest
import torch
from helpers import run_cli

from zo_kernels import cli


@pytest.mark.parametrize("command", ["demo", "plan", "bench", "dashboard"])
def test_help_shows_defaults_and_units(capsys, command):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    text = " ".join(out.split())
    expected = {
        "demo": ["--steps STEPS training steps (default: 400)", "--batch SEQUENCES", "--context TOKENS",
                 "(default: 0.003)", "--model-size PARAMS", "--stage {1,2,3}", "--offload-param {none,cpu}"],
        "plan": ["--gpu-mem SIZE", "(default: 32GiB)", "GB = 1e9 bytes, GiB = 2^30", "--units {GB,TB,GiB,TiB}",
                 "--layer-params COUNT", "(default: 1GiB)", "--accumulation", "--dpu"],
        "bench": ["--sizes COUNT[,COUNT...]", "(default: 1e7)", "-o FILE.json"],
        "dashboard": ["RUN.json", "(default: report.html)"],
    }[command]  # fmt: skip
    for piece in expected:
        assert piece in text, (piece, text)


def test_a_suite_that_cannot_run_here_says_why_and_exits_0(capsys, monkeypatch, tmp_path):
    """Before: `zo-kernels bench --suite buckets` exited 5 on a CPU machine with only a pytest warning."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    called = []
    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: called.append(a) or 0)
    code, out, _ = run_cli(capsys, "bench", "--suite", "buckets", "-o", str(tmp_path / "b.json"))
    assert code == 0 and called == []
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("bench buckets: not run, it needs a GPU"), out


def test_every_suite_only_skipped_exits_0(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: cli.PYTEST_NO_TESTS)
    code, out, _ = run_cli(capsys, "bench", "--suite", "nvme", "-o", str(tmp_path / "n.json"))
    assert code == 0 and "every benchmark was skipped" in out


def test_the_suites_the_readme_lists_are_the_clis():
    readme = open(cli.Path(cli.__file__).resolve().parent.parent / "README.md", encoding="utf-8").read()
    for suite in cli.SUITES:
        assert f"`{suite}`" in readme, suite


def test_v100_example_as_the_readme_writes_it(capsys):
    """One 32 GiB V100: 13.50B for ZeRO-2 + offload (the ZeRO-Offload paper: 13B) and 1.70B for DDP; --k 16: 1.36B."""
    code, out, _ = run_cli(capsys, "plan", "--params", "13e9", "--gpu-mem", "32GiB", "--host-mem", "768GiB", "--max")
    rows = {line[:18].strip(): line for line in out.splitlines()}
    assert code == 0 and rows["ZeRO-2 + offload"].endswith("13.50B") and rows["DDP"].endswith("1.70B")
    code, out, _ = run_cli(capsys, "plan", "--params", "13e9", "--gpu-mem", "32GiB", "--host-mem", "768GiB", "--max",
                           "--k", "16")  # fmt: skip
    assert {line[:18].strip(): line for line in out.splitlines()}["DDP"].endswith("1.36B")


def test_sizes_mean_what_they_say(capsys):
    """32GB is 32e9 bytes, 32GiB is 32 x 2^30: both accepted, different results."""
    for size, shown in (("32GB", "32.0 GB"), ("32GiB", "34.4 GB")):
        code, out, _ = run_cli(capsys, "plan", "--params", "1e9", "--gpu-mem", size)
        assert code == 0 and f"1 GPU(s) x {shown}" in out, out.splitlines()[0]


def test_zero_infinity_table_1_from_the_command_line(capsys):
    """The ZeRO-Infinity paper's 1T model (128 layers, hidden 25,600; its GB and TB are GiB and TiB): 9.77 GiB of
    model-state working memory per GPU and 18.31 TiB of model states, from the command the README shows."""
    code, out, _ = run_cli(capsys, "plan", "--params", "1006632960000", "--layer-params", "2621440000", "--prefetch",
                           "0", "--k", "16", "--io-pool", "0", "--nvme", "20TiB", "--units", "TiB")  # fmt: skip
    assert code == 0
    assert re.search(r"working set 9\.77 GiB per GPU", out), out
    row = next(line for line in out.splitlines() if line.startswith("ZeRO-Infinity"))
    assert row.split()[-2:] == ["TiB", "yes"] and "18.31 TiB" in row, row


def test_demo_memory_lines_under_dpu_follow_the_buffers(capsys):
    """Before: the demo printed "no 2 B staging" beside 18 B/param under DPU."""
    code, out, _ = run_cli(capsys, "demo", "--steps", "4", "--model-size", "1e5", "--batch", "2", "--context", "16",
                           "--dtype", "bf16", "--delay-update-after", "1", "--quiet")  # fmt: skip
    assert code == 0
    assert "no 2 B staging" not in out
    host = next(line for line in out.splitlines() if line.strip().startswith("host"))
    # the update writes the new parameters over the gradients in their landing buffer: no staging (18 before)
    assert "host  16.00 B = 12.00 (p32, m, v) + 4.00 (gradient landing x2, DPU)" in host, host
    assert "staging" not in host, host
    # on a GPU the new parameters go over the gradients in the landing buffer: no staging there (16, not 18)
    assert "planner, ZeRO-2 + offload on a GPU: device 2 + buckets, host 16" in out


def _plan_samples() -> list[tuple[int, list[str], list[str]]]:
    """The README's ``` blocks that show a `$ zo-kernels plan ...` command and its output: (line, argv, output
    lines; "..." stands for lines left out)."""
    readme = (cli.Path(cli.__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(readme):
        if readme[i].startswith("$ zo-kernels plan"):
            start, command = i + 1, readme[i][2:]
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + " " + readme[i].strip()
            shown = []
            i += 1
            while readme[i] != "```":
                shown.append(readme[i])
                i += 1
            out.append((start, command.split()[1:], shown))
        i += 1
    return out


def test_the_readmes_plan_samples_are_what_the_commands_print(capsys):
    """Each `$ zo-kernels plan ...` sample of the README, run: its lines come out in that order ("..." skips lines).
    A new user found the V100 sample's ZeRO-2 + offload host column at 208.0 GB where the command prints 182.0 (14
    B/param, as the README's own table says)."""
    samples = _plan_samples()
    assert len(samples) >= 2
    for line, argv, shown in samples:
        code, out, _ = run_cli(capsys, *argv)
        printed = [x.rstrip() for x in out.splitlines()]
        assert code == 0, (line, out)
        at = 0
        for want in shown:
            if want.strip() == "...":
                continue
            want = want.rstrip()
            assert want in printed[at:], f"README.md:{line}: {want!r} is not printed (after line {at}):\n{out}"
            at = printed.index(want, at) + 1
