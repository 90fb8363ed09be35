#!/usr/bin/env bash
# Reduced-scale runs of each seed method in its own paper's setting, with FedAvg and Local on the
# same partition and seed (issue 3 evidence). Usage: benchmarks/seed_methods.sh [DATA_DIR] [OUT_DIR] [METHOD...]
# Rounds and local epochs are cut to fit a 2-core CPU; everything else follows settings.md §5.
set -euo pipefail
DATA=${1:-../shared/datasets}
OUT=${2:-runs/seed-methods}
shift 2 || true
METHODS=${*:-fedrema cwfedavg pfedcs dapfl pfedpm}
COMMON="data_dir=$DATA out_dir=$OUT backend=processes workers=2 seed=0 -q"

for method in $METHODS; do
  case $method in
  fedrema)  # FedReMa Table 1, MNIST: group_dominant s=0.2, 600/client, 80/20, B=100, SGD 0.01 mom 0.9 clip 10 (E=5, T=500 -> 20)
    pfedkit compare --algorithms fedrema,fedavg,local $COMMON dataset=mnist model=cnn num_clients=20 \
      partition.scheme=group_dominant partition.s=0.2 partition.samples_per_client=600 partition.train_ratio=0.8 \
      batch_size=100 lr=0.01 momentum=0.9 grad_clip=10 drop_last=true local_epochs=5 rounds=20 ;;
  cwfedavg)  # cwFedAvg Table 1, MNIST pathological 2 classes/client, 75/25, B=10, SGD 0.005, E=1 (T=1000 -> 10)
    pfedkit compare --algorithms cwfedavg,fedavg,local $COMMON dataset=mnist model=cnn num_clients=20 \
      partition.scheme=pathological partition.classes_per_client=2 batch_size=10 lr=0.005 local_epochs=1 rounds=10 ;;
  pfedcs)  # PFedCS Table 1, CIFAR-10 pathological C=2, 75/25, B=100, SGD 0.005 (E=5 -> 1, T=200 -> 10, beta=T/2)
    pfedkit compare --algorithms pfedcs,fedavg,local $COMMON dataset=cifar10 model=cnn num_clients=20 \
      partition.scheme=pathological partition.classes_per_client=2 batch_size=100 lr=0.005 local_epochs=1 \
      rounds=10 pfedcs.beta=5 headline.weighting=unweighted headline.point=last10 ;;
  dapfl)  # DA-PFL Table I, CIFAR-10 Dirichlet 0.5 on the official train split, 20 clients x 40%, B=10, SGD 0.01, E=1 (T=200 -> 25)
    pfedkit compare --algorithms dapfl,fedavg,local $COMMON dataset=cifar10 model=cnn_cifar num_clients=20 \
      join_ratio=0.4 partition.scheme=dirichlet partition.alpha=0.5 partition.least=10 \
      partition.test_split=official_fraction partition.test_fraction=0.1 batch_size=10 lr=0.01 local_epochs=1 rounds=25 headline.weighting=unweighted headline.point=last10 ;;
  pfedpm)  # pFedPM Table I, MNIST n-way k-shot n=3 k=100 noise 2, FedProto CNN, B=10, SGD 0.01 mom 0.5, E=1 (T=100 -> 40)
    pfedkit compare --algorithms pfedpm,fedavg,local $COMMON dataset=mnist model=cnn_proto num_clients=20 \
      partition.scheme=nway_kshot partition.n=3 partition.k=100 partition.n_noise=2 partition.k_noise=2 \
      batch_size=10 lr=0.01 momentum=0.5 local_epochs=1 rounds=40 ;;
  *) echo "unknown method $method" >&2; exit 2 ;;
  esac
done
