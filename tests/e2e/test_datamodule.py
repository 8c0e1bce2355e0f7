"""HotSPaDataModule: per-rank step plans that cover every token once, resume (also at another
world size and through Lightning's own fit loop), loader workers, sampler injection, bad data."""

from __future__ import annotations

import json
import pickle
import warnings
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from helpers import EIGHT, FOUNDATION
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data.distributed import DistributedSampler

from lightning_hotspa.data import (
    ByteTokenizer,
    DataError,
    HotSPaDataModule,
    PlanDataLoader,
    SyntheticSource,
    TokenizedCorpus,
    pin_rank_plan,
)
from lightning_hotspa.layout import Layout, MeshShape
from lightning_hotspa.plan import IGNORE_INDEX, RankPlan
from lightning_hotspa.planner import ThresholdPlanner

LAYOUT_SETS = [FOUNDATION, ["dp4", "dp2xtp2", "tp4"], ["dp4", "dp2xcp2", "tp2xcp2"], ["tp4"], EIGHT,
               ["dp2", "tp2", "cp2"]]
CONTEXT = 128


def corpus_of(lengths, seed: int = 0) -> TokenizedCorpus:
    rng = np.random.default_rng(seed)
    return TokenizedCorpus.from_token_arrays([rng.integers(0, 256, size=n) for n in lengths])


def default_corpus() -> TokenizedCorpus:
    rng = np.random.default_rng(7)
    lengths = np.concatenate([rng.integers(1, 40, size=40), rng.integers(60, 400, size=8)])
    return corpus_of(rng.permutation(lengths).tolist(), seed=7)


def make_dm(corpus, layouts=FOUNDATION, rank=0, *, tokens_per_batch=512, context_length=CONTEXT,
            **kwargs) -> HotSPaDataModule:
    world = Layout.parse(layouts[0]).world_size
    planner = ThresholdPlanner(layouts, CONTEXT // world)  # the widest tp*cp group holds CONTEXT
    dm = HotSPaDataModule(corpus, tokens_per_batch=tokens_per_batch, context_length=context_length,
                          planner=planner, mesh_shape=MeshShape.for_layouts(layouts, world),
                          rank=rank, **kwargs)
    dm.setup("fit")
    return dm


def rank_tokens(plan: RankPlan, dm: HotSPaDataModule, refs, rank: int) -> Counter:
    """(corpus doc, position, token) of this rank's real tokens; tp replicas are skipped. Checks
    labels against the corpus: a label is the next token of the same chunk, never across one."""
    mesh, corpus = dm._planning().mesh_shape, dm.corpus
    seen: Counter = Counter()
    for stage in plan.stages:
        _, tp_rank, cp_rank = mesh.rank_coords(stage.layout, rank)
        for mb in stage.micro_batches:
            assert mb.cp_size == stage.layout.cp and mb.cp_rank == cp_rank
            bounds = mb.cu_seqlens.tolist()
            assert len(bounds) == len(mb.doc_ids) + 1
            for j, d in enumerate(mb.doc_ids):
                ref = refs[d]
                chunk = corpus.doc(ref.doc, ref.start, ref.start + ref.length)
                seg = slice(bounds[j], bounds[j + 1])
                pos = mb.position_ids[seg].tolist()
                if mb.cp_size == 1:  # positions restart at every document; sequence parallelism pads the
                    # last document's tail to a multiple of tp (labels ignored: checked below)
                    tail = len(pos) - ref.length
                    assert pos == list(range(len(pos))), pos
                    assert tail == 0 or (j == len(mb.doc_ids) - 1 and 0 < tail < stage.layout.tp), (tail, j)
                for p, t, lab in zip(pos, mb.input_ids[seg].tolist(), mb.labels[seg].tolist(), strict=True):
                    want = int(chunk[p + 1]) if p + 1 < ref.length else IGNORE_INDEX
                    assert lab == want, f"label at chunk {ref} position {p}"
                    if p < ref.length:
                        assert t == int(chunk[p])
                        if tp_rank == 0:
                            seen[(ref.doc, ref.start + p, t)] += 1
    return seen


def epoch_plans(dm: HotSPaDataModule, **loader_kwargs) -> list[RankPlan]:
    return list(dm.train_dataloader(**loader_kwargs) if loader_kwargs else dm.train_dataloader())


def assert_same_plans(a: list[RankPlan], b: list[RankPlan]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.step, x.global_target_tokens, x.extras) == (y.step, y.global_target_tokens, y.extras)
        assert [(s.layout, s.label, len(s.micro_batches)) for s in x.stages] == [
            (s.layout, s.label, len(s.micro_batches)) for s in y.stages]
        for m, n in zip(x.micro_batches, y.micro_batches, strict=True):
            assert m.doc_ids == n.doc_ids and m.max_seqlen == n.max_seqlen
            for field in ("input_ids", "labels", "position_ids", "cu_seqlens", "cp_cu_seqlens"):
                u, v = getattr(m, field), getattr(n, field)
                assert (u is None and v is None) or torch.equal(u, v), field


def corpus_tokens(corpus: TokenizedCorpus, docs) -> Counter:
    return Counter((int(d), p, int(t)) for d in docs for p, t in enumerate(corpus.doc(int(d)).tolist()))


# -- every token once -----------------------------------------------------------------------------
@given(st.sampled_from(LAYOUT_SETS), st.lists(st.integers(1, 300), min_size=1, max_size=25),
       st.integers(0, 2**20))
@settings(max_examples=20, deadline=None)
def test_every_token_of_an_epoch_once_across_all_ranks(layouts, lengths, seed) -> None:
    corpus = corpus_of(lengths, seed)
    world = Layout.parse(layouts[0]).world_size
    seen: Counter = Counter()
    for rank in range(world):
        dm = make_dm(corpus, layouts, rank, seed=seed)
        dataset = dm.train_dataloader().dataset
        for plan in epoch_plans(dm):
            refs = dataset.minibatch(plan.extras["epoch"], plan.extras["step"])
            seen += rank_tokens(plan, dm, refs, rank)
            assert plan.global_target_tokens == sum(r.length - 1 for r in refs)
    assert seen == corpus_tokens(corpus, range(len(corpus)))


def test_plans_are_identical_when_computed_twice_and_in_a_fresh_instance() -> None:
    corpus = default_corpus()
    for rank in (0, 3):
        dm = make_dm(corpus, rank=rank)
        first, again = epoch_plans(dm), epoch_plans(dm)  # the second iteration is epoch 1
        fresh = epoch_plans(make_dm(default_corpus(), rank=rank))
        assert_same_plans(first, fresh)
        assert [p.extras["epoch"] for p in again] == [1] * len(again)
    dataset = make_dm(corpus).train_dataloader().dataset
    assert dataset.global_plan(2, 1) == make_dm(corpus, rank=2).train_dataloader().dataset.global_plan(2, 1)


def test_extras_carry_step_bookkeeping_and_planner_stats() -> None:
    dm = make_dm(default_corpus(), rank=1)
    plans = epoch_plans(dm)
    dataset = dm.train_dataloader().dataset
    for i, plan in enumerate(plans):
        e = plan.extras
        refs = dataset.minibatch(0, i)
        assert (e["split"], e["epoch"], e["step"], e["stream_step"], e["rank"]) == ("train", 0, i, i, 1)
        assert plan.step == i and e["num_docs"] == len(refs)
        assert e["num_tokens"] == sum(r.length for r in refs) <= 512
        assert 0 < e["fill"] <= 1 and 0 <= e["padding"] < 0.1 and e["imbalance"] >= 1
        assert [s["layout"] for s in e["stages"]] == [s.layout.name for s in plan.stages]
        assert sum(s["tokens"] for s in e["stages"]) == e["num_tokens"]


# -- a fixed number of plans per epoch ------------------------------------------------------------
def test_fixed_plans_per_epoch_and_passes_flow_across_epochs_without_loss() -> None:
    corpus = default_corpus()
    dm = make_dm(corpus, seed=0, tokens_per_batch=256)
    dataset = dm.train_dataloader().dataset
    counts = [dataset.sampler.num_batches(p) for p in range(4)]
    assert len(set(counts)) > 1, "test data should give passes of different lengths"
    assert dm.batches_per_epoch == counts[0]
    loader = dm.train_dataloader()
    by_pass: dict[int, Counter] = {}
    total = 0
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)  # what Lightning does at every epoch start
        plans = list(loader)
        assert len(plans) == len(loader) == counts[0]
        for plan in plans:
            assert plan.extras["stream_step"] == total
            total += 1
            refs = dataset.minibatch(epoch, plan.extras["step"])
            bucket = by_pass.setdefault(plan.extras["data_pass"], Counter())
            bucket.update((r.doc, r.start + p) for r in refs for p in range(r.length))
    everything = Counter((d, p) for d in range(len(corpus)) for p in range(int(corpus.lengths[d])))
    finished = [p for p in by_pass if sum(counts[: p + 1]) <= total]
    assert finished and all(by_pass[p] == everything for p in finished)
    assert all(c == 1 for bucket in by_pass.values() for c in bucket.values())


# -- resume ---------------------------------------------------------------------------------------
def test_resume_mid_epoch_without_a_trainer() -> None:
    corpus = default_corpus()
    reference = make_dm(corpus, rank=2)
    ref_loader = reference.train_dataloader()
    expected = list(ref_loader) + list(ref_loader)  # two epochs
    n = len(ref_loader)

    run = make_dm(corpus, rank=2)
    loader = run.train_dataloader()
    it = iter(loader)
    head = [next(it) for _ in range(2)]
    assert run.state_dict()["step"] == 2 and loader.state_dict() == {
        k: v for k, v in run.state_dict().items() if k not in ("val_fraction", "val_seed")}

    via_module = make_dm(corpus, rank=2)
    via_module.load_state_dict(json.loads(json.dumps(run.state_dict())))  # survives a checkpoint
    resumed = list(via_module.train_dataloader()) + list(via_module.train_dataloader())
    assert_same_plans(head + resumed, expected)

    via_loader = make_dm(corpus, rank=2)
    fresh = via_loader.train_dataloader()
    fresh.load_state_dict(loader.state_dict())  # Lightning's path: the fit loop's loader states
    assert_same_plans(head + list(fresh), expected[:n])

    early = HotSPaDataModule(corpus, tokens_per_batch=512, context_length=CONTEXT,
                             planner=ThresholdPlanner(FOUNDATION, 32),
                             mesh_shape=MeshShape.for_layouts(FOUNDATION, 4), rank=2)
    early.load_state_dict(run.state_dict())  # before setup: applied once the data is open
    early.setup("fit")
    assert_same_plans(head + list(early.train_dataloader()), expected[:n])


def test_resume_at_another_world_size_sees_the_same_mini_batches() -> None:
    corpus = default_corpus()
    four = [make_dm(corpus, FOUNDATION, r) for r in range(4)]
    loaders = [dm.train_dataloader() for dm in four]
    iters = [iter(x) for x in loaders]
    for _ in range(2):
        for it in iters:
            next(it)
    state = four[0].state_dict()
    assert all(dm.state_dict() == state for dm in four)

    def tokens_per_step(dms, epochs) -> list[Counter]:
        steps: dict[int, Counter] = {}
        for rank, dm in enumerate(dms):
            loader = dm.train_dataloader()
            for _ in range(epochs):
                for plan in loader:
                    refs = loader.dataset.minibatch(plan.extras["epoch"], plan.extras["step"])
                    steps.setdefault(plan.extras["stream_step"], Counter()).update(
                        rank_tokens(plan, dm, refs, rank))
        return [steps[k] for k in sorted(steps)]

    two = [make_dm(corpus, ["dp2", "tp2", "cp2"], r) for r in range(2)]
    for dm in two:
        dm.load_state_dict(state)
    uninterrupted = tokens_per_step([make_dm(corpus, FOUNDATION, r) for r in range(4)], epochs=2)
    assert tokens_per_step(two, epochs=2) == uninterrupted[2:]


def test_a_position_saved_for_other_data_is_refused() -> None:
    state = make_dm(default_corpus()).state_dict()
    with pytest.raises(DataError, match=r"tokens_per_batch.*\(512, 1024\)"):
        make_dm(default_corpus(), tokens_per_batch=1024).load_state_dict(state)
    with pytest.raises(DataError, match="not a HotSPa data position"):
        make_dm(default_corpus()).load_state_dict({"epoch": 0})


class _Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, int, int]] = []
        self.batch_idx: list[int] = []

    def training_step(self, batch: RankPlan, batch_idx: int) -> torch.Tensor:
        e = batch.extras
        self.seen.append((e["epoch"], e["step"], e["stream_step"]))
        self.batch_idx.append(batch_idx)
        return (self.weight * float(batch.global_target_tokens)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(dm: HotSPaDataModule, max_steps: int, ckpt: Path | None = None,
         callbacks: list | None = None) -> tuple[_Recorder, L.Trainer]:
    model = _Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                        callbacks=callbacks, enable_checkpointing=bool(callbacks),
                        enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return model, trainer


def test_lightning_fit_loop_resumes_mid_epoch_with_the_remaining_plans(tmp_path: Path) -> None:
    corpus = default_corpus()
    n = make_dm(corpus).batches_per_epoch
    total = n + 2  # crosses into the second epoch
    every = ModelCheckpoint(dirpath=tmp_path / "every", every_n_train_steps=3, save_top_k=-1)
    reference = _fit(make_dm(corpus), total, callbacks=[every])[0].seen
    assert [s for _, _, s in reference] == list(range(total))
    # the usual case: a checkpoint written by a callback in the middle of an epoch
    tail = _fit(make_dm(corpus), total, tmp_path / "every" / "epoch=0-step=3.ckpt")[0]
    assert tail.seen == reference[3:] and tail.batch_idx[: n - 3] == list(range(3, n))

    head, trainer = _fit(make_dm(corpus), 2)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["step"] == 2
    assert saved["HotSPaDataModule"]["step"] == 2
    tail = _fit(make_dm(corpus), total, ckpt)[0]
    assert head.seen + tail.seen == reference
    assert tail.batch_idx[: n - 2] == list(range(2, n))  # Lightning counts on from batch 2

    # stopped exactly at the end of epoch 0 (Lightning then numbers its epochs one ahead and
    # even calls batch_idx n once; the data still continues where it stopped)
    head, trainer = _fit(make_dm(corpus), n)
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    tail = _fit(make_dm(corpus), total, tmp_path / "end.ckpt")[0]
    assert head.seen + tail.seen == reference


# -- loaders: workers, pinning, sampler injection -------------------------------------------------
def test_loader_workers_yield_the_same_plans_as_the_main_process(tmp_path: Path) -> None:
    source = SyntheticSource(30, kind="uniform", seed=3, params={"low": 1, "high": 300})
    corpus = TokenizedCorpus.build(source, ByteTokenizer(), tmp_path)  # pickles as its path
    main = epoch_plans(make_dm(corpus, rank=3))
    dm = make_dm(corpus, rank=3, num_workers=2)
    loader = dm.train_dataloader()
    it = iter(loader)
    first = next(it)
    assert dm.state_dict()["step"] == 1  # counted as handed out, not as prefetched by workers
    assert_same_plans([first, *it], main)
    # what a spawned worker receives: the dataset through pickle (the corpus as its path)
    clone = pickle.loads(pickle.dumps(loader.dataset))
    assert clone.corpus.path == corpus.path and clone.corpus.tokens is not corpus.tokens
    assert_same_plans([clone[(0, s)] for s in range(len(main))], main)


def test_pinning_replaces_every_tensor_and_is_skipped_without_an_accelerator() -> None:
    dm = make_dm(default_corpus(), rank=0)
    plan = epoch_plans(dm)[0]
    pinned: list[torch.Tensor] = []

    def fake_pin(t: torch.Tensor) -> torch.Tensor:
        pinned.append(t.clone())
        return pinned[-1]

    out = pin_rank_plan(plan, fake_pin)
    ids = {id(t) for t in pinned}
    for mb in out.micro_batches:
        for t in (mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens, mb.cp_cu_seqlens):
            assert t is None or id(t) in ids
    assert_same_plans([out], [plan])
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="no accelerator"):
            loader = make_dm(default_corpus(), pin_memory=True).train_dataloader()
        assert_same_plans([next(iter(loader))], [plan])


def test_a_sampler_injected_by_lightning_is_ignored() -> None:
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import DataLoader

    dm = make_dm(default_corpus(), rank=1)
    expected = epoch_plans(make_dm(default_corpus(), rank=1))
    with _replace_dunder_methods(DataLoader, "dataset"):
        loader = dm.train_dataloader()  # as Lightning requests it: init arguments recorded
    sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Lightning's default sampler: dropped without a warning
        replaced = _update_dataloader(loader, sampler, mode=RunningStage.TRAINING)
    assert isinstance(replaced, PlanDataLoader)
    assert_same_plans(list(replaced), expected)
    with _replace_dunder_methods(DataLoader, "dataset"):
        loader = dm.train_dataloader()
    with pytest.warns(UserWarning, match="ignores the sampler RandomSampler"):  # a user's own sampler
        _update_dataloader(loader, torch.utils.data.RandomSampler(loader.dataset), mode=RunningStage.TRAINING)
    with _replace_dunder_methods(DataLoader, "dataset"):
        predict = dm.predict_dataloader()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own sampler comes back: no warning
        predict = _update_dataloader(predict, predict.sampler, mode=RunningStage.PREDICTING)
    assert len(list(predict)) == len(dm.predict_dataloader()) > 0


# -- validation and prediction --------------------------------------------------------------------
def test_validation_holds_out_documents_and_covers_them_once() -> None:
    corpus = default_corpus()
    seen: Counter = Counter()
    for rank in range(4):
        dm = make_dm(corpus, rank=rank, val_fraction=0.25)
        val, train = set(dm.val_doc_ids.tolist()), set(dm.train_doc_ids.tolist())
        assert len(val) == 12 and not val & train and len(val | train) == len(corpus)
        loader = dm.val_dataloader()
        for _ in range(2):  # validation repeats data pass 0 every time
            plans = list(loader)
            assert [p.extras["split"] for p in plans] == ["val"] * len(plans)
        for plan in plans:
            refs = loader.dataset.minibatch(0, plan.extras["step"])
            assert {r.doc for r in refs} <= val
            seen += rank_tokens(plan, dm, refs, rank)
        assert len(dm.predict_dataloader()) == len(loader)
        for plan in epoch_plans(dm):
            assert {r.doc for r in dm.train_dataloader().dataset.minibatch(0, plan.extras["step"])} <= train
    assert seen == corpus_tokens(corpus, sorted(val))
    no_val = make_dm(corpus)
    assert no_val.val_dataloader() == []
    from lightning.pytorch.utilities.model_helpers import is_overridden

    # Lightning sees no val_dataloader, so it skips validation without an empty-loader warning
    assert not is_overridden("val_dataloader", no_val) and is_overridden("val_dataloader", dm)


class _Tester(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.plans: list[RankPlan] = []

    def test_step(self, batch: RankPlan, batch_idx: int) -> None:
        self.plans.append(batch)


def test_a_test_split_holds_out_documents_and_trainer_test_runs_it() -> None:
    corpus = default_corpus()
    dm = make_dm(corpus, val_fraction=0.25, test_fraction=0.25)
    val, test, train = (set(ids.tolist()) for ids in (dm.val_doc_ids, dm.test_doc_ids, dm.train_doc_ids))
    assert len(test) == 12 and not test & (val | train) and len(val | test | train) == len(corpus)
    assert set(make_dm(corpus, val_fraction=0.25).train_doc_ids.tolist()) == train | test  # out of training only
    model = _Tester()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.test(model, datamodule=dm)
    loader = dm.test_dataloader()
    assert len(model.plans) == len(loader) > 0 and {p.extras["split"] for p in model.plans} == {"test"}
    seen = {r.doc for p in model.plans for r in loader.dataset.minibatch(0, p.extras["step"])}
    assert seen == test  # every test document, and only those
    with pytest.raises(DataError, match="test_fraction"):
        make_dm(corpus).test_dataloader()
    with pytest.raises(DataError, match="test_fraction"):
        make_dm(corpus, val_fraction=0.5, test_fraction=0.5)


# -- bad data and bad configuration ---------------------------------------------------------------
def test_bad_records_propagate_with_file_and_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text('{"text": "hello"}\n{"text": 5}\n')
    dm = HotSPaDataModule("jsonl", {"path": str(data)}, cache_dir=str(tmp_path / "cache"),
                          tokens_per_batch=64, context_length=64)
    with pytest.raises(DataError, match=r"a\.jsonl line 2.*not a string"):
        dm.prepare_data()
    with pytest.raises(DataError, match="unknown data source kind 'nope'"):
        HotSPaDataModule("nope")


def test_too_long_document_under_raise_names_it() -> None:
    corpus = TokenizedCorpus.from_token_arrays([np.ones(10), np.ones(CONTEXT + 1)], ["short", "long.py"])
    with pytest.raises(DataError, match=rf"document 'long.py' has {CONTEXT + 1} tokens, more than context_length"):
        make_dm(corpus, long_doc_policy="raise")
    make_dm(corpus, long_doc_policy="split")  # the default cuts it into context-sized chunks


def test_planning_configuration_errors_are_clear() -> None:
    corpus = default_corpus()
    with pytest.raises(DataError, match=r"context_length=256 is longer than any micro-batch.*\(128 tokens\)"):
        make_dm(corpus, context_length=256).train_dataloader()
    bare = HotSPaDataModule(corpus, tokens_per_batch=512, context_length=CONTEXT)
    bare.setup("fit")
    with pytest.raises(DataError, match="needs a planner and a mesh shape.*no Trainer"):
        bare.train_dataloader()
    mesh = MeshShape.for_layouts(["dp4", "tp4"], 4)
    wrong = HotSPaDataModule(corpus, tokens_per_batch=512, context_length=CONTEXT, mesh_shape=mesh,
                             planner=ThresholdPlanner(FOUNDATION, 32), rank=0)
    with pytest.raises(DataError, match=r"planner layouts \['dp2xtp2', 'dp2xcp2', 'tp2xcp2'\] are not on the mesh"):
        wrong.setup("fit")  # checked as soon as planner and mesh are known
    with pytest.raises(DataError, match="rank 4 is outside the mesh of 4 ranks"):
        make_dm(corpus, rank=4).train_dataloader()
    with pytest.raises(DataError, match="val_fraction must be in"):
        HotSPaDataModule(corpus, val_fraction=1.0)
