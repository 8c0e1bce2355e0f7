"""Profiled cost planner wired into training: measured stage times -> observations on every rank ->
refits at deterministic steps -> the same plans on every rank and in every loader worker, and the
coefficient version survives a checkpoint."""

from __future__ import annotations

import warnings

import lightning as L
import numpy as np
import pytest
import torch.distributed as dist
from helpers import lightning_rank_env
from lightning.pytorch.callbacks import Callback

import lightning_hotspa  # noqa: F401  (registers "hotspa")
from lightning_hotspa import HotSPaStrategy
from lightning_hotspa.activation_checkpointing import Checkpointing
from lightning_hotspa.data import HotSPaDataModule, PlanDataLoader, TokenizedCorpus
from lightning_hotspa.layout import Layout, MeshShape
from lightning_hotspa.models import LlamaLM
from lightning_hotspa.plan import PlanError
from lightning_hotspa.planner.profiled.calibration import Observation
from lightning_hotspa.planner.profiled.measured_planner import MeasuredCostPlanner
from lightning_hotspa.planner.profiled.schedule import CoefficientSchedule
from lightning_hotspa.planner.solve.solver import CostModelPlanner

LAYOUTS = ["dp4", "dp2xtp2", "tp2xcp2"]
TOKENS_PER_RANK = 64


def _corpus(seed: int = 0) -> TokenizedCorpus:
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(4, 40, size=120), rng.integers(80, 250, size=12)])
    return TokenizedCorpus.from_token_arrays([rng.integers(0, 256, size=int(n)) for n in rng.permutation(lengths)])


def _planner(refit_every: int = 2) -> CostModelPlanner:
    return CostModelPlanner(LAYOUTS, model="tiny", hardware="cpu-gloo", tokens_per_rank=TOKENS_PER_RANK,
                            activation_checkpointing=False, profiled=True, refit_every=refit_every)


# ------------------------------------------------------------------------------------ the schedule
def test_schedule_plans_each_step_with_the_version_decided_lag_steps_before() -> None:
    key = (Layout(dp=4), Checkpointing.NONE)  # an option key is typed (a bool key would not match)
    s = CoefficientSchedule([key], refit_every=3, lag=2)
    assert s.entry_for(1, wait=False).version == 0  # needs no decision yet
    with pytest.raises(PlanError, match="plan of step 5 needs the coefficients decided at step 3"):
        s.entry_for(5, wait=False)
    s.mark_decided(2)
    s.publish(3, version=1, scale=2.0, fitted={key: (1.0, 2.0, 3.0, 0.0)})
    assert [s.entry_for(t, wait=False).version for t in range(6)] == [0, 0, 0, 0, 0, 1]
    assert s.entry_for(5, wait=False).fitted == {key: (1.0, 2.0, 3.0, 0.0)} and s.entry_for(None, False).scale == 2.0
    s.mark_decided(5)
    s.publish(6, version=2, scale=3.0, fitted={})
    entries, decided = s.read()
    assert decided == 6 and [e.version for e in entries] == [1, 2]  # version 0 plans no pending step
    t = CoefficientSchedule([key], refit_every=3, lag=2)
    t.load(*CoefficientSchedule.entries_from_state(s.state()))
    assert t.read() == s.read()
    # saved states carry typed layout records (never names parsed back); states saved as names still load
    assert all(isinstance(lay, dict) for e in s.state()["entries"] for lay, _, _ in e[3])
    old = s.state()
    old["entries"] = [[*e[:3], [[Layout.from_state(lay).name, ac, v] for lay, ac, v in e[3]]] for e in old["entries"]]
    u = CoefficientSchedule([key], refit_every=3, lag=2)
    u.load(*CoefficientSchedule.entries_from_state(old))
    assert u.read() == s.read()
    with pytest.raises(PlanError, match="refits must run in step order"):
        s.publish(3, version=3, scale=1.0, fitted={})
    with pytest.raises(PlanError, match="plan_lag must be an int >= 0, got -1"):
        CostModelPlanner(LAYOUTS, model="tiny", hardware="cpu-gloo", profiled=True, plan_lag=-1)


def _fake_observations(step: int) -> list[Observation]:
    """Timings that change with the step, so every refit changes the coefficients."""
    rng = np.random.default_rng(step)
    out = []
    for name in LAYOUTS:
        lay = Layout.parse(name)
        for _ in range(4):
            mbs = [list(rng.integers(8, 60, size=rng.integers(1, 4))) for _ in range(rng.integers(1, 3))]
            s = np.asarray([n for mb in mbs for n in mb], dtype=float)
            secs = (1e-6 * (step + 1) * (s * s).sum() + 1e-4 * s.sum() + 0.01 * len(mbs)) * (1 + 0.05 * rng.random())
            out.append(Observation.from_lengths(lay, False, mbs, secs))
    return out


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_loader_workers_plan_with_the_versions_the_main_process_decides(context: str) -> None:
    """Workers prefetch far ahead with their own planner copy; refits in the main process (as the
    strategy does after each step) must still reach every plan exactly by the lag rule."""
    planner = _planner(refit_every=2)
    dm = HotSPaDataModule(_corpus(), tokens_per_batch=384, context_length=256, planner=planner,
                          mesh_shape=MeshShape.for_layouts([Layout.parse(x) for x in LAYOUTS], 4), rank=1)
    dm.setup("fit")
    # a worker prefetching 6 plans with plan_lag 2: it must wait for the main process' refits
    loader = PlanDataLoader(dm._dataset("train"), num_workers=1, prefetch_factor=6, multiprocessing_context=context)
    seen = []
    for i, plan in enumerate(loader):
        step = plan.step
        expected = planner.version_at(step)  # decided in this process: steps <= step - 1 are
        refs = loader.dataset.minibatch(plan.extras["epoch"], plan.extras["step"])
        mine = planner.plan(step, [r.length for r in refs])  # the main process' own plan of that step
        seen.append((step, plan.extras["planner_version"], expected))
        assert plan.extras["planner_version"] == expected == planner.last_version
        assert plan.extras["plan_digest"] == _digest(mine)
        planner.observe(_fake_observations(step))
        planner.refit(step)
        if i == 9:
            planner._schedule.mark_decided(10**6)  # release a worker still waiting (else shutdown waits 5 s)
            break
    # every refit (steps 0, 2, 4, ...) changes the fit and plans from two steps later
    assert [v for _, v, _ in seen] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4], seen
    # the DataModule's own loader with workers raises the lag past their prefetch (nothing waits)
    workers = HotSPaDataModule(_corpus(), tokens_per_batch=384, context_length=256, planner=_planner(),
                               mesh_shape=MeshShape.for_layouts([Layout.parse(x) for x in LAYOUTS], 4), rank=1,
                               num_workers=2)
    workers.setup("fit")
    workers.train_dataloader()
    assert workers._planning().planner.plan_lag == 2 * 2 + 2


def _digest(plan) -> int:
    import zlib

    return zlib.crc32(repr([(s.layout.name, s.activation_checkpointing, s.micro_batches)
                            for s in plan.stages]).encode())


# ------------------------------------------------------------------------------------ 4 ranks, a real Trainer
class _PlanLog(Callback):
    """Per training step: (step, version that planned it, plan digest, newest version after it);
    per validation batch: (version that planned it, newest version then)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, int]] = []
        self.val: list[tuple[int, int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        planner = trainer.strategy.planner
        self.rows.append((batch.step, batch.extras["planner_version"], batch.extras["plan_digest"], planner.version))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        planner = trainer.strategy.planner
        self.val.append((batch.extras["planner_version"], batch.extras["plan_digest"], planner.version))


def _datamodule() -> HotSPaDataModule:
    return HotSPaDataModule(_corpus(), tokens_per_batch=384, context_length=256, num_workers=0, val_fraction=0.1)


def profiled_fit(ckpt: str, steps: int):
    """Fits a few steps with a profiled planner refitting every 2 steps, saves a checkpoint, then
    restores it into a fresh strategy and planner."""
    log = _PlanLog()
    with lightning_rank_env(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=HotSPaStrategy(LAYOUTS, planner=_planner(2),
                                                                                 tokens_per_rank=TOKENS_PER_RANK),
                            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False, callbacks=[log],
                            val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=0)
        trainer.fit(LlamaLM("tiny", seed=1), datamodule=_datamodule())
        planner = trainer.strategy.planner
        trainer.save_checkpoint(ckpt)
        saved = planner.state_dict()
        restored = L.Trainer(accelerator="cpu", devices=4, strategy=HotSPaStrategy(
            LAYOUTS, planner=_planner(2), tokens_per_rank=TOKENS_PER_RANK), max_steps=steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, limit_val_batches=0)
        restored.fit(LlamaLM("tiny", seed=1), datamodule=_datamodule(), ckpt_path=ckpt)  # at max_steps: restore only
    again = restored.strategy.planner
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"log": log.rows, "val": log.val, "coefficients": saved["coefficients"]["fitted"],
                                      "scale": saved["coefficients"]["scale"]})
    return {"ranks": gathered, "version": planner.version, "restored_version": again.version,
            "restored_state": again.state_dict()["schedule"] == saved["schedule"],
            "next_versions": [planner.version_at(s) for s in range(steps, steps + 2)],
            "restored_next_versions": [again.version_at(s) for s in range(steps, steps + 2)]}


def test_four_ranks_refit_at_the_same_steps_and_plan_alike(ranks, tmp_path) -> None:
    steps = 5
    out = ranks(4).run(profiled_fit, str(tmp_path / "ckpt"), steps)
    first = out[0]["ranks"]
    assert all(o["ranks"] == first for o in out), "ranks disagree on plans, versions or coefficients"
    log = first[0]["log"]
    assert [r[0] for r in log] == list(range(steps))
    planned, newest = [r[1] for r in log], [r[3] for r in log]
    # step 0's timings are not used (warm-up): the refits after steps 2 and 4 change the fit, and
    # each version plans from two steps later
    assert newest == [0, 0, 1, 1, 2], log
    assert planned == [0, 0, 0, 0, 1], log
    # validation after step 3 plans with the newest version then (training paused on every rank)
    assert [(v, n) for v, _, n in first[0]["val"]] == [(1, 1), (1, 1)], first[0]["val"]
    assert first[0]["scale"] != 1.0 or first[0]["coefficients"], "the fit never moved off the analytic model"
    for o in out:
        assert o["restored_version"] == o["version"] == newest[-1] and o["restored_state"]
        assert o["restored_next_versions"] == o["next_versions"]


@pytest.mark.parametrize("name", ["rule", "cost", "cost-profiled", "cost-measured"])
def test_the_strategy_builds_each_named_planner(name: str) -> None:
    """``planner="cost-profiled"`` is documented and was once rejected by the constructor's check."""
    strategy = HotSPaStrategy(LAYOUTS, planner=name, tokens_per_rank=TOKENS_PER_RANK)
    strategy.layouts = tuple(Layout.parse(x) for x in LAYOUTS)  # what setup_environment does on 4 ranks
    strategy._lightning_module = LlamaLM("tiny")
    planner = strategy.planner
    assert tuple(planner.layouts) == strategy.layouts
    assert getattr(planner, "profiled", False) == (name in ("cost-profiled", "cost-measured"))
    assert hasattr(planner, "guard") == (name == "cost-measured")
    assert isinstance(planner, CostModelPlanner) == name.startswith("cost")


# ------------------------------------------------------------- the measured cost planner, 4 ranks (issue 53)
def _measured_planner() -> MeasuredCostPlanner:
    return MeasuredCostPlanner(LAYOUTS, model="tiny", hardware="cpu-gloo", tokens_per_rank=TOKENS_PER_RANK,
                               activation_checkpointing=False, noise_sd=0.1, explore_budget=0.2, horizon=6)


def measured_fit(ckpt: str, steps: int):
    with lightning_rank_env(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = dict(accelerator="cpu", devices=4, max_steps=steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                  limit_val_batches=0, num_sanity_val_steps=0)
        strategy = HotSPaStrategy(LAYOUTS, planner=_measured_planner(), tokens_per_rank=TOKENS_PER_RANK)
        trainer = L.Trainer(strategy=strategy, **kw)
        trainer.fit(LlamaLM("tiny", seed=1), datamodule=_datamodule())
        planner = trainer.strategy.planner
        trainer.save_checkpoint(ckpt)
        saved = planner.state_dict()["measured"]
        strategy = HotSPaStrategy(LAYOUTS, planner=_measured_planner(), tokens_per_rank=TOKENS_PER_RANK)
        restored = L.Trainer(strategy=strategy, **kw)
        restored.fit(LlamaLM("tiny", seed=1), datamodule=_datamodule(), ckpt_path=ckpt)  # at max_steps: restore only
    again = restored.strategy.planner.state_dict()["measured"]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, saved)
    return {"all": gathered, "restored_equal": again == saved}


def test_four_ranks_measure_alike_and_resume(ranks, tmp_path) -> None:
    """Issue 53: the measured cost planner in a real 4-rank Trainer: the gathered stage table feeds it on every
    rank alike, and its state (corrections, exploration, published decisions) survives a checkpoint."""
    out = ranks(4).run(measured_fit, str(tmp_path / "ckpt"), 5)
    first = out[0]["all"][0]
    assert all(s == first for o in out for s in o["all"]), "ranks disagree on the measured planner's state"
    assert first["guard"]["correction"]["options"], "no option was measured"
    assert first["decided_through"] == 4
    assert all(o["restored_equal"] for o in out)
