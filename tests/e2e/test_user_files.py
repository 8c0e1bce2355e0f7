"""Issue 32, sections 2-4: exports that leave no stale weights, the padded ``tiny`` model exported
and loaded back in ``transformers`` with equal logits, and bad files and arguments named (file,
line, field) instead of trained on or crashed deep inside. One process each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import make_tokenizer

from lightning_hotspa.adapter.checkpoints.dcp_state import save_distributed_checkpoint


def _tiny_checkpoint(path: Path, seed: int = 0):
    """A DCP checkpoint of a single-process ``LlamaLM("tiny")`` (vocabulary 260 padded to 320 rows)."""
    from lightning_hotspa.models import LlamaLM

    model = LlamaLM("tiny", seed=seed)
    checkpoint = {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}, "global_step": 0,
                  "hyper_parameters": {"config": "tiny", "seed": seed}}
    save_distributed_checkpoint(checkpoint, path, is_rank_zero=True, barrier=lambda: None)
    return model


def test_padded_tiny_model_exports_and_loads_in_transformers_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_hotspa.adapter.checkpoints.hf_export import export_hf
    from lightning_hotspa.plan import pack_micro_batch

    model = _tiny_checkpoint(tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == model.config.padded_vocab_size == 320
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    mb = pack_micro_batch([ids])
    with torch.no_grad():
        ours = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
        theirs = hf(ids[None]).logits[0]
    assert ours.shape == theirs.shape
    assert float((ours - theirs).norm() / theirs.norm()) <= 1e-5


def test_export_refuses_a_non_empty_folder_and_overwrite_leaves_only_the_export(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from lightning_hotspa.tools.cli import main

    _tiny_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "hf"
    out.mkdir()
    stale = ["model.safetensors.index.json", "model-00001-of-00002.safetensors", "pytorch_model.bin", "notes.txt"]
    for name in stale:
        (out / name).write_text("{}")
    assert main(["export", str(tmp_path / "ckpt"), str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--overwrite" in err and str(out) in err
    assert sorted(p.name for p in out.iterdir()) == sorted(stale)  # untouched
    assert main(["export", str(tmp_path / "ckpt"), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_live_save_pretrained_removes_stale_weight_files(tmp_path):
    pytest.importorskip("safetensors")
    from lightning_hotspa.models import LlamaLM
    from lightning_hotspa.models.hf import save_pretrained

    model = LlamaLM("tiny")
    (tmp_path / "model-00001-of-00002.safetensors").write_text("old")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_hf_config_and_weights_errors_name_the_file_and_field(tmp_path):
    pytest.importorskip("safetensors")
    from lightning_hotspa.models.hf_config import HFConfigError, config_from_hf, read_hf_config
    from lightning_hotspa.models.hf_weights import HFCheckpoint, HFWeightsError

    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_')
    with pytest.raises(HFConfigError, match=r"config\.json' is not valid JSON \(line 1, column"):
        read_hf_config(tmp_path)
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 64}
    with pytest.raises(HFConfigError, match=r"no 'hidden_size'"):
        config_from_hf(hf)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(HFWeightsError, match=r"model\.safetensors' is not a readable safetensors file"):
        HFCheckpoint(tmp_path)


def test_bad_chat_lines_are_named_and_skippable(tmp_path):
    from lightning_hotspa.data import DataError
    from lightning_hotspa.data.chat import ChatJsonlSource

    good = json.dumps({"prompt": "hi", "response": "there"}).encode()
    (tmp_path / "c.jsonl").write_bytes(good + b"\n" + b'{"prompt": "caf\xe9", "response": "x"}\n' + good + b"\n")
    with pytest.raises(DataError, match=r"c\.jsonl:2: not UTF-8 text \(byte 15"):
        list(ChatJsonlSource(tmp_path / "c.jsonl"))
    assert len(list(ChatJsonlSource(tmp_path / "c.jsonl", on_bad_record="skip"))) == 2
    empty = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    (tmp_path / "e.jsonl").write_text(json.dumps(empty) + "\n")
    with pytest.raises(DataError, match=r"e\.jsonl:1: assistant message 1 \(of 2\) has empty content"):
        list(ChatJsonlSource(tmp_path / "e.jsonl"))


def test_chat_sources_and_the_chat_tokenizer_only_go_together(tmp_path):
    from lightning_hotspa import HotSPaDataModule
    from lightning_hotspa.data import DataError

    (tmp_path / "c.jsonl").write_text(json.dumps({"prompt": "hi", "response": "there"}) + "\n")
    with pytest.raises(DataError, match=r"ChatJsonlSource needs the chat tokenizer.*raw JSON text"):
        HotSPaDataModule("chat_jsonl", {"path": str(tmp_path / "c.jsonl")}, "byte", tokens_per_batch=64,
                         context_length=32, use_cache=False)
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    with pytest.raises(DataError, match=r"the chat tokenizer renders conversations.*JsonlSource yields plain text"):
        HotSPaDataModule("jsonl", {"path": str(tmp_path / "p.jsonl")}, "chat",
                         {"path": str(make_tokenizer(tmp_path / "t"))}, tokens_per_batch=64, context_length=32,
                         use_cache=False)


def test_context_longer_than_the_model_is_refused(tmp_path):
    from types import SimpleNamespace

    from lightning_hotspa import HotSPaDataModule
    from lightning_hotspa.data import DataError
    from lightning_hotspa.models import LlamaLM

    (tmp_path / "doc.txt").write_text("hello world\n")
    dm = HotSPaDataModule("text", {"path": str(tmp_path)}, "byte", tokens_per_batch=8192, context_length=4096,
                          use_cache=False)
    dm.trainer = SimpleNamespace(lightning_module=LlamaLM("tiny"))  # max_seq_len 2048
    with pytest.raises(DataError, match=r"context_length=4096 is longer than the model's max_seq_len=2048"):
        dm._check_vocabulary()


def test_strategy_arguments_that_would_be_ignored_or_crash_later_are_named():
    from lightning_hotspa import HotSPaStrategy
    from lightning_hotspa.layout import LayoutError

    with pytest.raises(ValueError, match=r"hardware='tpu9000'.*planner='rule' would ignore it"):
        HotSPaStrategy(["dp1"], planner="rule", hardware="tpu9000")
    with pytest.raises(LayoutError, match=r"layouts must be 'auto' or a list of layouts.*got None"):
        HotSPaStrategy(None)
    with pytest.raises(TypeError, match=r"breadcrumb_dir must be a folder path.*got 123"):
        HotSPaStrategy(["dp1"], reliability={"breadcrumb_dir": 123})


def test_layouts_that_do_not_fit_the_world_fail_when_the_trainer_is_built():
    import lightning as L

    from lightning_hotspa import HotSPaStrategy
    from lightning_hotspa.layout import LayoutError

    with pytest.raises(LayoutError, match=r"HotSPaStrategy\(layouts=\['dp4'\]\).*devices x num_nodes"):
        L.Trainer(accelerator="cpu", devices=2, strategy=HotSPaStrategy(["dp4"]), logger=False)



def test_a_missing_ckpt_path_fails_before_any_process_or_group_starts(tmp_path):
    import lightning as L
    import torch.distributed as dist

    from lightning_hotspa import HotSPaStrategy
    from lightning_hotspa.adapter.checkpoints.dcp_state import CheckpointError
    from lightning_hotspa.models import LlamaLM

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HotSPaStrategy(["dp1"]), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        max_steps=1)
    for spec, match in ((str(tmp_path / "nope"), r"nope' does not exist \(checked before starting the processes"),
                        (f"latest:{tmp_path / 'typo'}", r"typo' \(no such folder; checked before.*latest_or_scratch:")):
        with pytest.raises(CheckpointError, match=match):
            trainer.fit(LlamaLM("tiny"), train_dataloaders=[], ckpt_path=spec)
        assert not dist.is_initialized()
