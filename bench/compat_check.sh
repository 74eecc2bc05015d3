#!/usr/bin/env bash
# The default suite under another Python and torch (README "Versions"):
#   bash bench/compat_check.sh PYTHON TORCH_VERSION [VENV_DIR]
#   e.g. bash bench/compat_check.sh /root/.pyenv/versions/3.10.13/bin/python3.10 2.6.0
# Builds a venv (default /tmp/zo-compat-TORCH; PyPI's torch wheels are CUDA builds, several GB, that run on the CPU),
# installs that torch (and the Triton it pins), the test extras without letting them move torch, the project in
# place, and runs the README's test command. The venv stays for a re-run; remove it when done.
set -euo pipefail
py="${1:?usage: bash bench/compat_check.sh PYTHON TORCH_VERSION [VENV_DIR]}"
torch_version="${2:?usage: bash bench/compat_check.sh PYTHON TORCH_VERSION [VENV_DIR]}"
venv="${3:-/tmp/zo-compat-$torch_version}"
cd "$(dirname "$0")/.."
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
pip install -q "torch==$torch_version" numpy pytest pytest-benchmark pybind11 scikit-build-core
pip install -q "torch==$torch_version" "transformers>=4.46" "peft>=0.13" "accelerate>=1.0" "safetensors>=0.4" \
  "lightning>=2.0" matplotlib
pip install -q --no-build-isolation --no-deps -e .
python -m pip list 2>/dev/null | grep -i -E '^(torch|triton|transformers|lightning) ' || true
python -m pytest -q -p no:cacheprovider
