"""A run's identity across pfedkit versions: a key added since a run was written counts as its default."""
from pfedkit.config import load_config
from pfedkit.run_identity import MISSING, changed_keys, identity


def _written_before(key: str, config) -> dict:
    stored = identity(config)
    stored.pop(key)
    return stored


def test_a_key_absent_from_an_older_run_equals_its_default():
    config = load_config({"dataset": "digits"})
    assert changed_keys(_written_before("new_clients", config), identity(config)) == {}
    assert changed_keys(identity(config), _written_before("validation_fraction", config)) == {}


def test_a_key_absent_from_an_older_run_differs_from_a_non_default_value():
    config = load_config({"dataset": "digits", "new_clients": 2, "num_clients": 6})
    changes = changed_keys(_written_before("new_clients", config), identity(config))
    assert changes == {"new_clients": (MISSING, 2)}


def test_changed_values_and_unknown_keys_are_still_reported():
    config = load_config({"dataset": "digits"})
    stored = identity(config)
    stored["lr"] = stored["lr"] * 2
    stored["retired_key"] = 1  # a key no Config has: no default to fall back on
    assert set(changed_keys(stored, identity(config))) == {"lr", "retired_key"}
