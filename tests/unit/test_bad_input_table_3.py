"""Issue 55: files and values a user hands us, round three, as one table (a sibling of
tests/unit/test_bad_input_table.py, same row type and checks) plus the layouts that must keep working:
one symlink rule (a Hugging Face folder follows symlinks into itself and, in huggingface_hub's
cache, into its repo's blobs/; a checkpoint folder's files all lie in it), the commit marker under
the integrity check, typed Hugging Face configs, outputs that never replace a device, wrapped DCP
errors and values at the edge. In one process, tiny tensors, tmp files.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("safetensors")

from helpers import Bad, check_refused, legacy_folder, raises_case, rehash, reseal, save_tiny  # noqa: E402

from lightning_hotspa.adapter.checkpoints.dcp_state import CheckpointError  # noqa: E402
from lightning_hotspa.models.hf_config import HFConfigError  # noqa: E402
from lightning_hotspa.models.hf_weights import HFWeightsError  # noqa: E402


class CliRefused(Exception):
    """``hotspa ...`` exited non-zero; the message is ``exit <code>: <stderr>``."""


def _cli(*argv: str) -> Callable[[Path], Callable[[], Any]]:
    """``hotspa ARGV`` in this process (``{tmp}`` replaced); a non-zero exit raises CliRefused, and
    anything else escaping ``main`` (a traceback a user would see) fails the row."""
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.tools.cli import main

        def call() -> None:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    code = main([a.replace("{tmp}", str(tmp)) for a in argv])
                except SystemExit as exc:  # argparse
                    code = exc.code
            if code != 0:
                assert "Traceback" not in err.getvalue(), err.getvalue()  # argparse's usage, a line: no traceback
                raise CliRefused(f"exit {code}: {err.getvalue()}")
        return call
    return make


# ------------------------------------------------------------------ Hugging Face folders
def tiny_hf(folder: Path, shard_bytes: int = 4 << 30, **config: Any) -> Path:
    """A 1-layer Llama folder (config.json + model.safetensors, or shards of at most ``shard_bytes``
    and their index) at ``folder``, config fields replaced."""
    from lightning_hotspa.models import LlamaConfig
    from lightning_hotspa.models.hf_config import config_to_hf
    from lightning_hotspa.models.hf_weights import hf_name, save_hf_folder
    from lightning_hotspa.models.init import build_llama

    cfg = LlamaConfig(vocab_size=32, hidden=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=32,
                      vocab_multiple=1, max_seq_len=64)
    tensors = {hf_name(n): p.detach() for n, p in build_llama(cfg, 0).named_parameters()}
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0  # a head unlike the embeddings
    save_hf_folder(folder, {**config_to_hf(cfg), **config}, tensors.items(), max_shard_bytes=shard_bytes)
    return folder


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hub_cache(cache: Path, source: Path, repo: str = "org/tiny", revision: str = "a" * 40) -> Path:
    """``source``'s files laid out as huggingface_hub caches a download: ``models--org--tiny/`` with
    ``refs/main`` (the commit), ``blobs/<hash>`` (sha256 for LFS files, the git blob sha1 for the
    rest), ``snapshots/<commit>/<file>`` relative symlinks ``../../blobs/<hash>`` and ``.no_exist/``
    for a file the hub does not have. Returns the snapshot folder."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = hashlib.sha256(data).hexdigest() if file.suffix == ".safetensors" else _git_blob_sha1(data)
        (root / "blobs" / blob).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    (root / ".no_exist" / revision).mkdir(parents=True)
    (root / ".no_exist" / revision / "generation_config.json").touch()
    return snapshot


def local_dir_download(folder: Path, source: Path) -> Path:
    """``source``'s files as ``hf_hub_download(local_dir=folder)`` leaves them: real files, and its
    bookkeeping under ``.cache/huggingface/`` (a metadata file per download)."""
    shutil.copytree(source, folder)
    meta = folder / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (folder / ".cache" / "huggingface" / ".gitignore").write_text("*")
    for file in source.iterdir():
        (meta / f"{file.name}.metadata").write_text(f"{'a' * 40}\n{'b' * 64}\n1765000000.0\n")
    return folder


def _load_hf(path: Path) -> Any:
    from lightning_hotspa.models import LlamaLM

    return LlamaLM.from_pretrained(str(path))


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_a_model_in_huggingface_hubs_own_cache_loads_as_transformers_loads_it(tmp_path: Path, sharded: bool) -> None:
    """main refused a sharded snapshot ("weight_map[...] leaves the model folder")."""
    source = tiny_hf(tmp_path / "src", shard_bytes=4096 if sharded else 4 << 30)
    assert (source / "model.safetensors.index.json").is_file() == sharded
    snapshot = hub_cache(tmp_path / "cache", source)
    hub = pytest.importorskip("huggingface_hub")
    # the layout is huggingface_hub's own: its cache lookups find the snapshot and the missing file
    assert Path(hub.snapshot_download("org/tiny", cache_dir=tmp_path / "cache", local_files_only=True)) == snapshot
    assert Path(hub.try_to_load_from_cache("org/tiny", "config.json", cache_dir=tmp_path / "cache")) == \
        snapshot / "config.json"
    assert hub.try_to_load_from_cache("org/tiny", "generation_config.json", cache_dir=tmp_path / "cache") \
        is hub.file_download._CACHED_NO_EXIST
    assert all((snapshot / f.name).is_symlink() for f in source.iterdir())
    model, reference = _load_hf(snapshot), _load_hf(source)
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(ours, theirs), name
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(snapshot))  # the same folder, transformers' way
    assert torch.equal(hf.lm_head.weight, model.model.output.weight)


def test_a_local_dir_download_and_links_inside_the_folder_load(tmp_path: Path) -> None:
    source = tiny_hf(tmp_path / "src")
    reference = _load_hf(source).state_dict()
    local = local_dir_download(tmp_path / "local", source)
    assert all(torch.equal(v, reference[k]) for k, v in _load_hf(local).state_dict().items())
    inner = tmp_path / "inner"  # a symlink to a file inside the folder itself
    inner.mkdir()
    (inner / "weights").mkdir()
    shutil.copy(source / "model.safetensors", inner / "weights" / "real.safetensors")
    shutil.copy(source / "config.json", inner / "config.json")
    (inner / "model.safetensors").symlink_to(Path("weights") / "real.safetensors")
    assert all(torch.equal(v, reference[k]) for k, v in _load_hf(inner).state_dict().items())
    (tmp_path / "alias").symlink_to(source, target_is_directory=True)  # a symlinked model folder itself
    assert all(torch.equal(v, reference[k]) for k, v in _load_hf(tmp_path / "alias").state_dict().items())


def _hf_case(setup: Callable[[Path], Path]) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        folder = setup(tmp)
        return lambda: _load_hf(folder)
    return make


def _outside_single_file(tmp: Path) -> Path:
    """``model.safetensors`` a symlink to a file elsewhere (read by main without a word)."""
    tiny_hf(tmp / "elsewhere")
    folder = tmp / "hf"
    folder.mkdir()
    shutil.copy(tmp / "elsewhere" / "config.json", folder / "config.json")
    (folder / "model.safetensors").symlink_to(tmp / "elsewhere" / "model.safetensors")
    return folder


def _outside_config(tmp: Path) -> Path:
    tiny_hf(tmp / "hf")
    tiny_hf(tmp / "other")
    (tmp / "hf" / "config.json").unlink()
    (tmp / "hf" / "config.json").symlink_to(tmp / "other" / "config.json")
    return tmp / "hf"


def _snapshot_into_another_repo(tmp: Path) -> Path:
    """A hub-cache snapshot whose weights link into another repo's blobs/."""
    snapshot = hub_cache(tmp / "cache", tiny_hf(tmp / "src"))
    other = hub_cache(tmp / "cache", tmp / "src", repo="evil/other")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(other / "model.safetensors")
    return snapshot


def _sharded_shard_outside(tmp: Path) -> Path:
    """An index whose shard name lies in the folder but is a symlink to a file outside it."""
    folder = tiny_hf(tmp / "hf")
    shutil.move(folder / "model.safetensors", tmp / "far.safetensors")
    (folder / "model-00001-of-00001.safetensors").symlink_to(tmp / "far.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp / "far.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}))
    return folder


def _symlink_rows() -> list[Bad]:
    return [
        Bad("hf model.safetensors symlinked outside the folder", "hf", _hf_case(_outside_single_file), HFWeightsError,
            ("hf/model.safetensors' is a symlink to", "elsewhere/model.safetensors", "outside the model folder")),
        Bad("hf config.json symlinked outside the folder", "hf", _hf_case(_outside_config), HFConfigError,
            ("hf/config.json' is a symlink to", "other/config.json", "outside the model folder")),
        Bad("hf hub snapshot linking into another repo's blobs", "hf", _hf_case(_snapshot_into_another_repo),
            HFWeightsError, ("model.safetensors' is a symlink to", "models--evil--other", "outside the model folder")),
        Bad("hf index shard symlinked outside", "hf", _hf_case(_sharded_shard_outside), HFWeightsError,
            ("model-00001-of-00001.safetensors' is a symlink to", "far.safetensors")),
    ]


def _config_case(**fields: Any) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        folder = tiny_hf(tmp / "hf", **fields)
        return lambda: _load_hf(folder)
    return make


_LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}


def _config_rows() -> list[Bad]:
    file = "hf/config.json'"
    rows = {  # field values of the wrong JSON type (main coerced them, or failed naming no key or file)
        "tie_word_embeddings a string": ({"tie_word_embeddings": "false"},
                                         ("'tie_word_embeddings'", "JSON boolean", "'false'")),
        "tie_word_embeddings a number": ({"tie_word_embeddings": 0}, ("'tie_word_embeddings'", "got 0")),
        "rope_scaling a string": ({"rope_scaling": "llama3"}, ("'rope_scaling'", "an object", "'llama3'")),
        "rope_parameters a list": ({"rope_parameters": [1]}, ("'rope_parameters'", "[1]")),
        "rope_theta a word": ({"rope_theta": "abc", "rope_parameters": None}, ("'rope_theta'", "'abc'")),
        "rope_parameters.rope_theta a string": ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
                                                ("'rope_parameters.rope_theta'", "'1e4'")),
        "rope factor a string": ({"rope_parameters": {**_LLAMA3, "factor": "8"}},
                                 ("'rope_parameters.factor'", "'8'")),
        "rope_scaling factor a string": ({"rope_parameters": None, "rope_scaling": {**_LLAMA3, "factor": "8"}},
                                         ("'rope_scaling.factor'", "'8'")),
        "rope original_max_position_embeddings a float": (
            {"rope_parameters": {**_LLAMA3, "original_max_position_embeddings": 64.5}},
            ("'rope_parameters.original_max_position_embeddings'", "64.5")),
        "rope_type a number": ({"rope_parameters": {"rope_type": 3}}, ("'rope_parameters.rope_type'", "a string")),
        "head_dim a string": ({"head_dim": "16"}, ("'head_dim'", "a positive integer", "'16'")),
        "num_key_value_heads zero": ({"num_key_value_heads": 0}, ("'num_key_value_heads'", "got 0")),
        "num_key_value_heads not dividing": ({"num_key_value_heads": 3}, ("'num_key_value_heads' 3", "does not "
                                                                           "divide")),
        "num_attention_heads a string": ({"num_attention_heads": "2"}, ("'num_attention_heads'", "'2'")),
        "rms_norm_eps a string": ({"rms_norm_eps": "1e-6"}, ("'rms_norm_eps'", "'1e-6'")),
        "rms_norm_eps infinite": ({"rms_norm_eps": float("inf")}, ("'rms_norm_eps'", "finite")),
        "max_position_embeddings a float": ({"max_position_embeddings": 64.0}, ("'max_position_embeddings'",
                                                                                "64.0")),
        "attention_bias a string": ({"attention_bias": "false"}, ("'attention_bias'", "'false'")),
        "hidden_act a list": ({"hidden_act": ["silu"]}, ("'hidden_act'", "a string")),
        "architectures a string": ({"architectures": "LlamaForCausalLM"}, ("'architectures'", "list of strings")),
    }
    return [Bad(f"hf config {name}", "hf", _config_case(**fields), HFConfigError, (file, *says))
            for name, (fields, says) in rows.items()]


def test_a_config_of_the_right_types_still_loads_with_its_own_head(tmp_path: Path) -> None:
    """``tie_word_embeddings: false`` (a JSON boolean) keeps the file's lm_head.weight."""
    model = _load_hf(tiny_hf(tmp_path / "hf", tie_word_embeddings=False))
    assert not torch.equal(model.model.output.weight, model.model.tok_embeddings.weight)


# ------------------------------------------------------------------ checkpoint folders: symlinks and the marker
def _load_ckpt(folder: Path) -> tuple[float, int]:
    from lightning_hotspa.adapter.checkpoints.dcp_state import load_distributed_checkpoint

    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(4))
    meta = load_distributed_checkpoint(folder, module, [])
    return float(module.w.detach()[0]), meta["global_step"]


def _ckpt(damage: Callable[[Path, Path], Any], load: str = "resume",
          name: str = "step=2") -> Callable[[Path], Callable[[], Any]]:
    """A clean checkpoint at tmp/c/<name> (step 2), ``damage(folder, tmp)``, then loaded one way."""
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.adapter.checkpoints.dcp_state import export_consolidated, resolve_checkpoint
        from lightning_hotspa.adapter.checkpoints.single_file import consolidate_checkpoint
        from lightning_hotspa.adapter.checkpoints.upgrade import upgrade_legacy_checkpoint

        folder = save_tiny(tmp / "c" / name, 2.0, 2)
        damage(folder, tmp)
        return {"resume": lambda: _load_ckpt(folder),
                "latest": lambda: resolve_checkpoint(f"latest:{tmp / 'c'}"),
                "export": lambda: export_consolidated(folder, tmp / "m.pt"),
                "consolidate": lambda: consolidate_checkpoint(folder, tmp / "m.ckpt"),
                "upgrade": lambda: upgrade_legacy_checkpoint(folder)}[load]
    return make


def _shard_elsewhere(folder: Path, tmp: Path) -> None:
    """The shard moved out and symlinked back: its checksum (of the target) still matches."""
    shutil.move(folder / "__0_0.distcp", tmp / "far.distcp")
    (folder / "__0_0.distcp").symlink_to(tmp / "far.distcp")


def _only_outside_folder(folder: Path, tmp: Path) -> None:
    """The checkpoint directory's only entry is a symlink to a checkpoint folder outside it."""
    shutil.move(folder, tmp / "far")
    (tmp / "c" / "step=9").symlink_to(tmp / "far", target_is_directory=True)


def _edited_step(step: int, resealed: bool) -> Callable[[Path, Path], None]:
    def damage(folder: Path, tmp: Path) -> None:
        marker = json.loads((folder / "commit.json").read_text())
        marker["global_step"] = step
        if resealed:
            reseal(folder, marker)
        else:
            (folder / "commit.json").write_text(json.dumps(marker, indent=1))
    return damage


def _upgrade_shard_elsewhere(folder: Path, tmp: Path) -> None:
    legacy_folder(folder)
    _shard_elsewhere(folder, tmp)


def _checkpoint_rows() -> list[Bad]:
    return [
        Bad("shard symlinked outside the folder", "checkpoint", _ckpt(_shard_elsewhere), CheckpointError,
            ("__0_0.distcp", "is a symlink to", "far.distcp", "outside the folder")),
        Bad("shard symlinked outside, consolidate", "checkpoint", _ckpt(_shard_elsewhere, "consolidate"),
            CheckpointError, ("__0_0.distcp", "far.distcp")),
        Bad("meta.pt symlinked outside, export", "checkpoint",
            _ckpt(lambda f, t: shutil.move(f / "meta.pt", t / "m") and (f / "meta.pt").symlink_to(t / "m"),
                  "export"), CheckpointError, ("meta.pt' is a symlink to", "outside the folder")),
        Bad("commit.json symlinked outside", "checkpoint",
            _ckpt(lambda f, t: shutil.move(f / "commit.json", t / "cj") and (f / "commit.json").symlink_to(t / "cj")),
            CheckpointError, ("commit.json' is a symlink to", "cj")),
        Bad("latest: of a folder whose only checkpoint is a symlink out", "checkpoint",
            _ckpt(_only_outside_folder, "latest"), CheckpointError,
            ("no complete checkpoint", "step=9' is a symlink to", "far")),
        Bad("upgrade-checkpoint with a shard symlinked outside", "checkpoint",
            _ckpt(_upgrade_shard_elsewhere, "upgrade"), CheckpointError,
            ("cannot convert", "__0_0.distcp' is a symlink to", "far.distcp", "Nothing was changed")),
        Bad("commit.json step edited", "checkpoint", _ckpt(_edited_step(9, resealed=False)), CheckpointError,
            ("commit.json", "was edited after its save", "global_step 9")),
        Bad("commit.json step edited and resealed, folder named step=2", "checkpoint",
            _ckpt(_edited_step(9, resealed=True)), CheckpointError,
            ("commit.json", "global_step 9", "the folder's name says step=2")),
        Bad("commit.json step edited and resealed, folder without a step", "checkpoint",
            _ckpt(_edited_step(9, resealed=True), name="ck"), CheckpointError,
            ("commit.json", "says global_step 9", "meta.pt holds global_step 2")),
        Bad("commit.json step edited, on consolidate", "checkpoint",
            _ckpt(_edited_step(9, resealed=True), "consolidate", name="ck"), CheckpointError,
            ("global_step 9", "global_step 2")),
        Bad("commit.json step edited, on export_consolidated", "checkpoint",
            _ckpt(_edited_step(9, resealed=True), "export", name="ck"), CheckpointError,
            ("global_step 9", "global_step 2")),
        Bad("upgrade-checkpoint of a folder its loader then refuses", "checkpoint",
            _ckpt(lambda f, t: legacy_folder(f), "upgrade", name="step=7"), CheckpointError,
            ("cannot convert", "step=7", "global_step 2", "Nothing was changed")),
        Bad("upgrade-checkpoint --trust-pickle of a garbage meta.pt", "cli",
            lambda tmp: _cli("upgrade-checkpoint", str(_garbage_legacy(tmp)), "--trust-pickle")(tmp), CliRefused,
            ("exit 2", "meta.pt", "could not be unpickled even in full")),
    ]


def _garbage_legacy(tmp: Path) -> Path:
    folder = legacy_folder(save_tiny(tmp / "c" / "step=2", 2.0, 2))
    (folder / "meta.pt").write_bytes(b"\x80\x04this is no pickle")
    return folder


def test_latest_skips_an_edited_marker_and_names_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """main resumed the older state when an older folder's marker was edited to a higher step."""
    from lightning_hotspa.adapter.checkpoints.dcp_state import latest_checkpoint

    old, new = save_tiny(tmp_path / "step=2", 2.0, 2), save_tiny(tmp_path / "step=4", 4.0, 4)
    _edited_step(90, resealed=False)(old, tmp_path)
    with caplog.at_level("WARNING"):
        assert latest_checkpoint(tmp_path) == new
    assert "step=2" in caplog.text and "was edited after its save" in caplog.text
    assert _load_ckpt(new) == (4.0, 4)


def test_latest_follows_a_link_inside_its_folder_and_the_folder_itself_may_be_a_link(tmp_path: Path) -> None:
    from lightning_hotspa.adapter.checkpoints.dcp_state import resolve_checkpoint

    save_tiny(tmp_path / "c" / "step=2", 2.0, 2)
    (tmp_path / "c" / "last").symlink_to("step=2", target_is_directory=True)  # Lightning's "last" link
    (tmp_path / "alias").symlink_to(tmp_path / "c", target_is_directory=True)
    assert resolve_checkpoint(f"latest:{tmp_path / 'alias'}").name in ("step=2", "last")
    assert _load_ckpt(tmp_path / "alias" / "step=2") == (2.0, 2)


def test_an_upgraded_folder_passes_the_loaders_check(tmp_path: Path) -> None:
    from lightning_hotspa.adapter.checkpoints.upgrade import upgrade_legacy_checkpoint

    folder = legacy_folder(save_tiny(tmp_path / "step=2", 2.0, 2))
    upgrade_legacy_checkpoint(folder)
    assert _load_ckpt(folder) == (2.0, 2)


def test_a_marker_rewritten_in_another_json_layout_still_passes(tmp_path: Path) -> None:
    """The marker's own checksum is over its canonical JSON: re-indenting it is not an edit."""
    folder = save_tiny(tmp_path / "step=2", 2.0, 2)
    marker = json.loads((folder / "commit.json").read_text())
    (folder / "commit.json").write_text(json.dumps(dict(reversed(list(marker.items())))))
    assert _load_ckpt(folder) == (2.0, 2)
    rehash(folder)  # no-op rehash keeps it valid too
    assert _load_ckpt(folder) == (2.0, 2)


# ------------------------------------------------------------------ outputs
def _llama_ckpt(tmp: Path) -> Path:
    """A committed LlamaLM checkpoint (exportable) at tmp/ck/step=3."""
    from lightning_hotspa.adapter.checkpoints.dcp_state import save_distributed_checkpoint
    from lightning_hotspa.models import LlamaLM

    model = LlamaLM({"preset": "tiny", "n_layers": 1})
    save_distributed_checkpoint({"state_dict": dict(model.state_dict()), "global_step": 3,
                                 "hyper_parameters": {"config": {"preset": "tiny", "n_layers": 1}}},
                                tmp / "ck" / "step=3", is_rank_zero=True, barrier=lambda: None)
    return tmp / "ck" / "step=3"


def _fifo(tmp: Path, name: str = "out") -> Path:
    import os

    os.mkfifo(tmp / name)
    return tmp / name


def _socket(tmp: Path) -> Path:
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp / "out.sock"))
    sock.close()
    return tmp / "out.sock"


def _link(tmp: Path) -> Path:
    (tmp / "real.ckpt").write_bytes(b"keep me")
    (tmp / "out").symlink_to(tmp / "real.ckpt")
    return tmp / "out"


def _dir_link(tmp: Path) -> Path:
    (tmp / "realdir").mkdir()
    (tmp / "out").symlink_to(tmp / "realdir", target_is_directory=True)
    return tmp / "out"


def _under_file(tmp: Path) -> Path:
    (tmp / "afile").write_text("a file")
    return tmp / "afile" / "out"


def _writer(kind: str, output: Callable[[Path], Path]) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.adapter.checkpoints.dcp_state import export_consolidated
        from lightning_hotspa.adapter.checkpoints.hf_export import export_hf
        from lightning_hotspa.adapter.checkpoints.single_file import consolidate_checkpoint

        if kind == "save":
            out = output(tmp)
            return lambda: save_tiny(out, 1.0, 1)
        folder = _llama_ckpt(tmp) if kind == "export_hf" else save_tiny(tmp / "c" / "step=2", 2.0, 2)
        out = output(tmp)
        return {"consolidate": lambda: consolidate_checkpoint(folder, out),
                "export_consolidated": lambda: export_consolidated(folder, out),
                "export_hf": lambda: export_hf(folder, out, overwrite=True),
                "cli consolidate": _cli("consolidate", str(folder), str(out))(tmp)}[kind]
    return make


def _output_rows() -> list[Bad]:
    rows = []
    for kind, error in (("consolidate", OSError), ("export_consolidated", OSError), ("export_hf", OSError),
                        ("save", CheckpointError), ("cli consolidate", CliRefused)):
        folder = kind in ("export_hf", "save")
        under = ("afile/out", "Not a directory") if kind == "save" else ("afile/out", "its parent", "afile' is a file")
        rows += [Bad(f"{kind} to a FIFO", "output", _writer(kind, _fifo), error, ("out'", "is a FIFO")),
                 Bad(f"{kind} under a file", "output", _writer(kind, _under_file), error, under)]
        if not folder:
            rows.append(Bad(f"{kind} to a symlink", "output", _writer(kind, _link), error,
                            ("out' is a symlink to", "real.ckpt", "not replaced")))
    rows += [Bad("consolidate to a socket", "output", _writer("consolidate", _socket), OSError,
                 ("out.sock' exists and is a socket",)),
             Bad("export_hf to a symlinked folder", "output", _writer("export_hf", _dir_link), OSError,
                 ("out' is a symlink to", "realdir"))]
    return rows


def test_a_device_node_is_never_an_output(tmp_path: Path) -> None:
    """The check on a path whose stat says character device (/dev/null's stat, read only; nothing is
    written to a device in this test)."""
    import os

    from lightning_hotspa.paths import output_problem

    problem = output_problem(tmp_path / "dev", st=os.stat("/dev/null"))
    assert problem and "is a character device, not a regular file" in problem and "dev'" in problem
    assert "a character device, not a folder" in output_problem(tmp_path / "dev", True, os.stat("/dev/null"))


def test_outputs_under_a_symlinked_folder_are_written(tmp_path: Path) -> None:
    from lightning_hotspa.adapter.checkpoints.single_file import consolidate_checkpoint

    folder = save_tiny(tmp_path / "c" / "step=2", 2.0, 2)
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real", target_is_directory=True)
    consolidate_checkpoint(folder, tmp_path / "alias" / "m.ckpt")
    assert (tmp_path / "real" / "m.ckpt").is_file()
    assert _fifo(tmp_path, "still").is_fifo()  # and a FIFO refused above stays one (not replaced by a file)


def test_a_full_disk_is_one_line_naming_the_path_and_leaves_no_tmp(tmp_path: Path, monkeypatch) -> None:
    import errno

    folder = save_tiny(tmp_path / "c" / "step=2", 2.0, 2)
    real_save = torch.save

    def full(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CliRefused, match=r"(?s)exit 2: hotspa consolidate: error: consolidate output: cannot write "
                                         r"'.*m.ckpt': No space left on device\n$"):
        _cli("consolidate", str(folder), str(tmp_path / "m.ckpt"))(tmp_path)()
    monkeypatch.setattr(torch, "save", real_save)
    assert not list(tmp_path.glob("m.ckpt*"))


def test_a_full_disk_during_an_hf_export_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    import errno

    import safetensors.torch

    from lightning_hotspa.adapter.checkpoints.hf_export import export_hf

    folder = _llama_ckpt(tmp_path)

    def full(tensors: Any, filename: str, metadata: Any = None) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError, match=r"cannot write '.*/hf': No space left on device$"):
        export_hf(folder, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_exported_files_get_the_mode_open_gives_them(tmp_path: Path) -> None:
    import os
    import stat

    from lightning_hotspa.adapter.checkpoints.hf_export import export_hf
    from lightning_hotspa.adapter.checkpoints.single_file import consolidate_checkpoint

    folder = _llama_ckpt(tmp_path)
    old = os.umask(0o027)
    try:
        export_hf(folder, tmp_path / "hf")
        consolidate_checkpoint(folder, tmp_path / "m.ckpt")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [*(tmp_path / "hf").iterdir(), tmp_path / "m.ckpt"]}
    assert modes == {"model.safetensors": 0o640, "config.json": 0o640, "m.ckpt": 0o640}, modes


# ------------------------------------------------------------------ DCP errors, named
def _truncate(name: str = "__0_0.distcp") -> Callable[[Path, Path], None]:
    """The rank file cut in half, and commit.json rehashed to match (so only DCP's own read can tell)."""
    def damage(folder: Path, tmp: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[:len(data) // 2])
        rehash(folder, name)
    return damage


def _zeroed(folder: Path, tmp: Path) -> None:
    """The rank file's bytes zeroed at its full size, rehashed: DCP's torch.load of an item fails."""
    (folder / "__0_0.distcp").write_bytes(bytes((folder / "__0_0.distcp").stat().st_size))
    rehash(folder, "__0_0.distcp")


def _renamed_rank(folder: Path, tmp: Path) -> None:
    """Rank 0's file under rank 1's name (files of a save at another world size), rehashed."""
    (folder / "__0_0.distcp").rename(folder / "__1_0.distcp")
    marker = json.loads((folder / "commit.json").read_text())
    del marker["files"]["__0_0.distcp"]
    reseal(folder, marker)
    rehash(folder, "__1_0.distcp")


def _two_file_ckpt(tmp: Path) -> Path:
    """One process, two rank files (DCP's writer with two threads), of different sizes."""
    from lightning_hotspa.adapter.checkpoints import dcp_state

    class TwoFiles(dcp_state.RecordingWriter):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.thread_count = 2

    real = dcp_state.RecordingWriter
    dcp_state.RecordingWriter = TwoFiles
    try:
        dcp_state.save_distributed_checkpoint({"state_dict": {"a": torch.ones(4), "b": torch.arange(256.0)},
                                               "global_step": 2}, tmp / "two", is_rank_zero=True,
                                              barrier=lambda: None)
    finally:
        dcp_state.RecordingWriter = real
    return tmp / "two"


def _swapped(tmp: Path) -> Callable[[], Any]:
    from lightning_hotspa.adapter.checkpoints.single_file import consolidate_checkpoint

    folder = _two_file_ckpt(tmp)
    files = sorted(folder.glob("*.distcp"))
    assert len(files) == 2, files
    one, two = (f.read_bytes() for f in files)
    files[0].write_bytes(two)
    files[1].write_bytes(one)
    rehash(folder, *(f.name for f in files))
    return lambda: consolidate_checkpoint(folder, tmp / "m.ckpt")


def _dcp_rows() -> list[Bad]:
    likely = "truncated, a rank file swapped"
    return [
        Bad("truncated .distcp, rehashed, on resume", "checkpoint", _ckpt(_truncate()), CheckpointError,
            ("__0_0.distcp is", "bytes, its .metadata places data up to byte", likely)),
        Bad("truncated .distcp, rehashed, on consolidate", "checkpoint", _ckpt(_truncate(), "consolidate"),
            CheckpointError, ("__0_0.distcp is", likely)),
        Bad("truncated .distcp, rehashed, on export_consolidated", "checkpoint", _ckpt(_truncate(), "export"),
            CheckpointError, ("__0_0.distcp is", likely)),
        Bad("zeroed .distcp, rehashed, on resume", "checkpoint", _ckpt(_zeroed), CheckpointError,
            ("a rank file could not be read", "rehashed", likely)),
        Bad("zeroed .distcp, rehashed, on consolidate", "checkpoint", _ckpt(_zeroed, "consolidate"), CheckpointError,
            ("a rank file could not be read", likely)),
        Bad("rank file of another world size", "checkpoint", _ckpt(_renamed_rank), CheckpointError,
            ("places data in __0_0.distcp, which the folder lacks", "world size")),
        Bad("swapped rank files, rehashed", "checkpoint", _swapped, CheckpointError,
            (".distcp is", "bytes", "swapped")),
    ]


def test_a_truncated_rank_file_is_never_called_a_different_model(tmp_path: Path) -> None:
    call = _ckpt(_truncate())(tmp_path)
    with pytest.raises(CheckpointError) as info:
        call()
    assert "different model" not in str(info.value) and "does not fit" not in str(info.value), info.value


def test_another_model_is_still_named_so(tmp_path: Path) -> None:
    """A tensor of another size (the real misfit) keeps its message."""
    from lightning_hotspa.adapter.checkpoints.dcp_state import load_distributed_checkpoint

    folder = save_tiny(tmp_path / "step=2", 2.0, 2)
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(CheckpointError, match="does not fit Module"):
        load_distributed_checkpoint(folder, module, [])


def test_a_failed_checkpoint_write_is_one_line_naming_the_folder(tmp_path: Path, monkeypatch) -> None:
    import errno

    from lightning_hotspa.adapter.checkpoints import dcp_state

    def full(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_state.RecordingWriter, "write_data", full)
    with pytest.raises(CheckpointError, match=r"^cannot write a checkpoint to '.*step=2': No space left on device$"):
        save_tiny(tmp_path / "step=2", 2.0, 2)


# ------------------------------------------------------------------ values at the edge
def _hydra(override: str) -> Callable[[Path], Callable[[], Any]]:
    """The default config composed by Hydra with ``override``, then the recipe's checks."""
    def make(tmp: Path) -> Callable[[], Any]:
        from hydra import compose, initialize_config_dir

        from lightning_hotspa.adapter.recipes.hydra_recipe import CONFIG_DIR, check_config, register_resolvers

        def call() -> None:
            register_resolvers()
            with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
                cfg = compose("config", overrides=["output_dir=out", "run_name=t", "logger=none",
                                                   "hardware=cpu-gloo", override])
            check_config(cfg)
        return call
    return make


def _with_env(name: str, value: str, call: Callable[[Path], Callable[[], Any]]) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        import os

        inner = call(tmp)

        def run() -> Any:
            saved = os.environ.get(name)
            os.environ[name] = value
            try:
                return inner()
            finally:
                os.environ.pop(name) if saved is None else os.environ.__setitem__(name, saved)
        return run
    return make


def _wandb(mode: str) -> Callable[[], Any]:
    from lightning_hotspa.adapter.observability.wandb_run import decide_wandb_mode

    return lambda: decide_wandb_mode("auto", env={"WANDB_MODE": mode})


def _value_rows() -> list[Bad]:
    from lightning_hotspa.adapter.recipes.hydra_recipe import ConfigError
    from lightning_hotspa.models import LlamaLM

    plan = ("plan", "--data", "uniform")
    rows = [
        Bad("hydra trainer.gradient_clip_val=-1", "hydra", _hydra("trainer.gradient_clip_val=-1"), ConfigError,
            ("trainer.gradient_clip_val", "got -1")),
        Bad("hydra model.lr=inf", "hydra", _hydra("model.lr=inf"), ConfigError, ("model.lr", "finite", "inf")),
        Bad("hydra model.lr=nan", "hydra", _hydra("model.lr=nan"), ConfigError, ("model.lr", "nan")),
        Bad("hydra model.weight_decay=inf", "hydra", _hydra("model.weight_decay=inf"), ConfigError,
            ("model.weight_decay", "inf")),
        Bad("LlamaLM lr=inf", "model", raises_case(lambda: LlamaLM("tiny", lr=float("inf"))), ValueError,
            ("LlamaLM lr", "finite", "inf")),
        Bad("LlamaLM lr=nan", "model", raises_case(lambda: LlamaLM("tiny", lr=float("nan"))), ValueError,
            ("LlamaLM lr", "nan")),
        Bad("WANDB_MODE=ofline", "env", raises_case(_wandb("ofline")), ValueError, ("WANDB_MODE='ofline'",
                                                                                    "offline")),
        Bad("WANDB_MODE=disabeld", "env", raises_case(_wandb("disabeld")), ValueError, ("'disabeld'",)),
        Bad("HOTSPA_PROGRESS=maybe", "env", _with_env("HOTSPA_PROGRESS", "maybe", _cli(*plan)), CliRefused,
            ("HOTSPA_PROGRESS='maybe'", "true", "off")),
        Bad("plan --context 1e30", "cli", _cli(*plan, "--context", "1e30"), CliRefused,
            ("--context", "'1e30'", "out of range")),
        Bad("plan --context 1e30 --global-batch-tokens 1e31", "cli",
            _cli(*plan, "--context", "1e30", "--global-batch-tokens", "1e31"), CliRefused, ("'1e3",)),
        Bad("plan --world-size 10**14", "cli", _cli(*plan, "--world-size", "99999999999999"), CliRefused,
            ("'99999999999999'",)),
    ]
    return rows


def test_wandb_and_progress_accept_their_own_values(monkeypatch) -> None:
    from lightning_hotspa.adapter.observability.wandb_run import decide_wandb_mode
    from lightning_hotspa.tools.progress import progress_enabled

    assert [decide_wandb_mode("auto", env={"WANDB_MODE": m}).mode for m in
            ("online", "offline", "disabled", "dryrun", "run", "shared", " Offline ")] == \
        ["online", "offline", "disabled", "offline", "online", "online", "offline"]
    for value, on in (("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False), ("off", False),
                      ("False", False), ("no", False)):
        monkeypatch.setenv("HOTSPA_PROGRESS", value)
        assert progress_enabled() is on, value


def test_every_moved_module_gets_a_now_lives_at_hint() -> None:
    """Each module of the generated map, named in a ``_target_`` with a name defined in its new home."""
    import re

    from lightning_hotspa.adapter.recipes.hydra_recipe import ConfigError
    from lightning_hotspa.adapter.recipes.moved_targets import MOVED, check_moved_targets

    root = Path(__file__).resolve().parents[2] / "lightning_hotspa"
    assert len(MOVED) >= 70
    for old, new in MOVED.items():
        source = (root / (new.replace(".", "/") + ".py")).read_text()
        name = (re.findall(r"^(?:class|def) ([A-Za-z]\w*)", source, re.MULTILINE) or ["anything"])[0]
        with pytest.raises(ConfigError, match=re.escape(f"write lightning_hotspa.{new}.{name}")):
            check_moved_targets({"x": {"_target_": f"lightning_hotspa.{old}.{name}"}}, error=ConfigError)
    # a module the map does not know: the package is searched for the name
    with pytest.raises(ConfigError, match=r"write lightning_hotspa\.adapter\.lightning\.strategy\.HotSPaStrategy"):
        check_moved_targets({"s": {"_target_": "lightning_hotspa.adapter.nowhere.HotSPaStrategy"}}, error=ConfigError)
    check_moved_targets({"s": {"_target_": "lightning_hotspa.HotSPaStrategy"}}, error=ConfigError)  # fine as is


def test_the_moved_module_map_covers_every_rename_in_the_history() -> None:
    """The map regenerated from ``git log --diff-filter=R`` (skipped without the history)."""
    import subprocess

    from lightning_hotspa.adapter.recipes.moved_targets import MOVED

    repo = Path(__file__).resolve().parents[2]
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=repo, capture_output=True,
                                 text=True, check=True).stdout.strip()
        log = subprocess.run(["git", "log", "--diff-filter=R", "--name-status", "--format=", "--reverse"], cwd=repo,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history here")
    if shallow == "true":
        pytest.skip("a shallow clone: the history of moves is not there")

    def mod(path: str) -> str:
        return path[:-3].replace("/", ".").removesuffix(".__init__").removeprefix("lightning_hotspa.")

    final: dict[str, str] = {}
    for line in log.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[0].startswith("R") and parts[1].startswith("lightning_hotspa/") \
                and parts[1].endswith(".py") and parts[2].endswith(".py"):
            final[mod(parts[1])] = mod(parts[2])
    expected = {}
    for old in final:
        new, seen = old, set()
        while new in final and new not in seen:
            seen.add(new)
            new = final[new]
        gone = not (repo / "lightning_hotspa" / (old.replace(".", "/") + ".py")).exists() and \
            not (repo / "lightning_hotspa" / old.replace(".", "/")).is_dir()
        if gone and (repo / "lightning_hotspa" / (new.replace(".", "/") + ".py")).exists():
            expected[old] = new
    missing = {k: v for k, v in expected.items() if MOVED.get(k) != v}
    assert not missing, f"add to MOVED in adapter/recipes/moved_targets.py: {missing}"


CASES = _symlink_rows() + _config_rows() + _checkpoint_rows() + _output_rows() + _dcp_rows() + _value_rows()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.area}-{c.name}" for c in CASES])
def test_bad_input_is_refused_naming_the_value(case: Bad, tmp_path: Path) -> None:
    check_refused(case, tmp_path)


def test_row_names_are_unique() -> None:
    assert len({c.name for c in CASES}) == len(CASES)



def test_upgrade_checks_what_it_wrote_with_the_loaders_check(tmp_path: Path, monkeypatch) -> None:
    """A conversion whose marker the loader would refuse (here: a checksum written wrong) is not
    reported as converted; the folder stays in the old format."""
    from lightning_hotspa.adapter.checkpoints import upgrade
    from lightning_hotspa.adapter.checkpoints.trust import has_legacy_layout

    folder = legacy_folder(save_tiny(tmp_path / "step=2", 2.0, 2))
    real = upgrade.file_entries
    monkeypatch.setattr(upgrade, "file_entries", lambda f, names: {
        n: {**e, "sha256": "0" * 64} if n == "meta.pt" else e for n, e in real(f, names).items()})
    with pytest.raises(CheckpointError, match=r"fails the loader's check .*meta.pt: sha256 differs.*old format"):
        upgrade.upgrade_legacy_checkpoint(folder)
    assert has_legacy_layout(folder) and not (folder / "commit.json").exists()
