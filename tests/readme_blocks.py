"""The README's ```python blocks, and what each needs: a block whose first line is a comment saying "needs a GPU",
"needs several processes" or "needs an NVMe drive" runs only where that exists; every other block runs on a CPU.

As a script, runs the blocks of one kind, each in a fresh process, and exits 1 if any fails:
    python tests/readme_blocks.py --gpu      (what bench/gpu_check.sh runs on a GPU machine)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
NEEDS = {"gpu": "needs a GPU", "processes": "needs several processes", "nvme": "needs an NVMe drive"}
TIMEOUT_S = 900  # a bound a loaded 2-core machine does not trip; a block takes seconds


@dataclass
class Block:
    """One ```python block: its first line number in the README, its code and what it needs (None: a CPU)."""

    line: int
    code: str
    needs: str | None

    @property
    def name(self) -> str:
        return f"README.md:{self.line}" + (f" ({self.needs})" if self.needs else "")


def blocks(readme: Path = README) -> list[Block]:
    """Every ```python block of the README, in order."""
    text = readme.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.S | re.M):
        code = m.group(1)
        first = code.splitlines()[0] if code.strip() else ""
        needs = next((k for k, words in NEEDS.items() if first.startswith("#") and words in first), None)
        out.append(Block(text.count("\n", 0, m.start()) + 2, code, needs))
    return out


def run(block: Block, cwd: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run one block as a script in a fresh process (under `launcher`, e.g. torchrun), in `cwd`, files in it."""
    script = Path(cwd) / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {**os.environ, "TMPDIR": cwd}
    return subprocess.run([*(launcher or [sys.executable]), str(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)  # fmt: skip


def run_in_namespaces(kind: str | None, out: str) -> None:
    """Run every block of one kind in this process, each in a fresh namespace and its own temporary directory as
    cwd and TMPDIR (torch is imported once: seconds per block instead of a process each); write
    {line: traceback or ""} as JSON to `out`."""
    import json
    import traceback

    results = {}
    home, root = os.getcwd(), tempfile.mkdtemp()
    for b in (b for b in blocks() if b.needs == kind):
        d = tempfile.mkdtemp(dir=root)
        os.chdir(d)
        os.environ["TMPDIR"], tempfile.tempdir = d, None
        try:
            exec(compile(b.code, b.name, "exec"), {"__name__": "__main__"})
            results[b.line] = ""
        except BaseException:  # noqa: B036 (a block's SystemExit or KeyboardInterrupt is its failure too)
            results[b.line] = traceback.format_exc()
        finally:
            os.chdir(home)
            os.environ["TMPDIR"], tempfile.tempdir = root, None
    shutil.rmtree(root, ignore_errors=True)
    Path(out).write_text(json.dumps(results), encoding="utf-8")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--cpu-json"]:
        run_in_namespaces(None, argv[1])
        return 0
    kind = {"--gpu": "gpu", "--cpu": None}.get(argv[0] if argv else "", "?")
    if kind == "?":
        print(__doc__.strip().splitlines()[-1])
        return 2
    failed = 0
    for b in (b for b in blocks() if b.needs == kind):
        with tempfile.TemporaryDirectory() as d:
            r = run(b, d)
        print(f"{b.name}: {'ok' if r.returncode == 0 else f'FAILED rc={r.returncode}'}")
        if r.returncode:
            failed += 1
            print(r.stdout[-3000:] + r.stderr[-3000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
