"""Functional use of the run's model: forward any parameter dict without owning a module.

Server-side math (FedReMa's probe, cwFedAvg's head norms, feature statistics) and evaluation call
these with plain `Params`; the template module is never trained. It is on the ground floor because
algorithms receive it (`Setup.ops`, `Setup.ops_for(cid)`) and build.py makes it: both stand on core/.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call

from pfedkit.core.params import Params, clone, unprefixed


class ModelOps:
    """One architecture's functional forward: `build` makes the model (body + head), `template` is
    one eval-mode instance whose parameters are replaced by the caller's at each call."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        self.build = build
        self.template = build().eval()
        self.buffer_names = [name for name, _ in self.template.named_buffers()]

    def initial_params(self) -> Params:
        return clone(dict(self.template.named_parameters()))

    def initial_buffers(self) -> Params | None:
        buffers = dict(self.template.named_buffers())
        return clone(buffers) if buffers else None

    def _state(self, params: Params, buffers: Params | None) -> dict[str, torch.Tensor]:
        state = dict(params)
        if buffers:
            state.update(buffers)
        return state

    @torch.no_grad()
    def logits(self, params: Params, x: torch.Tensor, buffers: Params | None = None,
               chunk: int | None = None) -> torch.Tensor:
        """Eval-mode model output for x; `chunk`: at most that many samples per forward (memory)."""
        state = self._state(params, buffers)
        return _in_chunks(lambda block: functional_call(self.template, state, (block,)), x, chunk)

    @torch.no_grad()
    def features(self, params: Params, x: torch.Tensor, buffers: Params | None = None,
                 chunk: int | None = None) -> torch.Tensor:
        """Eval-mode body output for x; `chunk`: at most that many samples per forward (memory)."""
        state = self._state(params, buffers)
        body_state = unprefixed(state, "body")
        return _in_chunks(lambda block: functional_call(self.template.body, body_state, (block,)), x, chunk)

    @torch.no_grad()
    def head_logits(self, params: Params, features: torch.Tensor) -> torch.Tensor:
        return functional_call(self.template.head, unprefixed(params, "head"), (features,))


def _in_chunks(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """forward(x) computed on consecutive blocks of `chunk` samples and concatenated."""
    if chunk is None or len(x) <= chunk:
        return forward(x)
    return torch.cat([forward(block) for block in x.split(chunk)])
