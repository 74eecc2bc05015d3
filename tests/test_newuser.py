"""What a new user met following README.md and --help: each test failed on the code before its fix."""

import errno
import io
import re

import pytest
from helpers import run_cli

from zo_kernels import cli


@pytest.mark.parametrize("command", ["demo", "plan", "bench", "dashboard"])
def test_help_says_each_default_once_and_never_none(capsys, command):
    """Before: "(default: never) (default: None)", "(default: params / 32) (default: None)", required --params."""
    code, out, _ = run_cli(capsys, command, "--help")
    text = " ".join(out.split())
    assert code == 0
    assert "(default: None)" not in text, text
    assert not re.search(r"\(default: [^)]*\)\s*\(default:", text), text
    assert "(default: never)" in text or command != "demo"


@pytest.mark.parametrize("flag", [["--activation-offload"], ["--no-checkpointing"], ["--attention", "eager"]])
def test_plan_activation_flags_without_seq_are_refused(capsys, flag):
    """Before: `plan --params 7B --activation-offload` printed the 4 GiB-activations table, the flag ignored."""
    code, out, err = run_cli(capsys, "plan", "--params", "7B", "--gpu-mem", "24GB", *flag)
    assert code == 2 and out == ""
    assert flag[0] in err and "--seq" in err and "--hidden" in err, err


def test_plan_shape_option_without_seq_names_the_option(capsys):
    code, _, err = run_cli(capsys, "plan", "--params", "7B", "--hidden", "4096")
    assert code == 2 and "--hidden" in err and "--seq" in err, err


def test_demo_torch_line_and_header_with_compressed_moments(capsys):
    """Before: with --state-dtype bf16 the torch line read "planner DDP 12: fp32 training here is 4+4+8 = 16 too"
    (torch's AdamW keeps fp32 moments: 16), and the header "delayed update after None"."""
    code, out, _ = run_cli(capsys, "demo", "--steps", "2", "--model-size", "1e5", "--batch", "2", "--context", "16",
                           "--dtype", "bf16", "--state-dtype", "bf16", "--quiet")  # fmt: skip
    assert code == 0
    torch_line = next(line for line in out.splitlines() if line.strip().startswith("torch  device"))
    assert "planner DDP 16:" in torch_line, torch_line
    assert "delayed update after None" not in out and "no delayed update" in out, out.splitlines()[:3]


def test_bench_sizes_reach_every_benchmark(capsys, monkeypatch, tmp_path):
    """Before: `bench --suite cpu_adam --sizes 1e5` still ran the moment formats at 5e7 (stage 3's NVMe rows at
    1.6e7 and 6.4e7): --sizes set only ZO_BENCH_SIZES."""
    for var in ("ZO_BENCH_SIZES", "ZO_BENCH_FORMAT_SIZES", "ZO_BENCH_INFINITY_SIZES"):
        monkeypatch.delenv(var, raising=False)
    envs = []
    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: envs.append(k["env"]) or 0)
    assert run_cli(capsys, "bench", "--suite", "cpu_adam", "--sizes", "1e5", "-o", str(tmp_path / "a.json"))[0] == 0
    env = envs[-1]
    assert env["ZO_BENCH_SIZES"] == env["ZO_BENCH_FORMAT_SIZES"] == env["ZO_BENCH_INFINITY_SIZES"] == "100000"
    # without --sizes each benchmark keeps its own default sizes
    assert run_cli(capsys, "bench", "--suite", "cpu_adam", "-o", str(tmp_path / "b.json"))[0] == 0
    env = envs[-1]
    assert env["ZO_BENCH_SIZES"] == "10000000"
    assert "ZO_BENCH_FORMAT_SIZES" not in env and "ZO_BENCH_INFINITY_SIZES" not in env


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


def test_offload_param_nvme_at_stage_2_says_stage_3(tmp_path):
    """Before: ZeroOffloadAdamW(model, offload_param="nvme", nvme_dir=d) at the default stage 2 said only "nvme_dir is
    used only with offload_optimizer='nvme'"; adding that then failed on the stage."""
    import torch

    import zo_kernels

    with pytest.raises(ValueError, match=r"offload_param='nvme' needs stage=3"):
        zo_kernels.ZeroOffloadAdamW(_model(), offload_param="nvme", nvme_dir=str(tmp_path), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"nvme_dir is used only with offload_optimizer='nvme'.*offload_param='nvme'"):
        zo_kernels.ZeroOffloadAdamW(_model(), stage=3, offload_param="nvme", nvme_dir=str(tmp_path),
                                    dtype=torch.bfloat16)  # fmt: skip
    assert list(tmp_path.iterdir()) == []


class _FailingFile(io.FileIO):
    """A checkpoint's temporary file whose writes raise `error` once 4 KiB have been written."""

    error: BaseException = KeyboardInterrupt()

    def write(self, b):
        if self.tell() + len(b) > 4096:
            raise self.error
        return super().write(b)


@pytest.mark.parametrize("error, expected", [(KeyboardInterrupt(), KeyboardInterrupt),
                                             (OSError(errno.EIO, "Input/output error"), OSError)])  # fmt: skip
def test_a_save_interrupted_by_ctrl_c_or_an_io_error_says_so(tmp_path, monkeypatch, error, expected):
    """Before: Ctrl-C (or EIO) inside torch.save's writes was reported as "OSError: [Errno 28] no space left on the
    device": torch turns the write's exception into 'unexpected pos', which was read as a full disk."""
    import torch

    from zo_kernels import checkpoint_io, save_checkpoint

    model = torch.nn.Linear(64, 64)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, step=1)
    before = path.read_bytes()
    monkeypatch.setattr(_FailingFile, "error", error)
    monkeypatch.setattr(checkpoint_io.os, "fdopen", lambda fd, mode: _FailingFile(fd, "wb"))
    with pytest.raises(expected) as e:
        save_checkpoint(path, model, step=2)
    monkeypatch.undo()
    assert "no space left" not in str(e.value)
    if expected is OSError:
        assert e.value.errno == errno.EIO
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


@pytest.mark.parametrize("where", ["nvme", "memory", "adafactor"])
def test_a_step_interrupted_is_refused_until_a_checkpoint_is_loaded(tmp_path, monkeypatch, where):
    """Ctrl-C in the middle of a step leaves part of the state with the new step. Before: in memory the next step
    went on silently from that mixed state; on NVMe (the files torn) the optimizer said "restore a state with
    write_all" (the swapper's method) and load_checkpoint failed the same way, so only a new optimizer went on."""
    import torch

    import zo_kernels
    from zo_kernels.offload import adafactor, update

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        kw = dict(offload_optimizer="nvme", nvme_dir=str(tmp_path)) if where == "nvme" else {}
        kw["tile_numel"] = 1024
        cls = zo_kernels.ZeroOffloadAdafactor if where == "adafactor" else zo_kernels.ZeroOffloadAdamW
        return model, cls(model, lr=1e-2, dtype=torch.bfloat16, **kw)

    def step(model, opt):
        opt.backward(model(torch.ones(4, 64, dtype=torch.bfloat16)).float().square().mean())
        opt.step()
        opt.synchronize()

    model, opt = build()
    step(model, opt)
    zo_kernels.save_checkpoint(tmp_path / "ck.pt", model, opt, step=1)
    calls = []

    def interrupting(real):  # Ctrl-C at the update's third tile (NVMe), in its first call (memory)
        def call(*a, **k):
            calls.append(1)
            if len(calls) == (3 if where == "nvme" else 1):
                raise KeyboardInterrupt
            return real(*a, **k)

        return call

    for module, name in ((update, "cpu_adam_step"), (update, "tiled_writeback"), (adafactor, "adafactor_step")):
        monkeypatch.setattr(module, name, interrupting(getattr(module, name)))
    with pytest.raises(KeyboardInterrupt):
        step(model, opt)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="load a checkpoint"):
        step(model, opt)
    assert zo_kernels.load_checkpoint(tmp_path / "ck.pt", model, opt) == {"step": 1}
    step(model, opt)
    # the same two steps without the interruption
    ref_model, ref_opt = build()
    step(ref_model, ref_opt)
    step(ref_model, ref_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    ref_opt.close()
    opt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]


@pytest.mark.parametrize("option", ["--gpu-mem", "--host-mem", "--nvme"])
def test_plan_a_size_without_a_unit_that_cannot_mean_bytes_is_refused(capsys, option):
    """Before: `plan --params 7B --gpu-mem 24` planned for a 24-byte GPU ("1 GPU(s) x 0.0 GB"), no word said."""
    code, out, err = run_cli(capsys, "plan", "--params", "7B", option, "24")
    assert code == 2 and out == ""
    assert option in err and "24GB" in err and "24GiB" in err, err
    assert run_cli(capsys, "plan", "--params", "7B", "--nvme", "0", "--io-pool", "0")[0] == 0  # 0 needs no unit


def test_an_output_that_is_a_directory_is_refused(capsys, monkeypatch, tmp_path):
    """Before: `zo-kernels dashboard run.json -o somedir/` died with an IsADirectoryError traceback."""
    called = []
    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: called.append(a) or 0)
    run_json = tmp_path / "run.json"
    run_json.write_text('{"benchmarks": []}')
    for argv in (["dashboard", str(run_json), "-o", str(tmp_path)],
                 ["bench", "--suite", "cpu_adam", "-o", str(tmp_path)], ["demo", "--plot", str(tmp_path)]):  # fmt: skip
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and "is a directory" in err and ("--output" in err or "--plot" in err), (argv, err)
    assert called == []


def test_cpuadam_given_the_model_says_model_parameters():
    """Before: CPUAdam(model) said only "'Linear' object is not iterable" (ZeroOffloadAdamW takes the model)."""
    import torch

    import zo_kernels

    with pytest.raises(TypeError, match=r"params must be .*model\.parameters\(\).*Linear"):
        zo_kernels.CPUAdam(torch.nn.Linear(4, 4), lr=1e-3)


def test_plan_says_what_to_try_when_nothing_fits(capsys):
    """Before: 7B on a 24 GB GPU and 64 GB of host memory printed nine rows of "no" and nothing to try."""
    code, out, _ = run_cli(capsys, "plan", "--params", "7B", "--gpu-mem", "24GB", "--host-mem", "64GB")
    assert code == 0 and "nothing fits: try" in out and "--state-dtype" in out and "--nvme SIZE" in out, out
    code, out, _ = run_cli(capsys, "plan", "--params", "7B", "--gpu-mem", "24GB", "--host-mem", "64GB",
                           "--state-dtype", "8bit")  # fmt: skip
    assert code == 0 and "nothing fits" not in out  # the suggestion works: ZeRO-2 + offload fits at 8.03 B/param
    assert "ZeRO-2 + offload" in out and "yes" in next(r for r in out.splitlines() if r.startswith("ZeRO-2 + off"))


_NVME_LOOP = """
import sys
import torch
import zo_kernels
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
opt = zo_kernels.ZeroOffloadAdamW(model, dtype=torch.bfloat16, offload_optimizer="nvme", nvme_dir=sys.argv[1],
                                  tile_numel=1 << 12)
x = torch.randn(8, 256, dtype=torch.bfloat16)
for i in range(10**6):
    opt.backward(model(x).float().square().mean())
    opt.step()
    if i == 1:
        print("stepping", flush=True)
"""


def test_ctrl_c_during_nvme_steps_exits_and_leaves_no_file(tmp_path):
    """SIGINT to a process stepping with its state on NVMe: it exits by KeyboardInterrupt and removes its files."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", _NVME_LOOP, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "stepping", proc.stderr.read()
        time.sleep(0.2)  # in the middle of some step
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)  # a slow machine: generous, only a hang trips it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # the traceback ends in KeyboardInterrupt, followed only by the note cpu_adam_step adds when the signal lands
    # inside the kernel call (which part of the range holds the new step)
    lines = err.strip().split("\n")
    ends = [i for i, line in enumerate(lines) if line == "KeyboardInterrupt"]
    notes = lines[ends[-1] + 1 :] if ends else ["(no KeyboardInterrupt line)"]
    assert proc.returncode == -signal.SIGINT and all(n.startswith("cpu_adam_step: updated = (0, ") for n in notes), (
        err[-2000:])  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def _gpt():
    import torch

    from zo_kernels.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=96, context=32, layers=2, width=64, heads=2))


def test_params_leaving_out_trainable_parameters_of_module_are_refused_naming_them():
    """Before: params=list(m.blocks.parameters()), module=m was built (the model cast to bf16), then step() said
    "tok.weight was frozen (requires_grad=False) when ZeroOffloadAdamW was built" of a parameter never frozen; a
    parameter outside the module was taken too. Now refused at construction, naming them, the model untouched."""
    import torch

    import zo_kernels

    m = _gpt()
    before = {n: (p.dtype, p.detach().clone()) for n, p in m.named_parameters()}
    with pytest.raises(ValueError, match=r"leaves out trainable parameters of module: tok\.weight, pos\.weight"):
        zo_kernels.ZeroOffloadAdamW(params=list(m.blocks.parameters()), module=m)
    with pytest.raises(ValueError, match=r"param group 0 param 0 \(shape \(4, 4\)\) is not a parameter of module"):
        zo_kernels.ZeroOffloadAdamW(params=[torch.nn.Parameter(torch.zeros(4, 4)), *m.parameters()], module=m)
    for n, p in m.named_parameters():
        assert p.dtype == before[n][0] and torch.equal(p, before[n][1]), n
    m.tok.weight.requires_grad_(False)  # frozen ones may be left out, and groups may split the rest
    rest = [p for n, p in m.named_parameters() if n != "tok.weight"]
    opt = zo_kernels.ZeroOffloadAdamW(params=[{"params": rest[:3]}, {"params": rest[3:], "lr": 1e-4}], module=m)
    x = torch.randint(0, 96, (2, 9))
    opt.backward(m(x[:, :-1], x[:, 1:]))
    opt.step()
    opt.close()


@pytest.mark.parametrize("bad", [None, 5, "model", {"params": []}])
def test_params_of_the_wrong_type_name_the_argument(bad):
    """Before: ZeroOffloadAdamW(None) said "'NoneType' object is not iterable"."""
    import zo_kernels

    with pytest.raises(TypeError, match=r"params must be the model \(a torch\.nn\.Module\), an iterable"):
        zo_kernels.ZeroOffloadAdamW(bad)


def test_assigning_to_opt_state_raises():
    """Before: `opt.state = {}` (the usual reset) was silently ignored; the README says an assignment raises.
    Handing back the optimizer's own view (accelerate's wrapper forwards its setter) is allowed."""
    import collections

    import torch

    import zo_kernels

    opt = zo_kernels.ZeroOffloadAdamW(torch.nn.Linear(4, 4), dtype=torch.float32)
    for value in ({}, collections.defaultdict(dict), {0: {}}):
        with pytest.raises(AttributeError, match="read-only"):
            opt.state = value
    opt.state = opt.state
    assert len(opt.state) == 2
    opt.close()


def test_backward_takes_retain_graph_as_loss_backward_does():
    """Before: opt.backward(loss, retain_graph=True) was a TypeError. Two backward passes of one graph sum, as
    loss.backward(retain_graph=True) twice does (the oracle: torch's AdamW with the doubled gradient)."""
    import copy

    import torch

    import zo_kernels

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ref = copy.deepcopy(model)
    opt = zo_kernels.ZeroOffloadAdamW(model, lr=1e-2, dtype=torch.float32)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(5, 4)
    loss = model(x).square().mean()
    opt.backward(loss, retain_graph=True)
    opt.backward(loss)
    opt.step()
    ref_loss = ref(x).square().mean()
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    topt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="retain_graph must be a bool"):
        opt.backward(model(x).sum(), retain_graph="yes")
    opt.close()

