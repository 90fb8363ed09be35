"""LG-FedAvg (Liang et al., arXiv:2001.01523, 2020): a private body, a global head.

The mirror of FedPer: the top layers (here the head, L_g = 1 as in FL-bench and PFLlib) are
averaged, the local representation stays on the client. The paper's optional FedAvg pre-training
is not done. Evaluated: own body + global head. Communication: |head| up and down.
"""
from __future__ import annotations

from pfedkit.algorithms.fedper import FedPer
from pfedkit.algorithms.registry import register


@register
class LGFedAvg(FedPer):
    name = "lg_fedavg"
    description = "LG-FedAvg: FedAvg on the head, each client keeps its own body"
    evaluated_model = "shared_head"
    shared = "head"
