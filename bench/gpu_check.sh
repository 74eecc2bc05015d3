#!/usr/bin/env bash
# The one command that verifies the GPU path on a machine with one CUDA GPU and no network:
#   bash bench/gpu_check.sh OUTDIR        (carry .whl/, from bash bench/fetch_anchor_wheels.sh, for the anchors)
# Builds the project in place with the Python found here (torch, triton, pybind11, scikit-build-core, cmake,
# ninja, pytest, pytest-benchmark preinstalled), runs tests/test_gpu.py, tests/test_gpu_two_ranks.py (stages 1, 2,
# 3, 3+cpu on two gloo processes over CUDA tensors against the oracle), the CUDA tests and the GPU benchmarks:
#   bench/test_bench_buckets.py          pack (and cast) vs torch's flatten + cast, and a device copy of the same
#                                        bytes: GB/s and fraction of that copy bandwidth   -> OUTDIR/bench-pack.json
#   bench/test_bench_transport.py -k cuda  H2D/D2H GB/s, zo pinned pool / torch pinned / pageable, 64 MiB..1 GiB;
#                                        CPU Adam alone, H2D alone, tiled writeback: hidden fraction
#                                                                                    -> OUTDIR/bench-transport.json
#   bench/step_rows.py                   the GPT step in parts, 95M and 1.3B params, sync and DPU: phases,
#                                        fwd+bwd alone, CPU Adam alone, D2H alone, torch AdamW(fused) + peaks
#   bench/activation_rows.py             activations: no checkpointing, torch's checkpoint, save_on_cpu, zo's offloaded
#                                        and resident checkpoint, per block and (torch, zo offloaded) per half block:
#                                        step time, peak device activation memory, checkpoint allocations per step,
#                                        one profiled step each, longest sequence in 1 GiB above the model (issue 21)
#   bench/anchors.py                     torch fused, DeepSpeed ZeRO-Offload, torchao, FSDP2, zo: one GPT, batch
#                                        and dtype, each in its own process (wheels from .whl/ when carried)
# and writes OUTDIR/summary.json (bench/summary.py --summary-json: device, date, commit, pack, step, anchors,
# activations, targets; the step, anchor and activation rows are folded into it), OUTDIR/gpu_check.log
# (everything), OUTDIR/tests.xml, tests-two-ranks.xml and OUTDIR/summary.txt (one line per stage, then
# bench/summary.py's ratios): 7 files (8 with ZO_CHECK_COMPILE=1, which also compiles every Triton kernel for sm_80/sm_90 as CI does on the CPU:
# 57 s on the H200), under the device's 8. ZO_SKIP_BUILD=1 (a second command on the same warm machine): the build the
# first one left is used.
# Commit OUTDIR/summary.json as bench/results/gpu-DATE-DEVICE.json (the script prints the name).
# Sizes: ZO_BENCH_SIZES (elements/params, default here 1e7,1e8), ZO_BENCH_COPY_MIB (default 64,256,1024),
# ZO_STEP_SIZES (default 95M,1.3B), ZO_ANCHOR_SIZE (default 95M), batch x context ZO_STEP_BATCH x ZO_STEP_CONTEXT
# (default 8 x 512), the step rows' moments ZO_STEP_STATE_DTYPE (default fp32; 8bit: issue 20's rows at batch 8).
# Every stage has a time limit and the whole run a deadline (ZO_CHECK_BUDGET_S, default 500 s) so that it ends
# within 9 minutes on one H100; each stage prints its progress and seconds; a stage cut short is
# reported FAILED (rc 124) and keeps the rows it finished.
# Scale mode (issue 23), its own device command because the default check uses most of one:
#   bash bench/gpu_check.sh OUTDIR scale  builds, then bench/scale_check.py: per setting (ZO_SCALE_SETTINGS,
#     default s2-8bit-sync,s2-8bit,s2-fp32: the largest model, the one with DPU, then fp32 moments where 150 s are
#     left, the 8-bit settings' control; s3-cpu on request) the
#     largest GPT the planner fits, built on the meta device, 5 steps (6 with DPU, delayed after 3; no DPU for
#     s2-8bit-sync) and checkpointing, beside the planner's figures -> OUTDIR/scale.json, folded into
#     OUTDIR/summary.json's "scale" rows. The first setting takes what the budget leaves; a later one starts only with
#     150 s left for it (on an H200: 116 s for the 15.3B sync setting, 69 s for the 12.0B DPU one, 239 s for the
#     command with the build), else its row says NOT RUN; one that runs out keeps the steps it finished. One device command:
#     ZO_CHECK_BUDGET_S=570 bash bench/gpu_check.sh OUTDIR scale (timeout 600).
#   Without a GPU it runs the same script on the CPU at a few million parameters (what tests/test_scale_check.py
#   runs) and says so.
# Anchors mode: bash bench/gpu_check.sh OUTDIR anchors  builds, then step rows at batch ZO_BIG_BATCH x 512 (default
#   32: DPU, gpu_fraction 0 and auto, --checkpoint, 8-bit moments on the host and in the device's tail,
#   ZO_BIG_STATE_DTYPE; up to 150 s, leaving 70), then the default run's last two stages with a command of their own
#   (in the default run they get what the budget leaves, often nothing): bench/activation_rows.py (up to 120 s,
#   leaving 40), installs .whl/, bench/anchors.py (the rest, up to 170 s, 150 s per system; DeepSpeed builds its CPU
#   Adam on first use) -> OUTDIR/summary.json's "step", "activations" and "anchors" rows; then, with what is left
#   (up to 120 s; not started under 45), bench/profile_step.py -> OUTDIR/profile.json (the step under
#   torch.profiler, the 95M GPT first). (Order: what was never measured on a GPU first.)
# Tests mode: bash bench/gpu_check.sh OUTDIR tests  builds, then the default run's two test stages alone (the GPU tests,
#   then the two ranks), no benchmarks: bench/gpu_session.sh's tests part (first run on the H200, sixth run).
# Run on a GPU in this form (one H200: default and anchors modes 2026-11-26 and -27, the scale mode 2026-11-27); its
# no-GPU path runs in .ci/run.
# Without a GPU it says so, runs the CPU-side compile checks (every Triton kernel to cubin for sm_80/sm_90,
# cuda/*.cu with nvcc where present) and the benchmarks' collection (the CUDA ones skip, with the reason),
# and exits with their status (0 when they pass).
set -uo pipefail
out="${1:?usage: bash bench/gpu_check.sh OUTDIR [scale|anchors|tests]}"
mode="${2:-default}"
if [ "$mode" != default ] && [ "$mode" != scale ] && [ "$mode" != anchors ] && [ "$mode" != tests ]; then
  echo "usage: bash bench/gpu_check.sh OUTDIR [scale|anchors|tests]  (unknown mode: $mode)" >&2
  exit 2
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
log="$out/gpu_check.log"
summary="$out/summary.txt"
: >"$log"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
step() { # step NAME CMD...: run, log, one summary line with the exit status and seconds
  local name="$1" t0 rc
  shift
  t0=$(date +%s)
  echo "=== $name: $*" >>"$log"
  echo "... $name (at $(($(date +%s) - start))s of ${budget}s)"
  "$@" >>"$log" 2>&1
  rc=$?
  say "$(printf '%-34s %s (%ss)' "$name" "$([ $rc = 0 ] && echo ok || echo "FAILED rc=$rc")" $(($(date +%s) - t0)))"
  return $rc
}
start=$(date +%s)
budget="${ZO_CHECK_BUDGET_S:-500}"
stage_s() { # stage_s CAP RESERVE: the limit `limited CAP RESERVE` gives a stage started now (a script's own budget
  local t=$((budget - ($(date +%s) - start) - $2))  # must stay under it, or the limit cuts it, not its budget)
  [ "$t" -gt "$1" ] && t="$1"
  echo "$t"
}
limited() { # limited CAP RESERVE NAME CMD...: step under a limit of CAP s, leaving RESERVE s of the budget for later
  local cap="$1" reserve="$2" name="$3" t
  shift 3
  t=$(stage_s "$cap" "$reserve")
  if [ "$t" -lt 15 ]; then
    say "$(printf '%-34s %s' "$name" "NOT RUN: the ${budget}s budget is spent")"
    return 1
  fi
  # SIGINT first: pytest then ends the session and pytest-benchmark writes the JSON of what finished
  step "$name" timeout -s INT -k 5 "$t" "$@"
}

say "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); $("$py" --version 2>&1)"
gpu="$("$py" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "")' 2>>"$log")"
status=0
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
scale_settings="${ZO_SCALE_SETTINGS:-s2-8bit-sync,s2-8bit,s2-fp32}"
if [ "$mode" = scale ] && [ -z "$gpu" ]; then
  say "no CUDA GPU visible: scale mode runs bench/scale_check.py on the CPU at a few million parameters instead"
  step "scale check on the CPU (tiny)" "$py" bench/scale_check.py "$out/scale.json" --device cpu --max-params 12e6 \
    --context 32 --vocab 256 --tokens 128 --host-reserve-gib 0 --settings "$scale_settings" || status=1
  ZO_DEVICE="CPU (no GPU)" "$py" bench/summary.py --summary-json "$out" 2>>"$log" | tee -a "$summary" || status=1
  exit $status
fi
if [ -z "$gpu" ]; then
  say "no CUDA GPU visible: the GPU tests and benchmarks did NOT run; CPU-side compile checks only"
  step "triton kernels -> cubin sm_80/90" env -u TRITON_INTERPRET "$py" tests/triton_compile.py "$out/triton_compile.json" || status=1
  if command -v nvcc >/dev/null 2>&1; then
    step "cuda/*.cu with nvcc sm_80/90" "$py" -m pytest -q -p no:cacheprovider tests/test_transport.py \
      -k nvcc || status=1
  else
    say "nvcc not found: cuda/*.cu not compiled"
  fi
  step "benchmarks: CUDA ones skip here" "$py" -m pytest -q -rs -p no:cacheprovider bench -k cuda || status=1
  say "result: $([ $status = 0 ] && echo 'compile checks passed (no GPU)' || echo 'compile checks FAILED')"
  exit $status
fi

say "GPU: $gpu; torch $("$py" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
commit="${ZO_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
device_tag="$(echo "$gpu" | grep -oE 'H100|H200|A100|L40S|B200|GH200' | head -1)"
step_args=(--batch "${ZO_STEP_BATCH:-8}" --context "${ZO_STEP_CONTEXT:-512}")
site=/tmp/zo-anchor-site
install_wheels() { # the anchors' wheels from .whl/ (bench/fetch_anchor_wheels.sh) into $site
  local whl rc=0
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    say "no .whl/ carried: DeepSpeed and torchao rows will say NOT INSTALLED (bash bench/fetch_anchor_wheels.sh)"
    return 0
  fi
  for whl in .whl/*.whl; do  # one at a time: a wheel this Python refuses (not cp312?) leaves the others installed
    step "anchor wheel $(basename "$whl" | cut -d- -f1-2)" timeout 30 "$py" -m pip install -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target "$site" "$whl" || rc=1
  done
  return $rc
}
build_stage() { # build_stage CAP RESERVE: pip install -e . (ZO_SKIP_BUILD=1, a second command on the same warm
  # machine whose first one built this tree: skipped, the build it left is used). Without an importable build after
  # it every later stage fails in seconds (2026-11-27: a budget under the build's reserve left it NOT RUN and the run
  # went on through nine failures): the run stops here instead, saying why
  if [ "${ZO_SKIP_BUILD:-0}" = 1 ] && "$py" -c "import zo_kernels._cpu" >>"$log" 2>&1; then
    say "$(printf '%-34s %s' "build (pip install -e .)" "skipped (ZO_SKIP_BUILD=1; the build already here is used)")"
    return 0
  fi
  local rc=0
  limited "$1" "$2" "build (pip install -e .)" "$py" -m pip install --no-build-isolation --no-deps -e . || rc=1
  if ! "$py" -c "import zo_kernels._cpu" >>"$log" 2>&1; then
    say "no importable build (zo_kernels._cpu): every stage after the build needs one, so none ran. The build runs"
    say "  only with ZO_CHECK_BUDGET_S over its reserve plus its own time (reserve: 240 s scale and tests, 250 anchors,"
    say "  330 default; the build ~50 s), or build first (pip install --no-build-isolation --no-deps -e .) and pass"
    say "  ZO_SKIP_BUILD=1"
    say "result: FAILED before any stage ran on $gpu"
    exit 1
  fi
  return $rc
}
gpu_tests_stage() { # gpu_tests_stage CAP RESERVE: the tests that need the GPU, then the two ranks (up to 60 s, leaving
  # RESERVE), each a pytest of its own: a crash in one (the H200's first run: SIGSEGV in test_gpu.py) does not hide
  # the other's results. (Not tests/test_gpu_shaped.py nor test_activations.py's CopyEngineTransport tests: CPU only,
  # 37 s on a loaded 2-core machine, run by every default pytest; nor tests/test_buckets.py: with a GPU it runs only
  # the torch path on CPU tensors, test_gpu.py runs the compiled kernels.)
  local rc=0 t
  limited "$1" "$(($2 + 30))" "tests: GPU, CUDA" "$py" -m pytest -q -rs -p no:cacheprovider \
    --junitxml="$out/tests.xml" tests/test_gpu.py tests/test_transport.py \
    tests/test_activations.py::test_cuda_offload_bitwise_no_per_step_allocation_and_lower_peak || rc=1
  grep -E "passed|failed|error" "$log" | grep -E "^[0-9=]" | tail -2 >>"$summary"
  # (the launch's own bound, 22 s under the stage's limit (38 s under 60), for pytest's start and the stacks' dump: a
  # hang ends with both ranks' stacks and the finished cases; the H200 run of 2026-11-27 was cut at the stage's limit
  # with no case finished and nothing to say where it stood)
  t=$(stage_s 60 "$2")
  limited 60 "$2" "tests: two ranks on one GPU" env ZO_TWO_RANK_JOIN_S=$((t > 42 ? t - 22 : 20)) "$py" -m pytest -q \
    -rs -p no:cacheprovider --junitxml="$out/tests-two-ranks.xml" tests/test_gpu_two_ranks.py || rc=1
  grep -E "passed|failed|error|no tests ran" "$log" | grep -E "^[0-9=n]" | tail -1 >>"$summary"
  return $rc
}
activations_stage() { # activations_stage CAP RESERVE [ARGS]: bench/activation_rows.py, its budget under the stage's limit
  local t cap="$1" reserve="$2"
  shift 2
  t=$(stage_s "$cap" "$reserve")  # (the scripts' budgets: what their stage's limit leaves, less a margin for their rows)
  limited "$cap" "$reserve" "bench: activations (issue 21)" "$py" bench/activation_rows.py "$out/activations.json" \
    --budget-s "$((t * 3 / 4))" --profile "$@"
}
anchors_stage() { # anchors_stage CAP RESERVE TIMEOUT: bench/anchors.py, each system at most TIMEOUT s
  local t nvcc_dir
  t=$(stage_s "$1" "$2")
  nvcc_dir="$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")"
  # DS_SKIP_CUDA_CHECK: DeepSpeed refuses to build any op when nvcc's CUDA version differs from torch's; its CPU
  # Adam compiles no device code (it links cudart), so the machine's toolkit version need not be torch's
  limited "$1" "$2" "bench: anchors (same GPT)" env PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" \
    CUDA_HOME="${CUDA_HOME:-$nvcc_dir}" DS_SKIP_CUDA_CHECK="${DS_SKIP_CUDA_CHECK:-1}" "$py" bench/anchors.py \
    "$out/anchors.json" --size "${ZO_ANCHOR_SIZE:-95M}" --timeout-s "$3" --budget-s "$((t - 10))" "${step_args[@]}"
}
if [ "$mode" = anchors ]; then  # step rows at a batch whose forward + backward covers CPU Adam (ZO_BIG_BATCH, default
  # 32 x 512: issue 20's rows), then the default run's last two stages, given a command of their own, in the order of
  # what was never measured: the activations (issue 21), then the anchors (measured once, on the H200)
  # (with ZO_SKIP_BUILD=1 and ZO_CHECK_BUDGET_S=340: the step rows 150 s (the 1.3B rows build a model and pin ~20 GB
  # of host memory each), the activations 120 s, the anchors the rest: 60 s or more)
  build_stage 150 250 || status=1
  t=$(stage_s 150 70)
  limited 150 70 "bench: step rows at batch ${ZO_BIG_BATCH:-32}" "$py" bench/step_rows.py "$out/step.json" \
    --sizes "${ZO_STEP_SIZES:-95M,1.3B}" --modes dpu --gpu-fractions 0,auto --checkpoint --budget-s "$((t / 2))" \
    --batch "${ZO_BIG_BATCH:-32}" --context "${ZO_STEP_CONTEXT:-512}" --state-dtype "${ZO_BIG_STATE_DTYPE:-8bit}" \
    || status=1
  activations_stage 120 40 || status=1
  install_wheels || status=1
  anchors_stage 170 5 150 || status=1
  # then, with what is left (up to 120 s; none below 45 s: the seventh run's 22 s wrote a third of one row), the step
  # under torch.profiler: where the host blocks and the device idles (OUTDIR/profile.json, row by row: the 95M GPT
  # first, whose DPU step is the one near its bar, 1.17-1.21x forward + backward on the H100, 2026-11-28; then the
  # 1.3B, DPU with 80% of its optimizer on the device first, 52% of its 110 ms outside kernels and copies on the
  # H200, 2026-11-27; then DPU at gpu_fraction 0, then sync at both)
  # (ZO_SKIP_PROFILE=1: bench/gpu_session.sh's profile part ran it already, with a share of its own)
  if [ "${ZO_SKIP_PROFILE:-0}" != 1 ]; then
    t=$(stage_s 120 3)
    if [ "$t" -lt 45 ]; then
      say "$(printf '%-34s %s' "bench: the step under torch.profiler" "NOT RUN: ${t}s left of the budget, it needs 45")"
    else
      limited 120 3 "bench: the step under torch.profiler" "$py" bench/profile_step.py "$out/profile.json" \
        --sizes "${ZO_PROFILE_SIZES:-95M,1.3B}" --modes dpu,sync --gpu-fractions "${ZO_PROFILE_FRACTIONS:-0.8,0}" \
        --steps 2 || status=1
    fi
  fi
  ZO_DEVICE="$gpu" ZO_COMMIT="$commit" "$py" bench/summary.py --summary-json "$out" 2>>"$log" | tee -a "$summary" \
    && rm -f "$out/anchors.json" "$out/activations.json" "$out/step.json" || status=1
  say "commit it as bench/results/gpu-$(date -u +%Y-%m-%d)-${device_tag:-GPU}-anchors.json (and profile.json as"
  say "  bench/results/profile-$(date -u +%Y-%m-%d)-${device_tag:-GPU}.json: not a summary, outside gpu-*.json)"
  say "result: $([ $status = 0 ] && echo 'anchors, step rows and activations passed' \
    || echo 'anchors, step rows or activations FAILED')" \
    "on $gpu in $(($(date +%s) - start))s"
  exit $status
fi
if [ "$mode" = tests ]; then  # the default run's test stages alone, no benchmarks (bench/gpu_session.sh's tests part)
  build_stage 150 240 || status=1
  gpu_tests_stage "$((budget * 3 / 5))" 0 || status=1
  say "result: $([ $status = 0 ] && echo 'GPU tests passed' || echo 'GPU tests FAILED') on $gpu" \
    "in $(($(date +%s) - start))s"
  exit $status
fi
if [ "$mode" = scale ]; then
  build_stage 150 240 || status=1
  left=$((budget - ($(date +%s) - start) - 20))
  limited "$left" 15 "scale: largest model per setting" "$py" bench/scale_check.py "$out/scale.json" \
    --settings "$scale_settings" --budget-s "$((left - 10))" \
    ${ZO_SCALE_MIN_SHARE_S:+--min-share-s "$ZO_SCALE_MIN_SHARE_S"} || status=1
  grep -E "^\[scale .*(params|error|exited|timed out)" "$log" | tail -6 >>"$summary"
  ZO_DEVICE="$gpu" ZO_COMMIT="$commit" "$py" bench/summary.py --summary-json "$out" 2>>"$log" | tee -a "$summary" \
    && rm -f "$out/scale.json" || status=1
  say "commit it as bench/results/gpu-$(date -u +%Y-%m-%d)-${device_tag:-GPU}-scale.json"
  say "result: $([ $status = 0 ] && echo 'scale check passed' || echo 'scale check FAILED') on $gpu" \
    "in $(($(date +%s) - start))s"
  exit $status
fi
export ZO_BENCH_SIZES="${ZO_BENCH_SIZES:-1e7,1e8}" ZO_BENCH_COPY_MIB="${ZO_BENCH_COPY_MIB:-64,256,1024}"
say "benchmark sizes: ZO_BENCH_SIZES=$ZO_BENCH_SIZES ZO_BENCH_COPY_MIB=$ZO_BENCH_COPY_MIB; budget ${budget}s"
build_stage 150 330 || status=1
if [ "${ZO_CHECK_COMPILE:-0}" = 1 ]; then  # (CI compiles every kernel for sm_80/sm_90 on the CPU: 57 s here on the H200)
  limited 60 300 "triton kernels -> cubin sm_80/90" env -u TRITON_INTERPRET "$py" tests/triton_compile.py \
    "$out/triton_compile.json" || status=1
else
  say "$(printf '%-34s %s' "triton kernels -> cubin sm_80/90" "not run (CI compiles them on the CPU; ZO_CHECK_COMPILE=1)")"
fi
gpu_tests_stage 110 240 || status=1
bench() { # bench CAP RESERVE NAME JSON FILE [pytest args]: one benchmark suite into OUTDIR/JSON
  local cap="$1" reserve="$2" name="$3" json="$out/$4"
  shift 4
  limited "$cap" "$reserve" "$name" "$py" -m pytest -q -rs -p no:cacheprovider --benchmark-json="$json" "$@"
}
bench 60 200 "bench: pack, cast vs copy" bench-pack.json bench/test_bench_buckets.py || status=1
bench 45 160 "bench: H2D/D2H, writeback hidden" bench-transport.json bench/test_bench_transport.py -k cuda || status=1
# gpu_fraction 0 and auto (issue 20's Twin-Flow rows; on the H200 the 95M and 1.3B rows took ~120 s of the 130), each
# row also checkpointed (--checkpoint: a few more steps; the 57 s of the sm_80/90 compile stage are CI's now)
# (reserve 60 s, for the README's GPU examples after it; the activations and anchors have a command of their own, the
# anchors mode; here they get what is left) (no size started past half the stage's limit; a size cut short keeps its
# finished rows)
t=$(stage_s 150 60)
limited 150 60 "bench: step in parts (step_rows)" "$py" bench/step_rows.py "$out/step.json" \
  --sizes "${ZO_STEP_SIZES:-95M,1.3B}" --modes "${ZO_STEP_MODES:-sync,dpu,selective}" --budget-s "$((t / 2))" \
  --gpu-fractions "${ZO_STEP_FRACTIONS:-0,auto}" --checkpoint --state-dtype "${ZO_STEP_STATE_DTYPE:-fp32}" \
  "${step_args[@]}" || status=1
# --- README examples marked "# needs a GPU" (tests/readme_blocks.py; the CPU ones run in the default pytest; they ran
# on the H200: after the measurements now) ---
limited 120 70 "README: the GPU examples" "$py" tests/readme_blocks.py --gpu || status=1
# --- end of the README examples ---
install_wheels || status=1
activations_stage 60 15 --wide none || status=1  # (the wide shape's ~25 s: the anchors mode's, with 120 s)
anchors_stage 200 5 100 || status=1
say "--- benchmark ratios (bench/summary.py; best of N rounds)"
"$py" bench/summary.py "$out"/bench-*.json 2>>"$log" | tee -a "$summary" || status=1
# --- pack rows (issue 17, deliverable 1): bench/test_bench_buckets.py's cases (64 tensors at align 1 and 8, 1 tensor;
# ZO_BENCH_SIZES elements) as summary.json's "pack" rows {numel, tensors, align, zo_ms, copy_ms, torch_ref_ms, ...}
# (bench/summary_pack.py's pack_rows(); the table and MET/MISSED per target go to summary.txt)
if [ -s "$out/bench-pack.json" ]; then
  "$py" bench/summary_pack.py "$out/bench-pack.json" >/dev/null 2>>"$summary" || status=1  # the table; rows go to summary.json
else
  say "pack rows: no bench-pack.json (the pack benchmark did not finish)"
  status=1
fi
ZO_DEVICE="$gpu" ZO_COMMIT="$commit" "$py" bench/summary.py --summary-json "$out" 2>>"$log" | tee -a "$summary" \
  && rm -f "$out/step.json" "$out/anchors.json" "$out/activations.json" || status=1
say "commit it as bench/results/gpu-$(date -u +%Y-%m-%d)-${device_tag:-GPU}.json"
say "result: $([ $status = 0 ] && echo 'GPU checks passed' || echo 'GPU checks FAILED') on $gpu" \
  "in $(($(date +%s) - start))s"
exit $status
