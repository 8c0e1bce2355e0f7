"""LlamaLM's hyper-parameters are plain values: Lightning's CSV and TensorBoard loggers write them as YAML
(a frozen dataclass config made ``Trainer(logger=CSVLogger(...))`` fail before the first step), and the
config read back builds the same model config (checkpoints and ``hotspa export`` read it from there)."""

from __future__ import annotations

import yaml
from lightning.pytorch.loggers import CSVLogger

from lightning_hotspa.models import LlamaConfig, LlamaLM
from lightning_hotspa.models.lightning_module import _as_config


def test_hparams_are_written_by_the_csv_logger_and_read_back_to_the_same_config(tmp_path):
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig.preset("tiny", n_layers=1, rope_scaling=scaling)  # Llama-3.1 rope scaling: a nested dataclass
    model = LlamaLM(config, seed=1, lr=1e-3)
    logger = CSVLogger(tmp_path, name="", version="")
    logger.log_hyperparams(model.hparams_initial)  # what the Trainer logs
    logger.save()
    written = yaml.safe_load((tmp_path / "hparams.yaml").read_text())
    assert written["lr"] == 1e-3 and written["seed"] == 1
    assert _as_config(written["config"]) == config == model.config
    assert written["config"]["rope_scaling"] == scaling
    assert _as_config(LlamaLM("tiny").hparams["config"]) == LlamaConfig.preset("tiny")
