#!/usr/bin/env bash
# Speed and memory figures of issue 4 (FedAvg, MNIST, Dirichlet 0.1, FedAvgCNN, B=10, E=1, lr 0.005).
# Usage: benchmarks/speed.sh [DATA_DIR]. Each bench prints one JSON line last; run on an idle machine.
set -euo pipefail
DATA=${1:-../shared/datasets}
B="pfedkit bench --data-dir $DATA"
$B --rounds 3 --backend sequential
$B --rounds 3 --backend sequential channels_last=false
$B --rounds 3 --backend processes
$B --rounds 3 --backend processes --precision bf16
$B --rounds 3 --backend sequential --precision bf16
# scaling: same data over 100 and 1,000 clients; fedavg (no client state) and local (a model per client).
# Dirichlet 0.1 cannot give 1,000 clients PFLlib's minimum of 35 samples each, so 1,000 uses iid.
for algorithm in fedavg local; do
  $B --rounds 2 --backend processes --clients 100 --algorithm $algorithm
  $B --rounds 2 --backend processes --clients 1000 --algorithm $algorithm partition.scheme=iid
done
