#!/usr/bin/env bash
# benchmarks/gpu_run.sh RESULTS_DIR [--cpu-small]
#
# The simulation benchmark with JAX on the GPU, streams sized to fill it: 576 agents (sparse,
# slots 96) with 1 .. 1,024 streams and 9,216 agents (slots 1,536) with 1 .. 64 streams, on
# stream prefixes (40 x N/6 tasks, past the detector's warm-up), each point in its own process
# (benchmarks/scale_speed.py: cold compile, steady tasks/s, µs per task, peak host RSS).
# Writes RESULTS_DIR/gpu_table.md (the tables), RESULTS_DIR/gpu_rows_*.json and RESULTS_DIR/env.txt.
# Budget: under 8 minutes on one H200 (not yet measured on a GPU: no GPU was available here).
#
# --cpu-small: the same script on CPU with small sizes (JAX_PLATFORMS=cpu), so it is tested
# without a GPU (tests/test_benchmarks.py).
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: benchmarks/gpu_run.sh RESULTS_DIR [--cpu-small]" >&2
    exit 2
fi
out=$1
mode=${2:-gpu}
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python}
mkdir -p "$out"
{
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    echo "host: $(uname -srm), $(nproc) cores"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "gpu: none"
    "$python" -c "import jax; print('jax', jax.__version__, jax.devices())"
} > "$out/env.txt" 2>&1

if [[ "$mode" == "--cpu-small" ]]; then
    export JAX_PLATFORMS=cpu
    runs=("--sizes 6 --streams-at 6 --widths 2 --prefix-per-six 10 --repeats 1")
else
    if ! "$python" -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)"; then
        echo "gpu_run.sh: JAX sees no GPU (jax.default_backend() != 'gpu'); install jax[cuda12] or use --cpu-small" >&2
        exit 1
    fi
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
    runs=("--no-sizes --streams-at 576 --widths 1 64 256 1024 --prefix-per-six 40 --repeats 1"
          "--no-sizes --streams-at 9216 --widths 1 16 64 --prefix-per-six 40 --repeats 1")
fi
: > "$out/gpu_table.md"
k=0
for run in "${runs[@]}"; do
    # shellcheck disable=SC2086  # the flags of one run, split on spaces
    "$python" "$here/scale_speed.py" $run --out "$out/gpu_rows_$k.json" | tee -a "$out/gpu_table.md"
    k=$((k + 1))
done
echo "gpu_run.sh: tables in $out/gpu_table.md"
