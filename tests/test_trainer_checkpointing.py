"""HF Trainer with activation checkpointing and ZeroOffloadAdamW: TrainingArguments(activation_checkpointing=True)
(gradient_checkpointing=True before transformers 5), and zo_kernels.checkpoint set as the model's checkpoint function
(Trainer's own flag left off: it would set torch's function again when train() starts). Judged against the same
Trainer with torch AdamW, with tests/test_clients.py's fp32 tolerances; checkpointing changes nothing in the numbers
(torch's recomputation is bitwise), so the reference runs without it.
"""

from __future__ import annotations

import copy
import functools

import pytest
from clients_util import checkpointing_args, enable_checkpointing, is_checkpointing, tiny_gpt2, torch_adamw
from test_clients import compare_fp32_runs, make_trainer, need, record_losses, zo_adamw

import zo_kernels as zk


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """torch AdamW in Trainer without checkpointing: (initial model, trained model, losses)."""
    need("transformers", "accelerate")
    m0 = tiny_gpt2(0)
    ref = copy.deepcopy(m0)
    losses, handle = record_losses(ref)
    make_trainer(ref, torch_adamw(ref), tmp_path_factory.mktemp("torch"), max_grad_norm=0.0).train()
    handle.remove()
    return m0, ref, losses


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_trainer_gradient_checkpointing(tmp_path, reference, reentrant):
    m0, ref, ref_losses = reference
    model = copy.deepcopy(m0)
    losses, handle = record_losses(model)
    trainer = make_trainer(model, zo_adamw(model), tmp_path, max_grad_norm=0.0, **checkpointing_args(reentrant))
    trainer.train()
    handle.remove()
    assert is_checkpointing(model), "premise: Trainer turned checkpointing on"
    compare_fp32_runs(m0, ref, ref_losses, model, losses, f"Trainer(gradient_checkpointing=True, {reentrant=})")


def test_trainer_with_zo_kernels_checkpoint(tmp_path, reference):
    """The model's checkpoint function is zo_kernels.checkpoint with host buffers (on the CPU: the GPU-shaped
    transport); the buffers are used (allocations made) and the run equals torch AdamW's."""
    from zo_kernels.transport import CopyEngineTransport

    m0, ref, ref_losses = reference
    model = copy.deepcopy(m0)
    enable_checkpointing(model, False)
    buffers = zk.ActivationBuffers("cpu", CopyEngineTransport())
    ckpt = functools.partial(zk.checkpoint, buffers=buffers)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=ckpt)
    losses, handle = record_losses(model)
    try:
        make_trainer(model, zo_adamw(model), tmp_path, max_grad_norm=0.0).train()
    finally:
        handle.remove()
        buffers.transport.close()
    assert buffers.host_allocations > 0, "premise: zo_kernels.checkpoint kept checkpoints in its host buffers"
    compare_fp32_runs(m0, ref, ref_losses, model, losses, "Trainer with zo_kernels.checkpoint")
