#!/usr/bin/env bash
# Speed and memory figures (issues 4 and 11): FedAvg, MNIST, Dirichlet 0.1, FedAvgCNN, B=10, E=1, lr 0.005.
# Usage: benchmarks/speed.sh [DATA_DIR] > speed.log. Each bench prints one JSON line last; run on an
# idle machine and compare ratios within one run (the machine is shared, absolute times drift).
set -euo pipefail
DATA=${1:-../shared/datasets}
B="pfedkit bench --data-dir $DATA"

# 1. The reference round on this CPU: fp32, then the levers that may or may not pay here.
$B --rounds 3 --backend sequential
$B --rounds 3 --backend processes
$B --rounds 3 --backend processes --compile
NATIVE_BF16=$(python -c "import torch; print(int(torch.ops.mkldnn._is_mkldnn_bf16_supported()))")
if [ "$NATIVE_BF16" = 1 ]; then
  $B --rounds 3 --backend processes --precision bf16 --parity   # speed + accuracy parity after 10 rounds
else
  echo "this CPU has no native bf16: bf16 rows skipped (pfedkit refuses precision=bf16 here)"
fi

# 2. Scaling: the same data over 100, 1,000 and 10,000 clients (iid: Dirichlet 0.1 cannot give
#    every client PFLlib's minimum size at 1,000+). fedavg: no client state; local: a model per
#    client, in memory and on disk (client_states=disk); 10,000 local models are 23 GB of fp32
#    state: on disk only (client_states=auto chooses it where memory is short).
for clients in 100 1000 10000; do
  $B --rounds 2 --backend processes --clients $clients --algorithm fedavg partition.scheme=iid
done
for clients in 100 1000; do
  $B --rounds 2 --backend processes --clients $clients --algorithm local partition.scheme=iid client_states=memory
done
for clients in 1000 10000; do
  $B --rounds 2 --backend processes --clients $clients --algorithm local partition.scheme=iid client_states=disk
done

# 3. GPU (only where one is present): the vectorized backend against sequential on the same GPU.
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  for clients in 20 100 1000; do
    scheme=$([ "$clients" -gt 100 ] && echo iid || echo dirichlet)
    $B --rounds 3 --backend sequential --clients $clients partition.scheme=$scheme
    $B --rounds 3 --backend vectorized --clients $clients partition.scheme=$scheme
  done
else
  echo "no GPU here: vectorized-vs-sequential GPU rows skipped"
fi
