"""The planner's gpu_fraction: the offload rows' bytes with part of the state on the GPU, and `plan --auto`'s pick,
against hand-computed figures."""

import math
import re

import pytest

from zo_kernels.auto_fraction import (
    DEVICE_BYTES_PER_ELEMENT,
    measure_cpu_adam_rate,
    measure_device_adam_rate,
    pick_fraction,
)
from zo_kernels.cli import main
from zo_kernels.planner import plan


@pytest.mark.parametrize("gpus", [1, 4])
@pytest.mark.parametrize("f", [0.0, 0.25, 1.0])
def test_offload_rows_move_the_fraction_to_the_gpu(f, gpus):
    n, params, k = gpus, 1e9, 12
    p = plan(params, gpus, "80GiB", "768GiB", gpu_fraction=f)
    z2, z3 = p.row("ZeRO-2 + offload"), p.row("ZeRO-3 + offload")
    # ZeRO-2 + offload: p16 on the GPU (2) and the tail's p32, m, v + g16 ((k + 2) f / N); the host keeps the head's
    # g16, p32, m, v ((1 - f)(2 + k) / N; no p16 staging: the new parameters go over the gradients)
    assert z2.gpu_states == pytest.approx((2 + f * (k + 2) / n) * params, rel=1e-12)
    assert z2.host == pytest.approx((1 - f) * (2 + k) / n * params, rel=1e-12, abs=1e-3)
    # ZeRO-3 + offload: the p16 shard stays on the host (2 / N)
    assert z3.gpu_states == pytest.approx(f * (k + 2) / n * params, rel=1e-12, abs=1e-3)
    assert z3.host == pytest.approx((2 + (1 - f) * (2 + k)) / n * params, rel=1e-12)
    assert p.row("ZeRO-2").gpu_states == plan(params, gpus, "80GiB", "768GiB").row("ZeRO-2").gpu_states


def test_accumulation_buffers_follow_the_fraction():
    a = plan(1e9, 1, accumulation=True, dpu=True, gpu_fraction=0.5).row("ZeRO-2 + offload")
    b = plan(1e9, 1, accumulation=True, dpu=True).row("ZeRO-2 + offload")
    extra = 2 * 4 + 2  # two fp32 accumulators and a second g16 landing buffer per parameter
    assert b.host == pytest.approx((2 + 12 + extra) * 1e9)
    assert a.host == pytest.approx(0.5 * (2 + 12 + extra) * 1e9)
    # the GPU's tail: one landing buffer and one accumulator (the device's update reads them at once)
    assert a.gpu_states == pytest.approx((2 + 0.5 * (14 + 4)) * 1e9)


def test_pick_is_bounded_by_time_then_by_memory():
    # the 95M GPT: CPU Adam ~23 ms (4.13e9 params/s), forward+backward half of it
    P, cpu = 95e6, 95e6 / 0.023
    pick = pick_fraction(P, cpu, 5e10, 0.0115, 80 * 2**30)
    assert pick.fraction == pytest.approx(0.5) and pick.by_time == pytest.approx(0.5) and pick.by_memory == 1.0
    assert pick.cpu_s == pytest.approx(0.0115) and pick.device_s == pytest.approx(0.5 * P / 5e10)
    assert "forward+backward" in pick.explain() and "0.500" in pick.explain()
    assert pick.tokens_to_cover == pytest.approx(2.0) and "at 2.0x this step's tokens" in pick.explain()
    tight = pick_fraction(P, cpu, 5e10, 0.0115, 0.2 * DEVICE_BYTES_PER_ELEMENT * P)
    assert tight.fraction == pytest.approx(0.2) and "memory" in tight.explain()
    keeps_up = pick_fraction(P, cpu, 5e10, 1.0, 1e12)
    assert keeps_up.fraction == 0.0 and "covers CPU Adam over the whole partition already" in keeps_up.explain()
    assert tight.tokens_to_cover == pytest.approx(2.0)  # (the memory bound does not change the batch that hides it)
    assert pick_fraction(P, cpu, 5e10, 0.0115, -1.0).fraction == 0.0  # no memory left
    for bad in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="fwd_bwd_s"):
            pick_fraction(P, cpu, 5e10, bad, 1e9)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "8bit"])
def test_measured_rates_are_rates(fmt):
    for rate in (measure_cpu_adam_rate(numel=1 << 16, repeats=1, state_dtype=fmt),
                 measure_device_adam_rate("cpu", numel=1 << 16, repeats=1, state_dtype=fmt)):  # fmt: skip
        assert math.isfinite(rate) and rate > 1e5


@pytest.mark.parametrize("fmt, k", [("bf16", 8.0), ("8bit", 6.03125)])
def test_compressed_moments_move_k_bytes_to_the_gpu(fmt, k, capsys):
    """With bf16 / 8-bit moments the tail keeps them in that format on the device (offload/device_adam.py): the offload
    rows move K + 2 bytes per element of the tail; --auto's memory bound divides by K + 2 as well."""
    params, f = 1.3e9, 0.4
    z2 = plan(params, 1, "80GiB", "768GiB", k=k, gpu_fraction=f).row("ZeRO-2 + offload")
    assert z2.gpu_states == pytest.approx((2 + f * (k + 2)) * params, rel=1e-12)
    assert z2.host == pytest.approx((1 - f) * (2 + k) * params, rel=1e-12)
    P, cpu = 95e6, 95e6 / 0.023
    assert pick_fraction(P, cpu, 5e10, 0.0115, 0.2 * (k + 2) * P, k + 2).by_memory == pytest.approx(0.2)
    held = {}
    for state_dtype in ("fp32", fmt):  # (the same free device memory: --auto's bound scales as 14 / (K + 2))
        argv = ["plan", "--params", "95e6", "--gpu-mem", "6GiB", "--auto", "--fwd-bwd-ms", "1", "--state-dtype",
                state_dtype, "--cpu-adam-rate", str(95e6 / 0.023)]  # fmt: skip
        assert main(argv) == 0
        out = capsys.readouterr().out
        held[state_dtype] = float(re.search(r"the device memory left holds at most ([0-9]+\.[0-9]+)", out)[1])
    assert 0.1 < held["fp32"] < 0.5 and held[fmt] == pytest.approx(held["fp32"] * 14 / (k + 2), abs=2e-3)


def rows_of(text):
    return {line[:18].strip(): line for line in text.splitlines()}


def test_cli_auto_prints_the_pick_and_plans_with_it(capsys):
    argv = ["plan", "--params", "95e6", "--gpu-mem", "80GiB", "--auto", "--fwd-bwd-ms", "11.5",
            "--cpu-adam-rate", str(95e6 / 0.023)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gpu_fraction 0.500" in out and "not measured" not in out
    z2 = plan(95e6, 1, "80GiB", gpu_fraction=0.5).row("ZeRO-2 + offload")
    assert f"{z2.gpu_states / 1e9:,.1f} GB" in rows_of(out)["ZeRO-2 + offload"]
    assert main(["plan", "--params", "95e6", "--gpu-fraction", "0.5"]) == 0
    assert "gpu_fraction 0.5" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--auto"], "--auto needs --fwd-bwd-ms"),
    (["--gpu-fraction", "1.5"], "--gpu-fraction must be in [0, 1]"),
    (["--gpu-fraction", "nan"], "--gpu-fraction must be in [0, 1]"),
    (["--gpu-fraction", "x"], "--gpu-fraction must be a number"),
    (["--auto", "--fwd-bwd-ms", "0"], "--fwd-bwd-ms must be a number > 0"),
    (["--auto", "--fwd-bwd-ms", "5", "--device-adam-rate", "inf"], "--device-adam-rate must be a number > 0"),
    (["--auto", "--fwd-bwd-ms", "5", "--selective", "0.1"], "--auto picks a gpu_fraction, which --selective"),
    (["--fwd-bwd-ms", "5"], "--fwd-bwd-ms is read by --auto only"),  # (was ignored without a word)
    (["--device-adam-rate", "1e9"], "--device-adam-rate is read by --auto only"),
    (["--cpu-adam-rate", "1e9"], "--cpu-adam-rate is read by --auto only"),
])  # fmt: skip
def test_cli_bad_values_one_line_exit_2(capsys, argv, message):
    assert main(["plan", "--params", "95e6", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, message", [
    (["--gpu-fraction", "2"], "--gpu-fraction must be in [0, 1]"),
    (["--gpu-fraction", "-0.5"], "--gpu-fraction must be in [0, 1]"),
])  # fmt: skip
def test_demo_gpu_fraction_bad_values_one_line_exit_2(capsys, argv, message):
    assert main(["demo", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
