"""Train a model with HotSPa from the Hydra configs in the top-level ``configs/``.

    python recipes/train.py                                   # = make train (tiny, 4 CPU processes)
    python recipes/train.py model=small strategy=static_tp2xcp2 logger=csv trainer.max_steps=20
    torchrun --nproc-per-node 8 recipes/train.py trainer=gpu8 strategy=hotspa_8gpu hydra.run.dir=outputs/run1

With ``trainer.devices=N`` Lightning re-runs this script in N-1 more processes and passes them this
run's ``hydra.run.dir``, so all ranks share one output folder. Do not use Hydra's ``--multirun`` with
Lightning's launcher (each job would launch its own processes from a sweep process); run sweeps as
separate invocations (e.g. a shell loop over torchrun), see docs/configuration.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a checkout works without installing

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from lightning_hotspa.adapter.recipes.hydra_recipe import (  # noqa: E402
    CONFIG_DIR,
    ConfigError,
    check_overrides,
    register_resolvers,
    train,
)
from lightning_hotspa.data.errors import DataError  # noqa: E402
from lightning_hotspa.layout import LayoutError  # noqa: E402
from lightning_hotspa.plan import PlanError  # noqa: E402

register_resolvers()


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        status = train(cfg)
    except (ConfigError, LayoutError, DataError, PlanError) as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        kind = "config error" if isinstance(exc, ConfigError) else f"error ({type(exc).__name__})"
        print(f"{kind}: {exc}\n(set HYDRA_FULL_ERROR=1 for the traceback)", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if status:
        raise SystemExit(status)


def main() -> None:
    """Hydra's main, after one check of the command line: a strategy key that moved into an option group
    (``strategy.compile_blocks=true``) is named with its new place, not refused by Hydra as unknown."""
    moved = check_overrides(sys.argv[1:])
    if moved is not None:
        print(f"config error: {moved}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
