"""The ratios of pytest-benchmark JSON files (`--benchmark-json`), one block per group, best of N rounds.

Usage: python bench/summary.py FILE.json...   (bench/gpu_check.sh writes its summary.txt with it)
       python bench/summary.py --summary-json OUTDIR   (OUTDIR/summary.json from OUTDIR's bench-pack.json,
       step.json of bench/step_rows.py, anchors.json of bench/anchors.py, activations.json of
       bench/activation_rows.py and scale.json of bench/scale_check.py; see summary_json)
Per provider: best time, GB/s of the bytes the op must move, time against the group's baseline, fraction of
the group's ceiling (ceiling time / provider time). Also, where a group holds them: the hidden fraction of
the tiled writeback, and the peak device memory of a training step. Needs only the standard library.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from summary_pack import host_row, pack_rows  # bench/ is on sys.path: this file runs as a script

# Providers named by the suites: a group's ratios are against the first baseline and the first ceiling present.
BASELINES = ("torch_fused", "torch", "torch_ref", "kernel", "reference", "pageable")
CEILINGS = ("ceiling", "copy", "torch_pinned")


def provider_times(name: str, min_s: float, info: dict) -> list[tuple[str, float]]:
    """The (provider, seconds) rows one benchmark stands for: the providers it timed itself (`providers_ms`: the
    pack suite times zo, torch_ref and copy with CUDA events in one benchmark, whose pytest-benchmark rounds time
    only the host's launch on a GPU), else pytest-benchmark's best round."""
    if isinstance(info.get("providers_ms"), dict):
        return [(p, ms / 1e3) for p, ms in info["providers_ms"].items()]
    return [(name, min_s)]


def hidden_fraction(a: float, b: float, both: float) -> float:
    """Share of the shorter of two jobs hidden behind the longer one when run overlapped in `both` seconds:
    1 - (both - max(a, b)) / min(a, b); 1 = fully hidden, 0 = serial (a + b), below 0 = slower than serial."""
    return 1.0 - (both - max(a, b)) / min(a, b)


def load(paths: list[str]) -> tuple[dict, list[str]]:
    """({group: {provider: benchmark}}, [machine lines]) from the files that exist."""
    groups: dict[str, dict[str, dict]] = defaultdict(dict)
    machines = []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            machines.append(f"{path}: not read ({e.__class__.__name__}: {e})")
            continue
        m = data.get("machine_info", {}).get("zo") or {}
        machines.append(f"{path}: cpu {m.get('cpu')} ({m.get('cores')} cores, {m.get('isa')}), cuda {m.get('cuda')}, "
                        f"torch {m.get('torch')}, {len(data.get('benchmarks', []))} benchmarks")  # fmt: skip
        for b in data.get("benchmarks", []):
            if not b.get("stats"):  # (a benchmark that failed or was skipped before timing: nothing measured)
                continue
            groups[b["group"] or b["name"]][b["extra_info"].get("provider", b["name"])] = b
    return groups, machines


def group_lines(group: str, by_provider: dict[str, dict]) -> list[str]:
    rows = [(p, t, b) for name, b in by_provider.items()
            for p, t in provider_times(name, b["stats"]["min"], b["extra_info"])]  # fmt: skip
    best = {p: t for p, t, _ in rows}
    base = next((p for p in BASELINES if p in best), None)
    ceil = next((p for p in CEILINGS if p in best), None)
    out = [group]
    for p, t, b in rows:
        info = b["extra_info"]
        line = f"  {p:<13} {t * 1e3:10.3f} ms  {b['stats']['rounds']:>3} rounds"
        if info.get("bytes"):
            line += f"  {info['bytes'] / t / 1e9:8.1f} GB/s"
        if base is not None and p != base:
            line += f"  {t / best[base]:6.2f}x {base}"
        if ceil is not None and p != ceil:
            line += f"  {best[ceil] / t:5.0%} of {ceil}"
        if "peak_gpu_bytes" in info:
            peak = info["peak_gpu_bytes"]
            line += f"  peak GPU {peak / 2**30:.2f} GiB"
            if info.get("numel"):
                line += f" ({peak / info['numel']:.1f} B/param)"
        out.append(line)
    if {"adam", "h2d", "writeback"} <= best.keys():
        a, c, both = best["adam"], best["h2d"], best["writeback"]
        out.append(f"  hidden fraction = 1 - (writeback - max(adam, h2d)) / min(adam, h2d) = "
                   f"{hidden_fraction(a, c, both):.1%}; writeback {both / max(a, c):.2f}x the longer")  # fmt: skip
    peaks = {
        p: b["extra_info"]["peak_gpu_bytes"] for p, b in by_provider.items() if "peak_gpu_bytes" in b["extra_info"]
    }
    if "zo" in peaks and base in peaks:
        out.append(f"  zo vs {base}: step time {best['zo'] / best[base]:.2f}x, peak GPU memory "
                   f"{peaks['zo'] / peaks[base]:.2f}x")  # fmt: skip
    return out


def step_targets(rows: list[dict]) -> dict:
    """Per target of issue 17 over the step rows: the worst value, its bar and whether every row meets it."""
    out: dict = {}
    for r in rows:
        for name, t in (r.get("targets") or {}).items():
            worst = out.get(name)
            sign = -1 if t.get("at_least") else 1  # (a bar to reach from below: the worst is the smallest)
            if worst is None or sign * t["value"] > sign * worst["value"]:
                out[name] = {"value": t["value"], "bar": t["bar"], "met": t["met"], "params": r.get("params"),
                             **({"at_least": True} if t.get("at_least") else {})}  # fmt: skip
    return out


def activation_targets(rows: list[dict]) -> dict:
    """Issue 21's targets over the activation rows (where measured): zo's offloaded checkpoint against torch's
    checkpoint (step time <= 1.05x, per block and per half block; longest sequence >= 2x, zo's longest of its
    segmentations against torch's longest of its, each naming the rows it compares) and against save_on_cpu (step
    time < 1x); and, beside them, against torch's checkpoint under save_on_cpu (transformers 5's offload: < 1x).
    The rows of the wide shape (activation_rows.py --wide: a model whose step the device sets) are judged too, their
    step ratios named wide_*."""
    out = _activation_targets([r for r in rows if r.get("shape", "main") == "main"])
    wide = _activation_targets([r for r in rows if r.get("shape") == "wide"])
    out.update({f"wide_{k}": v for k, v in wide.items() if k.startswith(("step_", "half_step_"))})
    return out


def _activation_targets(rows: list[dict]) -> dict:
    by = {r.get("provider"): r for r in rows if "step_ms" in r}
    zo, out = by.get("zo"), {}
    if zo is None:
        return out

    def judge(name: str, value: float, bar: float, at_most: bool, **more) -> None:
        out[name] = {"value": value, "bar": bar, "met": value <= bar if at_most else value >= bar, **more}

    if "torch" in by:
        judge("step_vs_torch_checkpoint", zo["step_ms"] / by["torch"]["step_ms"], 1.05, True)
        if "zo_half" in by:
            judge("half_step_vs_torch_checkpoint", by["zo_half"]["step_ms"] / by["torch"]["step_ms"], 1.05, True)
        zos = [r for r in (zo, by.get("zo_half")) if r and r.get("longest_seq")]
        torches = [r for r in (by["torch"], by.get("torch_half")) if r and r.get("longest_seq")]
        if zos and torches:
            z, t = max(zos, key=lambda r: r["longest_seq"]), max(torches, key=lambda r: r["longest_seq"])
            judge("longest_seq_vs_torch_checkpoint", z["longest_seq"] / t["longest_seq"], 2.0, False,
                  providers=f"{z['provider']} / {t['provider']}")  # fmt: skip
            # a search cut short found a lower bound: torch's makes the ratio an upper bound (not judged met),
            # zo's a lower bound (met only if already past the bar)
            if not t.get("longest_seq_search_ended", True):
                out["longest_seq_vs_torch_checkpoint"].update(met=False, note="torch's search was cut short: the "
                                                              "ratio is at most this")  # fmt: skip
            elif not z.get("longest_seq_search_ended", True):
                out["longest_seq_vs_torch_checkpoint"]["note"] = "zo's search was cut short: the ratio is at least this"
    if "save_on_cpu" in by:
        judge("step_vs_save_on_cpu", zo["step_ms"] / by["save_on_cpu"]["step_ms"], 1.0, True)
    if "torch_offload" in by:  # (not the issue's: transformers 5's offloaded checkpoint, the nearest rival)
        judge("step_vs_torch_offload", zo["step_ms"] / by["torch_offload"]["step_ms"], 1.0, True)
    if "checkpoint_allocations_per_step" in zo:
        judge("checkpoint_allocations_per_step", zo["checkpoint_allocations_per_step"], 0.0, True)
    return out


def scale_line(r: dict) -> str:
    """One scale row (bench/scale_check.py) as text: the figures beside the planner's, the mismatches."""
    if r.get("tflops") is None:
        return f"scale {r.get('setting')}: {r.get('error') or 'no step finished'}"
    gib = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    return (f"scale {r['setting']}: {r['params'] / 1e9:.2f}B params (planner {r['planner_params'] / 1e9:.2f}B), "
            f"{r['tokens_per_s']:.0f} tokens/s, {r['tflops']:.1f} TFLOPS = {r['mfu']:.0%} of the measured matmul"
            + (f" ({r['mfu_peak']:.0%} of the datasheet's peak)" if r.get("mfu_peak") else "")
            + f", peak {gib(r['peak_gib'])} GiB (planner {gib(r.get('planner_peak_gib'))}), host "
            f"{gib(r['host_gib'])} GiB (planner {gib(r.get('planner_host_gib'))}), loss {r['loss_first']:.3f} -> "
            f"{r['loss_last']:.3f}" + (f" (held-out {r['held_out_losses'][0]:.3f} -> {r['held_out_losses'][-1]:.3f})"
                                       if r.get("held_out_losses") else "")
            + (f"; MISMATCH {'; '.join(r['mismatch'])}" if r.get("mismatch") else "")
            + (f"; {describe_probes(r['update_probe'])}" if r.get("update_probe") else "")
            + (f"; {r['error']}" if r.get("error") else ""))  # fmt: skip


def describe_probes(probes: list[dict]) -> str:
    """bench/update_probe.py's probes as one phrase: the step whose move over lr came closest to (or past) its
    bound, and what went past it over all of them (scale_check's progress line gives one step's, scale_line a
    run's)."""
    if not probes:
        return ""
    worst = max(probes, key=lambda p: p["update_over_lr"] / p["update_bound"])
    beyond = sum(len(p["beyond_bound"]) for p in probes)
    mismatched = sum(p.get("writeback_mismatches", 0) for p in probes)
    text = f"masters moved <= {worst['update_over_lr']:.2f} x lr (bound {worst['update_bound']:.2f})"
    if beyond or mismatched:
        text += f": UPDATE PROBE {beyond} windows beyond the bound, {mismatched} device values not the masters' cast"
    return text


def _cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def host_info(root: str = "/") -> dict:
    """The host CPU the step rows ran on: model, logical CPUs this process may use, how many of them share a physical
    core (SMT siblings: an update thread on one slows a launching thread on the other), physical cores among them,
    NUMA nodes, the cgroup's CPU quota, whether AVX-512 is there. None for what this system does not say."""
    import os

    def text(path: str) -> str | None:
        try:
            with open(os.path.join(root, path.lstrip("/"))) as f:
                return f.read()
        except OSError:
            return None

    cpuinfo = text("/proc/cpuinfo") or ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 None)  # fmt: skip
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") and root == "/" else None
    if cpus is None:
        online = text("/sys/devices/system/cpu/online")
        cpus = sorted(_cpu_list(online)) if online else []
    cores, per_core = set(), []
    for c in cpus:
        sib = text(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        if sib is None:
            cores, per_core = set(), []
            break
        group = frozenset(_cpu_list(sib))
        cores.add(group)
        per_core.append(len(group))
    nodes = text("/sys/devices/system/node/online")
    quota = (text("/sys/fs/cgroup/cpu.max") or "").split()  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
    if not quota:  # cgroup v1: the quota in its own file, -1 for none
        v1 = [(text(f"/sys/fs/cgroup/cpu/cpu.cfs_{k}_us") or "").strip() for k in ("quota", "period")]
        quota = ["max" if v1[0] == "-1" else v1[0], v1[1]] if all(v1) else []
    return {
        "cpu_model": model,
        "cpus": len(cpus) or None,
        "threads_per_core": max(per_core) if per_core else None,
        "physical_cores": len(cores) or None,
        "numa_nodes": len(_cpu_list(nodes)) if nodes else None,
        "cgroup_cpus": int(quota[0]) / int(quota[1]) if len(quota) == 2 and quota[0] != "max" else None,
        "avx512": "avx512f" in flags,
    }


def _host() -> dict:
    """host_info(), or what stopped it: a system that reads differently never costs the run its summary."""
    try:
        return host_info()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def summary_json(outdir: str, device: str = "", commit: str = "", date: str = "") -> dict:
    """summary.json: {"device", "date", "commit", "host" (host_info), "pack": [...], "step": [...], "anchors": [...],
    "scale": [...], "targets": {...}}. pack: bench/summary_pack.py's pack_rows over OUTDIR/bench-pack.json (and
    pack_host: the host time per call); step: OUTDIR/step.json (bench/step_rows.py); anchors: OUTDIR/anchors.json
    (bench/anchors.py); activations: OUTDIR/activations.json (bench/activation_rows.py), judged by
    activation_targets; scale: OUTDIR/scale.json (bench/scale_check.py, gpu_check.sh's scale mode)."""
    import datetime
    import os

    def read(name: str) -> list:
        try:
            with open(os.path.join(outdir, name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return []

    try:
        with open(os.path.join(outdir, "bench-pack.json")) as f:
            bench_pack = json.load(f)
    except (OSError, ValueError):
        bench_pack = {}
    pack = pack_rows(bench_pack)
    step = read("step.json")
    activations = read("activations.json")
    return {
        "device": device,
        "date": date or datetime.date.today().isoformat(),
        "commit": commit,
        "host": _host(),
        "pack": pack,
        "pack_host": host_row(bench_pack),
        "step": step,
        "anchors": read("anchors.json"),
        "activations": activations,
        "scale": read("scale.json"),
        "targets": {"step": step_targets([r for r in step if "targets" in r]),
                    "activations": activation_targets(activations)},
    }


def main(paths: list[str]) -> int:
    if paths[:1] == ["--summary-json"] and len(paths) >= 2:
        import os

        outdir = paths[1]
        env = os.environ
        data = summary_json(outdir, env.get("ZO_DEVICE", ""), env.get("ZO_COMMIT", ""), env.get("ZO_DATE", ""))
        with open(os.path.join(outdir, "summary.json"), "w") as f:
            json.dump(data, f, indent=1)
        for r in data["step"]:
            if "zo_ms" not in r:
                print(f"  step {r.get('size')}: {r.get('error') or r.get('skipped')}")
                continue
            peak = f", peak {r['zo_peak_gib']:.2f} vs {r['torch_peak_gib']:.2f} GiB" if r.get("zo_peak_gib") else ""
            twin = f" gpu_fraction {r['gpu_fraction']:.3f}" if r.get("gpu_fraction") else ""
            twin += f" {r['state_dtype']} moments" if r.get("state_dtype", "fp32") != "fp32" else ""
            alone = {k: "-" if r.get(k) is None else f"{r[k]:.1f}" for k in ("cpu_adam_ms", "d2h_ms")}
            print(f"  step {r['params'] / 1e6:.0f}M {r['mode']}{twin}: zo {r['zo_ms']:.1f} ms, "
                  f"fwd+bwd {r['fwd_bwd_ms']:.1f}, CPU Adam {alone['cpu_adam_ms']}, D2H {alone['d2h_ms']}, "
                  f"torch fused {r['torch_fused_ms']:.1f}{peak}")  # fmt: skip
        for r in data["anchors"]:
            ms = f"{r['ms']:.1f} ms, peak {r['peak_gib']} GiB, host {r['host_gib']:.2f} GiB" if r.get("ms") else ""
            print(f"  anchor {r.get('system')}: {ms} {r.get('note', '')}"[:300])
        for r in data["scale"]:
            print("  " + scale_line(r))
        for name, t in data["targets"]["step"].items():
            bar = f"{'>=' if t.get('at_least') else '<='} {t['bar']}"
            print(f"  target {name}: worst {t['value']:.3f} (bar {bar}): {'MET' if t['met'] else 'MISSED'}")
        for r in data["activations"]:
            if "us_per_block" in r:
                print("  activations host time per block: " + ", ".join(
                    f"{n} {v:.1f} us" for n, v in r["us_per_block"].items()) + f" (zo above torch's checkpoint "
                    f"{r['zo_over_torch_us']:.1f} us, resident {r['zo_resident_over_torch_us']:.1f})")  # fmt: skip
                continue
            if "step_ms" not in r:
                wide = " (wide)" if r.get("shape") == "wide" else ""
                print(f"  activations {r.get('provider')}{wide}: {r.get('error')}")
                continue
            peak = f", peak activations {r['peak_activation_gib']:.2f} GiB" if "peak_activation_gib" in r else ""
            longest = f", longest seq {r['longest_seq']}" if r.get("longest_seq") else ""
            shape = "" if r.get("shape", "main") == "main" else f" ({r['shape']}: {r['layers']} x {r['hidden']})"
            print(f"  activations {r['provider']}{shape} seq {r['seq']}: {r['step_ms']:.1f} ms{peak}{longest}")
        for name, t in data["targets"]["activations"].items():
            print(f"  target activations {name}: {t['value']:.3f} (bar {t['bar']}): {'MET' if t['met'] else 'MISSED'}")
        print(f"{outdir}/summary.json: {len(data['pack'])} pack, {len(data['step'])} step, "
              f"{len(data['anchors'])} anchor, {len(data['activations'])} activation, "
              f"{len(data['scale'])} scale rows")  # fmt: skip
        return 0
    if not paths:
        print(__doc__.strip().splitlines()[2])
        return 2
    groups, machines = load(paths)
    print("\n".join(machines))
    for group, by_provider in groups.items():
        print("\n".join(group_lines(group, by_provider)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
