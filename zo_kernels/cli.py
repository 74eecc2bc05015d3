"""The `zo-kernels` command: demo, plan, bench, dashboard."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from .auto_fraction import DEFAULT_DEVICE_ADAM_RATE, measure_cpu_adam_rate, pick_fraction
from .planner import MAX_GPUS, STATE_DTYPES, UNITS, format_plan, parse_count, plan, state_k

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SUITES = {"cpu_adam": "test_bench_cpu_adam.py", "buckets": "test_bench_buckets.py",
          "transport": "test_bench_transport.py", "step": "test_bench_step.py", "stages": "test_bench_stages.py",
          "nvme": "test_bench_nvme.py"}  # fmt: skip
# suites that cannot run on some machines: (what they need, whether this machine has it, why, in one line)
NEEDS = {"buckets": ("a GPU", torch.cuda.is_available,
                     "it times the Triton cast and pack against torch on CUDA; on a CPU both are torch's own ops")}
# the benchmarks' own sizes (bench/test_bench_cpu_adam.py's moment formats, bench/test_bench_stages.py's NVMe rows)
SIZE_VARS = ("ZO_BENCH_FORMAT_SIZES", "ZO_BENCH_INFINITY_SIZES")
PYTEST_NO_TESTS = 5  # pytest's exit status when every test was skipped or none was collected


# Bounds of the demo: beyond them it would not fit in a machine's memory (the batches are made up front).
MAX_DEMO_PARAMS, MAX_STEPS, MAX_BATCH, MAX_CONTEXT = 2e8, 100_000, 4096, 4096


class UsageError(Exception):
    """A bad argument: reported on one line, exit status 2."""


def _int_in(name: str, lo: int, hi: int):
    """An argparse type: an integer in [lo, hi], the error naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{name} must be >= {lo}, got {value}")
        if value > hi:
            raise argparse.ArgumentTypeError(f"{name} must be <= {hi}, got {str(value)[:20]}")
        return value

    return parse


def _positive_int(name: str, hi: int = 2**31 - 1):
    return _int_in(name, 1, hi)


def _float(name: str):
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None

    return parse


def _count(text: str) -> float:
    try:
        value = parse_count(text, "--model-size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value > MAX_DEMO_PARAMS:
        raise argparse.ArgumentTypeError(f"--model-size must be <= {MAX_DEMO_PARAMS:.0e} (a demo on one machine), "
                                         f"got {text!r}")  # fmt: skip
    return value


class _DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" where the help does not say its default already and X means something (not None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "(default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zo-kernels", description="ZeRO-Offload kernels: demo, memory planner, benchmarks, dashboard")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    fmt = dict(formatter_class=_DefaultsOnce)  # every --help shows the defaults

    d = sub.add_parser("demo", help="train a small GPT with ZeroOffloadAdamW and with torch AdamW, side by side", **fmt)
    d.add_argument("--steps", type=_positive_int("--steps", MAX_STEPS), default=400, help="training steps")
    d.add_argument("--model-size", type=_count, default=1e6, metavar="PARAMS",
                   help="approximate parameters (e.g. 1M, 5e6)")  # fmt: skip
    d.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="device parameter dtype (auto: bf16 where the device computes it natively, else fp32 on a "
                        "CPU, fp16 on a GPU)")  # fmt: skip
    d.add_argument("--delay-update-after", type=_int_in("--delay-update-after", 0, 2**31 - 1), default=None,
                   metavar="STEPS", help="enable the delayed parameter update after this many synchronous steps "
                                         "(default: never)")  # fmt: skip
    d.add_argument("--stage", type=int, choices=(1, 2, 3), default=2, help="ZeRO stage of ZeroOffloadAdamW")
    d.add_argument("--offload-param", choices=("none", "cpu"), default="none",
                   help="stage 3: keep the parameter shards in host memory")  # fmt: skip
    d.add_argument("--state-dtype", choices=STATE_DTYPES, default="fp32",
                   help="format of ZeroOffloadAdamW's Adam moments on the host (the fp32 masters stay)")
    d.add_argument("--gpu-fraction", default="0", metavar="FRACTION",
                   help="ZeroOffloadAdamW's gpu_fraction: that part of the optimizer state stays on the device "
                        "(Twin-Flow; its moments in --state-dtype's format)")  # fmt: skip
    d.add_argument("--seed", type=_int_in("--seed", 0, 2**63 - 1), default=0, help="model and data seed")
    d.add_argument("--batch", type=_positive_int("--batch", MAX_BATCH), default=16, metavar="SEQUENCES",
                   help="sequences per step")  # fmt: skip
    d.add_argument("--context", type=_positive_int("--context", MAX_CONTEXT), default=64, metavar="TOKENS",
                   help="tokens per sequence")  # fmt: skip
    d.add_argument("--lr", type=_float("--lr"), default=3e-3, help="learning rate of both optimizers")
    d.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: the GPU where there is one")  # fmt: skip
    d.add_argument("--plot", metavar="FILE.png", help="save the loss curves and the phase breakdown (matplotlib)")
    d.add_argument("--quiet", action="store_true", help="no progress bar")

    pl = sub.add_parser("plan", help="bytes per device for DDP, ZeRO-1/2/3, ZeRO-2/3 + offload and ZeRO-Infinity",
                        description="Sizes take a unit: GB = 1e9 bytes, GiB = 2^30 (also KB/MB/TB, KiB/MiB/TiB; "
                                    "no unit: bytes). Counts: 13e9, 13B, 350M.", **fmt)  # fmt: skip
    pl.add_argument("--params", required=True, metavar="COUNT", help="model size, e.g. 13e9 or 13B")
    pl.add_argument("--gpus", default="1", metavar="COUNT", help="data-parallel GPUs")
    pl.add_argument("--gpu-mem", default="32GiB", metavar="SIZE", help="memory per GPU, e.g. 32GiB or 32GB")
    pl.add_argument("--host-mem", default="768GiB", metavar="SIZE", help="host memory per host")
    pl.add_argument("--gpus-per-host", default=None, metavar="COUNT",
                    help="GPUs sharing one host's memory (default: all)")  # fmt: skip
    pl.add_argument("--k", default=None, metavar="BYTES",
                    help="optimizer bytes per parameter (default 12: Adam, fp32 master + 2 moments; or from "
                         "--state-dtype)")  # fmt: skip
    pl.add_argument("--state-dtype", choices=STATE_DTYPES, default=None,
                    help="K from the Adam moments' format: fp32 12, bf16 8, 8bit 6.03 (fp32 master + moments)")
    pl.add_argument("--activations", default=None, metavar="SIZE",
                    help="activation memory per GPU (default 4GiB; or derived from --seq)")  # fmt: skip
    pl.add_argument("--seq", default=None, metavar="TOKENS",
                    help="derive the activations from the model's shape: tokens per sequence (needs --hidden, "
                         "--layers)")  # fmt: skip
    pl.add_argument("--batch", default="1", metavar="SEQUENCES", help="with --seq: sequences per GPU micro-batch")
    pl.add_argument("--hidden", default=None, metavar="WIDTH", help="with --seq: the model's hidden size")
    pl.add_argument("--layers", default=None, metavar="COUNT", help="with --seq: transformer layers")
    pl.add_argument("--heads", default="0", metavar="COUNT", help="with --attention eager: attention heads")
    pl.add_argument("--vocab", default="0", metavar="COUNT",
                    help="with --seq: count the logits (6 B per token x vocab)")  # fmt: skip
    pl.add_argument("--attention", choices=("flash", "eager"), default="flash",
                    help="with --seq: eager attention keeps the s x s scores (5 a s^2 b bytes per layer)")
    act = pl.add_mutually_exclusive_group()
    act.add_argument("--activation-offload", nargs="?", const="layer", choices=("layer", "half"), default=None,
                     help="with --seq: checkpointing + offload (zo_kernels.checkpoint) sizes the rows, a checkpoint "
                          "per layer, or with 'half' one around each attention and each MLP")  # fmt: skip
    act.add_argument("--no-checkpointing", action="store_true",
                     help="with --seq: no activation checkpointing sizes the rows (default: checkpointing)")
    pl.add_argument("--workspace", default="1GiB", metavar="SIZE", help="workspace memory per GPU")
    pl.add_argument("--reserve", default="0.05", metavar="FRACTION",
                    help="fraction of GPU memory lost to fragmentation")  # fmt: skip
    pl.add_argument("--buckets", default=None, metavar="SIZE",
                    help="GPU gradient buckets of the offload and stage-3 rows, both together (default: "
                         "ZeroOffloadAdamW's for the model's size: 64MiB up to 537M params, 128MiB to 1.07B, "
                         "256MiB above, or two of the embedding where --vocab x --hidden is larger)")  # fmt: skip
    pl.add_argument("--nvme", default="0", metavar="SIZE",
                    help="NVMe capacity per host for the ZeRO-Infinity rows (e.g. 4TB)")  # fmt: skip
    pl.add_argument("--layer-params", default=None, metavar="COUNT",
                    help="largest layer gathered at once by stage 3 (default: params / 32)")  # fmt: skip
    pl.add_argument("--prefetch", default="1", metavar="LAYERS",
                    help="stage 3: layers gathered ahead of the one computing")  # fmt: skip
    pl.add_argument("--io-pool", default="1GiB", metavar="SIZE", help="host I/O buffers per GPU of the NVMe rows")
    pl.add_argument("--units", choices=UNITS, default="GB",
                    help="the table's unit (the working set is printed in GB or GiB alike)")  # fmt: skip
    pl.add_argument("--accumulation", action="store_true",
                    help="gradient accumulation: the offload rows' host holds an fp32 accumulator (4 B/param / N)")
    pl.add_argument("--dpu", action="store_true",
                    help="the delayed parameter update: a second gradient landing buffer on the host (2 B/param / N)")
    pl.add_argument("--max", action="store_true", help="also print the largest model each strategy can train")
    pl.add_argument("--gpu-fraction", default="0", metavar="FRACTION",
                    help="ZeroOffloadAdamW's gpu_fraction: that part of the offload rows' optimizer state (and its "
                         "gradients) on the GPU")  # fmt: skip
    pl.add_argument("--selective", default="0", metavar="FRACTION",
                    help="ZeroOffloadAdamW's selective fraction (0: off): the ZeRO-2 + offload row adds the "
                         "selection's state and gradient on the GPU and the window sums on the host")  # fmt: skip
    pl.add_argument("--auto", action="store_true",
                    help="pick --gpu-fraction: the smallest whose CPU Adam part takes no longer than forward+backward "
                         "(--fwd-bwd-ms), within the GPU memory the ZeRO-2 + offload row leaves")  # fmt: skip
    pl.add_argument("--fwd-bwd-ms", default=None, metavar="MS", help="--auto: forward+backward time per step")
    pl.add_argument("--cpu-adam-rate", default=None, metavar="PARAMS/S",
                    help="--auto: CPU Adam's rate per rank (default: measured here, ~1 s)")  # fmt: skip
    pl.add_argument("--device-adam-rate", default=None, metavar="PARAMS/S",
                    help=f"--auto: the GPU's fused AdamW rate (default: {DEFAULT_DEVICE_ADAM_RATE:g}, an H100: "
                         "3.35 TB/s x 0.6 / 40 B per param; not measured)")  # fmt: skip

    b = sub.add_parser("bench", help="run the pytest-benchmark suites and write their JSON", **fmt)
    b.add_argument("--suite", choices=sorted(SUITES), action="append",
                   help="a suite (repeatable; default: all); one that cannot run here says why and is left out")
    b.add_argument("--sizes", default=None, metavar="COUNT[,COUNT...]",
                   help="comma-separated sizes in elements or parameters, for every benchmark; without it the "
                        "moment formats run at 5e7 and stage 3's NVMe rows at 1.6e7,6.4e7 (default: 1e7)")
    b.add_argument("-o", "--output", default=None, metavar="FILE.json",
                   help="JSON path (default: bench-<timestamp>.json)")  # fmt: skip

    db = sub.add_parser("dashboard", help="render benchmark JSON runs into one self-contained HTML page", **fmt)
    db.add_argument("runs", nargs="+", metavar="RUN.json", help="pytest-benchmark JSON files, oldest first")
    db.add_argument("-o", "--output", default="report.html", metavar="FILE.html", help="the page to write")
    return p


# plan()'s argument names -> the options that set them, so every error names the option
PLAN_OPTIONS = {"params": "--params", "gpus": "--gpus", "gpu_mem": "--gpu-mem", "host_mem": "--host-mem",
                "gpus_per_host": "--gpus-per-host", "k": "--k", "activations": "--activations",
                "workspace": "--workspace", "reserve": "--reserve", "bucket_bytes": "--buckets", "nvme": "--nvme",
                "layer_params": "--layer-params", "prefetch": "--prefetch", "io_pool": "--io-pool", "seq": "--seq",
                "batch": "--batch", "hidden": "--hidden", "layers": "--layers", "heads": "--heads", "vocab": "--vocab",
                "attention": "--attention", "selective": "--selective", "gpu_fraction": "--gpu-fraction"}  # fmt: skip


def cmd_plan(a: argparse.Namespace) -> int:
    try:
        gpus = _int_in("--gpus", 1, MAX_GPUS)(a.gpus)
        per_host = None if a.gpus_per_host is None else _int_in("--gpus-per-host", 1, MAX_GPUS)(a.gpus_per_host)
        prefetch = _int_in("--prefetch", 0, 1024)(a.prefetch)
        if a.k is not None and a.state_dtype is not None:
            raise UsageError("--k and --state-dtype both set K: give one")
        k = _float("--k")(a.k) if a.k is not None else state_k(a.state_dtype or "fp32")
        reserve = _float("--reserve")(a.reserve)
        shape = {name: None if getattr(a, name) is None else _int_in(f"--{name}", 0, 2**40)(getattr(a, name))
                 for name in ("seq", "batch", "hidden", "layers", "heads", "vocab")}  # fmt: skip
        fraction = _fraction_in("--gpu-fraction")(a.gpu_fraction)
        selective = _fraction_in("--selective")(a.selective)
        if a.seq is None:
            for flag, given in (("--activation-offload", a.activation_offload is not None),
                                ("--no-checkpointing", a.no_checkpointing),
                                ("--attention eager", a.attention == "eager"), ("--hidden", a.hidden is not None),
                                ("--layers", a.layers is not None), ("--heads", a.heads != "0"),
                                ("--vocab", a.vocab != "0"), ("--batch", a.batch != "1")):  # fmt: skip
                if given:
                    raise argparse.ArgumentTypeError(
                        f"{flag} describes the activations (from the model's shape): give --seq, --hidden and --layers "
                        "too (without them the activations are --activations, default 4GiB)")
        if selective and a.auto:
            raise argparse.ArgumentTypeError("--auto picks a gpu_fraction, which --selective refuses: give one")
        if fraction and a.auto:  # (--auto's pick would replace it without a word)
            raise argparse.ArgumentTypeError("--auto picks the gpu_fraction: give --gpu-fraction or --auto, not both")
        if not a.auto:
            for flag, attr in AUTO_RATES:
                if getattr(a, attr) is not None:
                    raise argparse.ArgumentTypeError(f"{flag} is read by --auto only: add --auto, or leave it out")
        auto = _auto_rates(a) if a.auto else None
    except argparse.ArgumentTypeError as e:
        raise UsageError(str(e)) from None
    kw = dict(k=k, activations=a.activations, workspace=a.workspace, reserve=reserve, bucket_bytes=a.buckets,
              gpus_per_host=per_host, nvme=a.nvme, layer_params=a.layer_params, prefetch=prefetch, io_pool=a.io_pool,
              accumulation=a.accumulation, dpu=a.dpu, attention=a.attention, selective=selective, **shape,
              activation_mode={"layer": "offload", "half": "offload_half"}.get(a.activation_offload)
              or ("none" if a.no_checkpointing else "checkpoint"))  # fmt: skip
    try:
        p = plan(a.params, gpus, a.gpu_mem, a.host_mem, gpu_fraction=fraction, **kw)
        pick = None
        if auto is not None:
            fwd_bwd_s, cpu_rate, device_rate = auto
            row = plan(a.params, gpus, a.gpu_mem, a.host_mem, **kw).row("ZeRO-2 + offload")
            # (a hair under the bound: the row's total at exactly the memory left can round a byte over it, so the
            # pick's row read "no (GPU)": 13B, --auto --accumulation, 2026-11-28)
            free = (p.gpu_mem * (1 - p.reserve) - row.gpu_total) * (1 - 1e-9)
            # a tail element holds k bytes of state and a 2-byte gradient, with accumulation a 4-byte sum too
            pick = pick_fraction(p.params / gpus, cpu_rate, device_rate, fwd_bwd_s, free,
                                 k + 2 + (4 if a.accumulation else 0))  # fmt: skip
            p = plan(a.params, gpus, a.gpu_mem, a.host_mem, gpu_fraction=pick.fraction, **kw)
    except ValueError as e:
        raise UsageError(re.sub(r"^\w+", lambda m: PLAN_OPTIONS.get(m[0], m[0]), str(e))) from None
    print(format_plan(p, show_max=a.max, unit=a.units))
    if pick is not None:
        print(f"\n--auto: CPU Adam {cpu_rate:.3g} params/s{' (measured here)' if a.cpu_adam_rate is None else ''}, "
              f"device AdamW {device_rate:.3g} params/s; {pick.explain()}")  # fmt: skip
    elif fraction:
        print(f"\ngpu_fraction {fraction:g}: the offload rows keep that part of p32, m, v and the gradients on the GPU")
    if selective:
        print(f"\nselective {selective:g}: the ZeRO-2 + offload row holds the selection's p32, m, v, index and "
              "gradient on the GPU\n(24 B per selected element, 28 with --accumulation) and two fp32 window sums, "
              "the p16 staging,\nthe selection's index and its pinned shuttle on the host (10 B/param + 20 B per "
              "selected element, / N),\nand a second gradient landing buffer (+ 2 B/param, and a second fp32 "
              "accumulator with --accumulation, / N)")
    return 0


def _fraction_in(name: str):
    def parse(text: str) -> float:
        value = _float(name)(text)
        if not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(f"{name} must be in [0, 1], got {text!r}")
        return value

    return parse


AUTO_RATES = (("--fwd-bwd-ms", "fwd_bwd_ms"), ("--cpu-adam-rate", "cpu_adam_rate"),
              ("--device-adam-rate", "device_adam_rate"))  # --auto's measured inputs: (flag, attribute)


def _auto_rates(a: argparse.Namespace) -> tuple[float, float, float]:
    """--auto's (forward+backward seconds, CPU Adam params/s, device AdamW params/s)."""
    if a.fwd_bwd_ms is None:
        raise argparse.ArgumentTypeError("--auto needs --fwd-bwd-ms (forward+backward time per step, measured)")
    rates = []
    for name, attr in AUTO_RATES:
        text = getattr(a, attr)
        value = None if text is None else _float(name)(text)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{name} must be a number > 0, got {text!r}")
        rates.append(value)
    fwd_bwd_ms, cpu_rate, device_rate = rates
    if cpu_rate is None:
        cpu_rate = measure_cpu_adam_rate(state_dtype=a.state_dtype or "fp32")
    return fwd_bwd_ms / 1e3, cpu_rate, DEFAULT_DEVICE_ADAM_RATE if device_rate is None else device_rate


def bench_dir() -> Path:
    here = Path(__file__).resolve().parent.parent / "bench"
    if not (here / "conftest.py").exists():
        raise UsageError(f"the benchmark suites live in bench/ of a source checkout (not found at {here})")
    return here


def cmd_bench(a: argparse.Namespace) -> int:
    root = bench_dir()
    suites = list(dict.fromkeys(a.suite or sorted(SUITES)))
    # pytest runs in the checkout: a relative path is made absolute here, relative to the caller's directory
    out = Path(a.output or f"bench-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json").absolute()
    _check_output_dir(out, "--output")
    if a.sizes is not None and not a.sizes.strip():
        raise UsageError("--sizes: give element counts, e.g. 1e6,1e7 (got an empty string)")
    sizes = a.sizes or "1e7"
    for s in sizes.split(","):
        try:
            n = parse_count(s, "--sizes")
        except ValueError as e:
            raise UsageError(str(e)) from None
        if n != int(n) or not 1 <= n <= 2**40:
            raise UsageError(f"--sizes: each a whole number of elements in [1, 2**40], got {s!r}")
    for s in [s for s in suites if s in NEEDS and not NEEDS[s][1]()]:
        print(f"bench {s}: not run, it needs {NEEDS[s][0]} and this machine has none ({NEEDS[s][2]})", flush=True)
        suites.remove(s)
    if not suites:
        return 0
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--benchmark-json={out}",
           *[str(root / SUITES[s]) for s in suites]]  # fmt: skip
    env = {**os.environ, "ZO_BENCH_SIZES": ",".join(str(int(parse_count(s))) for s in sizes.split(","))}
    if a.sizes is not None:  # the benchmarks with sizes of their own take the ones asked for too
        env.update({var: env["ZO_BENCH_SIZES"] for var in SIZE_VARS})
    print(f"running {', '.join(suites)} at sizes {env['ZO_BENCH_SIZES']} -> {out}", flush=True)
    code = subprocess.call(cmd, cwd=root.parent, env=env)
    if code == PYTEST_NO_TESTS:
        print(f"bench {', '.join(suites)}: every benchmark was skipped on this machine (the reasons are above)")
        return 0
    return code


def _check_output_dir(path: Path, option: str) -> None:
    """The output can be written: a file's path in an existing directory, openable for writing (tried before any
    work; a file made by the try is removed)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option}: {path} is a directory: give a file's path in it")
    if not path.absolute().parent.is_dir():
        raise UsageError(f"{option}: directory {path.absolute().parent} does not exist")
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise UsageError(f"{option}: cannot write {path}: {e.strerror or e}") from None
    finally:
        if not existed and path.exists():
            path.unlink()


def cmd_dashboard(a: argparse.Namespace) -> int:
    from .dashboard import render

    _check_output_dir(Path(a.output), "--output")
    for r in a.runs:
        if not Path(r).is_file():
            raise UsageError(f"no such benchmark JSON: {r}")
    try:
        html = render([Path(r) for r in a.runs])
    except ValueError as e:
        raise UsageError(str(e)) from None
    except (TypeError, AttributeError, KeyError) as e:  # (a field of an unexpected type in one of the inputs)
        raise UsageError(f"a malformed benchmark or GPU summary JSON among {', '.join(map(str, a.runs))}: "
                         f"{type(e).__name__}: {e}") from None  # fmt: skip
    try:
        Path(a.output).write_text(html, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--output: cannot write {a.output}: {e.strerror or e}") from None
    print(f"wrote {a.output} ({len(html) / 1e3:.0f} KB, {len(a.runs)} run(s))")
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from . import demo

    if a.delay_update_after is not None and a.delay_update_after < 0:
        raise UsageError(f"--delay-update-after must be >= 0, got {a.delay_update_after}")
    if a.offload_param != "none" and a.stage != 3:
        raise UsageError(f"--offload-param {a.offload_param} needs --stage 3 (parameters are partitioned only there)")
    if not (a.lr > 0 and a.lr < 1):
        raise UsageError(f"--lr must be in (0, 1), got {a.lr}")
    try:
        a.gpu_fraction = _fraction_in("--gpu-fraction")(a.gpu_fraction)
    except argparse.ArgumentTypeError as e:
        raise UsageError(str(e)) from None
    if a.plot:
        _check_output_dir(Path(a.plot), "--plot")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    if a.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    a.dtype = None if a.dtype == "auto" else DTYPES[a.dtype]  # None: the demo picks one for the device
    return demo.main(a)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `zo-kernels` and `python -m zo_kernels`."""
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already reported on one line)
        return int(e.code or 0)
    try:
        return {"demo": cmd_demo, "plan": cmd_plan, "bench": cmd_bench, "dashboard": cmd_dashboard}[a.command](a)
    except UsageError as e:
        sys.stderr.write(f"zo-kernels {a.command}: error: {e}\n")
        return 2
    except BrokenPipeError:  # (`zo-kernels plan ... | head`: the reader left; nothing more to say, no traceback)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the interpreter's flush at exit)
        return 0
