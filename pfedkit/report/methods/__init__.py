"""Each method's diagnostic figures, found by the algorithm's module name.

An algorithm only records diagnostics (`Algorithm.record`, saved as the run's diagnostics.pt);
drawing them is the report's job. `pfedkit/report/methods/<module>.py` draws the diagnostics of
the algorithms defined in `pfedkit/algorithms/<module>.py` through one function
`draw(diagnostics, out_dir) -> list[Path]`. The lookup is by name, not by a table, so adding a
method's figures is adding one file here. A subclass defined in another module (and without a
drawing module of its own) gets its parent's figures: the lookup walks the class's MRO and the
first module with a drawing module wins. No drawing module anywhere in the MRO: nothing is drawn.

`shared.py` holds the drawings several methods use (cluster maps, mixing matrices, local-global
distances); it has no `draw` and is never found by the lookup, since no algorithm module in
pfedkit/algorithms/ is named `shared`.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

ALGORITHMS_PACKAGE = "pfedkit.algorithms."


def drawing_module_name(algorithm_cls: type) -> str | None:
    """The full name of the drawing module for `algorithm_cls`, or None when it has none."""
    for klass in algorithm_cls.__mro__:
        # only classes of pfedkit's own algorithm modules: a user's module that happens to be
        # called like one of ours must not borrow our figures
        if not klass.__module__.startswith(ALGORITHMS_PACKAGE):
            continue
        name = f"{__name__}.{klass.__module__.removeprefix(ALGORITHMS_PACKAGE)}"
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def draw_diagnostics(algorithm_cls: type, diagnostics: dict[str, dict[int, Any]], out_dir: Path) -> list[Path]:
    """Draw the recorded `diagnostics` of a run of `algorithm_cls` as PNGs into out_dir; returns
    the files written ([] when the algorithm has no drawing module)."""
    name = drawing_module_name(algorithm_cls)
    if name is None:
        return []
    return importlib.import_module(name).draw(diagnostics, Path(out_dir))
