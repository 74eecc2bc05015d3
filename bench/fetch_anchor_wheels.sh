#!/usr/bin/env bash
# Fetch, on a machine with a package registry, the wheels bench/anchors.py needs that the GPU machine's image lacks,
# into .whl/ at the repository root (ignored by git; carried with the device run, 64 MiB in all):
#   bash bench/fetch_anchor_wheels.sh
# Python 3.12, manylinux x86_64, --no-deps: an explicit list. The image already has torch, numpy, einops, msgpack,
# ninja, packaging, psutil, py-cpuinfo, tqdm, nvidia-ml-py. DeepSpeed publishes no wheel (a source archive only):
# it is built here into a pure-Python wheel with DS_BUILD_OPS=0 (its CPU Adam op is then built on first use, with
# ninja, on the GPU machine). On the GPU machine gpu_check.sh installs them with
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl   (and PYTHONPATH=/tmp/site)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
dest=.whl
# name==version, one per line: one version of each (two stop the whole install)
BINARY=(
  torchao==0.18.0            # CPUOffloadOptimizer (torchao.optim); no dependencies
  hjson==3.1.0               # deepspeed
  pydantic==2.14.3           # deepspeed (>= 2)
  pydantic-core==2.50.4      # pydantic 2.14.3 pins it
  annotated-types==0.8.0     # pydantic
  typing-inspection==0.4.5   # pydantic
  typing-extensions==4.16.0  # pydantic needs >= 4.16 (the image's may be older)
)
SOURCE=(deepspeed==0.19.8)
rm -rf "$dest"
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$dest" "${BINARY[@]%%[[:space:]]*}"
for spec in "${SOURCE[@]}"; do  # pure-Python wheels built from source archives (need torch importable here)
  DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "$spec"
done
for f in "$dest"/*.whl; do
  case "$f" in *-py3-none-any.whl | *cp312* | *abi3* | *py2.py3* ) ;; *) echo "not for cp312: $f" >&2; exit 1 ;; esac
done
n=$(ls "$dest"/*.whl | wc -l)
size=$(du -sk "$dest" | cut -f1)
echo "$n wheels, $((size / 1024)) MiB in $dest:"
ls -1 "$dest"
if [ "$size" -gt $((48 * 1024)) ]; then
  echo "too large to carry beside the working tree (> 48 MiB)" >&2
  exit 1
fi
