"""The algorithms and models by name, without importing them: what `pfedkit list`, `pfedkit config`
and config validation need to know (names, descriptions, an algorithm's options with their
defaults, which algorithms allow heterogeneous models, which models read token ids).

The modules of algorithms and models import torch, which alone takes seconds to start; a command
that only lists names, or refuses a misspelt key, should not wait for it. So these facts are kept
in catalog.json, beside this module, written from the classes by

    python -m pfedkit.catalog

The file records a digest of the sources it was made from (pfedkit/algorithms, pfedkit/models,
pfedkit/core/contract.py). When they changed since (an algorithm added or edited without writing
the file again), `catalog()` builds the catalog from the classes instead: slower, never stale.
tests/test_startup.py fails until the file is written again, so the fast path cannot rot.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CATALOG_FILE = Path(__file__).with_name("catalog.json")
# What the catalog is made from, relative to the package: a change there makes catalog.json stale.
SOURCES = ("algorithms", "models", "core/contract.py")


@dataclass(frozen=True)
class Option:
    """One option of an algorithm (a field of its `Hyper`)."""
    default: str  # as `pfedkit list` prints it
    description: str


@dataclass(frozen=True)
class AlgorithmEntry:
    description: str
    options: dict[str, Option]
    heterogeneous_models: bool  # Algorithm.supports_heterogeneous_models


@dataclass(frozen=True)
class ModelEntry:
    description: str
    token_ids: bool  # reads token ids (text), not images or feature vectors


@dataclass(frozen=True)
class Catalog:
    algorithms: dict[str, AlgorithmEntry]  # by name, sorted
    models: dict[str, ModelEntry]  # in pfedkit.models.MODELS's order


@functools.cache
def catalog() -> Catalog:
    """catalog.json when it was made from the sources as they are, else built from the classes."""
    stored = _read_stored()
    if stored is not None and stored.get("sources") == source_digest():
        return _from_dict(stored)
    return build_catalog()


def build_catalog() -> Catalog:
    """The catalog read from the classes themselves (imports every algorithm and model)."""
    from pfedkit.algorithms import algorithm_names, get_algorithm
    from pfedkit.models import MODELS

    algorithms = {}
    for name in algorithm_names():
        algorithm = get_algorithm(name)
        options = {key: Option(str(field.default), field.description or "")
                   for key, field in algorithm.Hyper.model_fields.items()}
        algorithms[name] = AlgorithmEntry(algorithm.description, options,
                                          bool(algorithm.supports_heterogeneous_models))
    models = {name: ModelEntry(info.description, info.token_ids) for name, info in MODELS.items()}
    return Catalog(algorithms, models)


def source_digest() -> str:
    """SHA-256 over the SOURCES' Python files (names and contents); "" when one cannot be read."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    try:
        files = sorted(path for source in SOURCES for path in
                       ((package / source).rglob("*.py") if (package / source).is_dir() else [package / source]))
        for path in files:
            digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    except OSError:
        return ""
    return digest.hexdigest()


def catalog_json(built: Catalog) -> str:
    """catalog.json's text for `built`, with the digest of the sources as they are now."""
    return json.dumps({"sources": source_digest(), **asdict(built)}, indent=1, ensure_ascii=False) + "\n"


def _read_stored() -> dict[str, Any] | None:
    try:
        return json.loads(CATALOG_FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _from_dict(data: dict[str, Any]) -> Catalog:
    algorithms = {name: AlgorithmEntry(entry["description"],
                                       {key: Option(**option) for key, option in entry["options"].items()},
                                       entry["heterogeneous_models"])
                  for name, entry in data["algorithms"].items()}
    models = {name: ModelEntry(**entry) for name, entry in data["models"].items()}
    return Catalog(algorithms, models)


if __name__ == "__main__":  # python -m pfedkit.catalog: write catalog.json from the classes
    from pfedkit.atomic import atomic_write_text

    atomic_write_text(CATALOG_FILE, catalog_json(build_catalog()))
    print(f"wrote {CATALOG_FILE}")
