#!/usr/bin/env bash
# GPU and many-core figures (issue 26): FedAvg, MNIST, Dirichlet 0.1 (iid beyond 100 clients),
# FedAvgCNN, B=10, E=1, lr 0.005. Usage, on the machine with the GPU:
#   benchmarks/gpu.sh [tests|bench|anchor|scaling|all] [DATA_DIR] [OUT_DIR]
#   tests   : the CUDA tests (tests/test_device.py; they skip on machines without CUDA)
#   bench   : s/round of sequential and vectorized on the GPU at 20, 100 and 1,000 clients
#   anchor  : PFLlib's FedAvg on the same GPU and setting (needs .anchor/, see benchmarks/RESULTS.md)
#   scaling : the processes backend on the CPU at 1, 2, 4, 8, 16 workers
# Each bench prints one JSON line last; they are also collected in OUT_DIR/gpu_bench.jsonl.
set -uo pipefail
WHAT=${1:-all}
DATA=${2:-${PFEDKIT_DATA:-../shared/datasets}}
OUT_DIR=${3:-${OUT:-.}}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
B="$PY -m pfedkit.cli bench --data-dir $DATA"
JSONL="$OUT_DIR/gpu_bench.jsonl"

bench() {  # one bench; its JSON line (the last) appended to the collection
  echo "== bench $*"
  $B "$@" 2>&1 | tee /tmp/pfedkit-bench.log | tail -3
  tail -1 /tmp/pfedkit-bench.log | grep '^{' >> "$JSONL"
}

if [[ $WHAT == tests || $WHAT == all ]]; then
  $PY -m pytest -q -p no:cacheprovider tests/test_device.py 2>&1 | tail -25
fi

if [[ $WHAT == bench || $WHAT == all ]]; then
  for clients in ${CLIENTS:-20 100 1000}; do
    scheme=$([ "$clients" -gt 100 ] && echo iid || echo dirichlet)
    bench --rounds 3 --backend vectorized --clients $clients partition.scheme=$scheme device=cuda
    [[ -z ${SKIP_SEQUENTIAL:-} ]] && bench --rounds 3 --backend sequential --clients $clients partition.scheme=$scheme device=cuda
  done
fi

if [[ $WHAT == anchor || $WHAT == all ]]; then
  if [ -x .anchor/run_pfllib.sh ]; then
    bash .anchor/run_pfllib.sh "$DATA/mnist/mnist.npz.xz" cuda 3 2>&1 | tail -30
    cp .anchor/*cuda*.log "$OUT_DIR/" 2>/dev/null
  else
    echo "anchor: .anchor/run_pfllib.sh not found (PFLlib is fetched and set up by hand; see benchmarks/RESULTS.md)"
  fi
fi

if [[ $WHAT == scaling || $WHAT == all ]]; then
  for workers in 1 2 4 8 16; do
    bench --rounds 2 --backend processes --workers $workers device=cpu
  done
fi
