"""The names of the backends (config `backend`): the one list the config, the command line and
`pfedkit.build.RUNTIMES` (name -> the runtime's row: factory, default threads) share.

The runtimes themselves live high up (engine/runtimes/) and the config low down, so the names
are kept here, on the ground floor, where both and the command line (which must start without
loading pydantic or torch) can read them. `pfedkit.build` checks at import that its table has
exactly these names, in this order.
"""
from __future__ import annotations

BACKENDS = ("sequential", "processes", "vectorized", "ray")
