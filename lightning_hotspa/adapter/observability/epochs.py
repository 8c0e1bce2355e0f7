"""The epoch a progress bar shows: ``Epoch <n>/<total>``, counted from 1, for ours and Lightning's bars.

Why: a run bounded by ``max_steps`` alone has ``max_epochs = -1`` in Lightning, and its
``RichProgressBar`` (what Lightning picks by default when ``rich`` is installed) reads ``Epoch 0/-2``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["epoch_text", "number_lightning_bars"]


def epoch_text(trainer: Any) -> str:
    """``Epoch <n>/<total>`` counted from 1: the total is ``max_epochs``, or for a run bounded by
    ``max_steps`` the epochs those steps span (``Epoch <n>`` where neither bounds the run).

    Args:
        trainer: the fitting Trainer (``num_training_batches`` known).
    """
    epoch = trainer.current_epoch + 1
    total = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
    per_epoch = trainer.num_training_batches
    steps = trainer.max_steps
    if steps is not None and steps > 0 and isinstance(per_epoch, int) and per_epoch > 0:
        accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        by_steps = -(-steps * accumulate // per_epoch)
        total = by_steps if total is None else min(total, by_steps)
    return f"Epoch {epoch}/{total}" if total else f"Epoch {epoch}"


def number_lightning_bars(trainer: Any) -> None:
    """Lightning's ``RichProgressBar`` on ``trainer`` (Lightning's default where ``rich`` is installed)
    shows :func:`epoch_text` instead of ``Epoch <n>/<max_epochs - 1>`` (``Epoch 0/-2`` under
    ``max_steps`` alone). Lightning's ``TQDMProgressBar`` shows ``Epoch <n>``, nothing to fix; a
    Rich bar without the private hook it patches is left as it is.

    Args:
        trainer: the Trainer being set up.
    """
    from lightning.pytorch.callbacks import RichProgressBar

    bar = getattr(trainer, "progress_bar_callback", None)
    if not isinstance(bar, RichProgressBar) or not hasattr(bar, "_get_train_description"):
        return

    def describe(current_epoch: int) -> str:
        text = epoch_text(trainer)
        width = len(getattr(bar, "validation_description", ""))
        return f"{text:{width}}" if width > len(text) else text  # Lightning pads it so, against flicker

    bar._get_train_description = describe  # noqa: SLF001 - Lightning's only seam for the description
