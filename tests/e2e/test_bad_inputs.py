"""Bad inputs across config, data and API, table-driven.

Every row is one bad input: it must raise the expected error type with a message that names the bad
value and where it came from (asserted on the message text), and must leave no new file behind (a
half-written file) and no running process (multi-rank rows run in the RankPool, whose deadline turns a
hang into a failure). The module prints how many inputs it tried and how many were handled (pytest -s).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    Bad,
    check_refused,
    config_case,
    datamodule_case,
    files_under,
    jsonl_case,
    raises_case,
    strategy_case,
)

from lightning_hotspa.adapter.checkpoints.dcp_state import CheckpointError
from lightning_hotspa.adapter.recipes.hydra_recipe import ConfigError
from lightning_hotspa.data import DataError
from lightning_hotspa.layout import LayoutError

TALLY = {"tried": 0, "handled": 0}




@pytest.fixture(scope="module", autouse=True)
def tally():
    yield
    print(f"\nbad-input sweep: {TALLY['tried']} inputs tried, {TALLY['handled']} handled with a clear error")






# ------------------------------------------------------------------ config (Hydra, recipes/train.py)


CONFIG = [
    Bad("layouts_as_a_string", "config", config_case("strategy.layouts=dp4"), ConfigError,
        ("strategy.layouts", "got the string 'dp4'")),
    Bad("negative_degree", "config", config_case("strategy.layouts=[{dp: -2, tp: -2}]"), ConfigError,
        ("strategy.layouts", "Layout.dp must be a positive int, got -2")),
    Bad("layouts_not_covering_the_world", "config", config_case("trainer=cpu4", "strategy.layouts=[{dp: 2}]"),
        ConfigError, ("strategy.layouts", "layout dp2 covers 2 ranks", "world size is 4")),
    Bad("context_longer_than_any_micro_batch", "config", config_case("data.context_length=4096"), ConfigError,
        ("data.context_length=4096", "strategy.tokens_per_rank=256")),
    Bad("context_smaller_than_a_bucket_bound", "config",
        config_case("strategy=hotspa_buckets", "data.context_length=512"), ConfigError,
        ("strategy.planner.buckets", "[1024]", "data.context_length=512")),
    Bad("checkpoint_every_negative", "config", config_case("checkpoint.every_n_steps=-3", build=True), ConfigError,
        ("checkpoint.every_n_steps", "got -3")),
    Bad("missing_jsonl_path", "config", config_case("data=jsonl"), ConfigError,
        ("data.source_kwargs.path", "required")),
    Bad("unknown_nonfinite_policy", "config", config_case("+strategy.nonfinite=ignore", build=True), ConfigError,
        ("strategy: could not build", "nonfinite must be one of", "'ignore'")),
    Bad("negative_timeout", "config", config_case("+strategy.timeout=-5", build=True), ConfigError,
        ("strategy: could not build", "timeout must be positive, got -5")),
    Bad("wrong_type_tokens_per_rank", "config", config_case("strategy.tokens_per_rank=lots", build=True), ConfigError,
        ("strategy.tokens_per_rank must be a positive int, got 'lots'",)),  # the recipe edge, before building
]


# ------------------------------------------------------------------ data






def _synthetic(**kwargs: Any) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.data import SyntheticSource

        return datamodule_case(lambda: SyntheticSource(20, kind="uniform", params={"low": 2, "high": 60}), tmp,
                               **kwargs)
    return make


def _resume_with_other_seed(tmp: Path) -> Callable[[], Any]:
    from lightning_hotspa.data import SyntheticSource

    source = SyntheticSource(20, kind="uniform", params={"low": 2, "high": 60})
    datamodule_case(source, tmp, seed=0)()  # the token cache exists before the bad call
    saved = {"format": 1, "epoch": 0, "step": 1, "seed": 0, "tokens_per_batch": 512, "context_length": 64}

    def call() -> Any:
        from lightning_hotspa import HotSPaDataModule
        from lightning_hotspa.layout import MeshShape, parse_layouts
        from lightning_hotspa.planner.rule import ThresholdPlanner

        layouts = parse_layouts(["dp1"], 1)
        dm = HotSPaDataModule(source, planner=ThresholdPlanner(layouts, 64), mesh_shape=MeshShape.for_layouts(
            layouts, 1), rank=0, tokens_per_batch=512, context_length=64, seed=5, cache_dir=str(tmp / "cache"))
        dm.setup("fit")
        dm.load_state_dict(saved)
    return call


def _hand_set_buckets(tmp: Path) -> Callable[[], Any]:
    from lightning_hotspa.data import SyntheticSource
    from lightning_hotspa.layout import parse_layouts
    from lightning_hotspa.planner.rule import ThresholdPlanner

    planner = ThresholdPlanner(parse_layouts(["dp2", "tp2"], 2), 64, buckets=[(32, "dp2"), (128, "tp2")])
    return datamodule_case(lambda: SyntheticSource(20, kind="uniform", params={"low": 2, "high": 60}), tmp,
                       layouts=("dp2", "tp2"), planner=planner, context_length=100)


def _source(kind: str, **kwargs: Any) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.data import build_source

        resolved = {k: (str(tmp / v) if k == "path" else v) for k, v in kwargs.items()}
        return lambda: build_source(kind, **resolved)
    return make


def _tokenizer(tmp: Path) -> Callable[[], Any]:
    from lightning_hotspa.data import build_tokenizer

    return lambda: build_tokenizer("hf", path=str(tmp / "models" / "tokenizer.json"))


DATA = [
    Bad("empty_corpus", "data", jsonl_case("\n\n   \n"), DataError, ("JsonlSource", "corpus.jsonl",
                                                                "the documents were empty")),
    Bad("jsonl_line_not_json", "data", jsonl_case('{"text": "fine"}\n{"text": oops}\n'), DataError,
        ("corpus.jsonl line 2", "not valid JSON")),
    Bad("jsonl_missing_text_field", "data", jsonl_case('{"text": "fine"}\n{"body": "x"}\n'), DataError,
        ("corpus.jsonl line 2", "missing text field 'text'", "['body']")),
    Bad("jsonl_text_not_a_string", "data", jsonl_case('{"text": 42}\n'), DataError,
        ("corpus.jsonl line 1", "text field 'text' is int")),
    Bad("missing_tokenizer_file", "data", _tokenizer, DataError,
        ("HFTokenizer", "tokenizer file does not exist", "models/tokenizer.json")),
    Bad("missing_data_path", "data", _source("jsonl", path="nowhere.jsonl"), DataError,
        ("JsonlSource", "path does not exist", "nowhere.jsonl")),
    Bad("unknown_source_kind", "data", _source("csv"), DataError, ("unknown data source kind 'csv'", "jsonl")),
    Bad("zero_tokens_per_batch", "data", _synthetic(tokens_per_batch=0), DataError,
        ("tokens_per_batch must be a positive int, got 0",)),
    Bad("context_length_wrong_type", "data", _synthetic(context_length="64"), DataError,
        ("context_length must be a positive int, got '64'",)),
    Bad("val_fraction_out_of_range", "data", _synthetic(val_fraction=1.5), DataError,
        ("HotSPaDataModule", "val_fraction must be in [0, 1), got 1.5")),
    Bad("negative_num_workers", "data", _synthetic(num_workers=-1), DataError,
        ("HotSPaDataModule", "num_workers must be an int >= 0", "got -1")),
    Bad("unknown_long_doc_policy", "data", _synthetic(long_doc_policy="chop"), DataError,
        ("long_doc_policy must be one of", "'chop'")),
    Bad("context_longer_than_any_micro_batch", "data", _synthetic(context_length=1000, tokens_per_batch=4096),
        DataError, ("HotSPaDataModule", "context_length=1000 is longer than any micro-batch", "(64 tokens)")),
    Bad("context_smaller_than_a_bucket_bound", "data", _hand_set_buckets, DataError,
        ("context_length=100 is smaller than the hand-set bucket bound(s) [128]", "ThresholdPlanner")),
    Bad("rank_outside_the_mesh", "data", _synthetic(rank=3), DataError, ("rank 3 is outside the mesh of 1 ranks",)),
    Bad("resume_with_another_seed", "data", _resume_with_other_seed, DataError,
        ("saved data position does not match", "'seed': (0, 5)")),
]


# ------------------------------------------------------------------ API (single process)




def _layout(**kwargs: Any) -> Callable[[], Any]:
    from lightning_hotspa.layout import Layout

    return lambda: Layout(**kwargs)


def _parse(specs: list[str], world: int) -> Callable[[], Any]:
    from lightning_hotspa.layout import MeshShape

    return lambda: MeshShape.for_layouts(specs, world)


def _heads(tmp: Path) -> Callable[[], Any]:
    from lightning_hotspa.models import LlamaLM

    return lambda: LlamaLM({"preset": "tiny", "n_heads": 2, "n_kv_heads": 2}).tp_plan(4)


def _precision(tmp: Path) -> Callable[[], Any]:
    import lightning as L

    from lightning_hotspa import HotSPaStrategy

    return lambda: L.Trainer(accelerator="cpu", devices=1, strategy=HotSPaStrategy(["dp1"]), precision="16-true",
                             logger=False)


def _save_into_a_file(tmp: Path) -> Callable[[], Any]:
    import torch

    from lightning_hotspa.adapter.checkpoints.dcp_state import save_distributed_checkpoint

    (tmp / "runs").mkdir()
    (tmp / "runs" / "ckpts").write_text("I am a file, not a folder")
    return lambda: save_distributed_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp / "runs" / "ckpts" / "s1",
                                               is_rank_zero=True, barrier=lambda: None)


def _load_incomplete(tmp: Path) -> Callable[[], Any]:
    from lightning_hotspa.adapter.checkpoints.dcp_state import export_consolidated

    (tmp / "ck" / "step=4").mkdir(parents=True)
    (tmp / "ck" / "step=4" / "__0_0.distcp").write_bytes(b"partial")
    return lambda: export_consolidated(tmp / "ck" / "step=4", tmp / "model.pt")


def _load_missing(tmp: Path) -> Callable[[], Any]:
    import torch

    from lightning_hotspa.adapter.checkpoints.dcp_state import load_distributed_checkpoint

    return lambda: load_distributed_checkpoint(tmp / "no-such-checkpoint", torch.nn.Linear(2, 2), [])


API = [
    Bad("negative_degree", "api", raises_case(_layout(dp=-2)), LayoutError,
        ("Layout.dp must be a positive int, got -2",)),
    Bad("fractional_degree", "api", raises_case(_layout(tp=2.5)), LayoutError,
        ("Layout.tp must be a positive int, got 2.5",)),
    Bad("layouts_as_a_string", "api", raises_case(strategy_case("dp4")), LayoutError,
        ("layouts must be 'auto' or a list of layouts, got 'dp4'",)),
    Bad("unparsable_layout", "api", raises_case(strategy_case(["dp2xfoo"])), LayoutError,
        ("cannot parse layout 'dp2xfoo'",)),
    Bad("layouts_not_covering_the_world", "api", raises_case(_parse(["dp2", "tp4"], 4)), LayoutError,
        ("layout dp2 covers 2 ranks", "world size is 4")),
    Bad("layouts_that_do_not_nest", "api", raises_case(_parse(["tp3xdp2", "tp2xdp3"], 6)), LayoutError,
        ("dp2xtp3", "dp3xtp2", "do not nest")),
    Bad("tp_not_dividing_heads", "api", _heads, ValueError, ("tp=4 does not divide n_heads=2",)),
    Bad("unknown_nonfinite_policy", "api", raises_case(strategy_case(nonfinite="ignore")), ValueError,
        ("nonfinite must be one of ('stop', 'skip'), got 'ignore'",)),
    Bad("unknown_planner", "api", raises_case(strategy_case(planner="magic")), ValueError,
        ("unknown planner 'magic'",)),
    Bad("unknown_hardware_profile", "api", raises_case(strategy_case(planner="cost", hardware="tpu-v9")), ValueError,
        ("unknown hardware profile 'tpu-v9'", "H200")),
    Bad("timeout_wrong_type", "api", raises_case(strategy_case(timeout="30s")), ValueError,
        ("timeout must be a datetime.timedelta or a number of seconds, got '30s'",)),
    Bad("tokens_per_rank_wrong_type", "api", raises_case(strategy_case(tokens_per_rank="4096")), ValueError,
        ("tokens_per_rank must be a positive int, got '4096'",)),
    Bad("unsupported_precision", "api", _precision, ValueError, ("got '16-true'", "bf16-mixed")),
    Bad("checkpoint_dir_is_a_file", "api", _save_into_a_file, CheckpointError,
        ("cannot write a checkpoint to", "runs/ckpts/s1", "NotADirectoryError")),
    Bad("export_of_an_incomplete_checkpoint", "api", _load_incomplete, CheckpointError,
        ("step=4", "not a complete hotspa checkpoint", "no meta.pt and no .metadata")),
    Bad("load_of_a_missing_checkpoint", "api", _load_missing, CheckpointError,
        ("no-such-checkpoint", "does not exist")),
]

SINGLE = CONFIG + DATA + API




@pytest.mark.parametrize("case", SINGLE, ids=[f"{c.area}-{c.name}" for c in SINGLE])
def test_bad_input_single_process(case: Bad, tmp_path: Path) -> None:
    TALLY["tried"] += 1
    check_refused(case, tmp_path)
    TALLY["handled"] += 1


# ------------------------------------------------------------------ API through a real Trainer (2 or 4 ranks)
def _fit(model, layouts, *, ckpt_path=None, steps=1, callbacks=(), **trainer_kwargs):
    import lightning as L
    import torch
    import torch.distributed as dist
    from helpers import lightning_rank_env, mixed_plan, rank_plans

    from lightning_hotspa import HotSPaStrategy
    from lightning_hotspa.layout import Layout

    world = dist.get_world_size()
    strategy = HotSPaStrategy(layouts)
    plan_layouts = [Layout.parse(x) for x in (["dp2", "tp2"] if world == 2 else ["dp4", "dp2xtp2"])]
    batches = rank_plans([mixed_plan(s, [9, 30, 12, 5, 24, 17], plan_layouts) for s in range(steps)],
                         plan_layouts, dist.get_rank())
    with lightning_rank_env():
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            enable_checkpointing=bool(callbacks), callbacks=list(callbacks), **trainer_kwargs)
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None,
                                                                         collate_fn=lambda x: x),
                    ckpt_path=ckpt_path)
    return trainer


def save_at_world_4(path: str) -> int:
    """A checkpoint written by 4 ranks with layouts dp4 and dp2xtp2."""
    from helpers import lightning_rank_env

    from lightning_hotspa.models import LlamaLM

    trainer = _fit(LlamaLM("tiny", seed=1), ["dp4", "dp2xtp2"])
    with lightning_rank_env():
        trainer.save_checkpoint(path)
    return trainer.global_step


def bad_fits_at_world_2(base: str, world4_checkpoint: str) -> dict[str, str | None]:
    """Each bad input through a real Trainer on 2 ranks; the error text per case (None: no error)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_hotspa.models import LlamaLM

    class NonScalar(LlamaLM):
        def training_step(self, batch, batch_idx=0):
            return super().training_step(batch, batch_idx).repeat(2)

    class FloatLoss(LlamaLM):
        def training_step(self, batch, batch_idx=0):
            return float(super().training_step(batch, batch_idx))

    class Plain(LlamaLM):
        tp_plan = None  # a module without a tensor-parallel plan

    base_path = Path(base)
    incomplete = base_path / "epoch=0-step=9.ckpt.tmp"  # made by the fixture, like "blocker"
    cases: dict[str, Callable[[], Any]] = {
        "non_scalar_loss": lambda: _fit(NonScalar("tiny"), ["dp2", "tp2"]),
        "float_loss": lambda: _fit(FloatLoss("tiny"), ["dp2", "tp2"]),
        "no_tp_plan_with_tp_layouts": lambda: _fit(Plain("tiny"), ["dp2", "tp2"]),
        "unwritable_checkpoint_dir": lambda: _fit(LlamaLM("tiny"), ["dp2", "tp2"], callbacks=[ModelCheckpoint(
            dirpath=str(base_path / "blocker" / "ckpts"), every_n_train_steps=1)]),
        "save_checkpoint_into_a_file": lambda: _save_after_fit(str(base_path / "blocker" / "last")),
        "resume_from_an_interrupted_save": lambda: _fit(LlamaLM("tiny"), ["dp2", "tp2"], ckpt_path=str(incomplete)),
        "world_size_changed_with_the_saved_layouts": lambda: _fit(LlamaLM("tiny"), ["dp4", "dp2xtp2"],
                                                                  ckpt_path=world4_checkpoint, steps=2),
        "resume_into_another_model": lambda: _fit(LlamaLM({"preset": "tiny", "hidden": 96}), "auto",
                                                  ckpt_path=world4_checkpoint, steps=2),
        "negative_gradient_clip_val": lambda: _fit(LlamaLM("tiny"), ["dp2", "tp2"], gradient_clip_val=-1.0),
    }
    out: dict[str, str | None] = {}
    for name, case in cases.items():
        try:
            case()
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            out[name] = f"{type(exc).__name__}: {exc}"
    # the same checkpoint, with layouts for 2 ranks, resumes fine: the errors above were about the inputs
    out["control_resume_at_world_2"] = str(_fit(LlamaLM("tiny"), "auto", ckpt_path=world4_checkpoint,
                                                steps=2).global_step)
    return out


def _save_after_fit(path: str) -> None:
    from helpers import lightning_rank_env

    from lightning_hotspa.models import LlamaLM

    trainer = _fit(LlamaLM("tiny"), ["dp2", "tp2"])
    with lightning_rank_env():
        trainer.save_checkpoint(path)


MULTI = {
    "non_scalar_loss": ("ValueError", "NonScalar.training_step must return a scalar loss tensor",
                        "a tensor of shape (2,)"),
    "float_loss": ("ValueError", "FloatLoss.training_step must return a scalar loss tensor", "got float"),
    "no_tp_plan_with_tp_layouts": ("LayoutError", "layouts with tp=2 need a tensor-parallel plan", "Plain"),
    "unwritable_checkpoint_dir": ("CheckpointError", "ModelCheckpoint(dirpath=", "blocker/ckpts",
                                  "NotADirectoryError"),
    "save_checkpoint_into_a_file": ("CheckpointError", "cannot write a checkpoint to", "blocker/last"),
    "resume_from_an_interrupted_save": ("CheckpointError", "epoch=0-step=9.ckpt.tmp",
                                        "not a complete hotspa checkpoint"),
    "world_size_changed_with_the_saved_layouts": ("LayoutError", "layout dp4 covers 4 ranks",
                                                  "world size is 2", "['dp2', 'tp2']"),
    "resume_into_another_model": ("CheckpointError", "world4.ckpt", "does not fit LlamaLM", "Size mismatch",
                                  "tok_embeddings.weight"),
    # issue 55: Lightning skips clipping for a negative value without a word
    "negative_gradient_clip_val": ("ValueError", "Trainer(gradient_clip_val=-1.0)", "finite number >= 0"),
}


@pytest.fixture(scope="module")
def trainer_errors(ranks, tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_fits")
    ckpt = str(base / "world4.ckpt")
    assert ranks(4).run(save_at_world_4, ckpt) == [1] * 4
    (base / "blocker").write_text("a file where a folder should be")
    (base / "epoch=0-step=9.ckpt.tmp").mkdir()
    (base / "epoch=0-step=9.ckpt.tmp" / "__0_0.distcp").write_bytes(b"partial")  # an interrupted save
    before = files_under(base)
    results = ranks(2).run(bad_fits_at_world_2, str(base), ckpt, timeout_s=300)
    return results, before, files_under(base), base


@pytest.mark.parametrize("name", list(MULTI))
def test_bad_input_through_a_trainer(name: str, trainer_errors) -> None:
    TALLY["tried"] += 1
    results, before, after, base = trainer_errors
    expected_type, *fragments = MULTI[name]
    for rank, result in enumerate(results):  # every rank fails alike (none is left waiting in a collective)
        message = result[name]
        assert message is not None and message.startswith(expected_type + ":"), (rank, message)
        for fragment in fragments:
            assert fragment in message, (rank, fragment, message)
    assert results[0]["control_resume_at_world_2"] == "2"
    assert after == before, f"files left behind: {sorted(map(str, after - before))}"
    TALLY["handled"] += 1

