#!/usr/bin/env bash
# The accelerator check: one command, at most 8 minutes. Writes device_check.json and device_check.md to
# $OUT (the device tool's output folder) or to ./device_check/, and prints the table.
#   bash scripts/device_check.sh            # on a GPU or TPU
#   bash scripts/device_check.sh --smoke    # anywhere: tiny shapes (a few minutes on a CPU)
#   bash scripts/device_check.sh --only-variants   # issue 57's rows alone: layer loops x XLA option sets
#                                                  # (with weight copies per step), projections joined or not
#   bash scripts/device_check.sh --only-attention  # decode attention alone at 1K, 8K and 32K per implementation
#                                                  # (dense, pallas_gpu, split_gpu), plain steps at 8K and 32K
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device_check}"
mkdir -p "$out"
if ! python -c "import retrace_jax" 2>/dev/null; then
  pip install -q -e . >"$out/pip.log" 2>&1
fi
python -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 470 python benchmarks/device_check.py --out-dir "$out" "$@"
