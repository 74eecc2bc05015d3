"""A process using the library exits cleanly: no thread of ours is left inside C++ when the interpreter finalizes.

A daemon thread still inside a torch copy (which releases the GIL) when the interpreter finalizes is stopped by
pthread_exit as it takes the GIL back; the unwind through C++ aborts the process with "terminate called without
an active exception" (SIGABRT): the two-process tests' abort at exit (issue 19). Each case runs in a fresh
interpreter that exits without closing what it made.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPTS = {
    # copies still queued on the copy-engine thread at exit (before the fix: 2 of 2 runs of this script aborted)
    "copy_engine_busy": """
        import torch
        from zo_kernels.transport import CopyEngineTransport
        t = CopyEngineTransport(delay_s=0.0)
        src = t.pool.take(1 << 22, torch.float32)
        dst = torch.empty(1 << 22)
        for _ in range(100):
            t.h2d(dst, src)
    """,
    # an optimizer over the copy-engine transport, mid-training under DPU, never closed (exited 0 before the fix too)
    "optimizer_dpu_not_closed": """
        import torch
        import zo_kernels as zk
        from zo_kernels.transport import CopyEngineTransport
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
        opt = zk.ZeroOffloadAdamW(model, dtype=torch.float32, delay_update_after=0, bucket_numel=4096,
                                  transport=CopyEngineTransport(delay_s=0.001))
        for _ in range(3):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
    """,
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_exit_without_close_is_clean(name: str) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPTS[name])], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, (proc.returncode, proc.stderr[-2000:])
