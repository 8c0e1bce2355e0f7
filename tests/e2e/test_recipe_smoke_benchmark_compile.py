"""recipes/benchmark_compile.py --smoke --backend eager --layers 1 --checkpointing selective: per-block compile through
hot switches between four layouts (a sharded ``:fsdp`` one, tp with Ulysses, Ulysses with the KV ring) on 4 gloo
ranks and several document lengths per stage, the attention core recomputed (the :fsdp layout: the whole block): no
graph break, no recompile-limit hit, at most one graph per (layout, block), equal to eager. The graphs, guards and
recompiles are dynamo's, whatever the backend; dynamo's ``eager`` backend runs the captured graphs as they are, which
halves this run (72.6 s wall / 130 CPU-s with aot_eager, 39.7 s / 75 CPU-s with eager, alone on the 2-core box). AOT
autograd through a switch is checked by tests/e2e/test_lightning_parity.py (aot_eager in a Trainer) and inductor by
tests/unit/test_compile_blocks.py. One block instead of the tiny Llama's two: each rank traces 3 graphs, not 6 (23.1
-> 19.0 s, one run each, 2026-12-07); the full run (40 steps, inductor) keeps both.

The recipe runs in this process (``helpers.load_recipe``): its ranks fork from the suite's preloaded
server, where a subprocess paid a fresh interpreter's torch and Lightning imports five times (the
parent and 4 spawned ranks; 135 s against 73 s back to back on the loaded dev box,
benchmarks/2026-12-06-suite-time-2.md)."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import load_recipe


# dynamo traces 8 graphs on each of 4 ranks: minutes, not seconds, on a loaded 2-core box
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_benchmark_compile_smoke(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                 tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    module = load_recipe("benchmark_compile.py", monkeypatch)
    # one block: each rank traces 4 graphs, not 8; selective checkpointing (full on the :fsdp layout): the attention
    # core in a checkpoint inside the graph, where tp's column region caches its outputs (a break until allowed)
    argv = ["--smoke", "--backend", "eager", "--layers", "1", "--checkpointing", "selective"]
    monkeypatch.setattr(sys, "argv", ["benchmark_compile.py", *argv])
    module.main(argv)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the recipe's last line, as printed
    assert out["layouts_run"] >= 3 and out["steps"] == 1 and out["backend"] == "eager", out
    assert {"tp2xcp2", "cp4:kv2", "dp2xtp2:fsdp"} <= set(out["layouts"]) and out["checkpointing"] == "selective", out
    assert out["graph_breaks"] == 0 and out["cache_limit_hits"] == 0 and out["skipped_frames"] == 0, out
    blocks, layouts = out["blocks"], out["layouts_run"]
    assert 0 < out["compiled_graphs"] <= blocks * layouts, out
    assert out["recompile_limit"] >= blocks * layouts, out
    assert out["max_abs_diff_vs_eager"] <= 1e-5, out
