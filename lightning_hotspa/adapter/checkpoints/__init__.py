"""Checkpoints: DCP folders, their trust checks, nodes, upgrades and exports."""
