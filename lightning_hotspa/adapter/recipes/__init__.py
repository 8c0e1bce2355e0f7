"""Hydra glue: a composed recipe config checked and built into the run's objects."""
