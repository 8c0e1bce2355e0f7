"""A Lightning callback that keeps each training step's loss and wall seconds (this rank's), for the
recipes that compare a Trainer run with the single process or time it (``benchmark_measured.py``,
``e2e_mixed.py``)."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.callbacks import Callback


class StepRecord(Callback):
    """``losses``: each step's loss as ``training_step`` returned it; ``seconds``: from the batch's start
    to its end (the optimizer step included). :meth:`after_step` adds what a recipe reads per step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        self.seconds.append(time.perf_counter() - self._t0)
        self.after_step(trainer)

    def after_step(self, trainer: Any) -> None:
        """Called after each step's loss and seconds are kept (nothing here).

        Args:
            trainer: the running Trainer.
        """
