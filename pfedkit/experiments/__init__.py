"""Experiments over many runs: seeded comparisons and the papers' tables beside the papers' numbers."""
