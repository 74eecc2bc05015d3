"""The oldest torch and Triton the project is checked with: below them, a clear refusal or the torch path."""

import subprocess
import sys
import types

import pytest
import torch

from zo_kernels import buckets, versions
from zo_kernels.kernels.plan import PackPlan
from zo_kernels.versions import MIN_TORCH, MIN_TRITON, check_torch, release, triton_too_old


def test_release_reads_local_and_dev_versions():
    assert release("2.6.0+cu124") == (2, 6) and release("3.6.0.dev20260101") == (3, 6) and release("2.13") == (2, 13)
    with pytest.raises(ValueError, match="version"):
        release("nightly")


def test_a_torch_older_than_the_oldest_checked_is_refused_in_one_line():
    with pytest.raises(ImportError, match=r"zo_kernels needs torch >= 2\.6, found 2\.4\.1"):
        check_torch("2.4.1")
    check_torch("2.6.0+cu124")
    check_torch("2.13.0+cpu")
    check_torch(torch.__version__)
    assert MIN_TORCH == (2, 6) and MIN_TRITON == (3, 6)


def test_importing_under_an_old_torch_fails_at_once_naming_the_versions():
    code = "import torch; torch.__version__ = '2.4.1'\nimport zo_kernels"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == "ImportError: zo_kernels needs torch >= 2.6, found 2.4.1"


@pytest.fixture
def old_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.2.0"))
    monkeypatch.setattr(versions, "_warned_fallback", False)
    versions.triton_problem.cache_clear()  # (asked once per process)
    yield
    versions.triton_problem.cache_clear()


def test_an_old_triton_sends_cuda_tensors_down_the_torch_path_with_one_warning(old_triton):
    assert triton_too_old("3.2.0") and triton_too_old("3.6.0") is None and triton_too_old("3.9.1") is None
    with pytest.warns(UserWarning, match=r"triton 3\.2\.0 is older than 3\.6.*torch path"):
        assert buckets._choose_impl(None, torch.device("cuda")) == "torch"
    assert buckets._choose_impl(None, torch.device("cuda")) == "torch"  # (warned once)
    # the launch plans the offload step packs with take the same path
    cuda_plan = PackPlan((4,), (torch.float32,), torch.float32, (0,), (4,), 4, torch.device("cuda"))
    assert cuda_plan.impl == "torch"


def test_impl_triton_under_an_old_triton_is_refused_naming_impl(old_triton, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"impl='triton': triton 3\.2\.0 is older than 3\.6"):
        buckets._choose_impl("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="impl='triton'"):
        buckets.cast(torch.ones(3), torch.bfloat16, impl="triton")
