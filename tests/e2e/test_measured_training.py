"""Issue 53: the measured cost planner in a real 4-rank CPU Trainer: the gathered stage table feeds it
on every rank alike, and its state (corrections, exploration, published decisions) survives a checkpoint."""

from __future__ import annotations

import warnings

import lightning as L
import torch.distributed as dist
from helpers import lightning_rank_env
from test_profiled import LAYOUTS, TOKENS_PER_RANK, _datamodule

import lightning_hotspa  # noqa: F401  (registers "hotspa")
from lightning_hotspa import HotSPaStrategy
from lightning_hotspa.models import LlamaLM
from lightning_hotspa.planner.profiled.measured_planner import MeasuredCostPlanner


def _planner() -> MeasuredCostPlanner:
    return MeasuredCostPlanner(LAYOUTS, model="tiny", hardware="cpu-gloo", tokens_per_rank=TOKENS_PER_RANK,
                               activation_checkpointing=False, noise_sd=0.1, explore_budget=0.2, horizon=6)


def measured_fit(ckpt: str, steps: int):
    with lightning_rank_env(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = dict(accelerator="cpu", devices=4, max_steps=steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                  limit_val_batches=0, num_sanity_val_steps=0)
        trainer = L.Trainer(strategy=HotSPaStrategy(LAYOUTS, planner=_planner(), tokens_per_rank=TOKENS_PER_RANK),
                            **kw)
        trainer.fit(LlamaLM("tiny", seed=1), datamodule=_datamodule())
        planner = trainer.strategy.planner
        trainer.save_checkpoint(ckpt)
        saved = planner.state_dict()["measured"]
        restored = L.Trainer(strategy=HotSPaStrategy(LAYOUTS, planner=_planner(), tokens_per_rank=TOKENS_PER_RANK),
                             **kw)
        restored.fit(LlamaLM("tiny", seed=1), datamodule=_datamodule(), ckpt_path=ckpt)  # at max_steps: restore only
    again = restored.strategy.planner.state_dict()["measured"]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, saved)
    return {"all": gathered, "restored_equal": again == saved}


def test_four_ranks_measure_alike_and_resume(ranks, tmp_path) -> None:
    out = ranks(4).run(measured_fit, str(tmp_path / "ckpt"), 5)
    first = out[0]["all"][0]
    assert all(s == first for o in out for s in o["all"]), "ranks disagree on the measured planner's state"
    assert first["guard"]["correction"]["options"], "no option was measured"
    assert first["decided_through"] == 4
    assert all(o["restored_equal"] for o in out)
