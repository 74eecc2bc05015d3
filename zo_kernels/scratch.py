"""Scratch directories for files that live as long as their process: locked while in use, reclaimed after.

Each process gets `<root>/zo-nvme-<pid>-<random>/` holding a `lock` file under an exclusive flock for its
whole life. The kernel drops the flock when the process dies, however it dies (SIGKILL included), so the next
ScratchDir on the same root finds the lock free and removes the directory. A directory is locked before it
gets its final name: one being created is named `.zo-nvme-new-<pid>-...` and is removed only once that pid is
gone. (A child forked with the lock file open keeps the lock until it exits; only the process that made the
directory removes it.)
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from typing import Any

PREFIX = "zo-nvme-"
_NEW = ".zo-nvme-new-"
LOCK = "lock"


def _locked(path: str) -> bool:
    """Whether a live process holds the lock of scratch directory `path`."""
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # a final name is given only after locking: no lock file means its owner is gone
    except OSError:
        return True  # unreadable: not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock if we got it
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim(root: str) -> list[str]:
    """Remove the scratch directories under `root` whose owner has died; returns their paths."""
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if name.startswith(PREFIX):
            dead = not _locked(path)
        elif name.startswith(_NEW):
            pid = name[len(_NEW) :].split("-", 1)[0]
            dead = pid.isdigit() and not _pid_alive(int(pid))
        else:
            continue
        if dead:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def check_dir(root: Any, name: str = "nvme_dir") -> str:
    """`root` as a str: an existing, writable directory (the error names `name`)."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path, got {type(root).__name__}")
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise ValueError(f"{name} {root!r} is not an existing directory")
    if not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {root!r} is not writable")
    return root


class ScratchDir:
    """A directory of this process's scratch files under `root`, leftovers of dead processes removed first.

    Args:
        root: an existing, writable directory.
    """

    def __init__(self, root: str) -> None:
        root = check_dir(root)
        self.reclaimed = reclaim(root)
        self.owner = os.getpid()  # (a forked child holds a copy of this object and of the lock: not the files)
        self._lock: int | None = None
        tmp = tempfile.mkdtemp(prefix=f"{_NEW}{self.owner}-", dir=root)
        try:  # (a full disk when the pid is written, say: the half-made directory and its descriptor go)
            self._lock = os.open(os.path.join(tmp, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            os.write(self._lock, f"{self.owner}\n".encode())
            self.path = os.path.join(root, PREFIX + os.path.basename(tmp)[len(_NEW) :])
            os.rename(tmp, self.path)
        except BaseException:
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def close(self) -> None:
        """Remove the directory and its files, then drop the lock; in a forked child only its copy of the lock's
        descriptor is closed (the parent's directory stays, its lock held by the parent)."""
        if self._lock is None:
            return
        if os.getpid() == self.owner:
            shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)
        self._lock = None
