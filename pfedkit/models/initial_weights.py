"""A model's initial weights from a file (config `init_weights`): a run that starts where another
library's run, a pretrained model or an earlier run starts (e.g. PFLlib's initial FedAvgCNN of a
seed, benchmarks/conformance).

The file is `torch.save` of {name: tensor}. Names are the run's model's (`body.conv1.weight`) or the
same without the `body.` / `head.` part (`conv1.weight`): those stay valid whichever layers
`head_split` puts in the head. Every parameter must be there with its shape; buffers (BatchNorm
statistics) are taken when present. The file is read with `weights_only=True`: tensors and plain
containers only, never code.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pfedkit.core.errors import ConfigError

PARTS = ("body.", "head.")


def read_initial_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The {name: tensor} of `path`; ConfigError when it is missing or holds anything else."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"init_weights={path}: no such file")
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # not a torch file, or one holding more than tensors
        raise ConfigError(f"init_weights={path}: not a file of tensors torch.load reads with weights_only "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None
    if not (isinstance(weights, dict) and weights and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                          for k, v in weights.items())):
        raise ConfigError(f"init_weights={path}: expected a non-empty dict of name -> tensor "
                          f"(torch.save(model.state_dict(), path)), got {type(weights).__name__}")
    return weights


def unprefixed_name(name: str) -> str:
    """`body.conv1.weight` -> `conv1.weight`: the name whichever part of the model holds the layer."""
    for part in PARTS:
        if name.startswith(part):
            return name[len(part):]
    return name


@torch.no_grad()
def load_initial_weights(model: nn.Module, weights: dict[str, torch.Tensor], source: str) -> nn.Module:
    """`model` with `weights` copied in (matched by full or unprefixed name); ConfigError naming
    what is missing, unknown or of another shape."""
    own = dict(model.named_parameters())
    own.update(model.named_buffers())
    by_short = {unprefixed_name(name): name for name in own}
    matched: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in weights.items():
        target = name if name in own else by_short.get(name)
        if target is None:
            unknown.append(name)
        else:
            matched[target] = tensor
    missing = [name for name, _ in model.named_parameters() if name not in matched]
    wrong = [f"{name} {tuple(matched[name].shape)} (the model's: {tuple(own[name].shape)})"
             for name in matched if matched[name].shape != own[name].shape]
    if unknown or missing or wrong:
        problems = [f"{label}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                    for label, names in (("not in the model", unknown), ("missing", missing),
                                         ("of another shape", wrong)) if names]
        raise ConfigError(f"init_weights={source} does not fit the run's model ({'; '.join(problems)}); "
                          f"the model's parameters: {', '.join(list(by_short)[:6])} ...")
    for name, tensor in matched.items():
        own[name].copy_(tensor)
    return model
