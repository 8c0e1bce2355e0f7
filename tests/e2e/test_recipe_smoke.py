"""Every runnable recipe under recipes/ runs here in a smoke mode: tiny sizes, a few steps, its last
stdout line parsed as JSON and its keys (and cheap sane values) checked.

``SMOKE`` is the table: recipe file -> :class:`Smoke` (the arguments, the keys its final JSON line must
hold, an optional check of the values, whether it is in the fast tier) or :class:`Reuse` (an existing test that
already runs the recipe end to end, so it does not run twice). Files under recipes/ that are not entry
points are listed in ``HELPERS`` with what imports them. ``test_every_recipe_has_a_smoke_entry`` fails
on a recipe file in neither, so a new recipe without a smoke run fails the suite.

**Adding a recipe is one line**: ``"benchmark_x.py": Smoke(["--tiny", "args"], {"key", ...}),`` in
``SMOKE`` (``check=``: a function of the JSON object for its values; ``fast=True``: in ``make test-fast``,
for a run in one process, no ranks, a few seconds). A second mode of one file: a key ``"file.py --mode"``.

The recipes run in this process (loaded under their own module name, ``recipes/`` on ``sys.path``, so
a function a recipe hands to ``run_on_ranks`` pickles by name): their ranks then fork from the suite's
fork server (tests/conftest.py) instead of importing Lightning afresh. Runs not marked ``fast`` (those that
spawn ranks or take longer) are marked ``slow`` and stay out of ``make test-fast``.
"""

from __future__ import annotations

import ast
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from helpers import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"


class Smoke(NamedTuple):
    """A recipe run here: ``python recipes/<file> *args`` in this process."""

    args: list[str]
    keys: set[str]
    check: Callable[[dict[str, Any]], None] | None = None
    fast: bool = False  # in ``make test-fast``: one process, no ranks spawned, a few seconds


class Reuse(NamedTuple):
    """A recipe whose end-to-end run is an existing test (``tests/<path>::<test name>``)."""

    test: str


def _finite_positive(*values: float) -> None:
    for v in values:
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, values


def _check_data(out: dict) -> None:
    for source in ("stdlib", "commoncrawl", "github", "uniform", "bimodal"):
        assert 0 < out[f"{source}_fill"] <= 1 and 0 <= out[f"{source}_padding"] < 1, source
        assert out[f"{source}_imbalance"] >= 1 and out[f"{source}_docs"] >= 1, source
    _finite_positive(out["max_plan_ms"])


def _check_memory(out: dict) -> None:
    (row,) = out["rows"]
    _finite_positive(row["measured_peak_gib"], row["predicted_peak_gib"])
    assert 0 <= out["max_rel_error"] < 0.5


def _check_startup(out: dict) -> None:
    _finite_positive(out["shard_elements"], out["speedup"])


def _check_planner(out: dict) -> None:
    _finite_positive(out["max_guarded_plan_ms"], out["paper_set_median_cpu_ms"])
    measured = [v for v in out.values() if isinstance(v, dict) and "measured_plan_ms" in v]
    assert measured and all(v["measured_reuse_same_plan"] for v in measured)  # the memo changes no plan
    assert all(v["probes_priced"] >= 1 and v["measured_plan_ms_probes"] > 0 for v in measured)


def _check_blocks(out: dict) -> None:
    for setup in out["setups"]:
        assert setup["mixed_stages"] >= 1 and setup["geomean_lockstep_over_streams_same_copy"] >= 1 - 1e-9


def _check_published(out: dict) -> None:
    assert out["rows"] and all(r["predicted"] > 0 and r["ratio"] > 0 for r in out["rows"])
    _finite_positive(out["geomean_ratio"])


def _check_e2e(out: dict) -> None:
    s = out["stdlib"]
    _finite_positive(s["speedup"], s["best_static_tokens_per_s"], s["ideal_speedup"], s["predicted_speedup"],
                     s["model_parallel_speedup"])
    for cfg in ("hotspa", "rule", "model_parallel"):
        _finite_positive(*s["configs"][cfg]["loss"])
    assert out["model_parallel_layout"] is not None


def _check_overhead(out: dict) -> None:
    _finite_positive(*out["tokens_per_s"].values(), out["dp4_vs_ddp"], out["dp2xtp2_vs_model_parallel"])


def _check_hf_load(out: dict) -> None:
    assert len(out["per_rank"]) == 4 and all(r["home_shard_mib"] > 0 for r in out["per_rank"])
    _finite_positive(out["params"], out["max_peak_rss_mib"])


def _check_hot_path(out: dict) -> None:
    assert all(v == 0 for v in out["host_syncs_per_micro_batch"].values()), out["host_syncs_per_micro_batch"]
    for layout, r in out["reduce_exposure"].items():  # the fake world's count against the model's (issue 52)
        assert abs(r["exposed_share_at_1x"] - r["model_exposed_share_at_1x"]) < 2e-3, (layout, r)
    beside = out["tp_cp_bytes_per_layer"]
    assert beside["dp8"]["in_flight_beside_gemm_MB"] == 0 < beside["dp4xtp2"]["in_flight_beside_gemm_MB"]
    assert set(out["process_groups_per_rank"]) == {"8", "64"} and set(out["process_groups_wide_set"]) == {"64"}
    _finite_positive(out["kv_work_vs_single"])
    ring = out["cp_exchange_bytes_per_layer"]["tp8xcp8:kv on 64"]  # the KV ring's bytes are what is priced
    assert ring["ring_bytes"] == sum(ring["cost_model_bytes"].values()) > ring["ring_overlapped"] > 0


def _check_memory_peers(out: dict) -> None:
    for impl in ("ours_cpu", "ours_gpu", "hf_sdpa"):
        _finite_positive(*out["bytes_per_token"][impl].values())
    assert 0 < out["sp_activation_ratio"]["tp2"] < 1 and out["estimator_vs_model_max_rel_error"] < 0.1


def _check_model(out: dict) -> None:
    _finite_positive(*out["tokens_per_s"].values())
    assert out["max_grad_rel_err"] < 1e-3, out["grad_rel_err"]
    assert len([k for k in out["per_layout_max_grad_rel_err"] if "pp" in k]) >= 3, out["per_layout_max_grad_rel_err"]


def _check_pipeline(out: dict) -> None:
    assert max(out["schedules"].values()) <= 1e-5 and out["switch_plan_max_grad_rel_err"] <= 1e-5, out
    fractions = out["param_fraction_per_rank"]
    assert fractions["pp4"] < 0.5 and fractions["dp2xpp2"] < 0.75 and fractions["dp4"] == 1.0, fractions
    # into pp each rank receives only its stages' missing pieces; out of pp nothing its stages held
    assert all(v == 1.0 for v in out["switch_bytes_over_bound"].values()), out["switch_bytes_over_bound"]
    assert set(out["reduce_bytes_per_rank"]) == {"dp2xpp2", "tp2xpp2", "pp4"}, out["reduce_bytes_per_rank"]


def _check_switch(out: dict) -> None:
    assert out["correct"] is True and out["max_bytes_over_lower_bound"] >= 1
    _finite_positive(out["bytes_vs_naive"], out["time_vs_naive"])


def _check_mixed(out: dict) -> None:
    _finite_positive(*out["losses"], *out["reference_losses"])
    assert out["losses_match"] is True, out["max_loss_rel_diff"]
    if out["blocks"]:
        assert out["block_tokens_logged"] == out["batch_tokens"]


def _check_measured(out: dict) -> None:
    assert out["losses_match"] is True and out["max_loss_rel_err_vs_single"] <= 1e-4, out["max_loss_rel_err_vs_single"]
    _finite_positive(*out["static_s_per_step"].values())
    assert out["fastest_measured"] in out["static_s_per_step"] and len(out["exploits"]) == out["steps"]
    assert 0 <= out["exploration_share"] <= 1 and out["settled_on"] is not None
    assert 0 <= out["probe_steps"] <= out["explored_steps"] and out["probe_share"] == 0.125


def _check_fp8(out: dict) -> None:
    assert out["fp8_linears"] > 0 and out["scaled_mm_calls"] > 0 and out["layouts_run"] >= 3, out
    assert out["tolerance"] <= 0.03 and out["within_tolerance"] is True, out


SMOKE: dict[str, Smoke | Reuse] = {
    "benchmark_backends.py": Reuse("e2e/test_benchmark_backends.py::"
                                   "test_runs_every_cpu_backend_and_reports_unavailable_ones"),
    "benchmark_data.py": Smoke(["--batches", "1", "--tokens-per-batch", "8192", "--tokens-per-rank", "1024",
                                "--context-length", "2048"],
                               {"max_plan_ms", "stdlib_fill", "stdlib_padding", "plan_time_target_met"}, _check_data),
    # one step per fit, no warm-up step (its one-off costs land in the timed step: a smoke checks the code path)
    "benchmark_e2e.py": Smoke(["--datasets", "stdlib", "--context", "512", "--tokens-per-batch", "1024", "--steps", "1",
                               "--warmup", "0", "--repeats", "1", "--calibration-steps", "1", "--memory-mib", "3",
                               "--layouts", "dp4"],
                              {"stdlib", "tokens_per_rank", "layouts", "model_parallel_layout"}, _check_e2e),
    "benchmark_hf_load.py": Smoke(["--dir", "hf", "--preset", "tiny", "--ranks", "4", "--layouts", "dp4,dp2xtp2"],
                                  {"params", "per_rank", "max_peak_rss_mib", "checkpoint_mib"}, _check_hf_load),
    "benchmark_hot_path.py": Smoke(["--skip-switch", "--kv-tokens", "256", "--collectives-preset", "tiny",
                                    "--group-worlds", "8,64", "--cp-tokens", "2048", "--cp-worlds", "64",
                                    "--fake-layouts", "dp8,dp4xtp2"],  # dp2xtp4's exposure: test_grad_exposure
                                   {"host_syncs_per_micro_batch", "reduce_waits", "kv_attention_calls_per_layer",
                                    "kv_work_vs_single", "collectives_per_step", "process_groups_per_rank",
                                    "reduce_exposure", "tp_cp_bytes_per_layer",
                                    "cp_exchange_bytes_per_layer"},
                                   _check_hot_path),
    # 4 spawned gloo ranks, 3 Trainer fits (2 static layouts x 2 steps, 3 measured steps): 109 s on the shared
    # 2-core box at load ~30 (466 s at load ~130; the fits' start-up dominates), so not in the fast tier
    "benchmark_measured.py": Smoke(["--smoke"], {"static_s_per_step", "fastest_measured", "settled_step", "settled_on",
                                                 "max_loss_rel_err_vs_single", "exploration_share", "steps",
                                                 "probe_steps"},
                                   _check_measured),
    "benchmark_memory.py": Smoke(["--rows", "tiny:4", "--layouts", "dp4", "--hardware", "cpu-gloo", "--json"],
                                 {"rows", "max_rel_error", "feasible_rows", "feasible_rows_that_fit"}, _check_memory,
                                 fast=True),
    "benchmark_memory_peers.py": Smoke(["--smoke"], {"bytes_per_token", "loss_head_bytes_per_token", "capacity_tokens",
                                                     "sp_activation_ratio", "estimator_vs_model_max_rel_error"},
                                       _check_memory_peers),
    "benchmark_model.py": Smoke(["--preset", "tiny", "--tokens", "128", "--micro-batches", "4", "--steps", "1",
                                 "--warmup", "0"],
                                {"tokens_per_s", "grad_rel_err", "max_grad_rel_err", "lm_loss",
                                 "per_layout_max_grad_rel_err"}, _check_model),
    # 4 layers: pp4 holds one block per rank (8 are for interleaved 1F1B's 2 virtual stages per rank)
    "benchmark_pipeline.py": Smoke(["--layers", "4", "--schedules", "1f1b"],
                                   {"schedules", "switch_plan_max_grad_rel_err", "param_fraction_per_rank",
                                    "switch_bytes_over_bound", "reduce_bytes_per_rank"}, _check_pipeline),
    "benchmark_overhead.py": Smoke(["--model", "tiny", "--steps", "2", "--repeats", "1", "--tokens", "256"],
                                   {"tokens_per_s", "dp4_vs_ddp", "dp2xtp2_vs_model_parallel", "dp4_vs_ddp_cpu"},
                                   _check_overhead),
    "benchmark_fp8.py": Smoke(["--smoke"], {"fp8_linears", "scaled_mm_calls", "layouts_run", "tolerance",
                                            "max_rel_diff_between_layouts", "loss_rel_diff_vs_bf16"}, _check_fp8),
    "benchmark_compile.py": Reuse("e2e/test_recipe_smoke_benchmark_compile.py::test_benchmark_compile_smoke"),
    "benchmark_peers.py": Reuse("e2e/test_recipe_smoke_benchmark_peers.py::"
                                "test_smoke_prints_one_json_line_with_the_issue_keys"),
    "benchmark_planner.py": Smoke(["--repeats", "1", "--documents", "64"],
                                  {"max_guarded_plan_ms", "target_50ms_met", "paper_set_median_cpu_ms",
                                   "ladder_targets_met", "measured_probe_targets_met_cpu"}, _check_planner, fast=True),
    "benchmark_published.py": Smoke([], {"rows", "geomean_ratio", "max_abs_log_ratio", "held_out", "fit", "targets",
                                         "cp_rows", "guard_margin_in_use"}, _check_published, fast=True),
    "benchmark_startup.py": Smoke(["--model", "tiny", "--world", "4"],
                                  {"shard_elements", "shard_s", "own_elements_s", "full_s", "speedup"}, _check_startup,
                                  fast=True),
    "benchmark_switch.py": Smoke(["--world", "4", "--hidden", "64", "--ffn", "128", "--layers", "1", "--repeats", "1"],
                                 {"correct", "max_bytes_over_lower_bound", "bytes_vs_naive", "time_vs_naive"},
                                 _check_switch),
    "blocks_vs_lockstep.py": Smoke([], {"setups"}, _check_blocks, fast=True),
    "e2e_mixed.py": Smoke(["--steps", "1"], {"losses", "reference_losses", "max_loss_rel_diff", "losses_match",
                                             "steps_with_a_mixed_stage"}, _check_mixed),
    "e2e_mixed.py --blocks": Smoke(["--steps", "2", "--blocks"], {"losses", "losses_match", "block_tokens_logged",
                                                                 "batch_tokens"}, _check_mixed),
    "gpu_check.py": Reuse("e2e/test_gpu_check.py::test_every_part_ran_within_its_budget"),
    "gpu_check_tp_overlap.py": Reuse("e2e/test_recipe_smoke_gpu_check_tp_overlap.py::"
                                     "test_the_dry_run_equals_the_plain_path_and_prints_json_last"),
    "train.py": Reuse("e2e/test_what_a_user_sees.py::"
                      "test_the_launchers_processes_share_one_run_folder_with_csv_summary_and_timelines"),
}

#: files under recipes/ that are not entry points: what runs them
HELPERS = {
    "gpu_check_common.py": "gpu_check.py",
    "gpu_check_compile.py": "gpu_check.py",
    "gpu_check_fp8.py": "gpu_check.py",
    "gpu_check_cp.py": "gpu_check.py",
    "gpu_check_hopper.py": "gpu_check.py",
    "gpu_check_hotpath.py": "gpu_check.py",
    "gpu_check_layers.py": "gpu_check.py",
    "gpu_check_speed.py": "gpu_check.py",
    "gpu_check_summary.py": "gpu_check.py",
    "gpu_check_train.py": "gpu_check.py",
    "lightning_baselines.py": "benchmark_e2e.py, benchmark_overhead.py, e2e_mixed.py",
    "step_record.py": "benchmark_measured.py, e2e_mixed.py",
}

RUNS = sorted(name for name, entry in SMOKE.items() if isinstance(entry, Smoke))


def _file(key: str) -> str:
    """The recipe file of a SMOKE key (``"e2e_mixed.py --blocks"``: a second mode of one file)."""
    return key.split()[0]


def _params():
    for key in RUNS:
        marks = [] if SMOKE[key].fast else [pytest.mark.slow]
        yield pytest.param(key, id=key.replace(".py", "").replace(" --", "-"), marks=marks)


@pytest.mark.parametrize("name", list(_params()))
def test_recipe_smoke(name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                      tmp_path: Path) -> None:
    smoke = SMOKE[name]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOTSPA_CACHE_DIR", str(tmp_path / "cache"))
    start = time.perf_counter()
    module = load_recipe(_file(name), monkeypatch)
    monkeypatch.setattr(sys, "argv", [str(RECIPES / _file(name)), *smoke.args])
    module.main()
    seconds = time.perf_counter() - start
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines, f"{name} printed nothing"
    out = json.loads(lines[-1])
    assert isinstance(out, dict), lines[-1][:200]
    missing = smoke.keys - set(out)
    assert not missing, f"{name}: its JSON line lacks {sorted(missing)}; it has {sorted(out)}"
    if smoke.check is not None:
        smoke.check(out)
    print(f"{name} smoke: {seconds:.1f} s {out.get('seconds', '')}")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_recipe_has_a_smoke_entry() -> None:
    """A recipe file is either in SMOKE or a helper; a Reuse points to a test that exists and names it."""
    files = {p.name for p in RECIPES.glob("*.py")}
    entries = {_file(key) for key in SMOKE}
    unlisted = sorted(files - entries - set(HELPERS))
    assert not unlisted, f"recipes without a smoke entry in {__file__}: {unlisted} (add one line to SMOKE)"
    assert not entries & set(HELPERS)
    stale = sorted((entries | set(HELPERS)) - files)
    assert not stale, f"entries for recipes that are gone: {stale}"
    for name, entry in SMOKE.items():
        if isinstance(entry, Reuse):
            path, _, test = entry.test.partition("::")
            source = ROOT / "tests" / path
            assert source.is_file() and test in _test_names(source), f"{name}: no test {entry.test}"
            assert name in source.read_text(), f"{name}: {path} never names the recipe"
    for helper, users in HELPERS.items():
        assert "__main__" not in (RECIPES / helper).read_text(), f"{helper} is an entry point: give it a smoke run"
        for user in users.split(", "):
            assert helper.removesuffix(".py") in (RECIPES / user).read_text(), f"{user} does not use {helper}"


@pytest.mark.parametrize("recipe", ["benchmark_e2e.py", "benchmark_model.py"])
def test_a_negative_warmup_is_refused_by_name(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The smokes run ``--warmup 0``; below that a recipe stops before any rank starts, naming the value."""
    module = load_recipe(recipe, monkeypatch)
    with pytest.raises(SystemExit, match=r"--warmup must be >= 0.*-1"):
        module.main(["--warmup", "-1"])
