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

    monkeypatch.setattr(step_rows, "zo_step", interrupted)
    out = tmp_path / "step.json"
    argv = [str(out), "--sizes", "2e5", "--device", "cpu", "--batch", "2", "--context", "16", "--rounds", "2",
            "--modes", "sync,dpu"]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        step_rows.main(argv)
    assert calls == ["sync", "dpu"]
    (row,) = json.loads(out.read_text())
    assert row["mode"] == "sync" and row["zo_ms"] > 0 and row["torch_fused_ms"] > 0
