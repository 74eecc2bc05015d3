"""The project's mutation run: seed plausible bugs one at a time, run the tests that should catch each, score.

    python tests/mutate.py [--only NAME ...] [--list] [--timeout 900]

Each mutant is a text patch (an exact snippet replaced once) in the kernel, the offload step, stage 3, the pack
kernel or checkpoints. For each: apply it, rebuild the C++ extension when a C++ file changed, run the mutant's
own test selection (pytest -x: the first failure kills it), restore the file (always, also on Ctrl-C), rebuild
again if needed. A mutant is "killed" when its tests fail, "SURVIVED" when they pass, "undecided" when they did
not finish within --timeout (on a loaded machine: raise it). Run it before resolving an issue that touches the
step; a survivor is a missing test. It edits the working tree: run nothing else from the same tree meanwhile.
The snippets must still occur exactly once: a refactor that moves one makes the run say so.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATRIX_ONE_RANK = ("tests/test_oracle_matrix.py", "-k", "w1")  # the matrix's one-rank cases (no spawn)
COMBINATIONS = ("tests/test_combinations.py",)


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    path: str
    old: str
    new: str
    tests: tuple[tuple[str, ...], ...]  # pytest selections, run one after another (a -k applies to one only)


def _m(name: str, area: str, path: str, old: str, new: str, *tests: tuple[str, ...] | str) -> Mutant:
    return Mutant(name, area, path, old, new, tuple((t,) if isinstance(t, str) else t for t in tests))


MUTANTS = [
    # ---- the three that the whole suite let through (issue 24)
    _m("overflow-counts-as-iteration", "offload step", "zo_kernels/offload/grads.py",
       "        if found_inf:\n            self.iteration -= 1\n", "",
       COMBINATIONS, MATRIX_ONE_RANK),
    _m("nvme-drops-clip-factor", "offload step", "zo_kernels/offload/update.py",
       "step=step, grad_scale=grad_scale * factor, threads=threads, param_out=out,",
       "step=step, grad_scale=grad_scale, threads=threads, param_out=out,",
       COMBINATIONS, ("tests/test_offload_nvme.py", "-k", "nvme or clip")),
    _m("cpuadam-adamw-from-defaults", "CPUAdam", "zo_kernels/cpu_adam.py",
       'eps=group["eps"], weight_decay=group["weight_decay"], adamw=group["adamw"],',
       'eps=group["eps"], weight_decay=group["weight_decay"], adamw=self.defaults["adamw"],',
       "tests/test_combinations.py", "tests/test_cpu_adam_optimizer.py"),
    # ---- the offload step
    _m("clip-coefficient-not-capped", "offload step", "zo_kernels/offload/optimizer.py",
       "clip = min(1.0, self.max_grad_norm / (norm + 1e-6))", "clip = self.max_grad_norm / (norm + 1e-6)",
       MATRIX_ONE_RANK),
    _m("loss-scale-not-divided", "offload step", "zo_kernels/offload/optimizer.py",
       "grad_scale = clip / scale", "grad_scale = clip", MATRIX_ONE_RANK),
    _m("dpu-starts-one-late", "offload step", "zo_kernels/offload/optimizer.py",
       "self.grads.iteration >= self.delay_update_after", "self.grads.iteration > self.delay_update_after",
       MATRIX_ONE_RANK),
    _m("clip-factor-applied-twice-over-micro-batches", "offload step", "zo_kernels/offload/grads.py",
       "                    self.selected.scale(a, b, f)\n                self.factor[i] = 1.0\n",
       "                    self.selected.scale(a, b, f)\n", COMBINATIONS, MATRIX_ONE_RANK),
    _m("runs-merge-across-factors", "offload step", "zo_kernels/offload/layout.py",
       "(runs[-1][0], runs[-1][3], runs[-1][4]) == key", "(runs[-1][0], runs[-1][3]) == key[:2]",
       COMBINATIONS, MATRIX_ONE_RANK),
    _m("scaler-backoff-keeps-good-steps", "offload step", "zo_kernels/offload/scaler.py",
       "            self.scale *= SCALE_BACKOFF\n            self.good_steps = 0\n",
       "            self.scale *= SCALE_BACKOFF\n", ("tests/test_combinations.py", "-k", "dynamic_scale"),
       "tests/test_offload_semantics.py", "tests/test_offload.py"),
    # ---- stage 3
    _m("stage3-update-keeps-gathered-copies", "stage 3", "zo_kernels/offload/params.py",
       "        for u in self.units:\n            u.invalidate(refill_kept=u not in written)\n",
       "        for u in self.units:\n            pass\n",
       ("tests/test_combinations.py", "-k", "stage3"), ("tests/test_stages.py", "-k", "one_rank"),
       ("tests/test_stages_lifecycle.py", "-k", "write_of_the_weights or load_state_dict_reaches or step_inside")),
    _m("stage3-load-takes-wrong-slice", "stage 3", "zo_kernels/offload/params.py",
       "copy_(values.reshape(-1)[a - off : b - off])", "copy_(values.reshape(-1)[a : b])",
       ("tests/test_stages.py", "-k", "not two_ranks and not world_sizes")),
    # ---- the pack kernel (Triton; interpreted on the CPU)
    _m("pack-full-blocks-unscaled", "pack kernel", "zo_kernels/kernels/pack.py",
       "x = _ld(src + offs, offs < n_read, IN_KIND, FULL) * scale",
       "x = _ld(src + offs, offs < n_read, IN_KIND, FULL)", "tests/test_buckets.py"),
    _m("pack-stats-sum-not-squared", "pack kernel", "zo_kernels/kernels/pack.py",
       "return acc + x * x, bad", "return acc + tl.abs(x), bad",
       "tests/test_buckets.py"),
    # ---- checkpoints
    _m("load-ignores-saved-masters", "checkpoints", "zo_kernels/offload/state.py",
       'if st.get("master") is not None and from_zero_offload(state_dict):',
       'if st.get("master") is None and from_zero_offload(state_dict):',
       "tests/test_offload.py", "tests/test_offload_semantics.py", ("tests/test_torch_optim_contract.py", "-k",
                                                                    "loaded_alone")),
    _m("load-step-off-by-one", "checkpoints", "zo_kernels/offload/state.py",
       "opt.update.steps[i] = step\n", "opt.update.steps[i] = step + 1\n",
       "tests/test_offload.py", "tests/test_offload_semantics.py"),
    _m("state-dict-drops-good-steps", "checkpoints", "zo_kernels/offload/state.py",
       '"good_steps": opt.scaler.good_steps,', '"good_steps": 0,',
       ("tests/test_combinations.py", "-k", "dynamic_scale"), "tests/test_offload.py",
       "tests/test_offload_semantics.py"),
    _m("aborted-backward-taken-for-a-running-one", "offload step", "zo_kernels/offload/grads.py",
       "return torch._C._current_graph_task_id() in self._callback_tasks or in_nested_backward()", "return True",
       ("tests/test_interrupted.py", "-k", "raised_partway")),
    # ---- activation checkpoints (issue 21)
    _m("activation-restore-skips-wait", "activations", "zo_kernels/activations.py",
       "self.buffers.transport.device_wait(self.h2d)", "None", "tests/test_activations.py"),
    _m("activation-restored-needs-no-grad", "activations", "zo_kernels/activations.py",
       "return [_ordered(v, back).detach().requires_grad_(rg)", "return [_ordered(v, back).detach()",
       "tests/test_activations.py"),
    _m("activation-held-needs-no-grad", "activations", "zo_kernels/activations.py",
       "return [_ordered(x, back).detach().requires_grad_(rg)", "return [_ordered(x, back).detach()",
       "tests/test_activations.py"),
    _m("activation-resident-copy-missing", "activations", "zo_kernels/activations.py",
       "view.copy_(x)", "view.zero_()", "tests/test_activations.py"),
    _m("activation-inplace-change-unchecked", "activations", "zo_kernels/activations.py",
       "if _version(x) != v and self.changed is None:", "if False:", "tests/test_activations.py"),
    _m("activation-dropped-prefetch-unfenced", "activations", "zo_kernels/activations.py",
       "self.transport.device_wait(landing)", "pass", "tests/test_activations.py"),
    _m("activation-graphless-forward-evicts", "activations", "zo_kernels/activations.py",
       "self.buffers._settle(self, graph=graph)", "self.buffers._settle(self, graph=True)",
       "tests/test_activations.py"),
    _m("activation-released-under-create-graph", "activations", "zo_kernels/activations.py",
       "if torch.is_grad_enabled():  # create_graph=True", "if False:  # create_graph=True",
       ("tests/test_activations.py", "-k", "double_backward")),
    _m("activation-plain-backward-frees-kept-blocks", "activations", "zo_kernels/activations.py",
       'self.state == "restored" and not self.kept:', 'self.state == "restored":',
       ("tests/test_activations.py", "-k", "plain_backward_after_create_graph")),
    _m("activation-change-after-copy-unchecked", "activations", "zo_kernels/activations.py",
       "        self._check_watched()\n", "", ("tests/test_activations.py", "-k", "after_the_call")),
    _m("activation-change-inside-unchecked", "activations", "zo_kernels/activations.py",
       "if graph and any(_version(x) != v for x, v in taken):", "if False:",
       ("tests/test_activations.py", "-k", "inside_the_function")),
    # ---- the hyper-parameters a delayed update reads, the stale-masters check under DPU, stage 3's outputs
    _m("dpu-tensor-lr-read-late", "offload step", "zo_kernels/offload/optimizer.py",
       "return dict(lr=lr, betas=(beta1, beta2)", 'return dict(lr=group["lr"], betas=(beta1, beta2)',
       ("tests/test_torch_optim_contract.py", "-k", "tensor_lr")),
    _m("stale-check-skipped-under-a-pending-writeback", "checkpoints", "zo_kernels/offload/update.py",
       "        self.wait_written()\n        own, ranges, stale = ",
       "        if self.staged:\n            return\n        self.wait_written()\n"
       "        own, ranges, stale = ",
       ("tests/test_offload_review.py", "-k", "without_masters")),
    _m("stage3-objects-in-outputs-unseen", "stage 3", "zo_kernels/offload/unit.py",
       "elif dataclasses.is_dataclass(leaf):", "elif False:",
       ("tests/test_stages_lifecycle.py", "-k", "handed_out or dataclass_outputs")),
    # ---- selective: the selection's gradient gathered on the device follows the host's (selected.py)
    _m("selective-zero-grad-keeps-device-gradient", "selective", "zo_kernels/offload/grads.py",
       "                self.selected.landing.zero_()\n", "                pass\n", "tests/test_selective.py"),
    _m("selective-cleared-grad-kept-on-device", "selective", "zo_kernels/offload/grads.py",
       "                self.selected.zero(a, b, summed=self.n_micro > 1)\n", "                pass\n",
       "tests/test_selective.py"),
    # ---- the C++ kernel
    _m("kernel-bias-correction-no-sqrt", "kernel", "cpu/adam.cpp",
       "c.inv_bc2_sqrt = float(1.0 / std::sqrt(bc2));", "c.inv_bc2_sqrt = float(1.0 / bc2);",
       "tests/test_cpu_adam.py"),
    _m("kernel-decay-without-lr", "kernel", "cpu/adam.cpp",
       "c.decay = float(1.0 - double(a.lr) * a.weight_decay);", "c.decay = float(1.0 - a.weight_decay);",
       "tests/test_cpu_adam.py"),
    _m("kernel-8bit-unguarded", "kernel", "cpu/adam.cpp",
       "    c.capped = c.m_cap > 0.0f;", "    c.capped = false;", ("tests/test_cpu_adam_formats.py", "-k", "8bit")),
    _m("kernel-8bit-guard-bound-off-by-a-step", "kernel", "cpu/adam.cpp",
       "b2 = a.beta2, t = double(a.step);", "b2 = a.beta2, t = double(a.step + 1);",
       ("tests/test_cpu_adam_formats.py", "-k", "8bit")),
    # ---- interrupted steps and the lifecycle fuzzer's finds (2026-11-23)
    _m("interrupted-consume-unguarded", "offload step", "zo_kernels/offload/optimizer.py",
       "        with self._midway():  # (Ctrl-C in its checks) the gradients half consumed",
       "        if True:  # (Ctrl-C in its checks) the gradients half consumed",
       ("tests/test_interrupted.py", "-k", "accumulated_gradients")),
    _m("dpu-ctrl-c-in-wait-is-a-failure", "offload step", "zo_kernels/offload/update.py",
       "            if stopped_waiting(fut, e):  # Ctrl-C in the wait",
       "            if False:  # Ctrl-C in the wait",
       ("tests/test_interrupted.py", "-k", "background_update_loses_nothing")),
    _m("zero-grad-keeps-cleared-step-grads", "offload step", "zo_kernels/offload/grads.py",
       "            self.last_got = []  # torch holds no gradient now",
       "            pass  # torch holds no gradient now",
       ("tests/test_lifecycle_fuzz.py", "-k", "cleared")),
    _m("unfrozen-param-unchecked", "offload step", "zo_kernels/offload/optimizer.py",
       "        self._check_still_frozen()\n        for gi, group", "        for gi, group",
       ("tests/test_lifecycle_fuzz.py", "-k", "unfrozen")),
    _m("grad-norm-in-16-bits", "offload step", "zo_kernels/param_views.py",
       "like = grads[k].dtype if grads[k].dtype.itemsize >= 4 else torch.float32", "like = grads[k].dtype",
       ("tests/test_oracle_matrix.py", "-k", "16_bit")),
    _m("state-dict-compares-under-a-pending-writeback", "checkpoints", "zo_kernels/offload/state.py",
       '    if u.staged or getattr(getattr(u, "host", None), "staged", False):\n        return\n', "",
       "tests/test_state_dict_reads_only.py"),
    _m("refreshed-masters-skip-staging", "checkpoints", "zo_kernels/offload/update.py",
       "                self.staging_buf[a:b].copy_(values)", "                pass",
       ("tests/test_offload.py", "-k", "reach_staging")),
    _m("twin-refresh-takes-the-whole-tail", "checkpoints", "zo_kernels/offload/twin.py",
       "stale.update(differing(tail, self.own[s:], param_ranges(self.layout), s))",
       "stale.update(r for r in param_ranges(self.layout) if r[1] > s)",
       ("tests/test_offload.py", "-k", "edited_parameter")),
    # ---- the 8-bit exp_avg's stochastic rounding (2026-11-27)
    _m("kernel-8bit-scalar-rounds-m-to-nearest", "kernel", "cpu/adam.cpp",
       "code_sr(mb[j] * im, weyl16(k.index0 + j, key));", "int8_t(code_of(mb[j] * im));",
       ("tests/test_cpu_adam_formats.py", "-k", "8bit")),
    _m("kernel-8bit-avx2-weyl-not-advanced", "kernel", "cpu/adam.cpp",
       "for (int64_t j = 0; j < L; j += 8, w = _mm256_add_epi32(w, dw)) {", "for (int64_t j = 0; j < L; j += 8) {",
       ("tests/test_cpu_adam_formats.py", "-k", "8bit or identical")),
    _m("tail-8bit-rounds-m-to-nearest", "gpu_fraction", "zo_kernels/kernels/adam.py",
       "cm, sm = _requant(m, mask, 127.0, w, True)", "cm, sm = _requant(m, mask, 127.0, w, False)",
       ("tests/test_device_adam.py", "-k", "triton or kernel")),
    _m("tail-seeds-by-tail-index", "gpu_fraction", "zo_kernels/offload/device_adam.py",
       "sr_args(self.seed, z))", "sr_args(self.seed, z - o))",
       ("tests/test_device_adam.py", "-k", "host_only_run")),
    # ---- DPU: the background update, not the end of backward, waits for the gradient's copies (2026-11-27)
    _m("dpu-update-skips-the-copies-wait", "offload step", "zo_kernels/offload/update.py",
       "        if before is not None:\n            before()\n", "",
       ("tests/test_gpu_shaped.py", "-k", "waits_for_the_gradients")),
    _m("dpu-backward-waits-for-its-copies", "offload step", "zo_kernels/offload/grads.py",
       "        if self.defer_copies is not None and self.defer_copies():", "        if False:",
       ("tests/test_gpu_shaped.py", "tests/test_dpu_tiles.py", "-k", "waits_for_the_gradients or host_syncs")),
    # ---- 2026-11-28
    _m("bump-version-first-tensor-only", "kernels", "zo_kernels/cpu_adam.py",
       "torch.autograd.graph.increment_version(written)", "torch.autograd.graph.increment_version(written[:1])",
       ("tests/test_battery.py", "-k", "version")),
    _m("before-launch-timed-as-offload", "offload step", "zo_kernels/offload/grads.py",
       "            self.before_launch()\n        t0 = time.perf_counter()\n",
       "            pass\n        t0 = time.perf_counter()\n        self.before_launch and self.before_launch()\n",
       ("tests/test_gpu_check_stages.py", "-k", "before_launch")),
    _m("pack-step-trusts-any-out", "pack kernel", "zo_kernels/kernels/plan.py",
       "        t = next((t for t in self._trusted if t.out is out and t.into is into), None)",
       "        t = self._trusted[-1] if self._trusted else None",
       ("tests/test_buckets.py", "-k", "pack_step")),
    _m("pack-step-ignores-moved-memory", "pack kernel", "zo_kernels/kernels/plan.py",
       "        if t is None or t.where != _where(out, into):", "        if t is None:",
       ("tests/test_buckets.py", "-k", "pack_step")),
    _m("pack-step-skips-the-apart-check", "pack kernel", "zo_kernels/kernels/plan.py",
       "        if t.apart is not self._ptrs:  # (check read new addresses)", "        if False:",
       ("tests/test_buckets.py", "-k", "pack_step")),
    _m("default-bucket-ignores-the-model", "offload step", "zo_kernels/offload/optimizer.py",
       "            bucket_numel = default_bucket_numel(sum(p.numel() for ps in groups for p in ps))",
       "            bucket_numel = default_bucket_numel(0)",
       "tests/test_bucket_size.py"),
    _m("default-bucket-counts-frozen-params", "offload step", "zo_kernels/offload/optimizer.py",
       "            bucket_numel = default_bucket_numel(sum(p.numel() for ps in groups for p in ps))",
       "            bucket_numel = default_bucket_numel(sum(p.numel() for p in module.parameters()) if module "
       "is not None else sum(p.numel() for ps in groups for p in ps))",
       "tests/test_bucket_size.py"),
    _m("planner-max-ignores-the-bucket-step", "planner", "zo_kernels/planner.py",
       "        m = min(hi, _largest(cap, per_param, fixed + 4.0 * max(size, largest_param)))",
       "        m = _largest(cap, per_param, fixed + 4.0 * max(size, largest_param))",
       ("tests/test_planner.py", "-k", "bucket or search")),
]

CPP_SUFFIXES = (".cpp", ".h", ".inc", ".cu")


def rebuild() -> None:
    """The C++ extension from the current sources (editable install, as the set-up does)."""
    # a build directory of its own: after the first build only the mutated file recompiles
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "-e", str(ROOT),
                    f"--config-settings=build-dir={ROOT / 'build' / 'mutate'}"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)  # fmt: skip


def run_mutant(m: Mutant, timeout_s: float) -> tuple[str, float]:
    """Apply, test, restore; ("killed" | "SURVIVED" | "timeout (undecided)" | "not applied", seconds)."""
    path = ROOT / m.path
    original = path.read_text()
    if original.count(m.old) != 1:
        return f"not applied ({original.count(m.old)} matches)", 0.0
    cpp = m.path.endswith(CPP_SUFFIXES)
    t0 = time.perf_counter()
    try:
        path.write_text(original.replace(m.old, m.new))
        if cpp:
            rebuild()
        verdict = "SURVIVED"
        for selection in m.tests:
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *selection]
            left = timeout_s - (time.perf_counter() - t0)
            try:
                proc = subprocess.run(cmd, cwd=ROOT, timeout=max(1.0, left), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)  # fmt: skip
            except subprocess.TimeoutExpired:
                verdict = "timeout (undecided)"
                break
            if proc.returncode != 0:
                verdict = "killed"
                if proc.returncode != 1:  # 2: interrupted/collection error, 5: no tests: worth a look
                    verdict += f" (pytest exit {proc.returncode})"
                break
    finally:
        path.write_text(original)
        if cpp:
            rebuild()
    return verdict, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutant names to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant's tests")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:46s} {m.area:13s} {m.path}  ->  {' ; '.join(' '.join(t) for t in m.tests)}")
        return 0
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    rows, t_all = [], time.perf_counter()
    for m in chosen:
        verdict, secs = run_mutant(m, args.timeout)
        rows.append((m, verdict, secs))
        print(f"{m.name:46s} {verdict:22s} {secs:6.0f} s", flush=True)
    killed = sum(v.startswith("killed") for _, v, _ in rows)
    decided = sum(v.startswith(("killed", "SURVIVED")) for _, v, _ in rows)
    print("\n| mutant | area | tests | result | s |\n|---|---|---|---|---|")
    for m, v, s in rows:
        print(f"| {m.name} | {m.area} | {' ; '.join(' '.join(t) for t in m.tests)} | {v} | {s:.0f} |")
    print(f"\nscore: {killed}/{decided} killed, {len(rows) - decided} undecided or not applied "
          f"({time.perf_counter() - t_all:.0f} s in all)")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
