"""check_memory's read-only check peeks at no memory that may fault.

It looks for the header of a Python bytes object in front of a foreign buffer. On the first GPU run that peek read
the end of the mapping in front of a pinned block (cudaHostAlloc'd memory right after a driver mapping) and the
process died with SIGSEGV. Here the mapping in front is a file mapped past its end (a read there raises SIGBUS), so
the old peek kills the process on a CPU too: the call runs in a subprocess."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc/self/maps and mmap(2)")

PROGRAM = textwrap.dedent("""
    import ctypes, mmap, os, sys
    import torch
    from zo_kernels import cpu_adam_step

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    page = mmap.PAGESIZE
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    base = libc.mmap(None, 3 * page, rw, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)  # empty: every page of its mapping is past its end
    MAP_FIXED = 0x10  # Linux's value; Python's mmap module does not name it
    got = libc.mmap(base, 2 * page, rw, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
    assert got == base, ctypes.get_errno()
    buf = (ctypes.c_uint8 * page).from_address(base + 2 * page)  # anonymous, writable, right after that mapping
    out = torch.frombuffer(buf, dtype=torch.bfloat16)  # foreign memory: its storage is not resizable
    n = out.numel()
    p, g = torch.ones(n), torch.full((n,), 0.5)
    m, v = torch.zeros(n), torch.zeros(n)
    cpu_adam_step(p, g, m, v, step=1, lr=0.1, param_out=out)
    assert torch.equal(out, p.bfloat16()), "param_out does not hold the new params"
    print("ok")
""")


def test_readonly_check_never_reads_a_mapping_that_faults(tmp_path):
    r = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "empty")], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", (
        f"exit {r.returncode} (negative: killed by that signal)\n{r.stdout}\n{r.stderr[-2000:]}")


def test_readonly_check_still_refuses_bytes_and_readonly_mappings(tmp_path):
    import warnings

    import numpy as np
    import torch

    from zo_kernels import cpu_adam_step

    n = 1024
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = torch.frombuffer(bytes(4 * n), dtype=torch.float32)  # small and large bytes objects live in
        large = torch.frombuffer(bytes(4 << 20), dtype=torch.float32)[:n]  # different allocators
    path = tmp_path / "ro.bin"
    path.write_bytes(np.zeros(n, dtype=np.float32).tobytes())
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r", shape=(n,)))
    for ro, where in ((small, "bytes object"), (large, "bytes object"), (mapped, "mapped r")):
        p, g, v = torch.ones(n), torch.full((n,), 0.5), torch.zeros(n)
        with pytest.raises(ValueError, match=f"exp_avg is read-only memory .*{where}"):
            cpu_adam_step(p, g, ro, v, step=1, lr=0.1)
        assert torch.equal(p, torch.ones(n)) and not v.any()


def test_pinned_memory_is_not_parsed_per_call(monkeypatch):
    """The offload step writes pinned staging once per run or landed tile (39 kernel calls a step for the 95M GPT's
    selective update): each call parsed /proc/self/maps, milliseconds in a CUDA process. Pinned memory is writable by
    construction: never parsed. (No pinned memory without CUDA: is_pinned is stubbed for a foreign buffer.)"""
    import ctypes

    import torch

    from zo_kernels import cpu_adam, cpu_adam_step

    n = 1024
    buf = (ctypes.c_uint8 * (2 * n)).from_buffer(bytearray(2 * n))
    out = torch.frombuffer(buf, dtype=torch.bfloat16)  # foreign memory (not resizable), as the pinned pool's blocks
    parsed = []
    monkeypatch.setattr(cpu_adam, "_readonly", lambda *a: parsed.append(a))
    p, g, m, v = torch.ones(n), torch.full((n,), 0.5), torch.zeros(n), torch.zeros(n)
    cpu_adam_step(p, g, m, v, step=1, lr=0.1, param_out=out)
    k = len(parsed)
    assert k >= 1, "foreign memory that is not pinned is checked"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: self.data_ptr() == out.data_ptr())
    cpu_adam_step(p, g, m, v, step=2, lr=0.1, param_out=out)
    assert len(parsed) == k, "pinned memory was checked again"
    assert torch.equal(out, p.bfloat16())
