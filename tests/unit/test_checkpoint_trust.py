"""Files a user hands us (issue 32): a checkpoint folder runs no code before our checks, a corrupt
file is named instead of loaded, ``latest:`` reads only JSON markers, an HF index cannot point
outside its folder, and an export leaves no stale weights. All in one process, tiny tensors."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from helpers import Payload, legacy_folder, rehash, save_tiny

from lightning_hotspa.adapter.checkpoints import dcp_state as ck
from lightning_hotspa.adapter.checkpoints.dcp_state import CheckpointError


def _load(path: Path) -> tuple[float, int]:
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(4))
    meta = ck.load_distributed_checkpoint(path, module, [])
    return float(module.w[0]), meta["global_step"]


def _plant(folder: Path, name: str, marker: Path) -> None:
    if name == "meta.pt":
        torch.save(Payload(marker), folder / name)
    else:
        (folder / name).write_bytes(pickle.dumps(Payload(marker)))


def _try(fn, *args) -> Exception | None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - returned for the caller to check
        return exc
    return None


@pytest.mark.parametrize("name", ["meta.pt", ".metadata"])
def test_a_payload_in_a_checkpoint_never_runs_on_resume_or_export(tmp_path, name):
    from lightning_hotspa.adapter.checkpoints.hf_export import export_hf
    from lightning_hotspa.adapter.checkpoints.single_file import consolidate_checkpoint

    folder = save_tiny(tmp_path / "step=2", 2.0, 2)
    marker = tmp_path / "PWNED"
    _plant(folder, name, marker)
    error = _try(_load, folder)
    assert not marker.exists(), "resume ran code from the checkpoint folder"
    assert isinstance(error, CheckpointError) and name in str(error) and "integrity" in str(error), error
    for export in (lambda: export_hf(folder, tmp_path / "hf"), lambda: ck.export_consolidated(folder, tmp_path / "m"),
                   lambda: consolidate_checkpoint(folder, tmp_path / "c.ckpt")):
        assert isinstance(_try(export), CheckpointError)
        assert not marker.exists(), "export ran code from the checkpoint folder"


def test_a_progress_wrapper_sees_every_file_while_it_is_hashed(tmp_path, monkeypatch, capsys):
    from lightning_hotspa.adapter.checkpoints.trust import read_marker, verify_checkpoint
    from lightning_hotspa.tools.consolidate import run

    folder = save_tiny(tmp_path / "step=2", 2.0, 2)
    seen: list[str] = []
    verify_checkpoint(folder, progress=lambda files: (seen.append(f) or f for f in files))
    assert seen == sorted(read_marker(folder)["files"]) and ".metadata" in seen
    monkeypatch.setenv("HOTSPA_PROGRESS", "1")  # the CLI's bar: on stderr, stdout keeps its own line
    run(type("Args", (), {"checkpoint_dir": str(folder), "out_file": str(tmp_path / "c.ckpt")}))
    out, err = capsys.readouterr()
    assert "hotspa consolidate: checksums: 100%" in err and "wrote" in out and "checksums" not in out


def test_meta_is_read_weights_only_even_when_its_checksum_was_forged(tmp_path):
    folder = save_tiny(tmp_path / "step=2", 2.0, 2)
    marker = tmp_path / "PWNED"
    _plant(folder, "meta.pt", marker)
    rehash(folder, "meta.pt")  # the size and sha256 of the planted file, and the marker's own checksum
    error = _try(_load, folder)
    assert not marker.exists()
    assert isinstance(error, CheckpointError) and "cannot read the checkpoint metadata" in str(error), error


def test_latest_reads_only_commit_markers_and_never_unpickles_other_folders(tmp_path):
    from lightning_hotspa.adapter.checkpoints.nodes import CheckpointPlacement

    old, new = save_tiny(tmp_path / "step=2", 2.0, 2), save_tiny(tmp_path / "step=4", 4.0, 4)
    marker = tmp_path / "PWNED"
    _plant(old, "meta.pt", marker)
    _plant(old, ".metadata", marker)
    placement = CheckpointPlacement(0, (0,), broadcast=lambda x: x, barrier=lambda: None)
    assert ck.latest_checkpoint(tmp_path) == new
    assert not marker.exists(), "latest_checkpoint unpickled a folder it did not pick"
    assert placement.resolve(f"latest:{tmp_path}", ["dp1"]) == new
    assert not marker.exists(), "latest: unpickled a folder it did not pick"
    assert _load(new) == (4.0, 4)


def test_merge_of_node_copies_checks_them_before_reading_their_dcp_metadata(tmp_path):
    from lightning_hotspa.adapter.checkpoints.nodes import CheckpointPlacement, merge_node_copies

    placement = CheckpointPlacement(0, (0,), broadcast=lambda x: x, barrier=lambda: None)
    copy = tmp_path / "node0" / "step=2"
    placement._save_node_local({"state_dict": {"w": torch.full((4,), 2.0)}, "global_step": 2}, copy, ["dp1"])
    merged = merge_node_copies([copy], tmp_path / "merged")
    assert _load(merged) == (2.0, 2)  # a merged checkpoint carries its own commit marker
    marker = tmp_path / "PWNED"
    _plant(copy, ".metadata", marker)
    error = _try(merge_node_copies, [copy], tmp_path / "merged2")
    assert not marker.exists(), "merge_node_copies unpickled an unchecked .metadata"
    assert isinstance(error, CheckpointError) and ".metadata" in str(error), error


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_shard_is_named_and_nothing_is_loaded(tmp_path, damage):
    folder = save_tiny(tmp_path / "step=2", 2.0, 2)
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        for i in range(len(data) - 40, len(data) - 24):  # the tensor bytes sit at the end of the file
            data[i] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(4))
    what = "sha256 differs" if damage == "flip" else "truncated"
    with pytest.raises(CheckpointError, match=rf"__0_0\.distcp: .*{what}"):
        ck.load_distributed_checkpoint(folder, module, [])
    assert float(module.w.abs().sum()) == 0.0


def test_old_format_folders_are_refused_with_the_way_to_convert_them(tmp_path):
    from lightning_hotspa.tools.cli import main

    folder = save_tiny(tmp_path / "step=2", 2.0, 2)
    (folder / "commit.json").unlink()  # what main wrote: a pickled meta.pt and DCP files, nothing else
    torch.save({"global_step": 2}, folder / "meta.pt")
    with pytest.raises(ck.LegacyCheckpointError, match=r"older lightning_hotspa.*hotspa upgrade-checkpoint"):
        _load(folder)
    assert ck.latest_checkpoint(tmp_path) is None
    assert main(["upgrade-checkpoint", str(folder)]) == 0
    assert _load(folder) == (2.0, 2) and ck.latest_checkpoint(tmp_path) == folder


class _Custom:
    """A user type in hyper-parameters: loading it back would need to run its module's code."""


def test_a_save_whose_metadata_would_need_unpickling_code_is_refused_when_written(tmp_path):
    with pytest.raises(CheckpointError, match=r"weights-only load cannot read back.*_Custom"):
        save_tiny(tmp_path / "step=2", 2.0, 2, hyper_parameters={"thing": _Custom()})
    assert not (tmp_path / "step=2").exists()


def test_latest_with_nothing_to_resume_is_an_error_unless_asked_for(tmp_path):
    from lightning_hotspa.adapter.checkpoints.nodes import CheckpointPlacement

    placement = CheckpointPlacement(0, (0,), broadcast=lambda x: x, barrier=lambda: None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"latest:.*empty.*no complete checkpoint.*latest_or_scratch:"):
        placement.resolve(f"latest:{tmp_path / 'empty'}", ["dp1"])
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in '.*typo' \(no such folder\)"):
        placement.resolve(f"latest:{tmp_path / 'typo'}", ["dp1"])
    assert placement.resolve(f"latest_or_scratch:{tmp_path / 'empty'}", ["dp1"]) is None
    with pytest.raises(CheckpointError, match=r"typo.*does not exist"):
        ck.latest_checkpoint(tmp_path / "typo")


def test_latest_names_a_folder_whose_marker_is_unreadable(tmp_path, caplog):
    save_tiny(tmp_path / "step=2", 2.0, 2)
    newest = save_tiny(tmp_path / "step=4", 4.0, 4)
    (newest / "commit.json").write_text('{"format": "lightning_hotspa checkpoint", "vers')
    with caplog.at_level("WARNING"):
        assert ck.latest_checkpoint(tmp_path) == tmp_path / "step=2"
    assert "step=4" in caplog.text and "not valid JSON (line 1" in caplog.text


def test_hf_index_entries_that_leave_the_model_folder_are_refused(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from lightning_hotspa.models.hf_weights import HFCheckpoint, HFWeightsError

    save_file({"x": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    model = tmp_path / "model"
    model.mkdir()
    for target in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": target}}))
        with pytest.raises(HFWeightsError, match=r"weight_map\['x'\].*leaves the model folder"):
            HFCheckpoint(model)


def test_numpy_values_in_the_metadata_are_stored_as_plain_numbers(tmp_path):
    import numpy as np

    folder = save_tiny(tmp_path / "step=2", 2.0, 2,
                       hotspa={"planner": {"scale": np.float64(1.25), "fit": np.arange(3)}})
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(4))
    planner = ck.load_distributed_checkpoint(folder, module, [])["hotspa"]["planner"]
    assert planner["scale"] == 1.25 and type(planner["scale"]) is float and planner["fit"].tolist() == [0, 1, 2]


# ---------------------------------------------------------- issue 41: a rewritten commit.json runs no code either




def _planted_path(path: str, tmp_path: Path, marker: Path):
    """Plants a payload for one load path; returns the call that must refuse it."""
    from lightning_hotspa.adapter.checkpoints.hf_export import export_hf
    from lightning_hotspa.adapter.checkpoints.nodes import CheckpointPlacement
    from lightning_hotspa.adapter.checkpoints.single_file import consolidate_checkpoint
    from lightning_hotspa.adapter.checkpoints.upgrade import upgrade_legacy_checkpoint

    save_tiny(tmp_path / "step=1", 1.0, 1)
    folder = save_tiny(tmp_path / "step=2", 2.0, 2, hyper_parameters={"config": "tiny"})  # exportable metadata
    if path.startswith("upgrade"):
        legacy_folder(folder)
        if path == "upgrade-meta.pt":
            torch.save({"global_step": 2, "x": Payload(marker)}, folder / "meta.pt")
        else:
            _plant(folder, ".metadata", marker)
        return lambda: upgrade_legacy_checkpoint(folder)
    _plant(folder, ".metadata", marker)
    rehash(folder, ".metadata")
    placement = CheckpointPlacement(0, (0,), broadcast=lambda x: x, barrier=lambda: None)
    return {"resume": lambda: _load(folder),
            "latest:": lambda: _load(placement.resolve(f"latest:{tmp_path}", ["dp1"])),
            "export": lambda: export_hf(f"latest:{tmp_path}", tmp_path / "hf"),
            "consolidate": lambda: consolidate_checkpoint(folder, tmp_path / "c.ckpt"),
            "export-rehashed": lambda: export_hf(folder, tmp_path / "hf")}[path]


@pytest.mark.parametrize("path", ["resume", "latest:", "export", "consolidate", "upgrade-meta.pt",
                                  "upgrade-.metadata", "export-rehashed"])
def test_a_planted_payload_runs_on_none_of_the_load_paths(tmp_path, path):
    marker = tmp_path / "PWNED"
    error = _try(_planted_path(path, tmp_path, marker))
    assert not marker.exists(), f"{path} ran code from the checkpoint folder"
    assert isinstance(error, CheckpointError), error
    assert "open" in str(error) or "weights-only" in str(error), error  # names the global it refused


class _WithExtra(torch.nn.Module):
    """A module with a non-tensor state item (DCP stores it as torch.save bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))
        self.extra = {"k": 1}

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state) -> None:
        self.extra = state


def test_a_planted_non_tensor_item_in_a_shard_runs_no_code_on_resume(tmp_path):
    import dataclasses

    module = _WithExtra()
    folder = tmp_path / "step=2"
    ck.save_distributed_checkpoint({"state_dict": module.state_dict(), "global_step": 2}, folder,
                                   is_rank_zero=True, barrier=lambda: None)
    assert ck.load_distributed_checkpoint(folder, _WithExtra(), [])["global_step"] == 2  # the clean folder loads
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # the folder this test just wrote
    index = next(i for i in metadata.storage_data if i.fqn.startswith("model._extra_state"))
    info = metadata.storage_data[index]
    marker, payload = tmp_path / "PWNED", __import__("io").BytesIO()
    torch.save(Payload(marker), payload)
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    rehash(folder, ".metadata", info.relative_path)
    error = _try(ck.load_distributed_checkpoint, folder, _WithExtra(), [])
    assert not marker.exists(), "a planted non-tensor item ran code on resume"
    assert isinstance(error, CheckpointError) and "model._extra_state" in str(error), error


def test_upgrade_unpickles_in_full_only_when_asked_by_flag_and_says_so(tmp_path, capsys):
    from lightning_hotspa.tools.cli import main

    folder = legacy_folder(save_tiny(tmp_path / "step=2", 2.0, 2))
    torch.save({"global_step": 2, "hyper_parameters": {"thing": _Custom()}}, folder / "meta.pt")
    assert main(["upgrade-checkpoint", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "_Custom" in err and "--trust-pickle" in err and not (folder / "commit.json").exists()
    assert main(["upgrade-checkpoint", str(folder), "--trust-pickle"]) == 2  # unpickled; still not storable
    err = capsys.readouterr().err
    assert "unpickling" in err and "in full" in err and "weights-only load cannot read back" in err, err
