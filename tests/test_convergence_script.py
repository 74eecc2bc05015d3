"""bench/convergence.py's fine-tuning mode, tiny: a pretraining pass, then every variant from the same pretrained
weights (the curves' step-0 validation losses are equal) at the fine-tuning lr, each reported."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import convergence  # noqa: E402  (bench/convergence.py)


def test_finetune_runs_start_from_the_same_pretrained_weights(capsys):
    argv = ["--steps", "3", "--finetune", "4", "--batch", "2", "--context", "16", "--eval-every", "3",
            "--models", "demo-gpt", "--variants", "fp32,selective",
            "--selective", '{"fraction": 0.5, "apply_every": 2}']  # fmt: skip
    convergence.main(argv)
    out = capsys.readouterr().out
    assert "pretraining 4 steps" in out and "lr 0.0003" in out
    curves = [line.split() for line in out.splitlines() if line.strip().startswith(("fp32 ", "selective "))]
    (fp32, sel) = [c for c in curves if len(c) == 3]  # step 0 and step 3
    assert fp32[1] == sel[1], "both fine-tuning runs start from the same weights"
    assert fp32[0] == "fp32" and sel[0] == "selective"
