"""The algorithms and models by name, without importing them: what `pfedkit list`, `pfedkit config`
and config validation need to know (names, descriptions, an algorithm's options with their
defaults and the ranges `pfedkit tune` searches, the options it removed, which algorithms allow heterogeneous models, which models
read token ids).

The modules of algorithms and models import torch, which alone takes seconds to start; a command
that only lists names, or refuses a misspelt key, should not wait for it. So the facts, once read
from the classes, are cached as `catalog-<digest>.json` in the cache directory ($PFEDKIT_CACHE,
else ~/.cache/pfedkit), the digest taken over the sources they come from (pfedkit/algorithms,
pfedkit/models, pfedkit/core/contract.py). An edited or added algorithm changes the digest: the
next command reads the classes again and writes a new file. Nothing to regenerate by hand.

A process that has imported the algorithms or the models (a user's script, a test) may have
registered its own (`@register`, `MODELS[...]`): there the catalog is read from the live classes,
every time, so a name registered at run time is known.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# What the catalog is made from, relative to the package: a change there gives another digest.
SOURCES = ("algorithms", "models", "core/contract.py", "core/search.py")
# Imported in this process: algorithms or models may have been registered at run time.
LIVE_MODULES = ("pfedkit.algorithms.registry", "pfedkit.models")


@dataclass(frozen=True)
class Option:
    """One option of an algorithm (a field of its `Hyper`)."""
    default: str  # as `pfedkit list` prints it
    description: str
    searched: str = ""  # the range `pfedkit tune` searches (declared on the option: core/search.py); "": none


@dataclass(frozen=True)
class AlgorithmEntry:
    description: str
    options: dict[str, Option]
    heterogeneous_models: bool  # Algorithm.supports_heterogeneous_models
    removed: dict[str, str]  # Algorithm.removed_options: option -> why it went and what to set instead


@dataclass(frozen=True)
class ModelEntry:
    description: str
    token_ids: bool  # reads token ids (text), not images or feature vectors


@dataclass(frozen=True)
class Catalog:
    algorithms: dict[str, AlgorithmEntry]  # by name, sorted
    models: dict[str, ModelEntry]  # in pfedkit.models.MODELS's order


def catalog() -> Catalog:
    """The live classes' catalog where they are imported already, else the cached one for the
    sources as they are (built from the classes, and cached, when there is none)."""
    if any(module in sys.modules for module in LIVE_MODULES):
        return build_catalog()
    cached = cache_file()
    stored = _read_stored(cached)
    if stored is not None:
        return _from_dict(stored)
    built = build_catalog()
    _write_cache(cached, built)
    return built


def cache_file(digest: str | None = None) -> Path:
    """Where the catalog of the sources with `digest` (default: as they are now) is cached."""
    root = Path(os.environ.get("PFEDKIT_CACHE") or Path.home() / ".cache" / "pfedkit")
    return root / f"catalog-{digest or source_digest()}.json"


def build_catalog() -> Catalog:
    """The catalog read from the classes themselves (imports every algorithm and model)."""
    from pfedkit.algorithms import algorithm_names, get_algorithm
    from pfedkit.core.search import declared_ranges, range_in_words
    from pfedkit.models import MODELS

    algorithms = {}
    for name in algorithm_names():
        algorithm = get_algorithm(name)
        ranges = declared_ranges(algorithm.Hyper)
        options = {key: Option(str(field.default), field.description or "",
                               range_in_words(ranges[key]) if key in ranges else "")
                   for key, field in algorithm.Hyper.model_fields.items()}
        algorithms[name] = AlgorithmEntry(algorithm.description, options,
                                          bool(algorithm.supports_heterogeneous_models),
                                          dict(algorithm.removed_options))
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
    return json.dumps(asdict(built), indent=1, ensure_ascii=False) + "\n"


def _read_stored(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or damaged: built again
        return None


def _write_cache(path: Path, built: Catalog) -> None:
    """Best effort: a cache that cannot be written only costs the next command the import."""
    from pfedkit.atomic import atomic_write_text

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, catalog_json(built))
    except OSError:
        pass


def _from_dict(data: dict[str, Any]) -> Catalog:
    algorithms = {name: AlgorithmEntry(entry["description"],
                                       {key: Option(**option) for key, option in entry["options"].items()},
                                       entry["heterogeneous_models"], entry["removed"])
                  for name, entry in data["algorithms"].items()}
    models = {name: ModelEntry(**entry) for name, entry in data["models"].items()}
    return Catalog(algorithms, models)
