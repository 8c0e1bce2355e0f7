"""Issue 41: one table of bad inputs across strategy, model, HF folders, checkpoints, data, chat,
Hydra and the CLI, in one process (tiny models, tmp files, no ranks, no Trainer.fit).

Every row must raise its error type with a message that names the bad value (asserted on the text)
and leave no half-written file behind. The row type, the Hydra / DataModule / strategy builders and
the file checks are tests/e2e/test_bad_inputs.py's (imported by name), the checkpoint and chat
fixtures test_checkpoint_trust.py's and test_chat_data.py's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("transformers")

from helpers import (  # noqa: E402
    TEMPLATE,
    Bad,
    check_refused,
    config_case,
    jsonl_case,
    legacy_folder,
    make_tokenizer,
    raises_case,
    rehash,
    save_tiny,
    strategy_case,
)

from lightning_hotspa.adapter.checkpoints.dcp_state import CheckpointError  # noqa: E402
from lightning_hotspa.adapter.recipes.hydra_recipe import ConfigError  # noqa: E402
from lightning_hotspa.data import DataError, SyntheticSource, TextFolderSource  # noqa: E402
from lightning_hotspa.data.chat import ChatTemplateTokenizer  # noqa: E402
from lightning_hotspa.layout import LayoutError  # noqa: E402
from lightning_hotspa.models.hf_config import HFConfigError  # noqa: E402
from lightning_hotspa.models.hf_weights import HFWeightsError  # noqa: E402


class CliRefused(Exception):
    """``hotspa ...`` exited non-zero; the message is ``exit <code>: <stderr>``."""


# ------------------------------------------------------------------ Hydra values at the recipe edge
@functools.lru_cache(maxsize=1)
def _composed() -> Any:
    """The default config composed once by Hydra (each row merges its override into a copy)."""
    from hydra import compose, initialize_config_dir

    from lightning_hotspa.adapter.recipes.hydra_recipe import CONFIG_DIR, register_resolvers

    register_resolvers()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        return compose("config", overrides=["output_dir=out", "run_name=t", "logger=none", "hardware=cpu-gloo"])


def _hydra(override: str) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        from omegaconf import OmegaConf

        from lightning_hotspa.adapter.recipes.hydra_recipe import check_config

        def call() -> None:
            cfg = copy.deepcopy(_composed())
            OmegaConf.set_struct(cfg, False)  # Hydra's "+key=value": a key the config does not have yet
            cfg.merge_with(OmegaConf.from_dotlist([override]))
            check_config(cfg)
        return call
    return make


def _hydra_rows() -> list[Bad]:
    table = {  # key -> [(bad value, how the message shows it)]; the message names the key too
        "seed": [("abc", "'abc'"), ("-1", "got -1"), ("1.5", "got 1.5"), ("true", "got True")],
        "trainer.max_steps": [("lots", "an int >= -1 (-1: no limit), got 'lots'"), ("-2", "got -2"), ("2.5", "2.5"),
                              ("true", "True")],
        "trainer.max_epochs": [("1.5", "got 1.5"), ("lots", "'lots'"), ("-3", "-3")],
        "trainer.min_steps": [("-1", "got -1"), ("x", "'x'")], "trainer.min_epochs": [("2.5", "2.5")],
        "trainer.log_every_n_steps": [("0", "got 0"), ("often", "'often'")],
        "expect_loss_ratio": [("low", "a positive number, got 'low'"), ("-1", "-1"), ("0", "got 0"), ("true", "True")],
        "model.lr": [("fast", "a positive number, got 'fast'"), ("-0.1", "-0.1"), ("0", "got 0")],
        "model.weight_decay": [("-0.1", "-0.1"), ("heavy", "'heavy'")],
        "model.warmup_steps": [("-1", "-1"), ("few", "'few'")], "model.seed": [("abc", "'abc'")],
        "strategy.tokens_per_rank": [("0", "got 0"), ("lots", "'lots'"), ("1.5", "1.5")],
        "data.tokens_per_batch": [("0", "got 0"), ("big", "'big'")],
        "data.context_length": [("long", "'long'"), ("-8", "-8")],
    }
    rows = [Bad(f"hydra {key}={value}", "hydra", _hydra(f"{key}={value}"), ConfigError, (key, says))
            for key, values in table.items() for value, says in values]
    # a target of the flat adapter/ that moved into sub-packages: named, with where it lives now
    rows.append(Bad("hydra moved strategy target", "hydra",
                    _hydra("strategy._target_=lightning_hotspa.adapter.strategy.HotSPaStrategy"), ConfigError,
                    ("strategy._target_=lightning_hotspa.adapter.strategy.HotSPaStrategy",
                     "lightning_hotspa.adapter.lightning.strategy.HotSPaStrategy")))
    # two through Hydra's own override parser end to end (compose per row)
    rows += [Bad("hydra compose trainer.max_steps=lots", "hydra", config_case("trainer.max_steps=lots"), ConfigError,
                 ("trainer.max_steps", "'lots'")),
             Bad("hydra compose model.lr=fast", "hydra", config_case("model.lr=fast"), ConfigError,
                 ("model.lr", "'fast'"))]
    return rows


# ------------------------------------------------------------------ strategy and model arguments
def _file_at(tmp: Path, name: str = "crumbs") -> Path:
    (tmp / name).write_text("a file, not a folder")
    return tmp / name


def _strategy_rows() -> list[Bad]:
    s = strategy_case
    rows = [
        Bad("ac layout not a candidate", "strategy", raises_case(s(["dp1"], activation_checkpointing=["dp9"])),
            LayoutError,
            ("activation_checkpointing", "['dp9']", "not among the layouts ['dp1']")),
        Bad("ac layouts partly candidates", "strategy",
            raises_case(s(["dp2", "tp2"], activation_checkpointing=["tp2", "cp2"])), LayoutError, ("['cp2']", "'tp2'")),
        Bad("ac unknown mode", "strategy", raises_case(s(activation_checkpointing="sometimes")), ValueError,
            ("activation_checkpointing", "'sometimes'")),
        Bad("ac a number", "strategy", raises_case(s(activation_checkpointing=3)), ValueError,
            ("activation_checkpointing", "3")),
        Bad("ac a mapping", "strategy", raises_case(s(activation_checkpointing={"dp1": True})), ValueError,
            ("activation_checkpointing", "'dp1'")),
        Bad("ac unparsable layout", "strategy", raises_case(s(["dp1"], activation_checkpointing=["dpX"])), LayoutError,
            ("dpX",)),
        Bad("breadcrumb_dir a file", "strategy", lambda tmp: s(reliability={"breadcrumb_dir": str(_file_at(tmp))}),
            ValueError, ("breadcrumb_dir", "crumbs", "is a file")),
        Bad("breadcrumb_dir under a file", "strategy",
            lambda tmp: s(reliability={"breadcrumb_dir": str(_file_at(tmp) / "x")}),
            ValueError, ("crumbs/x", "lies under the file")),
        Bad("breadcrumb_dir a number", "strategy", raises_case(s(reliability={"breadcrumb_dir": 5})), TypeError,
            ("breadcrumb_dir", "5")),
        Bad("empty layout list", "strategy", raises_case(s([])), LayoutError, ("layouts=[]",)),
        Bad("tokens_per_rank zero", "strategy", raises_case(s(tokens_per_rank=0)), ValueError,
            ("tokens_per_rank", "got 0")),
        Bad("tokens_per_rank negative", "strategy", raises_case(s(tokens_per_rank=-4)), ValueError, ("got -4",)),
        Bad("tokens_per_rank float", "strategy", raises_case(s(tokens_per_rank=2.5)), ValueError, ("got 2.5",)),
        Bad("tokens_per_rank bool", "strategy", raises_case(s(tokens_per_rank=True)), ValueError, ("got True",)),
        Bad("fsdp_reduce_dtype", "strategy", raises_case(s(runtime={"fsdp_reduce_dtype": "fp8"})), ValueError,
            ("'fp8'",)),
        Bad("compile_blocks a string", "strategy", raises_case(s(runtime={"compile_blocks": "yes"})), ValueError,
            ("compile_blocks", "'yes'")),
        Bad("bucket_mb negative", "strategy", raises_case(s(runtime={"bucket_mb": -1})), ValueError,
            ("bucket_mb", "-1")),
        Bad("an old keyword", "strategy", raises_case(s(compile_blocks=True)), TypeError,
            ("compile_blocks=...) moved", "runtime=RuntimeOptions(compile_blocks=...)", "strategy.runtime.")),
        Bad("unknown runtime option", "strategy", raises_case(s(runtime={"compile": True})), TypeError,
            ("runtime: unknown option(s) ['compile']", "compile_blocks")),
        Bad("timeout negative", "strategy", raises_case(s(timeout=-5)), ValueError, ("timeout", "-5")),
        Bad("subgroup_timeout a string", "strategy", raises_case(s(reliability={"subgroup_timeout": "1m"})),
            ValueError, ("subgroup_timeout", "'1m'")),
        Bad("hardware unknown", "strategy", raises_case(s(planner="cost", hardware="nope")), ValueError, ("'nope'",)),
    ]
    return rows


def _lm(**kwargs: Any) -> Callable[[Path], Callable[[], Any]]:
    from lightning_hotspa.models import LlamaLM

    return raises_case(lambda: LlamaLM("tiny", **kwargs))


def _model_rows() -> list[Bad]:
    args = {  # LlamaLM argument -> (value, what the message names)
        "lr": [("fast", "'fast'"), (-1.0, "-1.0"), (0, "got 0"), (True, "True"), (None, "None")],
        "seed": [("abc", "'abc'"), (-1, "-1"), (1.5, "1.5")],
        "betas": [((0.9,), "(0.9,)"), ((1.5, 0.9), "(1.5, 0.9)"), ("ab", "'ab'"), ((0.9, "x"), "'x'")],
        "weight_decay": [(-0.1, "-0.1"), ("heavy", "'heavy'")],
        "warmup_steps": [(-1, "-1"), (1.5, "1.5"), ("few", "'few'")],
        "max_steps": [(-5, "-5"), ("many", "'many'")],
        "min_lr_ratio": [(2, "got 2"), ("low", "'low'")],
        "activation_checkpointing": [("maybe", "'maybe'"), (2, "got 2")],
        "attention_backend": [(3, "got 3")],
    }
    rows = [Bad(f"LlamaLM {k}={v!r}", "model", _lm(**{k: v}), ValueError, (k if k != "activation_checkpointing" else
                                                                           "activation checkpointing", says))
            for k, values in args.items() for v, says in values]
    config = {"n_layers": (0, "LlamaConfig.n_layers", "got 0"), "hidden": ("64", "LlamaConfig.hidden", "'64'"),
              "n_heads": (3, "n_heads=3", "hidden=64"), "rope_theta": (-1.0, "LlamaConfig.rope_theta", "-1.0"),
              "norm_eps": (0, "LlamaConfig.norm_eps", "got 0"), "qkv_bias": ("yes", "qkv_bias", "'yes'"),
              "sliding_window": (0, "LlamaConfig.sliding_window", "got 0"),
              "vocab_size": (True, "LlamaConfig.vocab_size", "True")}
    from lightning_hotspa.models import LlamaLM

    rows += [Bad(f"LlamaConfig {k}={v!r}", "model", raises_case(functools.partial(LlamaLM, {"preset": "tiny", k: v})),
                 ValueError, says) for k, (v, *says) in config.items()]
    return rows


# ------------------------------------------------------------------ Hugging Face folders
def _tiny_hf(tmp: Path, name: str = "hf", **weights: Any) -> Path:
    """A 1-layer Llama folder (config.json + model.safetensors), tensors replaced by ``weights``."""
    from lightning_hotspa.models import LlamaConfig
    from lightning_hotspa.models.hf_config import config_to_hf
    from lightning_hotspa.models.hf_weights import hf_name, save_hf_folder
    from lightning_hotspa.models.init import build_llama

    config = LlamaConfig(vocab_size=32, hidden=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=32,
                         vocab_multiple=1, max_seq_len=64)
    tensors = {hf_name(n): p.detach() for n, p in build_llama(config, 0).named_parameters()}
    tensors.update(weights)
    save_hf_folder(tmp / name, config_to_hf(config), tensors.items())
    return tmp / name


def _pretrained(setup: Callable[[Path], Any] | None = None, **kwargs: Any) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.models import LlamaLM

        folder = _tiny_hf(tmp)
        if setup is not None:
            setup(folder)
        return lambda: LlamaLM.from_pretrained(str(folder), **kwargs)
    return make


def _weights(**weights: Any) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.models import LlamaLM

        folder = _tiny_hf(tmp, **weights)
        return lambda: LlamaLM.from_pretrained(str(folder))
    return make


def _edit_config(**fields: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(fields)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def _stale_index(folder: Path) -> None:
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(32, 16)}, str(folder / "zero.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "zero.safetensors"}}))


def _write(name: str, text: str | bytes) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return edit


_EMBED = "model.embed_tokens.weight"


def _hf_rows() -> list[Bad]:
    nan, inf = torch.full((32, 16), float("nan")), torch.ones(32, 16)
    inf[3, 4] = float("inf")
    return [
        Bad("from_pretrained lr=fast", "hf", _pretrained(lr="fast"), ValueError, ("lr", "'fast'")),
        Bad("from_pretrained lr=None", "hf", _pretrained(lr=None), ValueError, ("lr", "None")),
        Bad("from_pretrained max_seq_len=long", "hf", _pretrained(max_seq_len="long"), ValueError,
            ("max_seq_len", "'long'")),
        Bad("from_pretrained unknown override", "hf", _pretrained(n_expert=4), HFConfigError, ("n_expert",)),
        Bad("from_pretrained strict_weights=no", "hf", _pretrained(strict_weights="no"), HFConfigError,
            ("strict_weights", "'no'")),
        Bad("model.safetensors beside a stale index", "hf", _pretrained(_stale_index), HFWeightsError,
            ("['model.safetensors']", "model.safetensors.index.json", "stale")),
        Bad("two weight files, no index", "hf", _pretrained(lambda f: _stale_index(f) or
                                                          (f / "model.safetensors.index.json").unlink()),
            HFWeightsError, ("'model.safetensors'", "'zero.safetensors'", "no model.safetensors.index.json")),
        Bad("integer weights", "hf", _weights(**{_EMBED: torch.ones(32, 16, dtype=torch.int64)}), HFWeightsError,
            ("non-float dtype", _EMBED, "I64", "strict_weights=False")),
        Bad("int8 weights", "hf", _weights(**{_EMBED: torch.ones(32, 16, dtype=torch.int8)}), HFWeightsError,
            (_EMBED, "I8")),
        Bad("all-NaN weights", "hf", _weights(**{_EMBED: nan}), HFWeightsError, (_EMBED, "512 non-finite")),
        Bad("one Inf weight", "hf", _weights(**{_EMBED: inf}), HFWeightsError, (_EMBED, "1 non-finite")),
        Bad("missing tensor", "hf", _pretrained(lambda f: _resave(f, drop="model.norm.weight")), HFConfigError,
            ("missing ['model.norm.weight']",)),
        Bad("extra tensor", "hf", _pretrained(lambda f: _resave(f, add={"model.layers.5.x.weight": torch.ones(2)})),
            HFConfigError, ("unexpected ['model.layers.5.x.weight']",)),
        Bad("wrong shape", "hf", _weights(**{_EMBED: torch.ones(32, 8)}), HFConfigError, (_EMBED, "(32, 8)")),
        Bad("no config.json", "hf", _pretrained(lambda f: (f / "config.json").unlink()), HFConfigError,
            ("has no config.json",)),
        Bad("config.json cut off", "hf", _pretrained(_write("config.json", '{"vocab_size": 3')), HFConfigError,
            ("config.json", "not valid JSON")),
        Bad("config.json a list", "hf", _pretrained(_write("config.json", "[1, 2]")), HFConfigError,
            ("config.json", "JSON list")),
        Bad("config.json not UTF-8", "hf", _pretrained(_write("config.json", b'{"a": "\xff"}')), HFConfigError,
            ("config.json", "not UTF-8")),
        Bad("architecture unknown", "hf", _pretrained(_edit_config(architectures=["GPT2LMHeadModel"])), HFConfigError,
            ("GPT2LMHeadModel",)),
        Bad("hidden_act gelu", "hf", _pretrained(_edit_config(hidden_act="gelu")), HFConfigError,
            ("hidden_act='gelu'",)),
        Bad("rope_type yarn", "hf", _pretrained(_edit_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4},
                                                             rope_scaling=None)), HFConfigError, ("'yarn'",)),
        Bad("head_dim mismatch", "hf", _pretrained(_edit_config(head_dim=4)), HFConfigError, ("head_dim=4",)),
        Bad("vocab_size zero", "hf", _pretrained(_edit_config(vocab_size=0)), HFConfigError, ("'vocab_size'", "got 0")),
        Bad("index not JSON", "hf", _pretrained(lambda f: _stale_index(f) or
                                               _write("model.safetensors.index.json", "{oops")(f)),
            HFWeightsError, ("model.safetensors.index.json", "not a JSON object")),
        Bad("index empty weight_map", "hf", _pretrained(_write("model.safetensors.index.json", '{"weight_map": {}}')),
            HFWeightsError, ("'weight_map'", "{}")),
        Bad("index to a missing shard", "hf", _pretrained(lambda f: (f / "model.safetensors").unlink() or _write(
            "model.safetensors.index.json", json.dumps({"weight_map": {_EMBED: "gone.safetensors"}}))(f)),
            FileNotFoundError, ("gone.safetensors", "does not exist")),
        Bad("garbage safetensors", "hf", _pretrained(_write("model.safetensors", b"\x10\0\0\0\0\0\0\0{garbage")),
            HFWeightsError, ("model.safetensors", "not a readable safetensors file")),
        Bad("no weights at all", "hf", _pretrained(lambda f: (f / "model.safetensors").unlink()), FileNotFoundError,
            ("no *.safetensors",)),
    ]


def _resave(folder: Path, drop: str | None = None, add: dict[str, torch.Tensor] | None = None) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors.pop(drop, None)
    tensors.update(add or {})
    save_file(tensors, str(folder / "model.safetensors"))


# ------------------------------------------------------------------ checkpoints
def _llama_ckpt(path: Path, n_layers: int) -> None:
    from lightning_hotspa.adapter.checkpoints.dcp_state import save_distributed_checkpoint
    from lightning_hotspa.models import LlamaLM

    model = LlamaLM({"preset": "tiny", "n_layers": n_layers})
    save_distributed_checkpoint({"state_dict": dict(model.state_dict()), "global_step": 3,
                                 "hyper_parameters": {"config": {"preset": "tiny", "n_layers": n_layers}}},
                                path, is_rank_zero=True, barrier=lambda: None)


def _resume(saved_layers: int, model_layers: int) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.adapter.checkpoints.dcp_state import load_distributed_checkpoint
        from lightning_hotspa.models import LlamaLM

        _llama_ckpt(tmp / "ck", saved_layers)
        model = LlamaLM({"preset": "tiny", "n_layers": model_layers})
        return lambda: load_distributed_checkpoint(tmp / "ck", model, [])
    return make


def _checkpoint(damage: Callable[[Path], Any], load: str = "resume") -> Callable[[Path], Callable[[], Any]]:
    """A clean 4-float checkpoint at tmp/c/step=2, damaged, then loaded one way."""
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.adapter.checkpoints.dcp_state import export_consolidated, load_distributed_checkpoint
        from lightning_hotspa.adapter.checkpoints.single_file import consolidate_checkpoint
        from lightning_hotspa.adapter.checkpoints.upgrade import upgrade_legacy_checkpoint

        folder = save_tiny(tmp / "c" / "step=2", 2.0, 2)
        damage(folder)
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(torch.zeros(4))
        return {"resume": lambda: load_distributed_checkpoint(folder, module, []),
                "export": lambda: export_consolidated(folder, tmp / "m.pt"),
                "consolidate": lambda: consolidate_checkpoint(folder, tmp / "m.ckpt"),
                "upgrade": lambda: upgrade_legacy_checkpoint(folder)}[load]
    return make


def _metadata(data: bytes) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / ".metadata").write_bytes(data)
        rehash(folder, ".metadata")
    return damage


def _marker(edit: Callable[[dict], Any]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        marker = json.loads((folder / "commit.json").read_text())
        edit(marker)
        (folder / "commit.json").write_text(json.dumps(marker))
    return damage


def _cli(*argv: str) -> Callable[[Path], Callable[[], Any]]:
    """``hotspa ARGV`` in this process (``{tmp}`` replaced); a non-zero exit raises CliRefused."""
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.tools.cli import main

        args = [a.replace("{tmp}", str(tmp)) for a in argv]

        def call() -> None:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    code = main(args)
                except SystemExit as exc:  # argparse
                    code = exc.code
            if code != 0:
                raise CliRefused(f"exit {code}: {err.getvalue()}")
        return call
    return make


def _checkpoint_rows() -> list[Bad]:
    import pickle

    return [
        Bad("2-layer checkpoint into a 1-layer model", "checkpoint", _resume(2, 1), CheckpointError,
            ("does not fit this model", "unexpected parameters", "model.layers.1.")),
        Bad("1-layer checkpoint into a 2-layer model", "checkpoint", _resume(1, 2), CheckpointError,
            ("missing parameters", "model.layers.1.")),
        Bad("two optimizer states into a run with one", "checkpoint", _optimizer_mismatch, CheckpointError,
            ("optimizer states ['optimizer_0', 'optimizer_1']", "this run has ['optimizer_0']")),
        Bad("metadata not a pickle", "checkpoint", _checkpoint(_metadata(b"not a pickle at all")), CheckpointError,
            (".metadata", "refusing to load")),
        Bad("metadata a dict", "checkpoint", _checkpoint(_metadata(pickle.dumps({"a": 1}))), CheckpointError,
            (".metadata", "holds a dict, not DCP Metadata")),
        Bad("metadata names os.system", "checkpoint", _checkpoint(_metadata(b"cos\nsystem\n(S'true'\ntR.")),
            CheckpointError, ("os.system",)),
        Bad("metadata names torch.load on export", "checkpoint",
            _checkpoint(_metadata(pickle.dumps(torch.load)), "export"), CheckpointError, ("torch.serialization.load",)),
        Bad("metadata names eval on consolidate", "checkpoint",
            _checkpoint(_metadata(b"cbuiltins\neval\n(S'1'\ntR."), "consolidate"), CheckpointError, ("builtins.eval",)),
        Bad("metadata planted on a legacy upgrade", "checkpoint",
            _checkpoint(lambda f: legacy_folder(f) and (f / ".metadata").write_bytes(b"cbuiltins\nexec\n(S'1'\ntR."),
                        "upgrade"), CheckpointError, ("builtins.exec",)),
        Bad("legacy meta.pt holding a user type", "checkpoint",
            _checkpoint(lambda f: legacy_folder(f) and torch.save({"global_step": 2, "x": _Obj()}, f / "meta.pt"),
                        "upgrade"),
            CheckpointError, ("_Obj", "--trust-pickle")),
        Bad("upgrade of a current folder", "checkpoint", _checkpoint(lambda f: None, "upgrade"), CheckpointError,
            ("not an old-format hotspa checkpoint",)),
        Bad("legacy folder resumed", "checkpoint", _checkpoint(legacy_folder), CheckpointError,
            ("older lightning_hotspa", "upgrade-checkpoint")),
        Bad("commit.json cut off", "checkpoint", _checkpoint(_write("commit.json", '{"format": ')), CheckpointError,
            ("commit.json", "not valid JSON")),
        Bad("commit.json other version", "checkpoint", _checkpoint(_marker(lambda m: m.update(version=7))),
            CheckpointError, ("version 7",)),
        Bad("commit.json files not an object", "checkpoint", _checkpoint(_marker(lambda m: m.update(files=[1]))),
            CheckpointError, ("'files'", "[1]")),
        Bad("commit.json names a path", "checkpoint",
            _checkpoint(_marker(lambda m: m["files"].update({"../x": {"bytes": 1, "sha256": "0"}}))), CheckpointError,
            ("'../x'", "not a plain file name")),
        Bad("commit.json step a string", "checkpoint", _checkpoint(_marker(lambda m: m.update(global_step="2"))),
            CheckpointError, ("global_step", "'2'")),
        Bad("commit.json bytes a string", "checkpoint",
            _checkpoint(_marker(lambda m: m["files"].update({"meta.pt": {"bytes": "1", "sha256": "0"}}))),
            CheckpointError, ("files['meta.pt']",)),
        Bad("a shard truncated", "checkpoint", _checkpoint(lambda f: (f / "__0_0.distcp").write_bytes(b"x")),
            CheckpointError, ("__0_0.distcp", "truncated")),
        Bad("meta.pt missing", "checkpoint", _checkpoint(lambda f: (f / "meta.pt").unlink()), CheckpointError,
            ("no meta.pt",)),
        Bad("checkpoint path is a file", "checkpoint", raises_case(lambda: _resolve(__file__)), CheckpointError,
            ("is a file, not a hotspa checkpoint",)),
        Bad("latest: without a folder", "checkpoint", raises_case(lambda: _resolve("latest:")), CheckpointError,
            ("give the folder after 'latest:'",)),
        Bad("latest: of an empty folder", "checkpoint", lambda tmp: lambda: _resolve(f"latest:{tmp}"),
            CheckpointError, ("'latest:", "no complete checkpoint in")),
        Bad("latest: of a missing folder", "checkpoint", lambda tmp: lambda: _resolve(f"latest:{tmp}/typo"),
            CheckpointError, ("typo", "does not exist")),
        Bad("consolidate latest: of a missing folder", "checkpoint", lambda tmp: lambda: _consolidate(
            f"latest:{tmp}/nope", tmp / "o.ckpt"), CheckpointError, ("nope", "does not exist")),
        Bad("save to a name ending .tmp", "checkpoint", lambda tmp: lambda: save_tiny(tmp / "x.tmp", 1.0, 1),
            CheckpointError, ("x.tmp", "reserved")),
    ]


def _optimizer_mismatch(tmp: Path) -> Callable[[], Any]:
    from lightning_hotspa.adapter.checkpoints.dcp_state import load_distributed_checkpoint

    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lightning_hotspa.adapter.checkpoints.dcp_state import save_distributed_checkpoint

    state = get_optimizer_state_dict(module, optimizer)
    save_distributed_checkpoint({"state_dict": dict(module.state_dict()), "global_step": 1,
                                 "optimizer_states": [state, state]}, tmp / "ck", is_rank_zero=True,
                                barrier=lambda: None)
    return lambda: load_distributed_checkpoint(tmp / "ck", module, [optimizer])


class _Obj:
    """A user type an old meta.pt may hold (a weights-only load refuses it)."""


def _resolve(spec: str) -> Any:
    from lightning_hotspa.adapter.checkpoints.dcp_state import resolve_checkpoint

    return resolve_checkpoint(spec)


def _consolidate(spec: str, out: Path) -> Any:
    from lightning_hotspa.adapter.checkpoints.single_file import consolidate_checkpoint

    return consolidate_checkpoint(spec, out)


def _cli_rows() -> list[Bad]:
    plan = ("plan", "--data", "uniform")
    return [
        Bad("plan --context inf", "cli", _cli(*plan, "--context", "inf"), CliRefused, ("exit 2", "'inf'")),
        Bad("plan --context nan", "cli", _cli(*plan, "--context", "nan"), CliRefused, ("'nan'",)),
        Bad("plan --context -1", "cli", _cli(*plan, "--context", "-1"), CliRefused, ("'-1'", "positive")),
        Bad("plan --global-batch-tokens -5K", "cli", _cli(*plan, "--global-batch-tokens", "-5K"), CliRefused,
            ("--global-batch-tokens", "'-5K'", "positive")),
        Bad("plan --global-batch-tokens 0", "cli", _cli(*plan, "--global-batch-tokens", "0"), CliRefused, ("'0'",)),
        Bad("plan --global-batch-tokens lots", "cli", _cli(*plan, "--global-batch-tokens", "lots"), CliRefused,
            ("'lots'", "32K")),
        Bad("plan --global-batch-tokens below --context", "cli", _cli(*plan, "--global-batch-tokens", "1K"),
            CliRefused, ("--global-batch-tokens 1024 is below --context 32768",)),
        Bad("plan --world-size 0", "cli", _cli(*plan, "--world-size", "0"), CliRefused, ("'0'", "positive integer")),
        Bad("plan --world-size -2", "cli", _cli(*plan, "--world-size", "-2"), CliRefused, ("'-2'",)),
        Bad("plan --world-size eight", "cli", _cli(*plan, "--world-size", "eight"), CliRefused, ("'eight'",)),
        Bad("plan --tokens-per-rank 0", "cli", _cli(*plan, "--tokens-per-rank", "0"), CliRefused, ("'0'",)),
        Bad("plan --hardware nope", "cli", _cli(*plan, "--hardware", "nope"), CliRefused, ("'nope'", "H100")),
        Bad("plan --model nope", "cli", _cli(*plan, "--model", "nope"), CliRefused, ("'nope'",)),
        Bad("plan --data nowhere", "cli", _cli("plan", "--data", "{tmp}/nowhere"), CliRefused, ("nowhere",)),
        Bad("simulate --hardware nope", "cli", _cli("simulate", "--hardware", "nope"), CliRefused,
            ("--hardware", "'nope'", "A800-80G")),
        Bad("simulate --grid smoke --hardware H100", "cli", _cli("simulate", "--grid", "smoke", "--hardware", "H100"),
            CliRefused, ("--hardware 'H100'", "--grid smoke")),
        Bad("simulate --batches 0", "cli", _cli("simulate", "--batches", "0"), CliRefused, ("'0'",)),
        Bad("simulate --contexts inf", "cli", _cli("simulate", "--contexts", "inf"), CliRefused, ("'inf'",)),
        Bad("simulate --margin 20", "cli", _cli("simulate", "--grid", "smoke", "--margin", "20"), CliRefused,
            ("--margin", "20")),
        Bad("simulate --fa3-conservative without matching", "cli", _cli("simulate", "--grid", "smoke",
            "--fa3-conservative"), CliRefused, ("--fa3-conservative", "'default'")),
        Bad("export latest: of an empty folder", "cli", _cli("export", "latest:{tmp}", "{tmp}/hf"), CliRefused,
            ("latest:", "no complete checkpoint")),
        Bad("export of a missing folder", "cli", _cli("export", "{tmp}/none", "{tmp}/hf"), CliRefused,
            ("none", "does not exist")),
        Bad("consolidate latest: of an empty folder", "cli", _cli("consolidate", "latest:{tmp}", "{tmp}/o.ckpt"),
            CliRefused, ("no complete checkpoint",)),
        Bad("upgrade-checkpoint of a missing folder", "cli", _cli("upgrade-checkpoint", "{tmp}/none"), CliRefused,
            ("none", "not an old-format")),
    ]


# ------------------------------------------------------------------ data and chat
def _source_docs(kind: str, name: str, data: bytes | None = None, rows: Any = None,
                 **kwargs: Any) -> Callable[[Path], Callable[[], Any]]:
    """Iterate a source over one file written from ``data`` (or a parquet from ``rows``)."""
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.data import build_source

        path = tmp / name
        if rows is not None:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({k: pa.array(v, pa.string() if not v else None) for k, v in rows.items()}), path)
        elif data is not None:
            path.write_bytes(data)
        return lambda: list(build_source(kind, path=str(path), **kwargs))
    return make


def _corpus(kind: str, name: str, data: bytes | None = None, rows: Any = None) -> Callable[[Path], Callable[[], Any]]:
    """The token corpus of a one-file source (what the DataModule builds at setup)."""
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.data import ByteTokenizer, TokenizedCorpus, build_source

        _source_docs(kind, name, data, rows)(tmp)  # writes the file
        return lambda: TokenizedCorpus.build(build_source(kind, path=str(tmp / name)), ByteTokenizer(),
                                             cache_dir=tmp / "cache")
    return make


def _chat_line(*messages: tuple[str, Any]) -> bytes:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in messages]}).encode() + b"\n"


def _chat_tokenizer(template: str | None = None, corrupt: bytes | None = None) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        folder = make_tokenizer(tmp / "tok")
        if corrupt is not None:
            (folder / "tokenizer.json").write_bytes(corrupt)
        return lambda: ChatTemplateTokenizer(folder, chat_template=template)
    return make


_USER_ONLY = "{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} {% endif %}{% endfor %}"


def _data_rows() -> list[Bad]:
    j, c = "corpus.jsonl", "chat.jsonl"
    rows = [
        Bad("empty jsonl", "data", _corpus("jsonl", j, b""), DataError, (j, "the documents were empty")),
        Bad("blank lines only", "data", _corpus("jsonl", j, b"\n  \n\n"), DataError, (j, "documents were empty")),
        Bad("zero-length documents only", "data", _corpus("jsonl", j, b'{"text": ""}\n{"text": ""}\n'), DataError,
            (j, "2 empty")),
        Bad("parquet of 0 rows", "data", _corpus("parquet", "t.parquet", rows={"text": []}), DataError,
            ("t.parquet", "documents were empty")),
        Bad("empty corpus through the DataModule", "data", jsonl_case("\n\n"), DataError,
            ("corpus.jsonl", "documents were empty")),
        Bad("jsonl invalid UTF-8", "data", _source_docs("jsonl", j, b'{"text": "caf\xe9"}\n'), DataError,
            (j, "line 1")),
        Bad("jsonl lone surrogate", "data", _source_docs("jsonl", j, b'{"text": "a\\ud800b"}\n'), DataError,
            (j, "line 1", "lone surrogate '\\ud800'")),
        Bad("parquet binary invalid UTF-8", "data",
            _source_docs("parquet", "b.parquet", rows={"text": [b"ok", b"caf\xe9"]}), DataError,
            ("b.parquet row 1", "not UTF-8", "byte 3")),
        Bad("parquet null value", "data",
            _source_docs("parquet", "n.parquet", rows={"text": ["ok", None]}), DataError, ("n.parquet row 1", "null")),
        Bad("parquet missing column", "data", _source_docs("parquet", "m.parquet", rows={"body": ["x"]}), DataError,
            ("m.parquet", "no column 'text'")),
        Bad("parquet int column", "data", _source_docs("parquet", "i.parquet", rows={"text": [1, 2]}), DataError,
            ("i.parquet", "int64")),
        Bad("jsonl text a number", "data", _source_docs("jsonl", j, b'{"text": 42}\n'), DataError, ("is int",)),
        Bad("jsonl row a list", "data", _source_docs("jsonl", j, b'[1, 2]\n'), DataError, ("got list",)),
        Bad("on_bad_record ignore", "data", _source_docs("jsonl", j, b"", on_bad_record="ignore"), DataError,
            ("on_bad_record", "'ignore'")),
        Bad("text folder without matching files", "data", lambda tmp: lambda: TextFolderSource(tmp, suffixes=(".zz",)),
            DataError, ("no files ending in ['.zz']",)),
        Bad("unknown tokenizer kind", "data", raises_case(lambda: _tok("sentencepiece")), DataError,
            ("'sentencepiece'",)),
        Bad("HF tokenizer.json corrupt", "data", lambda tmp: (lambda p: lambda: _tok("hf", path=str(p)))(
            _put(tmp / "tokenizer.json", b'{"version": ')), DataError, ("tokenizer.json",)),
        Bad("byte tokenizer duplicate specials", "data",
            raises_case(lambda: _tok("byte", special_tokens=["<a>", "<a>"])),
            DataError, ("'<a>'",)),
        Bad("synthetic zero documents", "data", raises_case(lambda: SyntheticSource(0)), DataError, ("got 0",)),
    ]
    chat = [
        ("first turn the assistant's", _chat_line(("assistant", "hello"), ("user", "hi")), ("chat.jsonl:1",
                                                                                          "message 0", "assistant")),
        ("first turn after system the assistant's", _chat_line(("system", "s"), ("assistant", "x"), ("user", "y")),
         ("chat.jsonl:1", "message 1")),
        ("no assistant turn", _chat_line(("user", "hi")), ("chat.jsonl:1", "no assistant message")),
        ("empty assistant reply", _chat_line(("user", "hi"), ("assistant", " ")), ("assistant message 1",)),
        ("unknown role", _chat_line(("robot", "hi"), ("assistant", "x")), ("'robot'",)),
        ("content a number", _chat_line(("user", 5), ("assistant", "x")), ("'content': 5",)),
        ("messages empty", b'{"messages": []}\n', ("non-empty list",)),
        ("messages a string", b'{"messages": "hi"}\n', ("'messages' must be a non-empty list",)),
        ("row a string", b'"hello"\n', ("chat.jsonl:1", "JSON object, got str")),
        ("no known fields", b'{"question": "q"}\n', ("['question']",)),
        ("line not JSON", b'{"messages": [\n', ("chat.jsonl:1",)),
        ("line not UTF-8", b'{"prompt": "caf\xe9", "response": "x"}\n', ("chat.jsonl:1", "not UTF-8")),
        ("lone surrogate in a message", b'{"prompt": "a\\udc80", "response": "x"}\n',
         ("chat.jsonl:1", "lone surrogate")),
    ]
    rows += [Bad(f"chat {name}", "chat", _source_docs("chat_jsonl", c, data), DataError, says)
             for name, data, says in chat]
    rows += [
        Bad("chat template with no assistant tokens", "chat", _chat_tokenizer(_USER_ONLY), DataError,
            ("renders no tokens of the assistant's turns", "tok", "train on nothing")),
        Bad("chat template that fails", "chat", _chat_tokenizer("{{ raise_exception('no') }}"), DataError,
            ("chat template", "fails")),
        Bad("chat tokenizer.json corrupt", "chat", _chat_tokenizer(corrupt=b'{"version": "1.0", '), DataError,
            ("tok", "tokenizer.json", "cannot load")),
        Bad("chat tokenizer folder without tokenizer.json", "chat", lambda tmp: lambda: ChatTemplateTokenizer(tmp),
            DataError, ("has no tokenizer.json",)),
        Bad("chat template missing", "chat", _chat_tokenizer(""), DataError, ("has no chat_template",)),
    ]
    return rows


def _tok(kind: str, **kwargs: Any) -> Any:
    from lightning_hotspa.data import build_tokenizer

    return build_tokenizer(kind, **kwargs)


def _put(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


CASES = _hydra_rows() + _strategy_rows() + _model_rows() + _hf_rows() + _checkpoint_rows() + _cli_rows() + _data_rows()


def test_the_table_covers_every_area_with_150_cases_or_more() -> None:
    areas = {c.area for c in CASES}
    assert len(CASES) >= 150 and areas >= {"strategy", "data", "chat", "hydra", "cli", "checkpoint", "hf"}, \
        (len(CASES), areas)
    assert len({c.name for c in CASES}) == len(CASES), "row names must be unique"


@pytest.mark.parametrize("case", CASES, ids=[f"{c.area}-{c.name}" for c in CASES])
def test_bad_input_is_refused_naming_the_value(case: Bad, tmp_path: Path) -> None:
    check_refused(case, tmp_path)


def test_save_pretrained_removes_every_weight_file_it_did_not_write_and_says_so(tmp_path, caplog) -> None:
    from lightning_hotspa.models import LlamaLM

    folder = _tiny_hf(tmp_path)
    for name in ("old.safetensors", "pytorch_model.bin", "flax_model.msgpack"):
        (folder / name).write_bytes(b"stale")
    (folder / "tokenizer.json").write_text("{}")
    with caplog.at_level("WARNING"):
        LlamaLM.from_pretrained(str(_tiny_hf(tmp_path, "src"))).save_pretrained(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert "old.safetensors" in caplog.text and "pytorch_model.bin" in caplog.text
    LlamaLM.from_pretrained(str(folder))  # the next load reads what was written


def test_the_same_weights_load_when_asked_to_be_lenient(tmp_path) -> None:
    from lightning_hotspa.models import LlamaLM

    folder = _tiny_hf(tmp_path, **{_EMBED: torch.ones(32, 16, dtype=torch.int64)})
    model = LlamaLM.from_pretrained(str(folder), strict_weights=False)
    weight = model.model.tok_embeddings.weight
    assert weight.dtype == torch.float32 and float(weight[0, 0]) == 1


def test_a_chat_template_is_still_accepted_when_it_renders_the_replies(tmp_path) -> None:
    from lightning_hotspa.data.chat import ChatTemplateTokenizer

    tok = ChatTemplateTokenizer(make_tokenizer(tmp_path / "tok"), chat_template=TEMPLATE)
    ids = tok.encode(json.dumps([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"}]))
    assert int((ids < tok.token_vocab_size).sum()) > 0
