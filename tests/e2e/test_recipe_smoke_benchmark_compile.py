"""recipes/benchmark_compile.py --smoke: per-block compile (aot_eager) through hot switches between three
layouts on 4 gloo ranks and several document lengths per stage: no graph break, no recompile-limit hit,
at most one graph per (layout, block), equal to eager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# dynamo traces 8 graphs on each of 4 ranks: minutes, not seconds, on a loaded 2-core box
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_benchmark_compile_smoke():
    # its own process: the suite's preloaded rank server cannot import a recipe module by name
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "benchmark_compile.py"), "--smoke"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["layouts_run"] >= 3 and out["steps"] == 1, out
    assert out["graph_breaks"] == 0 and out["cache_limit_hits"] == 0 and out["skipped_frames"] == 0, out
    blocks, layouts = out["blocks"], out["layouts_run"]
    assert 0 < out["compiled_graphs"] <= blocks * layouts, out
    assert out["recompile_limit"] >= blocks * layouts, out
    assert out["max_abs_diff_vs_eager"] <= 1e-5, out
