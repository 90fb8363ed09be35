"""Shipped config presets: one YAML file each, selected with `preset=<name>` (see pfedkit.config)."""
