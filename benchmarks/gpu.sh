#!/usr/bin/env bash
# GPU and many-core figures (issue 26): FedAvg, MNIST, Dirichlet 0.1 (iid beyond 100 clients),
# FedAvgCNN, B=10, E=1, lr 0.005. Usage, on the machine with the GPU:
#   benchmarks/gpu.sh [tests|bench|processes|ray|anchor|scaling|all] [DATA_DIR] [OUT_DIR]
#   tests   : the CUDA tests (tests/test_device.py, tests/test_gpu_backends.py; they skip without CUDA)
#   bench   : s/round of sequential and vectorized on the GPU at 20, 100 and 1,000 clients
#   processes: s/round of the processes backend on GPUs (spawned workers) at 20 and 100 clients:
#             1 worker on cuda:0, 2 workers on cuda:0, and one worker per GPU (device=cuda)
#   ray     : s/round of the ray backend on GPUs at 20 and 100 clients: one actor per GPU, and
#             two per GPU (ray.gpus_per_worker=0.5); needs pip install -e '.[ray]' 
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
  $PY -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_device.py tests/test_gpu_backends.py 2>&1 | tail -25
fi

if [[ $WHAT == bench || $WHAT == all ]]; then
  for clients in ${CLIENTS:-20 100 1000}; do
    scheme=$([ "$clients" -gt 100 ] && echo iid || echo dirichlet)
    bench --rounds 3 --backend vectorized --clients $clients partition.scheme=$scheme device=cuda
    [[ -z ${SKIP_SEQUENTIAL:-} ]] && bench --rounds 3 --backend sequential --clients $clients partition.scheme=$scheme device=cuda
  done
fi

if [[ $WHAT == processes || $WHAT == all ]]; then
  GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
  for clients in ${CLIENTS_PARALLEL:-20 100}; do
    scheme=$([ "$clients" -gt 100 ] && echo iid || echo dirichlet)
    bench --rounds 3 --backend processes --workers 1 --clients $clients partition.scheme=$scheme device=cuda:0
    bench --rounds 3 --backend processes --workers 2 --clients $clients partition.scheme=$scheme device=cuda:0
    [ "$GPUS" -gt 1 ] && bench --rounds 3 --backend processes --workers "$GPUS" --clients $clients partition.scheme=$scheme device=cuda
  done
fi

if [[ $WHAT == ray || $WHAT == all ]]; then
  for clients in ${CLIENTS_PARALLEL:-20 100}; do
    scheme=$([ "$clients" -gt 100 ] && echo iid || echo dirichlet)
    bench --rounds 3 --backend ray --clients $clients partition.scheme=$scheme device=cuda
    bench --rounds 3 --backend ray --clients $clients partition.scheme=$scheme device=cuda ray.gpus_per_worker=0.5
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
