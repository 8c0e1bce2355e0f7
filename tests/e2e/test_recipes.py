"""recipes/train.py and configs/: every config option composes and builds, bad overrides end in one short
message, W&B goes offline without a key (the end-to-end run under Lightning's own launcher:
tests/e2e/test_what_a_user_sees.py)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import make_tokenizer
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_hotspa.adapter.observability.telemetry import RunSummary, StageRecord, detect_hardware
from lightning_hotspa.adapter.observability.wandb_run import decide_wandb_mode
from lightning_hotspa.adapter.recipes.hydra_recipe import (
    CONFIG_DIR,
    ConfigError,
    check_config,
    group_options,
    register_resolvers,
    run_dir_name,
)
from lightning_hotspa.data import SOURCE_KINDS, HotSPaDataModule
from lightning_hotspa.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "recipes" / "train.py"
GROUPS = ("model", "strategy", "data", "trainer", "logger", "hardware")


def _compose(overrides: list[str], tmp: Path) -> OmegaConf:
    register_resolvers()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        return compose("config", overrides=[f"output_dir={tmp}", "run_name=test", *overrides])


# ------------------------------------------------------------------ every option composes and builds
def _build_check(group: str, node, tmp: Path) -> None:
    """Builds what is cheap and machine-independent; binds the arguments of the rest."""
    if group == "model":
        with torch.device("meta"):
            assert isinstance(instantiate(node, _convert_="all"), L.LightningModule)
    elif group == "strategy":
        from lightning_hotspa import HotSPaStrategy

        assert isinstance(instantiate(node, _convert_="all"), HotSPaStrategy)
    elif group == "trainer":
        kwargs = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "_target_"}
        inspect.signature(L.Trainer).bind(**kwargs)
    elif group == "logger":
        for value in node.values():
            assert isinstance(instantiate(value), L.pytorch.loggers.Logger)
    elif group == "data":
        kwargs = OmegaConf.to_container(node, resolve=True)
        kwargs.pop("_target_")
        inspect.signature(HotSPaDataModule).bind(**kwargs)
        inspect.signature(SOURCE_KINDS[kwargs["source"]]).bind(**kwargs["source_kwargs"])
        if kwargs["source"] in ("stdlib", "synthetic", "text", "jsonl", "chat_jsonl"):
            instantiate(node, _convert_="all")
    elif group == "hardware":
        assert detect_hardware(node.profile, node.peak_flops_per_device, "cpu")[1] > 0


def test_every_config_group_option_composes_resolves_and_builds(tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text("hello world\n")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    paths = {"text": tmp_path, "jsonl": tmp_path / "docs.jsonl", "parquet": tmp_path, "hf_disk": tmp_path}
    checked = 0
    for group in GROUPS:
        options = group_options(group)
        assert options, group
        for option in options:
            extra = [f"{group}={option}", f"data.cache_dir={tmp_path / 'cache'}"]
            if group == "data" and option in paths:
                extra.append(f"data.source_kwargs.path={paths[option]}")
            if group == "data" and option == "chat":  # a chat file and a tokenizer folder made here
                (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "hello", "response": "world"}) + "\n")
                extra += [f"data.source_kwargs.path={tmp_path / 'chat.jsonl'}",
                          f"data.tokenizer_kwargs.path={make_tokenizer(tmp_path / 'tok')}"]
            if group == "model" and option == "hf":  # a tiny random Hugging Face folder, made here
                from helpers import hf_model

                hf_model("llama").save_pretrained(tmp_path / "hf")
                extra.append(f"model.path={tmp_path / 'hf'}")
            if option == "hotspa_8gpu":
                extra.append("trainer=gpu8")
            if option in ("cpu1", "cpu2"):  # the default context needs the memory of 4 ranks
                extra.append(f"strategy.tokens_per_rank={2048 // int(option[-1])}")
            cfg = _compose(extra, tmp_path)
            check_config(cfg)
            node = cfg[group]
            if node:
                _build_check(group, node, tmp_path)
            checked += 1
    assert checked >= 30
    cfg = _compose(["logger=[wandb,csv]"], tmp_path)  # selecting several options of one group
    assert set(cfg.logger) == {"wandb", "csv"}


# ------------------------------------------------------------------ bad overrides: one short message
def _run_main(argv: list[str], tmp: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    spec = importlib.util.spec_from_file_location("hotspa_train_recipe", TRAIN)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    saved = sys.argv
    sys.argv = [str(TRAIN), f"hydra.run.dir={tmp}", *argv]
    try:
        with pytest.raises(SystemExit) as exit_info:
            module.main()
    finally:
        sys.argv = saved
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), captured.err + captured.out


@pytest.mark.parametrize(("argv", "expected"), [
    (["strategy.layouts=[{dp:2,tp:4}]"], ["strategy.layouts", "covers 8 ranks", "dp*tp*cp = 4", "{dp: 4}"]),
    (["strategy.layouts=[{dp:2,pp:2,fsdp:true}]"],
     ["strategy.layouts", "layout dp2xpp2:fsdp: pipeline parallelism (pp=2)"]),
    (["strategy.layouts=dp4"], ["strategy.layouts", "write a list"]),
    (["data.context_length=4096"], ["data.context_length=4096", "strategy.tokens_per_rank"]),
    (["data=jsonl"], ["data.source_kwargs.path is required"]),
    (["model=nope"], ["Could not find 'model/nope'", "tiny", "llama7b"]),
    (["strategy.compile_blocks=true"], ["compile_blocks=...) moved", "strategy.runtime.compile_blocks"]),
])
def test_bad_override_prints_one_short_message(argv: list[str], expected: list[str], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _run_main(argv, tmp_path, capsys)
    assert code != 0
    for fragment in expected:
        assert fragment in text, text
    assert "Traceback" not in text and "omegaconf" not in text.lower()
    assert len(text.strip().splitlines()) <= 16, text


def test_check_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match="strategy.layouts: layouts .* do not nest"):
        check_config(_compose(["strategy.layouts=[{dp:4,tp:3},{dp:3,tp:4}]", "trainer.devices=12"], Path("/tmp")))


def test_ranks_started_by_a_launcher_agree_on_the_run_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    assert run_dir_name("2026-01-01/10-00-00") == "2026-01-01/10-00-00"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without a rendezvous id
    assert run_dir_name("t") == "t"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4f2a")
    assert run_dir_name("t") == "torchrun-4f2a"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert run_dir_name("t") == "slurm-77-0"


# ------------------------------------------------------------------ W&B mode, summary
def test_wandb_goes_offline_without_a_key_and_respects_explicit_modes(tmp_path: Path) -> None:
    assert decide_wandb_mode("auto", env={}, home=tmp_path).mode == "offline"
    assert decide_wandb_mode("auto", env={"WANDB_API_KEY": "x" * 40}, home=tmp_path).mode == "online"
    disabled = {"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}
    assert decide_wandb_mode("auto", env=disabled, home=tmp_path).mode == "disabled"
    assert decide_wandb_mode(True, env={"WANDB_API_KEY": "k"}, home=tmp_path).mode == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    os.chmod(tmp_path / ".netrc", 0o600)
    assert decide_wandb_mode("auto", env={}, home=tmp_path).mode == "online"
    own_server = {"WANDB_BASE_URL": "https://wandb.example.com"}
    assert decide_wandb_mode("auto", env=own_server, home=tmp_path).mode == "offline"


def test_summary_skips_start_up_and_reports_the_loss_ratio() -> None:
    summary = RunSummary(skip_first=1, peak_flops_total=1e9)
    for step, loss in enumerate([6.0, 5.0, 3.0], start=1):
        summary.add_loss(loss)
        record = StageRecord(step, 0, Layout(dp=4), "(0,256]", tokens=100, documents=2, micro_batches=1, switch_s=0.5,
                             switch_mb=1.0, compute_s=1.5 if step > 1 else 99.0, reduce_s=0.0, flops=1e9)
        summary.add(step, [record], step_s=2.0)
    (row,) = summary.rows()
    assert row["steps"] == 2 and row["tokens_per_s"] == pytest.approx(50.0)
    assert row["switch_fraction"] == pytest.approx(0.25) and row["mfu"] == pytest.approx(0.5)
    assert summary.loss_ratio() == pytest.approx((6.0, 14 / 3, 14 / 18))
    assert "dp4" in summary.format_table() and "0.778x" in summary.format_table()
