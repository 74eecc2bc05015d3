"""save_checkpoint killed (SIGKILL) or out of disk: the last checkpoint survives, nothing is left behind (issue 19)."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from zo_kernels import checkpoint_io, load_checkpoint, save_checkpoint


def _model(width: int = 700) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(width, width)  # ~2 MB: a save takes long enough for kills to land inside it


def _temps(d: Path) -> list[Path]:
    return sorted(d.glob(".ckpt.pt.*.tmp"))


def test_sigkill_during_save_leaves_nothing_after_the_next_save(tmp_path):
    path = tmp_path / "ckpt.pt"
    model = _model()
    save_checkpoint(path, model, step=0)
    rng, leftovers = random.Random(0), 0
    for kill in range(40):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child saves in a loop until it is killed
            os.close(r)
            torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP thread pools
            try:
                os.write(w, b"x")
                for i in range(10**6):
                    save_checkpoint(path, model, step=i + 1)
            finally:
                os._exit(1)
        os.close(w)
        os.read(r, 1)
        os.close(r)
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)  # reaped: its pid is gone
        leftovers += bool(_temps(tmp_path))
        if kill % 2:
            save_checkpoint(path, model, step=-1)  # the next save reclaims the dead writer's temp files
        else:
            load_checkpoint(path, _model())  # so does the next load (the last checkpoint is whole)
        assert _temps(tmp_path) == [], f"after kill {kill}: {_temps(tmp_path)}"
        if leftovers >= 3:
            break
    assert leftovers >= 1, "no kill landed inside a save: the test proved nothing"


def test_a_live_writers_temp_file_is_kept(tmp_path):
    path = tmp_path / "ckpt.pt"
    live = tmp_path / f"{checkpoint_io._temp_prefix(path)}abc.tmp"  # this process's: alive
    live.write_bytes(b"partial")
    foreign = tmp_path / ".ckpt.pt.otherhost.1.abc.tmp"  # another host's: its writer may be alive
    foreign.write_bytes(b"partial")
    save_checkpoint(path, _model(4))
    assert live.exists() and foreign.exists()


def test_disk_full_says_so_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _model(4), step=1)
    before = path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_io.os, "fsync", full)
    with pytest.raises(OSError, match="no space left.*the last checkpoint .* is intact") as e:
        save_checkpoint(path, _model(4), step=2)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert path.read_bytes() == before and _temps(tmp_path) == []


def test_disk_full_on_a_real_small_filesystem(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        path = mnt / "ckpt.pt"
        save_checkpoint(path, _model(4), step=1)
        before = path.read_bytes()
        with pytest.raises(OSError, match="no space left.*the last checkpoint .* is intact"):  # torch says only
            save_checkpoint(path, _model(400), step=2)  # "enforce fail ... unexpected pos"
        assert path.read_bytes() == before and _temps(mnt) == []
        assert load_checkpoint(path, _model(4)) == {"step": 1}
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
