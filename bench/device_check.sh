#!/usr/bin/env bash
# The checks only hardware can answer, on one GPU or TPU node, in under 8 minutes (docs/deploy.md).
#   bench/device_check.sh [OUT_DIR]       -> OUT_DIR/device_check.jsonl (default: the current directory)
# Installs what it needs (a virtual environment from pyproject.toml, JAX's build for the accelerator).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
mkdir -p "$out"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet --upgrade pip
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install --quiet -e '.[jax]' 'jax[cuda12]'
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_experimental_parallel_collective_overlap_limit=2"
elif [ -e /dev/accel0 ] || [ -e /dev/vfio/0 ]; then
    .venv/bin/pip install --quiet -e '.[jax,tpu]'
else
    echo "no GPU (nvidia-smi) or TPU (/dev/accel0) here: run it on the accelerator host" >&2
    exit 2
fi
timeout 480 .venv/bin/python bench/device_check.py --out "$out/device_check.jsonl"
