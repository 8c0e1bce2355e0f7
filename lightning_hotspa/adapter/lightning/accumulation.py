"""``accumulate_grad_batches=N``: the home gradients of the N Lightning batches (step plans, or
ordinary batches) of one optimizer step summed so that the update is the token mean over all of them.

Each plan's gradient reaches the strategy as its own token mean (docs/DESIGN.md §4, "Loss"); the
plan's global target tokens weigh it, and the sum is divided by the window's total at its last
batch, before clipping and the optimizer hooks see it. So N plans give exactly the update of one
plan of N times the tokens. Batches that do not count their tokens (an ordinary DataLoader without
``num_target_tokens``) weigh 1 each, Lightning's ``loss / N``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["GradAccumulation"]


class GradAccumulation:
    """The running, token-weighted sum of one optimizer step's batch gradients on the home params."""

    def __init__(self) -> None:
        self.weight = 0.0  # the tokens (or batches) summed so far in this window
        self.skipped = False  # a non-finite batch in this window: no update at its end

    def add(self, home: Mapping[str, nn.Parameter], engine: Any, tokens: int, *, skip: bool, last: bool) -> None:
        """Adds one batch's gradients (from the engine's store) and finishes the window at its last.

        Args:
            home: the home parameters (their ``.grad`` is the running sum).
            engine: the switch engine holding this batch's reduced gradients.
            tokens: the batch's global target tokens (<= 0: unknown, weighs 1).
            skip: the batch had a non-finite loss (``nonfinite="skip"``): the window makes no update.
            last: this batch ends the window (Lightning steps the optimizer after it).
        """
        previous = {n: p.grad for n, p in home.items()} if self.weight else {}
        if skip:
            self.skipped = True
        else:
            engine.assign_home_grads()
            w = float(tokens) if tokens > 0 else 1.0
            for name, p in home.items():
                if p.grad is not None:
                    p.grad.mul_(w)
                    if previous.get(name) is not None:
                        p.grad.add_(previous[name])
            self.weight += w
        if skip:
            for name, p in home.items():
                p.grad = previous.get(name)
        if last:
            for p in home.values():
                if self.skipped or p.grad is None:
                    p.grad = None
                else:
                    p.grad.div_(self.weight)
            self.weight, self.skipped = 0.0, False
