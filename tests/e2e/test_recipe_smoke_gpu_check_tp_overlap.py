"""recipes/gpu_check_tp_overlap.py's dry run: its code on 2 gloo CPU ranks (the ring decomposition), equal
to the collective-then-GEMM path, one JSON line last. The fused NCCL path it checks has never run on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_equals_the_plain_path_and_prints_json_last():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "gpu_check_tp_overlap.py"), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["world"] == 2 and report["collectives"] == "GlooCollectives" and report["ok"] is True
    assert report["worst_rel_error"] <= report["tolerance"]
    assert set(report["seconds"]) == {"all_gather_matmul_fused", "all_gather_matmul_plain",
                                      "matmul_reduce_scatter_fused", "matmul_reduce_scatter_plain"}
