#!/usr/bin/env bash
# Device check for a lent H100/H200: host-to-device bandwidth, loader -> device, loader-fed step.
# Usage: benchmarks/device/run.sh [--cpu-smoke] [--seconds S] [--out DIR] [--profile]   (table -> $OUT/device.md;
#   --profile: jax.profiler traces of the loader-fed steps of issue 16 -> $OUT/trace)
# On the accelerator machine the image's python3 has jax with CUDA; here the project's .venv runs
# the --cpu-smoke variant. Set PYTHON to choose another interpreter.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ] && [[ " $* " == *" --cpu-smoke "* ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/device/device_bench.py "$@"
