"""recipes/gpu_check_tp_overlap.py's dry run: its code on 2 gloo CPU ranks (the ring decomposition), equal
to the collective-then-GEMM path, one JSON line last. The fused NCCL path it checks has never run on a GPU.

The recipe runs in this process (``helpers.load_recipe``): its 2 ranks fork from the suite's preloaded
server, where a subprocess paid a fresh interpreter and 2 spawned ranks importing torch."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import load_recipe


def test_the_dry_run_equals_the_plain_path_and_prints_json_last(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    module = load_recipe("gpu_check_tp_overlap.py", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["gpu_check_tp_overlap.py", "--dry-run"])
    module.main(["--dry-run"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the recipe's last line, as printed
    assert report["world"] == 2 and report["collectives"] == "GlooCollectives" and report["ok"] is True
    assert report["worst_rel_error"] <= report["tolerance"]
    assert set(report["seconds"]) == {"all_gather_matmul_fused", "all_gather_matmul_plain",
                                      "matmul_reduce_scatter_fused", "matmul_reduce_scatter_plain"}
