#!/usr/bin/env bash
# The one command that verifies the GPU path on a machine with one CUDA GPU and no network:
#   bash bench/gpu_check.sh OUTDIR
# Builds the project in place with the Python found here (torch, triton, pybind11, scikit-build-core, cmake,
# ninja, pytest, pytest-benchmark preinstalled), runs tests/test_gpu.py, the CUDA tests and the GPU benchmarks,
# and writes OUTDIR/gpu_check.log, OUTDIR/bench.json, OUTDIR/tests.xml and OUTDIR/summary.txt.
# Without a GPU it says so, runs the CPU-side compile checks (every Triton kernel to cubin for sm_80/sm_90,
# cuda/*.cu with nvcc where present) and exits with their status (0 when they pass).
set -uo pipefail
out="${1:?usage: bash bench/gpu_check.sh OUTDIR}"
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
  "$@" >>"$log" 2>&1
  rc=$?
  say "$(printf '%-34s %s (%ss)' "$name" "$([ $rc = 0 ] && echo ok || echo "FAILED rc=$rc")" $(($(date +%s) - t0)))"
  return $rc
}

say "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); $("$py" --version 2>&1)"
gpu="$("$py" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "")' 2>>"$log")"
status=0
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
if [ -z "$gpu" ]; then
  say "no CUDA GPU visible: the GPU tests and benchmarks did NOT run; CPU-side compile checks only"
  step "triton kernels -> cubin sm_80/90" env -u TRITON_INTERPRET "$py" tests/triton_compile.py "$out/triton_compile.json" || status=1
  if command -v nvcc >/dev/null 2>&1; then
    step "cuda/*.cu with nvcc sm_80/90" "$py" -m pytest -q -p no:cacheprovider tests/test_transport.py \
      -k nvcc || status=1
  else
    say "nvcc not found: cuda/*.cu not compiled"
  fi
  say "result: $([ $status = 0 ] && echo 'compile checks passed (no GPU)' || echo 'compile checks FAILED')"
  exit $status
fi

say "GPU: $gpu; torch $("$py" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
export ZO_BENCH_SIZES="${ZO_BENCH_SIZES:-1e7}"  # keeps the whole run well inside 9 minutes
step "build (pip install -e .)" "$py" -m pip install --no-build-isolation --no-deps -e . || status=1
step "triton kernels -> cubin sm_80/90" env -u TRITON_INTERPRET "$py" tests/triton_compile.py \
  "$out/triton_compile.json" || status=1
step "tests: GPU and CUDA" timeout 300 "$py" -m pytest -q -rs -p no:cacheprovider --junitxml="$out/tests.xml" \
  tests/test_gpu.py tests/test_transport.py tests/test_buckets.py tests/test_gpu_shaped.py || status=1
step "benchmarks: pack, cast, copies" timeout 200 "$py" -m pytest -q -p no:cacheprovider \
  bench/test_bench_buckets.py bench/test_bench_transport.py --benchmark-json="$out/bench.json" || status=1
grep -E "passed|failed|error" "$log" | grep -E "^[0-9=]" | tail -4 >>"$summary"
if [ -f "$out/bench.json" ]; then
  "$py" - "$out/bench.json" >>"$summary" 2>>"$log" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    gbs = b["extra_info"].get("GB/s")
    print(f"  {b['group']:<40} {b['extra_info'].get('provider', b['name']):<12} "
          f"min {b['stats']['min'] * 1e3:9.3f} ms" + (f"  {gbs:7.1f} GB/s" if gbs else ""))
PY
fi
say "result: $([ $status = 0 ] && echo 'GPU checks passed' || echo 'GPU checks FAILED') on $gpu"
exit $status
