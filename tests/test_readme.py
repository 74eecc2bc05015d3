"""Every ```python block of the README runs as written on a CPU-only machine, each in a fresh namespace of one fresh
process (torch is imported once); the block that needs several processes runs under torchrun over gloo; the GPU
ones run in bench/gpu_check.sh (tests/readme_blocks.py --gpu)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from readme_blocks import TIMEOUT_S, blocks, run

ALL = blocks()
CPU = [b for b in ALL if b.needs is None]
PROCESSES = [b for b in ALL if b.needs == "processes"]


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    """{line: traceback or ""} of every CPU block, run by one fresh process."""
    out = tmp_path_factory.mktemp("readme") / "results.json"
    script = os.path.join(os.path.dirname(__file__), "readme_blocks.py")
    r = subprocess.run([sys.executable, script, "--cpu-json", str(out)], capture_output=True, text=True,
                       timeout=TIMEOUT_S)  # fmt: skip
    assert r.returncode == 0 and out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def test_the_readme_has_its_blocks():
    assert len(CPU) >= 8 and PROCESSES and any(b.needs == "gpu" for b in ALL)


@pytest.mark.parametrize("block", CPU, ids=[b.name for b in CPU])
def test_block_runs_on_a_cpu(block, cpu_results):
    assert cpu_results[block.line] == "", f"{block.name} failed:\n{cpu_results[block.line][-4000:]}"


@pytest.mark.parametrize("block", PROCESSES, ids=[b.name for b in PROCESSES])
def test_block_runs_under_torchrun_with_gloo(block, tmp_path):
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    # --standalone: the rendezvous binds a free port itself (no port chosen here, no race)
    r = run(block, str(tmp_path), [*launcher, "--standalone", "--nproc-per-node", "2"])
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{block.name} failed:\n{out[-4000:]}"
    assert "rank 0:" in out and "rank 1:" in out, out[-2000:]
