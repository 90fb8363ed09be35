"""The errors every layer raises for a configuration a user wrote: one line each, meant for them."""
from __future__ import annotations

from collections.abc import Iterable
from difflib import get_close_matches
from typing import Any


class ConfigError(ValueError):
    """Invalid configuration. `str(err)` is one line meant for the user."""


class ConfigWarning(UserWarning):
    """A configuration that runs, but not as written (an option that has no effect, a value
    lowered to what is possible). The command line prints it as one `warning:` line."""


def did_you_mean(word: Any, choices: Iterable[str]) -> str:
    """` (did you mean X?)` for the closest of `choices` to a misspelt `word`, or ""."""
    close = get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
