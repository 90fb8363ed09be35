#!/usr/bin/env bash
# GPU and many-core figures (issue 26): FedAvg, MNIST, Dirichlet 0.1 (iid beyond 100 clients),
# FedAvgCNN, B=10, E=1, lr 0.005. Usage, on the machine with the GPU:
#   benchmarks/gpu.sh [setup|tests|bench|lockstep|processes|ray|anchor|scaling|all|size] [DATA_DIR] [OUT_DIR]
#   setup   : (run before every step, so also first by all; safe to repeat) when pydantic or ray does
#             not import, unpack .devcarry/site.tar.xz (cp312 manylinux x86_64 wheels: pydantic, ray,
#             ...; built by benchmarks/devcarry.sh) into /tmp/site; PYTHONPATH=/tmp/site:$PWD
#   tests   : the CUDA tests (tests/test_device.py, tests/test_gpu_backends.py; they skip without CUDA);
#             PYTEST_ARGS adds pytest arguments, e.g. PYTEST_ARGS="-x -n 8" or "-k 'ray or vectorized'"
#   bench   : s/round of sequential and vectorized on the GPU at 20, 100 and 1,000 clients
#   lockstep: (issue 49) vectorized with CUDA graphs beside the eager step (EAGER= skips it) at CLIENTS
#             (20 100; Dirichlet 0.1), sequential at 100 (SEQUENTIAL= skips it), graphs at MANY (1000 10000) iid clients with
#             their peak GPU memory (memory flat in the number of clients); LOCKSTEP_ROUNDS (3) each
#   (processes and ray: PARALLEL_ROUNDS (3), CLIENTS_PARALLEL (20 100), WORKERS_ON_ONE_GPU (1 2),
#    GPU_SHARES (1 0.5: ray.gpus_per_worker))
#   processes: s/round of the processes backend on GPUs (spawned workers) at 20 and 100 clients:
#             1 worker on cuda:0, 2 workers on cuda:0, and one worker per GPU (device=cuda)
#   ray     : s/round of the ray backend on GPUs at 20 and 100 clients: one actor per GPU, and
#             two per GPU (ray.gpus_per_worker=0.5); needs ray (pip install -e '.[ray]', or setup)
#   anchor  : PFLlib's FedAvg on the same GPU and the bench's setting at 20 clients (the conformance
#             split mnist_dir01_bench, seed 0; benchmarks/conformance/README.md), PFLlib's own time cost
#             per round; PFLlib from $PFLLIB (a folder holding its system/; default .devcarry/pfllib),
#             scratch $ANCHOR_SCRATCH (default /tmp/pfllib-anchor); ANCHOR_ROUNDS (3), ANCHOR_DEVICE (cuda)
#   scaling : the processes backend on the CPU at 1, 2, 4, 8, 16 workers
#   size    : (here, before a call; not in all) the bytes that travel to the device machine: git's
#             tracked and untracked-not-ignored files plus the carried paths in $CARRY (.devcarry)
# DATA_DIR: $PFEDKIT_DATA, else .devcarry/data when present, else ../shared/datasets.
# Each bench prints one JSON line last; they are also collected in OUT_DIR/gpu_bench.jsonl.
set -uo pipefail
WHAT=${1:-all}
DEFAULT_DATA=../shared/datasets
[ -d .devcarry/data ] && DEFAULT_DATA=.devcarry/data
DATA=${2:-${PFEDKIT_DATA:-$DEFAULT_DATA}}
OUT_DIR=${3:-${OUT:-.}}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
B="$PY -m pfedkit.cli bench --data-dir $DATA"
JSONL="$OUT_DIR/gpu_bench.jsonl"

bench() {  # one bench; its JSON line (the last) appended to the collection
  echo "== bench $*"
  $B "$@" 2>&1 | tee /tmp/pfedkit-bench.log | tail -3
  tail -1 /tmp/pfedkit-bench.log | grep '^{' >> "$JSONL"
}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

if [[ $WHAT == size ]]; then  # here, not on the device machine: what a call would send
  tracked=$(git ls-files -z | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
  untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null |
              awk '{ s += $1 } END { print s + 0 }')
  carried=0
  for path in ${CARRY:-.devcarry}; do
    [ -e "$path" ] && carried=$((carried + $(du -sb "$path" | cut -f1)))
  done
  total=$((tracked + untracked + carried))
  echo "tracked $(mib "$tracked"), untracked not ignored $(mib "$untracked"), carried (${CARRY:-.devcarry}) $(mib "$carried")"
  echo "total $(mib "$total") of the 64 MiB a call may send"
  git ls-files --others --exclude-standard | sed 's/^/  untracked, travels: /'
  [ "$total" -lt $((56 * 1048576)) ] || { echo "size: over 56 MiB, too little margin"; exit 1; }
  exit 0
fi

# setup: pfedkit's requirements that the image lacks (pydantic, ray and theirs), unpacked once
if ! PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} $PY -c "import pydantic, ray" 2>/dev/null; then
  if [ -f .devcarry/site.tar.xz ]; then
    echo "== setup: unpacking .devcarry/site.tar.xz into $SITE"
    mkdir -p "$SITE" && tar -xJf .devcarry/site.tar.xz -C "$SITE" || { echo "setup: unpacking failed"; exit 1; }
  else
    echo "setup: pydantic or ray does not import and .devcarry/site.tar.xz is absent (benchmarks/devcarry.sh builds it)"
  fi
fi
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
if [[ $WHAT == setup || $WHAT == all ]]; then
  $PY -c "import sys, torch, pydantic, ray, pfedkit
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      'pydantic', pydantic.VERSION, 'ray', ray.__version__, 'data', '$DATA')" || exit 1
fi

if [[ $WHAT == tests || $WHAT == all ]]; then
  eval "extra=(${PYTEST_ARGS:-})"  # shell words, so quotes group: PYTEST_ARGS="-k 'ray and not flower'"
  # the whole log in OUT_DIR as it comes (a step cut by a time limit still leaves what it printed)
  $PY -m pytest -q -p no:cacheprovider -m "slow or not slow" "${extra[@]}" tests/test_device.py tests/test_gpu_backends.py tests/test_lockstep.py \
    2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -25
fi

if [[ $WHAT == bench || $WHAT == all ]]; then
  for clients in ${CLIENTS:-20 100 1000}; do
    scheme=$([ "$clients" -gt 100 ] && echo iid || echo dirichlet)
    bench --rounds 3 --backend vectorized --clients $clients partition.scheme=$scheme device=cuda
    [[ -z ${SKIP_SEQUENTIAL:-} ]] && bench --rounds 3 --backend sequential --clients $clients partition.scheme=$scheme device=cuda
  done
fi

if [[ $WHAT == lockstep || $WHAT == all ]]; then
  R=${LOCKSTEP_ROUNDS:-3}  # the same count for every line, so their final_acc compare too
  for clients in ${CLIENTS:-20 100}; do
    bench --rounds "$R" --backend vectorized --clients $clients device=cuda vectorized.step=graphs
    [[ -n ${EAGER-1} ]] && bench --rounds "$R" --backend vectorized --clients $clients device=cuda vectorized.step=eager
  done
  [[ -n ${SEQUENTIAL-1} ]] && bench --rounds "$R" --backend sequential --clients 100 device=cuda
  for clients in ${MANY:-1000 10000}; do
    bench --rounds "$R" --backend vectorized --clients $clients partition.scheme=iid device=cuda vectorized.step=graphs
  done
fi

if [[ $WHAT == processes || $WHAT == all ]]; then
  GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
  for clients in ${CLIENTS_PARALLEL:-20 100}; do
    scheme=$([ "$clients" -gt 100 ] && echo iid || echo dirichlet)
    for workers in ${WORKERS_ON_ONE_GPU:-1 2}; do
      bench --rounds "${PARALLEL_ROUNDS:-3}" --backend processes --workers $workers --clients $clients \
        partition.scheme=$scheme device=cuda:0
    done
    [ "$GPUS" -gt 1 ] && bench --rounds "${PARALLEL_ROUNDS:-3}" --backend processes --workers "$GPUS" \
      --clients $clients partition.scheme=$scheme device=cuda
  done
fi

if [[ $WHAT == ray || $WHAT == all ]]; then
  for clients in ${CLIENTS_PARALLEL:-20 100}; do
    scheme=$([ "$clients" -gt 100 ] && echo iid || echo dirichlet)
    for share in ${GPU_SHARES:-1 0.5}; do
      bench --rounds "${PARALLEL_ROUNDS:-3}" --backend ray --clients $clients partition.scheme=$scheme device=cuda \
        ray.gpus_per_worker=$share
    done
  done
fi

if [[ $WHAT == anchor || $WHAT == all ]]; then
  PFLLIB=${PFLLIB:-.devcarry/pfllib}
  SCRATCH=${ANCHOR_SCRATCH:-/tmp/pfllib-anchor}
  DEVICE=${ANCHOR_DEVICE:-cuda}
  C="$PY benchmarks/conformance/conformance.py"
  LOG=$SCRATCH/logs/mnist_dir01_bench/PFLlib-FedAvg-s0.log
  if [ -f "$PFLLIB/system/main.py" ]; then
    echo "== anchor: PFLlib FedAvg from $PFLLIB, mnist_dir01_bench seed 0, ${ANCHOR_ROUNDS:-3} rounds, $DEVICE"
    $C run --pfllib "$PFLLIB" --scratch "$SCRATCH" --split mnist_dir01_bench --method FedAvg --seeds 0 \
      --rounds "${ANCHOR_ROUNDS:-3}" --side PFLlib --device "$DEVICE" --data-dir "$DATA" || tail -30 "$LOG"
    cp "$LOG" "$OUT_DIR/pfllib-anchor-${DEVICE//:/-}.log" 2>/dev/null
    $C times "$LOG" | tee /tmp/pfllib-anchor-times.txt
    tail -1 /tmp/pfllib-anchor-times.txt | grep '^{' >> "$JSONL"
  else
    echo "anchor: $PFLLIB/system/main.py not found (PFLlib's system/ folder at d832e76: benchmarks/devcarry.sh copies it)"
  fi
fi

if [[ $WHAT == scaling || $WHAT == all ]]; then
  for workers in 1 2 4 8 16; do
    bench --rounds 2 --backend processes --workers $workers device=cpu
  done
fi
