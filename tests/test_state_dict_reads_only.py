"""state_dict() between steps changes nothing when the model was not written: a run that saves every step trains the
same bits as one that never saves, in every configuration whose update keeps state apart from the parameters (DPU's
pending writeback, stage 3's shards, gpu_fraction's tail, NVMe files, compressed moments, Adafactor; the GPU-shaped
transport: device buffers of their own, late copies, the new parameters over the gradients). Not `selective`: its
state_dict() closes the open window by design (README: read the state at checkpoints).

Since 2026-11-27 state_dict() compares the parameters with the masters' cast and takes the model's values where they
differ (weights loaded into the model since the last update: HF Trainer's resume under accelerate). Where some state
legitimately differs from the parameters' cast between steps, that compare would overwrite fp32 masters with 16-bit
values; this test would see it.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from helpers import digest
from offload_ref import make_data, make_model

import zo_kernels as zk
from zo_kernels.transport import CopyEngineTransport

CASES = {
    "sync": {},
    "dpu0": dict(delay_update_after=0),
    "dpu1-fp32": dict(delay_update_after=1, dtype=torch.float32),
    "gpu-shaped-sync": dict(transport="copy_engine"),
    "gpu-shaped-dpu": dict(transport="copy_engine", delay_update_after=0),
    "gpu-shaped-stage3-dpu": dict(transport="copy_engine", stage=3, delay_update_after=0),
    "stage3-cpu-dpu": dict(stage=3, offload_param="cpu", delay_update_after=0),
    "gpu_fraction-dpu": dict(gpu_fraction=0.5, delay_update_after=0),
    "nvme-dpu": dict(offload_optimizer="nvme", delay_update_after=0),
    "8bit-dpu": dict(state_dtype="8bit", delay_update_after=0),
    "adafactor-dpu": dict(adafactor=True, delay_update_after=0),
}


def _train(kw: dict, save_every_step: bool) -> str:
    kw = dict(kw)
    model = make_model(seed=0)
    with tempfile.TemporaryDirectory() as scratch:
        if kw.get("offload_optimizer") == "nvme":
            kw["nvme_dir"] = scratch
        if kw.get("stage") == 3:
            kw["module"] = model
        cls = zk.ZeroOffloadAdafactor if kw.pop("adafactor", False) else zk.ZeroOffloadAdamW
        transport = kw["transport"] = CopyEngineTransport(delay_s=0.002) if kw.get("transport") else None
        kw.setdefault("dtype", torch.bfloat16)
        opt = cls(model, lr=3e-3, weight_decay=0.01, bucket_numel=50_000, **kw)
        try:
            for step in make_data(5, batch=4, seed=2):
                x = step[0]
                opt.backward(model(x[:, :-1], x[:, 1:]))
                opt.step()
                if save_every_step:
                    opt.state_dict()
            sd = opt.state_dict()
            opt.synchronize()
            with opt.gathered():
                params = [p.detach().clone() for p in model.parameters()]
        finally:
            opt.close()
            if transport is not None:
                transport.close()
    tensors = [t for st in sd["state"].values() for t in st.values() if isinstance(t, torch.Tensor)]
    return digest(*tensors, *params)


@pytest.mark.parametrize("name", list(CASES))
def test_saving_every_step_trains_the_same_bits(name):
    assert _train(CASES[name], True) == _train(CASES[name], False)
