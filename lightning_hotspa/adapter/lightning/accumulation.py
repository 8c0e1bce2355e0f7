"""``accumulate_grad_batches=N``: the N Lightning batches (step plans, or ordinary batches) of one
optimizer step summed so that the update is the token mean over all of them, as DDP sums them.

Like DDP under ``no_sync``, the batches' gradients are summed before they are reduced: each batch's
micro-batch losses are scaled by its share of the window before their backward, and the step runner
keeps the working gradients unreduced from one batch to the next (``carry_out``) where its first
stage shares gradients with the last one's; what a batch does reduce adds into the engine's store.
A batch weighs its global target tokens (one that does not count them, an ordinary DataLoader
without ``num_target_tokens``, weighs 1: Lightning's ``loss / N``). The weights are relative to the
window's first batch times N, since later batches are not known yet; at the window's last batch the
store goes to the home ``.grad``, times (first x N) / (the window's total) where that is not exactly
1 (uneven token counts, a short last window of an epoch), before clipping and the optimizer hooks.
For N a power of two and equal batches the arithmetic is DDP's, bit for bit (docs/DESIGN.md §7).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["GradAccumulation"]


class GradAccumulation:
    """The token weights of one optimizer step's window of batches; the engine holds their sum."""

    def __init__(self) -> None:
        self.reference = 0.0  # the window's first batch's weight times N (0: no batch yet)
        self.weight = 0.0  # the tokens (or batches) summed so far in this window
        self.skipped = False  # a non-finite batch in this window: no update at its end

    def scale(self, tokens: int, batches: int) -> float:
        """The factor on this batch's loss weights: its tokens over the reference (the window's
        first batch's tokens times ``batches``, Lightning's ``accumulate_grad_batches``).

        Args:
            tokens: the batch's global target tokens (<= 0: not counted, weighs 1).
            batches: the batches per optimizer step (``accumulate_grad_batches``).
        """
        w = float(tokens) if tokens > 0 else 1.0
        if not self.reference:
            self.reference = w * batches
        self.weight += w
        return w / self.reference

    def finish(self, home: Mapping[str, nn.Parameter], engine: Any, *, skip: bool, last: bool) -> None:
        """After one batch: at the window's last, hands the engine's summed gradients to ``home``.

        Args:
            home: the home parameters (their ``.grad`` is set at the window's last batch only).
            engine: the switch engine whose store holds the window's reduced gradients.
            skip: the batch had a non-finite loss (``nonfinite="skip"``): the window makes no update.
            last: this batch ends the window (Lightning steps the optimizer after it).
        """
        self.skipped = self.skipped or skip
        if not last:
            for p in home.values():  # Lightning zeroed them; nothing is handed over before the last
                p.grad = None
            return
        if self.skipped:
            for p in home.values():
                p.grad = None
        else:
            engine.assign_home_grads()
            factor = self.reference / self.weight
            if factor != 1.0:
                for p in home.values():
                    if p.grad is not None:
                        p.grad.mul_(factor)
        engine.clear_grad_store()
        self.reference, self.weight, self.skipped = 0.0, 0.0, False
