"""The dashboard given several suites' JSON files: every suite drawn, every chart's labels inside its picture."""

import json
import re
import shutil
import subprocess

import pytest

from zo_kernels.dashboard import render

SUITES = {"cpu_adam fp32": ("torch_fused", "zo"), "writeback": ("kernel", "pipeline"), "nvme update": ("ceiling", "zo")}


def suite_file(path, op, providers, when):
    """One pytest-benchmark JSON file of one suite: two sizes per provider."""
    benches = [{"group": f"{op} n={n}", "name": f"test[{p}-{n}]", "stats": {"min": 1e-3 * (i + 1) * n / 1e6},
                "extra_info": {"provider": p, "numel": n, "bytes": 28 * n}}
               for i, p in enumerate(providers) for n in (1_000_000, 10_000_000)]  # fmt: skip
    path.write_text(json.dumps({"datetime": when, "machine_info": {}, "benchmarks": benches}))
    return path


def three_suites(tmp_path):
    return [suite_file(tmp_path / f"s{i}.json", op, ps, f"2026-11-2{i}T10:00:00") for i, (op, ps)
            in enumerate(SUITES.items())]  # fmt: skip


def test_every_suite_is_drawn(tmp_path):
    """Before: only the last file's op had a section."""
    page = render(three_suites(tmp_path))
    for op in SUITES:
        assert f"<h2>{op}</h2>" in page, op
    assert page.count("<section>") == 3 and page.count("<svg") == 6


def test_history_ticks_stay_inside_the_svg(tmp_path):
    """Each op's history chart puts "run k" inside the picture (before: "run 1" was drawn at a negative x when the
    op was in a later file only)."""
    page = render(three_suites(tmp_path))
    for svg in re.findall(r"<svg.*?</svg>", page):
        width = float(re.search(r'width="([\d.]+)"', svg)[1])
        for x, label in re.findall(r'<text x="([-\d.]+)"[^>]*>(run \d+)</text>', svg):
            half = 4 * len(label)  # at most ~8 px per character at 11 px, centred on x
            assert half <= float(x) <= width - half, (x, label)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# measures, in the browser, every <text> of every chart against its <svg>, and writes the offenders into the DOM
_PROBE = """<script>
addEventListener('load', () => {
  const bad = [];
  for (const svg of document.querySelectorAll('svg')) {
    const box = svg.getBoundingClientRect();
    for (const t of svg.querySelectorAll('text')) {
      const r = t.getBoundingClientRect();
      if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 || r.bottom > box.bottom + 0.5)
        bad.push(t.textContent);
    }
  }
  document.body.setAttribute('data-outside', JSON.stringify(bad));
  document.body.setAttribute('data-svgs', String(document.querySelectorAll('svg').length));
});
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install -y chromium)")
def test_in_chromium_every_label_is_inside_its_chart(tmp_path):
    page = render(three_suites(tmp_path)).replace("</body>", _PROBE + "</body>")
    out = tmp_path / "probe.html"
    out.write_text(page)
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--virtual-time-budget=5000",
             f"--user-data-dir={tmp_path / 'prof'}"]  # fmt: skip
    dom = subprocess.run([*flags, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=300).stdout
    svgs = re.search(r'data-svgs="(\d+)"', dom)
    assert svgs and int(svgs[1]) == 6, dom[-500:]
    outside = json.loads(re.search(r"data-outside=\"([^\"]*)\"", dom)[1].replace("&quot;", '"'))
    assert outside == [], outside
