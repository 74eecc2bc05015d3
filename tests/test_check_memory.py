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
        tiny = torch.frombuffer(bytes(256), dtype=torch.float32)  # bytes objects of every allocator: pymalloc,
        small = torch.frombuffer(bytes(4 * n), dtype=torch.float32)  # malloc's heap, its own mmap
        large = torch.frombuffer(bytes(4 << 20), dtype=torch.float32)[:n]
    path = tmp_path / "ro.bin"
    path.write_bytes(np.zeros(n, dtype=np.float32).tobytes())
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r", shape=(n,)))
    for ro, where in ((tiny, "bytes object"), (small, "bytes object"), (large, "bytes object"), (mapped, "mapped r")):
        n = ro.numel()
        p, g, v = torch.ones(n), torch.full((n,), 0.5), torch.zeros(n)
        with pytest.raises(ValueError, match=f"exp_avg is read-only memory .*{where}"):
            cpu_adam_step(p, g, ro, v, step=1, lr=0.1)
        assert torch.equal(p, torch.ones(n)) and not v.any()


def test_pinned_memory_is_not_parsed_per_call(monkeypatch):
    """The offload step writes pinned staging once per run or landed tile (39 kernel calls a step for the 95M GPT's
    selective update): each call parsed /proc/self/maps twice, milliseconds in a CUDA process. A pinned storage is
    parsed once, as a whole, then remembered. (No pinned memory without CUDA: is_pinned is stubbed for a foreign
    buffer.)"""
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
    for step in (2, 3, 4):
        cpu_adam_step(p, g, m, v, step=step, lr=0.1, param_out=out)
    assert len(parsed) == k + 1, f"pinned memory parsed {len(parsed) - k} times in 3 calls (once: its whole storage)"
    assert torch.equal(out, p.bfloat16())


def test_pinned_memory_still_refused_when_read_only(tmp_path, monkeypatch):
    """Page-locked memory can be read-only (cudaHostRegister with cudaHostRegisterReadOnly over a read-only mapping):
    a pinned storage is remembered only once found writable; before CUDA is initialized is_pinned is not asked."""
    import warnings

    import numpy as np
    import torch

    from zo_kernels import cpu_adam, cpu_adam_step

    n = 1024
    path = tmp_path / "ro.bin"
    path.write_bytes(np.zeros(n, dtype=np.float32).tobytes())
    with warnings.catch_warnings():  # (torch warns once per process that the array is not writable)
        warnings.simplefilter("ignore")
        ro = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r", shape=(n,)))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    for fn in ("adam_step", "adam_step_tiled"):  # a check that let it through fails here, not with SIGSEGV
        monkeypatch.setattr(cpu_adam._cpu, fn, lambda *a, **k: pytest.fail("read-only memory reached the kernel"))
    p, g, v = torch.ones(n), torch.full((n,), 0.5), torch.zeros(n)
    for _ in range(2):
        with pytest.raises(ValueError, match="exp_avg is read-only memory"):
            cpu_adam_step(p, g, ro, v, step=1, lr=0.1)
    assert torch.equal(p, torch.ones(n)) and not v.any()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: pytest.fail("is_pinned asked before CUDA init"))
    with pytest.raises(ValueError, match="exp_avg is read-only memory"):
        cpu_adam_step(p, g, ro, v, step=1, lr=0.1)


@pytest.mark.parametrize("refcnt, extra, nul, refused", [
    (0, 8, True, False), (1, -8, True, False), (1, 8, False, False), (1, 8, True, True),
], ids=["freed", "too-short", "no-trailing-nul", "looks-live"])  # fmt: skip
def test_a_stale_bytes_header_in_front_of_writable_memory_is_no_bytes_object(refcnt, extra, nul, refused):
    """Memory in front of a writable foreign buffer that reads as bytes' type, but not as a live bytes object holding
    the buffer (its reference count 0, as a freed one's; its size shorter than the buffer; no NUL where its size ends,
    as every bytes object has): the buffer is written. A fresh CI process once refused a write this way, naming a
    torch buffer an immutable bytes object (only the type was compared). A header with all four is taken for one."""
    import ctypes

    import torch

    from zo_kernels import cpu_adam_step

    n = 256
    mem = (ctypes.c_uint8 * (32 + 4 * n + 16))()  # writable heap memory: a fake header, the buffer, 16 bytes more
    word = ctypes.sizeof(ctypes.c_ssize_t)
    base = ctypes.addressof(mem)
    size = 4 * n + extra
    ctypes.c_ssize_t.from_address(base).value = refcnt
    ctypes.c_void_p.from_address(base + word).value = id(bytes)
    ctypes.c_ssize_t.from_address(base + 2 * word).value = size
    mem[32 + size] = 0 if nul else 7
    m = torch.frombuffer((ctypes.c_uint8 * (4 * n)).from_address(base + 32), dtype=torch.float32)  # not resizable
    m.zero_()
    p, g, v = torch.ones(n), torch.full((n,), 0.5), torch.zeros(n)
    if refused:
        with pytest.raises(ValueError, match="exp_avg is read-only memory"):
            cpu_adam_step(p, g, m, v, step=1, lr=0.1)
        return
    cpu_adam_step(p, g, m, v, step=1, lr=0.1)
    assert torch.equal(m, torch.full((n,), 0.05)), "exp_avg was not written"
