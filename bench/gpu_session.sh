#!/usr/bin/env bash
# One device command for a lent GPU (the device tool: 15 minutes a session, 10 a command, the machine given back
# after 30 s idle, at most 8 files back from OUTDIR, 2 folders down): build once, then the parts of
# bench/gpu_check.sh named in PLAN, each a gpu_check.sh run of its own with ZO_SKIP_BUILD=1 and its share of the
# command's time, every output folded into OUTDIR/session.tgz, each part's summary.json (where it writes one) beside it.
#   bash bench/gpu_session.sh OUTDIR [PLAN]
# PLAN: comma-separated parts, run in that order (default tests,anchors: the sixth run, 2026-11-27, ran
# scale,tests,profile,anchors in 535 s and cut the tests, the activation rows and all anchors but torch's at their
# shares; its tests then passed in a second command. Tests need ~170 s, anchors ~300 s: two parts fill a command.
# The eighth run, 2026-11-28 on an H200, fit a 15-minute lease as: ZO_SESSION_S=570 ... tests,anchors (503 s), then at
# once on the warm machine ZO_SESSION_S=270 ... profile (78 s); the host part (~90 s) fits beside the profile there):
#   scale       gpu_check.sh scale: ZO_SCALE_SETTINGS (default here s2-8bit,s2-fp32,s3-cpu: the DPU settings)
#   tests       gpu_check.sh tests: the default run's tests without its benchmarks (tests/test_gpu.py,
#               test_transport.py and the CUDA activation test, then tests/test_gpu_two_ranks.py: stages 1, 2, 3,
#               3+cpu on two gloo processes over CUDA tensors)
#   default     gpu_check.sh (tests, pack, transport, step rows, ...; it wants 345 s or more)
#   profile     bench/profile_step.py alone, the rows whose time nothing attributed first: the 95M GPT's DPU and
#               synchronous steps at gpu_fraction 0, batch 32 x 512 (the DPU step 1.17-1.21x its floor on the H100,
#               seventh run), then the 1.3B GPT's at 0.8 and 0, batch 8 (the DPU step at 0.8: 52% of 110 ms outside
#               kernels and copies on the H200),
#               each run's rows in OUTDIR/profile.json as they finish (the anchors part then skips its own profile)
#   anchors     gpu_check.sh anchors (step rows at batch 32, activations, anchors with .whl/ carried, the profile)
#   host        bench/bucket_host.py alone: where a bucket's host time goes, the 1.3B and 95M GPTs' DPU steps
#               (ZO_HOST_SIZES), each with the optimizer's default buckets and with 2**24-element ones (the default
#               until 2026-11-28: 131 buckets at 1.3B; at 95M the two are one row), into OUTDIR/bucket_host.json
#               (its first form, four rows, took ~90 s with the build on the H200, eighth run)
# ZO_SESSION_S: the command's seconds (default 570, under the tool's 600 s limit); the build takes what it needs
# (~50 s), then each part gets its weight's share of what is left (scale 6, tests 3, default 7, profile 2,
# anchors 4, host 2), less 10 s for the archive. What comes back: session.tgz (every part's folder), session.txt (every
# part's summary.txt, in order), PART-summary.json for each gpu_check.sh part, profile.json and bucket_host.json: at
# most 8 files.
# On an H100 (its scale row never measured): ZO_SCALE_SETTINGS=s2-8bit-sync,s2-8bit. Without a GPU each part takes
# gpu_check.sh's own no-GPU path (the CPU-side checks; the tests skip). Ran once on a GPU (the H200's sixth run,
# docs/gpu-runs.md); tests/test_gpu_check_stages.py runs it on a stand-in machine.
set -uo pipefail
out="${1:?usage: bash bench/gpu_session.sh OUTDIR [PLAN]}"
plan="${2:-tests,anchors}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
total="${ZO_SESSION_S:-570}"
start=$(date +%s)
text="$out/session.txt"
: >"$text"
say() { echo "$*" | tee -a "$text"; }
weight() { case "$1" in scale) echo 6 ;; tests) echo 3 ;; default) echo 7 ;; profile) echo 2 ;; anchors) echo 4 ;;
  host) echo 2 ;; *) echo 0 ;; esac; }
IFS=, read -r -a parts <<<"$plan"
for p in "${parts[@]}"; do
  if [ "$(weight "$p")" = 0 ]; then
    echo "bash bench/gpu_session.sh OUTDIR [PLAN]: unknown part '$p' (scale, tests, default, profile, anchors, host)" >&2
    exit 2
  fi
done
work="$(mktemp -d)"  # (after the plan's check: a refused plan leaves nothing behind)
trap 'rm -rf "$work"' EXIT
say "gpu_session $(date -u +%Y-%m-%dT%H:%M:%SZ): plan $plan, ${total}s"
t0=$(date +%s)
timeout 150 "$py" -m pip install -q --no-build-isolation --no-deps -e . >"$work/build.log" 2>&1
say "build (pip install -e .): rc $? in $(($(date +%s) - t0))s"
# the profile part: the 95M rows (both modes at gpu_fraction 0, batch ZO_PROFILE_BATCH, default 32 x 512: the step
# rows' batch, where the DPU step was 1.17-1.21x forward + backward on the H100, bar 1.15) with 40% of its time, then
# the 1.3B ones (batch 8; DPU at 0.8 first) with the rest; each script writes its rows as they finish, merged into
# OUTDIR/profile.json
profile_part() {
  local dir="$1" budget="$2" rc=0 first
  first=$((budget * 2 / 5))
  timeout -k 5 "$first" "$py" bench/profile_step.py "$dir/profile-95M.json" --sizes 95M --modes dpu,sync \
    --gpu-fractions 0 --batch "${ZO_PROFILE_BATCH:-32}" --steps 2 >"$dir/profile.txt" 2>&1 || rc=1
  timeout -k 5 "$((budget - ($(date +%s) - t0) - 3))" "$py" bench/profile_step.py "$dir/profile-1.3B.json" \
    --sizes 1.3B --modes dpu,sync --gpu-fractions 0.8,0 --steps 2 >>"$dir/profile.txt" 2>&1 || rc=1
  cat "$dir/profile.txt" >>"$text"
  "$py" -c 'import json, os, sys; rows = [r for f in sys.argv[2:] if os.path.exists(f) for r in json.load(open(f))]
json.dump(rows, open(sys.argv[1], "w"), indent=1)' "$out/profile.json" "$dir/profile-95M.json" \
    "$dir/profile-1.3B.json" || rc=1
  return $rc
}
# the host part: bench/bucket_host.py's rows, its lines (the last 12, warnings left out) into session.txt
host_part() {
  local dir="$1" budget="$2" rc
  timeout -k 5 "$((budget - 3))" "$py" bench/bucket_host.py "$out/bucket_host.json" \
    --sizes "${ZO_HOST_SIZES:-1.3B,95M}" --modes dpu --bucket-numels default,16777216 >"$dir/host.txt" 2>&1
  rc=$?
  grep -v Warning "$dir/host.txt" | tail -12 >>"$text"
  return $rc
}
skip_profile=$([[ ",$plan," == *,profile,* ]] && echo 1 || echo 0)  # (the anchors part's profile: done already)
status=0
left_weight=0
for p in "${parts[@]}"; do left_weight=$((left_weight + $(weight "$p"))); done
for p in "${parts[@]}"; do
  w=$(weight "$p")
  left=$((total - ($(date +%s) - start) - 10))
  budget=$((left * w / left_weight))
  left_weight=$((left_weight - w))
  if [ "$budget" -lt 30 ]; then
    say "$p: NOT RUN (${budget}s of the ${total}s left for it)"
    status=1
    continue
  fi
  say "--- $p: ${budget}s"
  dir="$work/$p"
  mkdir -p "$dir"
  t0=$(date +%s)
  if [ "$p" = profile ] || [ "$p" = host ]; then
    "${p}_part" "$dir" "$budget"
    rc=$?
    say "$p: rc $rc in $(($(date +%s) - t0))s"
    [ "$rc" = 0 ] || status=1
    continue
  fi
  mode=$([ "$p" = default ] && echo "" || echo "$p")
  # (a scale setting after the first starts with 90 s left, not gpu_check's 150: on the H200 the 12.0B DPU setting
  # took 69 s in all)
  ZO_SKIP_PROFILE=$skip_profile ZO_SKIP_BUILD=1 ZO_CHECK_BUDGET_S=$((budget - 5)) ZO_SCALE_SETTINGS="${ZO_SCALE_SETTINGS:-s2-8bit,s2-fp32,s3-cpu}" \
    ZO_SCALE_MIN_SHARE_S="${ZO_SCALE_MIN_SHARE_S:-90}" timeout -k 5 "$budget" bash bench/gpu_check.sh "$dir" $mode \
    >/dev/null 2>&1
  rc=$?
  cat "$dir/summary.txt" >>"$text" 2>/dev/null
  [ -s "$dir/summary.json" ] && cp "$dir/summary.json" "$out/$p-summary.json"
  say "$p: rc $rc in $(($(date +%s) - t0))s"
  [ "$rc" = 0 ] || status=1
done
tar czf "$out/session.tgz" -C "$work" . && rm -rf "$work"
say "gpu_session: $([ $status = 0 ] && echo passed || echo 'FAILED (a part above)') in $(($(date +%s) - start))s;" \
  "commit each PART-summary.json as bench/results/gpu-DATE-DEVICE[-PART].json, profile.json as" \
  "bench/results/profile-DATE-DEVICE.json"
exit $status
