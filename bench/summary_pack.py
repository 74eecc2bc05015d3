"""The "pack" rows of gpu_check.sh's summary.json, from the bucket benchmark's pytest-benchmark JSON.

Usage: python bench/summary_pack.py OUTDIR/bench-pack.json   (prints the rows as JSON, then a table on stderr)
Each row: numel, tensors, align, zo_ms, copy_ms, torch_ref_ms (medians, same run), plus zo_pack_ms, of_copy
(copy_ms / zo_ms), vs_torch_ref (torch_ref_ms / zo_ms), GB/s, the timer and the device, the CUDA graph's and the
back-to-back figures where measured (the table's "b2b of copy"); and `target`: the issue-17
bar for that size (>= 85% of a copy at 100M elements, >= 60% at 10M, faster than torch_ref) and whether it was met.
Needs only the standard library.
"""

from __future__ import annotations

import json
import sys

TARGET_OF_COPY = {10_000_000: 0.60, 100_000_000: 0.85}
KEYS = ("numel", "tensors", "align", "zo_ms", "copy_ms", "torch_ref_ms", "zo_pack_ms", "of_copy", "vs_torch_ref",
        "zo_GBps", "copy_GBps", "timer", "device", "zo_graph_ms", "graph_of_copy", "zo_graph_error",
        "zo_back_to_back_ms", "copy_back_to_back_ms", "back_to_back_of_copy")  # fmt: skip
HOST_KEYS = ("cpu_path_us", "launch")  # with every host_us* key (host_us_pack_step was dropped when it was added)


def pack_rows(bench: dict) -> list[dict]:
    """Rows {numel, tensors, align, zo_ms, copy_ms, torch_ref_ms, ...} of the test_pack cases in a benchmark JSON."""
    rows = []
    for b in bench.get("benchmarks", []):
        info = b.get("extra_info", {})
        if not {"numel", "tensors", "align", "zo_ms", "copy_ms", "torch_ref_ms"} <= info.keys():
            continue
        row = {k: info[k] for k in KEYS if k in info}
        bar = TARGET_OF_COPY.get(row["numel"])
        if bar is not None and str(row.get("timer")) == "cuda events":
            row["target"] = {"min_of_copy": bar, "faster_than_torch_ref": True,
                             "met": row["copy_ms"] / row["zo_ms"] >= bar and row["zo_ms"] < row["torch_ref_ms"]}
        rows.append(row)
    return sorted(rows, key=lambda r: (r["numel"], -r["tensors"], r["align"]))


def host_row(bench: dict) -> dict | None:
    """The host time per pack call (64 tensors, plan reused), if the JSON has it."""
    for b in bench.get("benchmarks", []):
        info = b.get("extra_info", {})
        if "host_us" in info:
            return {k: v for k, v in info.items() if k.startswith("host_us") or k in HOST_KEYS}
    return None


def table(rows: list[dict]) -> str:
    """A plain-text table of the rows."""
    lines = [f"{'numel':>11} {'tensors':>7} {'align':>5} {'zo ms':>9} {'copy ms':>9} {'torch ms':>9} {'of copy':>8} "
             f"{'vs torch':>9} {'b2b of copy':>11}"]  # fmt: skip
    for r in rows:
        met = r.get("target", {}).get("met")
        verdict = "" if met is None else f"  {'MET' if met else 'MISSED'}"
        b2b = f"{r['back_to_back_of_copy']:>11.0%}" if r.get("back_to_back_of_copy") else f"{'-':>11}"
        lines.append(f"{r['numel']:>11} {r['tensors']:>7} {r['align']:>5} {r['zo_ms']:>9.3f} {r['copy_ms']:>9.3f} "
                     f"{r['torch_ref_ms']:>9.3f} {r['copy_ms'] / r['zo_ms']:>8.0%} "
                     f"{r['torch_ref_ms'] / r['zo_ms']:>8.2f}x {b2b}{verdict}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        bench = json.load(f)
    rows = pack_rows(bench)
    print(json.dumps({"pack": rows, "pack_host": host_row(bench)}, indent=1))
    print(table(rows), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
