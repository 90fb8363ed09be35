#!/usr/bin/env bash
# Issues 7 and 8 evidence: every algorithm pfedkit has (seed methods included) on MNIST, 20 clients, FedAvgCNN, B=10, E=1, lr 0.005,
# processes backend, under (a) Dirichlet 0.1 and (b) pathological 2 classes per client.
# Usage: benchmarks/baselines.sh [DATA_DIR] [OUT_DIR] [ALGORITHMS (comma-separated)] [key=value ...]
#   e.g. benchmarks/baselines.sh ../shared/datasets runs/baselines all rounds=20 partition.pool_fraction=0.2
# Finished runs (summary.json present) are skipped, so an interrupted sweep continues where it
# stopped. The table: python benchmarks/baselines_table.py OUT_DIR
set -euo pipefail
DATA=${1:-../shared/datasets}
OUT=${2:-runs/baselines}
ALGOS=${3:-all}
shift 3 || true
EXTRA="$*"
if [ "$ALGOS" = all ]; then
  ALGOS=$(python -c "from pfedkit.algorithms import algorithm_names; print(','.join(algorithm_names()))")
fi
COMMON="data_dir=$DATA out_dir=$OUT backend=processes workers=2 seed=0 dataset=mnist model=cnn num_clients=20 batch_size=10 local_epochs=1 lr=0.005 rounds=20"
declare -A PARTITIONS=(
  [dir0.1]="partition.scheme=dirichlet partition.alpha=0.1"
  [pat2]="partition.scheme=pathological partition.classes_per_client=2"
)
for part in dir0.1 pat2; do
  for algo in ${ALGOS//,/ }; do
    name="$part-$algo"
    if [ -f "$OUT/$name/summary.json" ]; then echo "skip $name (done)"; continue; fi
    if [ -d "$OUT/$name" ]; then
      pfedkit run -q --resume "$OUT/$name"
    else
      pfedkit run -q $COMMON ${PARTITIONS[$part]} algorithm=$algo name=$name $EXTRA
    fi
  done
done
