"""FeSEM (Xie, Long, Shen, Zhou, Wang, Jiang, Zhang, arXiv:2005.01026, 2020; journal version Long
et al., World Wide Web 26(1), 2023): multi-center FL, K centre models fitted by stochastic EM on
the clients' local models.

Spec: baselines.md "FeSEM". The server keeps every client's latest uploaded local model w_i and
its n_i (the initial model, with no n_i, for a client that never uploaded) and K centres W_k.
Round t, on the server before the download (`broadcast`):

* initialisation [ours]: as soon as K clients have uploaded (round 2 under full participation),
  the centres become the stored models of K distinct uploaders drawn at random (seeded by
  (seed, t, SERVER, "fesem-init")): "K random clients' models after local training". Before,
  every centre is the initial model;
* E-step: each participant joins its nearest centre, argmin_k ||w_i - W_k||^2 (float64, all
  parameters; ties: the lowest k);
* M-step: each centre becomes the n_i-weighted mean of its members' stored models; members that
  never uploaded carry no weight (the server has neither their model nor n_i) [ours]; a centre
  without weighted members keeps its model;
* each participant downloads its centre, trains it E epochs (plain SGD on cross-entropy) and
  uploads the result (its new local model) with n_i.

Client state: its local model (initially the initial model). Evaluated: the local model.
Communication: one model down, one model + n_i up.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import Field

from pfedkit.algorithms import clusters
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, squared_distance_f64
from pfedkit.core.seeds import SERVER, numpy_rng


def squared_distances(model: Params, centres: list[Params]) -> list[float]:
    """[||w - W_k||^2 for each centre k], summed over all entries, in float64."""
    return [squared_distance_f64(model, centre) for centre in centres]


def e_step(models: dict[int, Params], centres: list[Params]) -> dict[int, int]:
    """Each client i -> argmin_k ||w_i - W_k||^2 (ties: the lowest k)."""
    return {cid: clusters.nearest(squared_distances(model, centres)) for cid, model in models.items()}


def m_step(centres: list[Params], models: dict[int, Params], assignment: dict[int, int],
           sizes: dict[int, float]) -> list[Params]:
    """W_k <- sum_{i in k} n_i w_i / sum_{i in k} n_i over the assigned clients (sorted ids); a
    centre whose members all have n_i = 0 (or that has none) is unchanged."""
    ordered = sorted(assignment)
    if not ordered:
        return list(centres)
    weights = clusters.one_hot_weights([assignment[c] for c in ordered], [sizes[c] for c in ordered], len(centres))
    return clusters.cluster_means(centres, [models[c] for c in ordered], weights)


def draw_initial_centres(seed: int, rnd: int, uploaders: list[int], k: int) -> list[int]:
    """K distinct clients among `uploaders`, uniformly at random from (seed, rnd, SERVER, "fesem-init")."""
    chosen = numpy_rng(seed, rnd, SERVER, "fesem-init").choice(sorted(uploaders), size=k, replace=False)
    return [int(c) for c in chosen]


@register
class FeSEM(Algorithm):
    name = "fesem"
    description = "FeSEM: K centres by stochastic EM on local models; each client trains from its nearest centre"
    evaluated_model = "own"

    class Hyper(HyperParams):
        """FeSEM hyperparameters.

        k: number of centres K. Default 3 [ours; the spec follows DA-PFL's 3 (20 clients) / 7
            (100 clients) convention]. K = 1 is FedAvg under full participation.
        Local epochs, lr and batch size come from the run config.
        """

        k: int = Field(3, ge=1, description="number of centre models K")

    def check(self) -> None:
        if self.hyper.k > self.setup.num_clients:
            raise ConfigError(f"fesem.k={self.hyper.k}: the centres are initialised from k distinct clients' models, "
                              f"but the run has {self.setup.num_clients} clients; set fesem.k <= num_clients")

    # --- state -------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        initial = clone(params)
        return {"centres": [initial] * self.hyper.k, "initial": initial, "initialised": False,
                "models": {}, "sizes": {}}  # latest upload and n_i per client that uploaded

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    # --- round -------------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        """Initialise the centres once K clients have uploaded, then E-step and M-step over the
        participants' stored models; each participant gets its centre. The new centres are written
        into `server` here (the engine's broadcast returns only the messages)."""
        centres = server["centres"]
        if not server["initialised"] and len(server["models"]) >= self.hyper.k:
            chosen = draw_initial_centres(self.setup.seed, rnd, list(server["models"]), self.hyper.k)
            centres = [server["models"][cid] for cid in chosen]
            server["initialised"] = True
            self.record(rnd, "centre_init_clients", np.asarray(chosen, dtype=np.int64))
        stored = {cid: server["models"].get(cid, server["initial"]) for cid in cids}
        assignment = e_step(stored, centres)
        centres = m_step(centres, stored, assignment, {cid: server["sizes"].get(cid, 0.0) for cid in cids})
        server["centres"] = centres
        self.record(rnd, "cluster_assignment", clusters.assignment_vector(self.setup.num_clients, assignment))
        return {cid: {"params": centres[assignment[cid]]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        trained = yield Fit(message["params"])
        return {"params": trained}, {"params": trained, "weight": data.n_train}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """Store each participant's new local model and n_i (the centres move at the next broadcast)."""
        models, sizes = dict(server["models"]), dict(server["sizes"])
        for cid in sorted(replies):
            models[cid] = replies[cid]["params"]
            sizes[cid] = float(replies[cid]["weight"])
        return {**server, "models": models, "sizes": sizes}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["params"]

    def joining_model(self, cid: int, server: dict, client: dict, data: ClientData) -> Params:
        """A newcomer has no local model to measure distances from: it takes the centre with the
        lowest loss on its training data [ours, IFCA's rule]."""
        from pfedkit.algorithms.ifca import choose_cluster

        centre, _ = choose_cluster(self.setup.ops_for(cid), server["centres"], data)
        return server["centres"][centre]
