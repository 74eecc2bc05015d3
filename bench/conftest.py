"""Benchmark session glue: machine info into the JSON, and a table of ratios measured in this run."""

import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))

from common import machine  # noqa: E402
from summary import BASELINES, CEILINGS, provider_times  # noqa: E402  (ratios against the first baseline/ceiling in a group)


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["zo"] = machine()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    benches = [b for b in getattr(session, "benchmarks", []) if b.stats is not None]
    if not benches:
        return
    groups = defaultdict(dict)
    for b in benches:
        groups[b.group][b.extra_info.get("provider", b.name)] = b
    tr = terminalreporter
    # Best-of-N: on a shared machine interference only ever adds time, so the minimum is the most repeatable
    # estimate of what the code does; pytest-benchmark's own table above shows medians and spreads too.
    tr.section("zo_kernels: ratios measured in this run (best of N rounds)")
    m = machine()
    tr.write_line(f"machine: {m['cpu']}, {m['cores']} cores, isa {m['isa']}, torch {m['torch']}, cuda {m['cuda']}")
    for group, by_provider in groups.items():
        rows = [(p, t, b) for name, b in by_provider.items()
                for p, t in provider_times(name, b.stats.min, b.extra_info)]  # fmt: skip
        best = {p: t for p, t, _ in rows}
        base = next((best[p] for p in BASELINES if p in best), None)
        ceil = next((best[p] for p in CEILINGS if p in best), None)
        tr.write_line(f"\n{group}")
        head = f"{'best ms':>11}{'GB/s':>9}{'x baseline':>12}{'of ceiling':>12}{'extra B/param':>15}"
        tr.write_line(f"  {'provider':<16}{head}")
        for name, t, b in rows:
            gbps = f"{b.extra_info['bytes'] / t / 1e9:.1f}" if b.extra_info.get("bytes") else "-"
            rel = f"{t / base:.2f}x" if base is not None else "-"
            of_ceil = f"{ceil / t:.0%}" if ceil is not None else "-"
            extra, n = b.extra_info.get("peak_extra_bytes"), b.extra_info.get("numel")
            extra = f"{extra / n:.2f}" if extra is not None and n else "-"
            tr.write_line(f"  {name:<16}{t * 1e3:>11.2f}{gbps:>9}{rel:>12}{of_ceil:>12}{extra:>15}")
            for key, v in b.extra_info.items():  # ratios a suite measured itself (e.g. stages: each vs stage 2)
                if key.startswith("ratio "):  # (measured by the suite its own way: its docstring says how)
                    tr.write_line(f"    {key[6:]:<44}{v:>6.2f}x  (the suite's own measure)")
        for name, b in by_provider.items():
            bar = b.extra_info.get("bar")
            ref = (bar.get("vs") if bar.get("vs") in best else next((p for p in BASELINES if p in best), None)
                   ) if bar else None  # fmt: skip
            if not bar or ref is None:
                continue
            t = best.get(name, b.stats.min)
            ratio = t / best[ref]
            ok = ratio <= bar["max_vs_baseline"]
            line = f"{name} {ratio:.2f}x {ref} (bar <= {bar['max_vs_baseline']}x)"
            if "min_of_ceiling" in bar and ceil is not None:
                frac = ceil / t
                ok = ok and frac >= bar["min_of_ceiling"]
                line += f", {frac:.0%} of ceiling (bar >= {bar['min_of_ceiling']:.0%})"
            tr.write_line(f"  bar: {line}: {'MET' if ok else 'MISSED'}")
