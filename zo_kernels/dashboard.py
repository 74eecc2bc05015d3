"""`zo-kernels dashboard`: pytest-benchmark JSON runs -> one self-contained HTML page (inline SVG, no scripts,
nothing fetched at view time). Per op: the metric against size for each provider, the ratio to torch and
to the streaming ceiling, and the history of each provider across the given runs."""

from __future__ import annotations

import html
import json
import math
import re
from collections import defaultdict
from pathlib import Path

# as bench/summary.py's: a group's ratios are against the first baseline and the first ceiling present
BASELINES = ("torch_fused", "torch", "torch_ref", "kernel", "reference", "pageable")
CEILINGS = ("ceiling", "copy", "torch_pinned")
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f")
_SIZE_TOKEN = re.compile(r"\s*\b(n|params)=[^\s]+")


def load_run(path: Path) -> dict:
    """A pytest-benchmark JSON file, checked for the fields the dashboard reads."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ValueError(f"{path}: not pytest-benchmark output (no 'benchmarks' list)")
    for key, kind in (("datetime", str), ("machine_info", dict)):
        if key in data and not isinstance(data[key], kind):
            raise ValueError(f"{path}: {key} must be a {kind.__name__}, got {type(data[key]).__name__}")
    for key, kind in (("zo", dict), ("cpu", dict)):
        value = data.get("machine_info", {}).get(key)
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"{path}: machine_info.{key} must be a {kind.__name__}, got {type(value).__name__}")
    for i, b in enumerate(data["benchmarks"]):
        where = f"{path}: benchmarks[{i}]"
        if not isinstance(b, dict):
            raise ValueError(f"{where} must be an object, got {type(b).__name__}")
        for key, kind in (("stats", dict), ("extra_info", dict), ("group", str), ("name", str)):
            if b.get(key) is not None and not isinstance(b[key], kind):
                raise ValueError(f"{where}.{key} must be a {kind.__name__}, got {type(b[key]).__name__}")
        provider = (b.get("extra_info") or {}).get("provider")
        if provider is not None and not isinstance(provider, str):
            raise ValueError(f"{where}.extra_info.provider must be a str, got {type(provider).__name__}")
        numbers = [("stats", k, (b.get("stats") or {}).get(k)) for k in ("min", "median")]
        numbers += [("extra_info", k, (b.get("extra_info") or {}).get(k)) for k in ("numel", "bytes")]
        for part, key, v in numbers:
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < 0 or (part == "stats" and v == 0)):  # fmt: skip
                raise ValueError(f"{where}.{part}.{key} must be a finite number > 0, got {v!r}")
    return data


def records(run: dict) -> list[dict]:
    """One record per benchmark: op, provider, size, best (minimum) seconds, metric value and unit.

    The minimum over rounds, as in the benchmark suites' own ratio tables: on a shared machine interference
    only adds time."""
    out = []
    for b in run["benchmarks"]:
        extra, stats = b.get("extra_info", {}), b.get("stats", {})
        median = stats.get("min") or stats.get("median")
        if not median or not b.get("group"):
            continue
        size = extra.get("numel") or 0
        nbytes = extra.get("bytes") or 0
        times = [(extra.get("provider", b.get("name", "?")), median)]
        timed = extra.get("providers_ms")  # providers the benchmark timed itself (pack: CUDA events per call)
        if isinstance(timed, dict) and all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                                           for v in timed.values()):  # fmt: skip
            times = [(str(p), ms / 1e3) for p, ms in timed.items()]
        for provider, seconds in times:
            out.append({
                "op": _SIZE_TOKEN.sub("", b["group"]).strip(),
                "provider": provider,
                "size": size,
                "median": seconds,
                "value": nbytes / seconds / 1e9 if nbytes else seconds * 1e3,
                "unit": "GB/s" if nbytes else "ms",
            })  # fmt: skip
    return out


def _fmt_size(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def _svg_chart(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, log_x: bool,
               xticks: list[tuple[float, str]] | None = None) -> str:  # fmt: skip
    """A line chart as inline SVG: one polyline (with points) per series."""
    w, h, left, right, top, bottom = 560, 300, 60, 150, 16, 44
    pts = [p for s in series.values() for p in s]
    if not pts:
        return "<p>no data</p>"
    fx = (lambda v: math.log10(max(v, 1e-12))) if log_x else float
    xs, ys = [fx(x) for x, _ in pts] + [fx(x) for x, _ in xticks or []], [y for _, y in pts]  # every tick inside
    x0, x1 = min(xs), max(xs)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    y1 = max(ys) * 1.1 or 1.0
    sx = lambda v: left + (fx(v) - x0) / (x1 - x0) * (w - left - right)  # noqa: E731
    sy = lambda v: top + (1 - v / y1) * (h - top - bottom)  # noqa: E731
    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img">',
             f'<rect x="{left}" y="{top}" width="{w - left - right}" height="{h - top - bottom}" fill="#fafafa" '
             'stroke="#999"/>']  # fmt: skip
    for i in range(5):
        v = y1 * i / 4
        y = f"{sy(v):.1f}"
        parts.append(f'<line x1="{left}" x2="{w - right}" y1="{y}" y2="{y}" stroke="#e3e3e3"/>')
        parts.append(f'<text x="{left - 6}" y="{sy(v) + 4:.1f}" text-anchor="end" font-size="11">{v:.3g}</text>')
    for xv, label in xticks or sorted({(x, _fmt_size(x)) for x, _ in pts}):
        parts.append(f'<text x="{sx(xv):.1f}" y="{h - bottom + 16}" text-anchor="middle" font-size="11">'
                     f"{html.escape(label)}</text>")  # fmt: skip
    parts.append(f'<text x="{(left + w - right) / 2}" y="{h - 6}" text-anchor="middle" font-size="12">'
                 f"{html.escape(xlabel)}</text>")  # fmt: skip
    parts.append(f'<text x="14" y="{(top + h - bottom) / 2}" font-size="12" text-anchor="middle" '
                 f'transform="rotate(-90 14 {(top + h - bottom) / 2})">{html.escape(ylabel)}</text>')  # fmt: skip
    for i, (name, s) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        s = sorted(s)
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
        parts.append(f'<polyline class="series" fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
        parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>' for x, y in s]
        parts.append(f'<text x="{w - right + 10}" y="{top + 14 + 16 * i}" font-size="12" fill="{color}">'
                     f"{html.escape(name)}</text>")  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def _op_section(op: str, latest: list[dict], history: list[tuple[str, list[dict]]]) -> str:
    unit = latest[0]["unit"]
    by_provider: dict[str, dict[float, dict]] = defaultdict(dict)
    for r in latest:
        by_provider[r["provider"]][r["size"]] = r
    sizes = sorted({r["size"] for r in latest})
    base_name = next((p for p in BASELINES if p in by_provider), None)
    ceil_name = next((p for p in CEILINGS if p in by_provider), None)
    chart = _svg_chart({p: [(s, r["value"]) for s, r in rs.items()] for p, rs in by_provider.items()},
                       "size (elements or parameters)", unit, log_x=True)  # fmt: skip
    head = "".join(f"<th>{html.escape(p)}</th>" for p in by_provider)
    rows = []
    for s in sizes:
        cells = []
        for p, rs in by_provider.items():
            r = rs.get(s)
            if r is None:
                cells.append("<td>-</td>")
                continue
            notes = []
            if base_name and s in by_provider[base_name] and p != base_name:
                notes.append(f"{r['median'] / by_provider[base_name][s]['median']:.2f}x time of {base_name}")
            if ceil_name and s in by_provider[ceil_name] and p != ceil_name:
                notes.append(f"{by_provider[ceil_name][s]['median'] / r['median']:.0%} of ceiling")
            note = f"<div class='note'>{html.escape('; '.join(notes))}</div>" if notes else ""
            cells.append(f"<td>{r['value']:.3g} {unit}{note}</td>")
        rows.append(f"<tr><th>{_fmt_size(s)}</th>{''.join(cells)}</tr>")
    table = f"<table class='ratios'><tr><th>size</th>{head}</tr>{''.join(rows)}</table>"
    # history: each provider at the largest size, one point per run
    top = sizes[-1]
    hist_series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    hist_rows = []
    for i, (label, recs) in enumerate(history):
        vals = {r["provider"]: r["value"] for r in recs if r["op"] == op and r["size"] == top}
        for p, v in vals.items():
            hist_series[p].append((i, v))
        cells = "".join(f"<td>{vals[p]:.3g}</td>" if p in vals else "<td>-</td>" for p in by_provider)
        hist_rows.append(f"<tr><th>{html.escape(label)}</th>{cells}</tr>")
    ticks = [(i, f"run {i + 1}") for i in range(len(history))]
    hist_chart = _svg_chart(dict(hist_series), f"run (size {_fmt_size(top)})", unit, log_x=False, xticks=ticks)
    hist_table = f"<table class='history'><tr><th>run</th>{head}</tr>{''.join(hist_rows)}</table>"
    return (f"<section><h2>{html.escape(op)}</h2><div class='row'><div>{chart}</div><div>{table}</div></div>"
            f"<h3>history across runs</h3><div class='row'><div>{hist_chart}</div><div>{hist_table}</div></div>"
            "</section>")  # fmt: skip


def render(paths: list[Path]) -> str:
    """The HTML page for these runs (oldest first; the last one is 'latest')."""
    if not paths:
        raise ValueError("no benchmark JSON given")
    gpu = [(p, load_gpu_summary(p)) for p in paths if is_gpu_summary(p)]
    paths = [p for p in paths if not is_gpu_summary(p)]
    if not paths:
        return _gpu_only_page(gpu)
    runs = [load_run(p) for p in paths]
    history = []
    for p, run in zip(paths, runs):
        label = f"{Path(p).name} ({run.get('datetime', '?')[:19]})"
        history.append((label, records(run)))
    if not any(recs for _, recs in history):
        raise ValueError(f"{paths[-1]}: no benchmark with a group and a median time")
    # every op of every run (several suites' files draw side by side), each from the latest run that has it
    ops: dict[str, list[dict]] = {}
    for _, recs in history:
        by_op: dict[str, list[dict]] = defaultdict(list)
        for r in recs:
            by_op[r["op"]].append(r)
        ops.update(by_op)
    machine = runs[-1].get("machine_info", {})
    zo = machine.get("zo", {})
    desc = ", ".join(f"{k} {v}" for k, v in zo.items() if v is not None) or machine.get("cpu", {}).get("brand_raw", "")
    sections = "".join(_op_section(op, recs, [(label, recs) for label, recs in history
                                              if any(r["op"] == op for r in recs)]) for op, recs in ops.items())
    sections += gpu_sections(gpu)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>zo_kernels benchmarks</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
h1 {{ margin-bottom: 4px; }} h2 {{ border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 32px; }}
.row {{ display: flex; flex-wrap: wrap; gap: 24px; align-items: flex-start; }}
table {{ border-collapse: collapse; font-size: 13px; }} th, td {{ border: 1px solid #ccc; padding: 4px 8px; }}
th {{ background: #f0f0f0; text-align: left; }} .note {{ color: #666; font-size: 11px; }}
.meta {{ color: #555; font-size: 13px; }}
</style></head><body>
<h1>zo_kernels benchmarks</h1>
<p class="meta">latest run: {html.escape(history[-1][0])}; {len(runs)} run(s); machine: {html.escape(desc)}</p>
<p class="meta">Times are the best of each benchmark's rounds. Ratios come from one run: "x time of"
divides by the baseline provider's time
(torch, or the bare kernel), "of ceiling" is the ceiling provider's time over this one's (a pass with the
same memory traffic). Figures measured on a machine without a GPU have no CUDA rows.</p>
{sections}
</body></html>
"""


# ---------------------------------------------------------------------- GPU summaries (bench/gpu_check.sh)


def is_gpu_summary(path: Path) -> bool:
    """A summary.json of bench/gpu_check.sh (bench/results/gpu-*.json), not a pytest-benchmark run."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "benchmarks" not in data and isinstance(data.get("step"), list)


def load_gpu_summary(path: Path) -> dict:
    """A GPU summary, checked for the lists the dashboard reads."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    for key in ("pack", "step", "anchors", "scale", "activations"):
        rows = data.get(key, [])
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{path}: {key} must be a list of objects")
    return data


def _text(v: object) -> str:
    """A value as a table shows it: floats to 4 digits, a target's {"met": ...} as MET/MISSED with its bars."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        head = [] if "met" not in v else ["MET" if v["met"] else "MISSED"]
        return "; ".join(head + [f"{k} {_text(x)}" for k, x in v.items() if k != "met"])
    return str(v)


def _cell(v: object) -> str:
    return f"<td>{html.escape(_text(v))}</td>"


def _rows_table(rows: list[dict], keys: list[str]) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(_cell(r.get(k)) for k in keys) + "</tr>" for r in rows)
    return f"<table class='ratios'><tr>{head}</tr>{body}</table>"


STEP_KEYS = ["params", "mode", "gpu_fraction", "state_dtype", "batch", "zo_ms", "fwd_bwd_ms", "cpu_adam_ms",
             "d2h_ms", "torch_fused_ms", "zo_peak_gib", "torch_peak_gib", "orchestration_of_step",
             "orchestration_isolated_of_step"]  # fmt: skip
ANCHOR_KEYS = ["system", "params", "ms", "tokens_per_s", "peak_gib", "host_gib", "note"]
SCALE_KEYS = ["setting", "params", "planner_params", "tokens_per_s", "tflops", "mfu", "mfu_peak", "peak_gib",
              "planner_peak_gib", "host_gib", "planner_host_gib", "loss_first", "loss_last", "adam_hidden", "mismatch",
              "error"]  # fmt: skip


def gpu_section(label: str, data: dict) -> str:
    """One GPU summary: its step rows (with their phases and targets), anchors, scale, activation and pack rows, and
    the pack's host time per call."""
    meta = f"{data.get('device', '?')}, {data.get('date', '?')}, commit {data.get('commit', '?')}"
    host = data.get("host") or {}
    if host.get("cpus"):  # (summaries since 2026-11-27 say which host CPU the step rows shared)
        smt = f", {host['threads_per_core']} threads per core" if host.get("threads_per_core") else ""
        meta += f"; host {host.get('cpu_model') or '?'}, {host['cpus']} CPUs{smt}"
    parts = [f"<section><h2>GPU: {html.escape(label)}</h2><p class='meta'>{html.escape(meta)}</p>"]
    if data.get("note"):
        parts.append(f"<p class='note'>{html.escape(str(data['note']))}</p>")
    step = [r for r in data.get("step", []) if "zo_ms" in r]
    if step:
        parts.append("<h3>train step</h3>" + _rows_table(step, STEP_KEYS))
        ids = ["params", "mode", "gpu_fraction", "batch"]  # (what tells two rows of one size and mode apart)
        phases = [{**{i: r.get(i) for i in ids}, **(r.get("phases") or {})} for r in step]
        keys = [*ids, *sorted({k for r in step for k in (r.get("phases") or {})})]
        if len(keys) > len(ids):
            parts.append("<h3>phases of the step (ms)</h3>" + _rows_table(phases, keys))
        targets = [{**{i: r.get(i) for i in ids}, "target": k, "value": t.get("value"), "bar": t.get("bar"),
                    "met": "MET" if t.get("met") else "MISSED"}
                   for r in step for k, t in (r.get("targets") or {}).items()]  # fmt: skip
        if targets:
            parts.append("<h3>targets</h3>" + _rows_table(targets, [*ids, "target", "value", "bar", "met"]))
    if data.get("anchors"):
        parts.append("<h3>anchors (same model, batch, dtype)</h3>" + _rows_table(data["anchors"], ANCHOR_KEYS))
    if data.get("scale"):
        rows = [{**r, "mismatch": "; ".join(r.get("mismatch") or []) or None} for r in data["scale"]]
        parts.append("<h3>scale: the largest model per setting, beside the planner</h3>"
                     + _rows_table(rows, SCALE_KEYS))  # fmt: skip
    if data.get("activations"):
        parts.append("<h3>activations (checkpointing, offloaded or not)</h3>"
                     + _any_rows([_profile_columns(r) for r in data["activations"]]))  # fmt: skip
    if data.get("pack"):
        parts.append("<h3>pack</h3>" + _any_rows(data["pack"]))
    if isinstance(data.get("pack_host"), dict):
        parts.append("<h3>pack: host time per call (64 tensors, plan reused; us)</h3>" + _any_rows([data["pack_host"]]))
    return "".join(parts) + "</section>"


def _profile_columns(row: dict) -> dict:
    """An activation row with its profiled step (bench/activation_rows.py --profile) as two columns: wall and
    device-busy ms per step (its gaps and runtime calls stay in the JSON); the host-overhead row without its
    function lists (in the JSON too)."""
    row = {k: v for k, v in row.items() if k != "profiled_top_us_per_block"}
    prof = row.get("profile")
    if not isinstance(prof, dict):
        return row
    rest = {k: v for k, v in row.items() if k != "profile"}
    return {**rest, "profiled_ms": prof.get("wall_ms"), "device_busy_ms": prof.get("busy_ms")}


def _any_rows(rows: list[dict]) -> str:
    """A table of rows whose keys vary by run: every key any row has, in order of appearance."""
    return _rows_table(rows, list(dict.fromkeys(k for r in rows for k in r)))


def gpu_sections(gpu: list[tuple[Path, dict]]) -> str:
    """The GPU summaries, newest first."""
    return "".join(gpu_section(Path(p).name, d) for p, d in sorted(gpu, key=lambda x: str(x[1].get("date")))[::-1])


def _gpu_only_page(gpu: list[tuple[Path, dict]]) -> str:
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'><title>zo_kernels GPU benchmarks</title>"
            "<style>body { font-family: system-ui, sans-serif; margin: 24px; } table { border-collapse: collapse; "
            "font-size: 13px; } th, td { border: 1px solid #ccc; padding: 4px 8px; } .meta, .note { color: #555; }"
            f"</style></head><body><h1>zo_kernels GPU benchmarks</h1>{gpu_sections(gpu)}</body></html>")
