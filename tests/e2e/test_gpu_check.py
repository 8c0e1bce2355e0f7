"""recipes/gpu_check.py --dry-run: every part runs on CPU, without hydra, omegaconf, wandb or
flash-attn importable (as on the GPU machine), and writes sane figures and a profile update."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hotspa.planner.cost.hardware import get_profile
from lightning_hotspa.planner.cost.profile_update import load_updated_profile

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("hydra", "omegaconf", "wandb", "flash_attn")
# None in sys.modules: `import x` raises ImportError and importlib.util.find_spec(x) is None, as when
# the package is not installed at all
PRELUDE = ("import runpy, sys\n"
           f"for name in {BLOCKED!r}:\n"
           "    sys.modules[name] = None\n"
           "sys.argv = ['gpu_check.py', '--dry-run']\n"
           "runpy.run_path(sys.argv_path, run_name='__main__')\n")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_out")
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PYTHONUNBUFFERED": "1"}
    code = PRELUDE.replace("sys.argv_path", repr(str(ROOT / "recipes" / "gpu_check.py")))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240,
                          cwd=str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    report = json.loads((out / "gpu_check.json").read_text())
    return summary, report, out


def test_every_part_ran_within_its_budget(dry_run):
    summary, report, _ = dry_run
    assert summary["gpu_check"] == "summary" and summary["dry_run"] is True and summary["watchdog"] is None
    assert list(report["part_seconds"]) == ["matmul", "train", "hotpath", "cpchunks", "hopper", "shards", "timers",
                                             "backends"]  # flex last
    for part, value in report["parts"].items():
        assert "traceback" not in value, (part, value.get("status"), value.get("traceback"))
        assert report["part_seconds"][part] <= value["budget_s"] + 5, part
    assert summary["matmul_tflops"] > 0


def test_strategy_trains_and_equals_the_plain_reference(dry_run):
    train = dry_run[1]["parts"]["train"]
    assert train["process_group_backend"] == "gloo" and train["world_size"] == 1
    assert train["steps"] == 8 and train["loss_fell"], train["losses"]
    ref = train["reference"]
    assert ref["init_fingerprint_equal"], "the strategy and the reference did not start from the same weights"
    assert len(ref["loss_rel_errors"]) == 3 and max(ref["loss_rel_errors"]) <= ref["loss_rtol"]
    assert ref["weight_rel_error_worst"][1] <= ref["weight_rtol"]
    assert train["match"] is True and train["pass"] is True
    assert all(t["device_s"] > 0 and t["strategy_stage_s"] > 0 for t in train["timings"])


def test_backends_report_speed_or_why_not(dry_run):
    backends = dry_run[1]["parts"]["backends"]
    for kind in ("attention_alone", "whole_model"):
        results = backends[kind]
        for name in ("torch_varlen", "flash_varlen"):  # CUDA only
            assert results[name]["status"] == "unavailable" and "CUDA" in results[name]["reason"]
        cells = results["sdpa"]["cells"]
        assert [c["length"] for c in cells] == [64, 128]
        for c in cells:
            assert c["status"] == "ok" and c["tokens_per_s"] > 0 and c["mfu_datasheet_peak"] > 0, c
            assert c["mfu_measured_peak"] == pytest.approx(c["tflops"] * 1e12 / dry_run[1]["meta"]["peaks"]["measured"])
    # flex: the document mask computes what per-document SDPA does (its backward has no CPU kernel)
    flex = backends["attention_alone"]["flex"]["cells"][0]
    assert flex["rel_error_vs_sdpa"] < 1e-4
    assert flex["status"] == "ok" or "CPU" in flex["status"]
    # two noisy CPU lengths may not fit positive efficiencies; then the update must not set them
    fit = backends["whole_model"]["sdpa"]["fit_vs_datasheet"]
    assert backends["profile_backend"] == ("sdpa" if fit else None)
    update_set = dry_run[1]["profile_update"]["file"]["set"]
    assert ("dense_efficiency" in update_set) == (fit is not None and 0 < fit["dense_efficiency"] <= 1.5)
    memory = backends["whole_model"]["sdpa"]["cells"][0]["memory"]
    assert memory["predicted_bytes"] > 0 and memory["measured_peak_bytes"] is None  # no CUDA allocator here


def test_shard_efficiency_and_memory_per_layout(dry_run):
    shards = dry_run[1]["parts"]["shards"]
    for kind in ("tp", "cp"):
        curve = shards["curves"][kind]
        assert [d for d, _ in curve] == [2, 4, 8] and all(e > 0 for _, e in curve), curve
    for shape in shards["shapes"].values():
        cells = {(c["tp"], c["cp"]): c for c in shape["cells"]}
        assert set(cells) == {(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (1, 8)}
        assert all(c["status"] == "ok" for c in cells.values())
        assert {c["local_tokens"] for (tp, cp), c in cells.items() if cp == 1} == {256}
        assert [cells[(1, d)]["local_tokens"] for d in (2, 4, 8)] == [128, 64, 32]
        base = cells[(1, 1)]["memory"]
        assert base["saved_bytes_per_token"] > 0 and base["model_bytes_per_token"] > 0
        for d in (2, 4, 8):  # Ulysses keeps 1/cp of every saved tensor: bytes per token fall as 1/cp
            assert cells[(1, d)]["memory"]["saved_bytes_per_token"] == pytest.approx(
                base["saved_bytes_per_token"] / d, rel=0.1)


def test_timers_and_profile_update(dry_run):
    summary, report, out = dry_run
    stages = report["parts"]["timers"]["stages"]
    assert set(stages) == {"forward", "backward", "optimizer"}
    assert all(s["device"] > 0 and s["host_sync"] > 0 and s["host_nosync"] > 0 for s in stages.values())
    update = json.loads((out / "h200_profile_update.json").read_text())
    assert update["profile"] == "cpu-gloo" and update["dry_run"] is True
    assert {"tp_efficiency", "cp_efficiency"} <= set(update["set"])
    profile = load_updated_profile(out / "h200_profile_update.json")
    assert profile.tp_efficiency == tuple((d, e) for d, e in update["set"]["tp_efficiency"])
    assert get_profile(str(out / "h200_profile_update.json")) == profile
    assert summary["profile_update_check"]["applies"] is True


def test_hotpath_part_counts_no_host_sync_and_times_the_chunk_kernel(dry_run):
    hotpath = dry_run[1]["parts"]["hotpath"]
    assert hotpath["host_syncs"]["per_step"] == 0, hotpath["host_syncs"]
    chunks = hotpath["kv_chunks"]
    # the ring's blocks: rank r's chunks r and 2cp-1-r see r + 1 and 2cp - r key chunks
    assert chunks["kernel_calls"] == chunks["cp"] * (2 * chunks["cp"] + 1) and chunks["chunks_s"] > 0
    assert chunks["single_s"] > 0


def test_cp_chunk_part_times_each_chunk_against_the_model(dry_run):
    """Part (g) on CPU: every tiny chunk cell is timed and set beside the model's price of its pairs."""
    from lightning_hotspa.models.config import LlamaConfig
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel

    summary, report, _ = dry_run
    chunks = report["parts"]["cpchunks"]
    heads, kv_heads, dim = chunks["heads"]
    layer = LlamaConfig(vocab_size=256, hidden=heads * dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads,
                        ffn_hidden=4 * dim, max_seq_len=256)
    per_pair = AnalyticCostModel(layer, "cpu-gloo", 1).attention_seconds_per_pair()
    assert [(c["rows"], c["keys"]) for c in chunks["cells"]] == [(16, 128), (32, 256)]
    for c in chunks["cells"]:
        assert c["status"] == "ok" and c["measured_s"] > 0, c
        assert c["pairs"] == c["rows"] * (c["keys"] - c["rows"]) + c["rows"] * (c["rows"] + 1) // 2
        assert c["predicted_s"] == pytest.approx(per_pair * c["pairs"])
        assert c["measured_over_predicted"] == pytest.approx(c["measured_s"] / c["predicted_s"])
    assert [cell[:2] for cell in summary["cpchunks"]["cells"]] == [[16, 128], [32, 256]]
    # the ring's block kernel against SDPA's forward and autograd backward (GQA, a window's band masks)
    ring = chunks["ring_blocks"]
    assert set(ring) == {"float32 window None", "float32 window 100", "bfloat16 window None", "bfloat16 window 100"}
    for case, errs in ring.items():
        worst = max(errs[k] for k in ("out", "dq", "dk", "dv"))
        assert worst < (1e-5 if case.startswith("float32") else 2e-2), (case, errs)


def test_the_hopper_part_says_why_each_kernel_cannot_run_on_cpu(dry_run):
    """Part (h) names every Hopper-class kernel of the registry and, on CPU, why it cannot run (never run on
    a GPU yet: a lent GPU runs its correctness and speed cells)."""
    from lightning_hotspa.models.attention_kernels import KERNELS

    hopper = dry_run[1]["parts"]["hopper"]
    assert set(hopper["documents"]) == {"fa3_varlen", "fa4_varlen", "cudnn_varlen"}
    assert set(hopper["chunks"]) == {k for k, r in KERNELS.items() if r.packed}
    for name, result in {**hopper["documents"], **hopper["chunks"]}.items():
        assert result["status"] == "unavailable" and "CUDA" in result["reason"], (name, result)
