"""The epoch a progress bar shows under ``max_steps`` alone (issue 54): Lightning's own pick of bar
read ``Epoch 0/-2``; under hotspa it reads ``Epoch <n>/<total>`` counted from 1."""

import lightning as L
import pytest
from lightning.pytorch.callbacks import RichProgressBar

from lightning_hotspa.adapter.observability.epochs import number_lightning_bars


def test_lightning_rich_bar_counts_epochs_from_one_under_max_steps() -> None:
    pytest.importorskip("rich")
    trainer = L.Trainer(max_steps=5, logger=False, enable_checkpointing=False, accelerator="cpu", devices=1,
                        enable_model_summary=False)
    bar = trainer.progress_bar_callback
    assert isinstance(bar, RichProgressBar)  # Lightning's default where rich is installed
    bar._trainer = trainer  # noqa: SLF001 - what Lightning's setup does
    trainer.fit_loop.max_epochs = -1  # what Trainer._run sets for max_steps without max_epochs
    assert bar._get_train_description(0).strip() == "Epoch 0/-2"  # noqa: SLF001 - Lightning's own text
    number_lightning_bars(trainer)
    assert bar._get_train_description(0).strip() == "Epoch 1"  # noqa: SLF001 - no total known before fit
    trainer.fit_loop.max_epochs = 3
    assert bar._get_train_description(0).strip() == "Epoch 1/3"  # noqa: SLF001
