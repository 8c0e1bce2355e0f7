"""Shared fixtures. Multi-process tests run on CPU over gloo through a reused RankPool per world
size (spawning 4 torch processes costs seconds on 2 cores); every call has a hard deadline, so a hung
collective fails the test instead of hanging CI."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")

from lightning_hotspa.testing.spawn import RankPool  # noqa: E402

_POOLS: dict[int, RankPool] = {}


def _pool(world: int) -> RankPool:
    if world not in _POOLS:
        _POOLS[world] = RankPool(world)
    return _POOLS[world]


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world).run(fn, *args)`` runs a module-level function on ``world`` gloo ranks."""
    yield _pool
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
