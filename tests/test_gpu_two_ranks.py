"""Two ranks on one GPU: NCCL refuses two ranks on one device, so two processes over gloo with CUDA tensors (the
model, the batches, the flat buffer and the buckets on the GPU; gloo moves the collectives through host memory),
stages 1, 2, 3 and 3 + offload_param="cpu", judged against the oracle (tests/oracle.py) run on the same device.

The oracle matrix's harness (tests/test_oracle_matrix.py: run_two_ranks, run_zo, check_case) runs the cases; a
DeviceCase only puts the case's model and batches on the device. Written without a GPU; on the H200 (2026-11-27,
sixth run, bench/gpu_session.sh) all 8 cases passed. Skipped without CUDA; ZO_TWO_RANK_DEVICE=cpu runs the same
body on the CPU.
"""

import dataclasses
import os

import pytest
import torch
from test_oracle_matrix import CASES, DTYPES, Case, check_case, run_oracle, run_two_ranks

DEV = torch.device(os.environ.get("ZO_TWO_RANK_DEVICE", "cuda"))
if DEV.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: none is visible here (bench/gpu_check.sh runs these on one; "
                "ZO_TWO_RANK_DEVICE=cpu runs the body on the CPU)", allow_module_level=True)  # fmt: skip

STAGES = ("1", "2", "3", "3+cpu")
# two-rank cases where every rank runs the same modules (stage 3 requires it), the first of each dtype
BASE = list({c.dtype: c for c in reversed([c for c in CASES if c.world == 2 and not c.unused])}.values())


@dataclasses.dataclass(frozen=True)
class DeviceCase(Case):
    """A case of the oracle matrix whose model and batches are on `device`."""

    device: str = "cpu"

    def model(self):
        return super().model().to(self.device)

    def batches(self):
        return [[[(x.to(self.device), y.to(self.device), branch, inject) for x, y, branch, inject in micro]
                 for micro in step] for step in super().batches()]  # fmt: skip


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def variants() -> list[DeviceCase]:
    """Each base case at each stage, on DEV, with the default transport (the CUDA one on a GPU)."""
    out = []
    for c in BASE:
        for s in STAGES:
            fields = {**dataclasses.asdict(c), "index": 2000 + len(out), "stage": s, "seed": c.index,
                      "transport": "host", "device": str(DEV)}  # fmt: skip
            out.append(DeviceCase(**fields))
    return out


_RESULTS: dict = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every variant in one launch of two gloo processes: variant index -> each rank's results (on the CPU)."""
    if not _RESULTS:
        vs = variants()
        # bounds under gpu_check's stage limit (60 s): a hang ends with the ranks' stacks and the cases finished
        join_s = float(os.environ.get("ZO_TWO_RANK_JOIN_S", "900"))
        # (a collective stuck on one rank times out before the launch's bound, so the other cases still run)
        got = run_two_ranks(vs, str(tmp_path_factory.mktemp("gpu_two_ranks")),
                            timeout_s=min(300.0, max(20.0, join_s - 8)), join_timeout_s=join_s)  # fmt: skip
        _RESULTS.update({v.index: (v, [_to_cpu(r) for r in got[v.index]]) for v in vs})
    return _RESULTS


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("base", BASE, ids=[f"c{c.index:02d}-{c.dtype}" for c in BASE])
def test_two_ranks_on_one_device_match_the_oracle(base, stage, results):
    (case, zo), = [(v, r) for v, r in results.values() if v.seed == base.index and v.stage == stage]
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(zo) if "error" in res]
    assert not errors, f"{case.id} on {DEV}: {errors[0]}"
    dtype = DTYPES[case.dtype]
    threads = torch.get_num_threads()
    torch.set_num_threads(zo[0]["threads"])  # the ranks' thread count (16-bit CPU kernels round by it)
    try:
        want = _to_cpu(run_oracle(case, dtype))
        other = _to_cpu(run_oracle(case, dtype, foreach=True, reverse_sums=True, nudge=True)
                        if dtype == torch.float32 else run_oracle(case, torch.float32))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    errors = check_case(case, zo, want, other)
    assert not errors, f"{case.id} on {DEV} ({case.describe()}):\n  " + "\n  ".join(errors[:12])
