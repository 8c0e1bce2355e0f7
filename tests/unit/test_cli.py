"""The ``hotspa`` command line: tables, the JSON last line, and one-line errors with exit code 2."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_hotspa.planner.solve.static_guard import DEFAULT_STATIC_MARGIN
from lightning_hotspa.tools.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_a_table_and_a_json_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "--model", "llama7b", "--world-size", "8", "--hardware", "A800-80G",
                         "--data", "bimodal", "--global-batch-tokens", "256K", "--context", "32K", "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[1].split()[:4] == ["band", "docs", "tokens", "layout"]
    result = json.loads(lines[-1])
    assert result["command"] == "plan" and result["world_size"] == 8
    stages = result["stages"]
    assert sum(s["tokens"] for s in stages) == result["tokens"] and result["tokens"] <= 256 * 1024
    assert sum(s["documents"] for s in stages) == result["documents"]
    statics = result["static_s"]
    assert result["best_static"] == {"layout": min(statics, key=statics.get), "seconds": min(statics.values())}
    assert result["speedup_vs_best_static"] >= 0.999  # the chosen set can fall back to that static layout
    assert "predicted speed-up" in out
    # the best static, planned on its own by the same command, predicts what the comparison said
    code, out, err = run(capsys, "plan", "--model", "llama7b", "--world-size", "8", "--hardware", "A800-80G",
                         "--data", "bimodal", "--global-batch-tokens", "256K", "--context", "32K", "--json",
                         "--layouts", result["best_static"]["layout"])
    alone = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and alone["layouts"] == [result["best_static"]["layout"]]
    assert alone["tokens"] == result["tokens"]  # the same batch
    assert alone["step_s"] == pytest.approx(result["best_static"]["seconds"], rel=1e-9)


def test_plan_with_given_layouts_and_a_corpus_folder(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    for i, n in enumerate((5000, 300, 12000, 800, 40)):
        (tmp_path / f"doc{i}.txt").write_bytes(b"x" * n)
    code, out, err = run(capsys, "plan", "--model", "tiny", "--world-size", "4", "--hardware", "cpu-gloo",
                         "--data", str(tmp_path), "--global-batch-tokens", "64K", "--context", "8K",
                         "--layouts", "dp4,dp2xtp2,tp2xcp2", "--tokens-per-rank", "4096", "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["documents"] == 6 and result["tokens"] == 5000 + 300 + 12000 + 800 + 40  # 12000 -> 8K + 3808
    assert result["layouts"] == ["dp4", "dp2xtp2", "tp2xcp2"]


def test_simulate_grid_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "simulate", "--contexts", "8K", "--batches", "1", "--sequences", "128", "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert any(line.startswith("| llama30b | 32 | 8K | github |") for line in lines)
    result = json.loads(lines[-1])
    assert len(result["cells"]) == 5 * 2
    for key in ("geomean_speedup_vs_best_static", "geomean_speedup_vs_hand_set"):
        assert result[key] > 0
    for cell in result["cells"]:  # the best static over all layouts is no slower than the best without cp
        assert cell["best_static_s"] <= cell["best_static_no_cp_s"] * (1 + 1e-12), cell


def test_simulate_long_grid_smoke_json(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HOTSPA_PROGRESS", "0")  # no progress lines then (the next test: with them)
    code, out, err = run(capsys, "simulate", "--grid", "smoke", "--batches", "1", "--json")
    assert code == 0, err
    assert "1/1" not in err
    lines = out.strip().splitlines()
    assert any(line.startswith("| H100 | llama3-8b | 16 | 64K | github |") for line in lines)
    result = json.loads(lines[-1])
    assert result["grid"] == "long" and result["margin"] == pytest.approx(DEFAULT_STATIC_MARGIN)
    for key in ("geomean_where_oracle_ge_1_4", "min_captured", "seconds"):
        assert key in result
    (cell,) = result["cells"]
    assert cell["ours_over_static"] == pytest.approx(cell["static_s"] / cell["ours_s"])


def test_simulate_long_grid_prices_ours_with_its_users_options(monkeypatch, capsys) -> None:
    """``--ours-options matching --fa3-conservative``: the JSON says what ours ran and how FA3 was priced."""
    monkeypatch.setenv("HOTSPA_PROGRESS", "0")
    code, out, err = run(capsys, "simulate", "--grid", "smoke", "--batches", "1", "--ours-options", "matching",
                         "--fa3-conservative", "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ours_options"]["attention_backend"] == "fa3_varlen" and result["ours_options"]["compile_blocks"]
    assert result["ours_options"]["fa3_priced"] == "conservative" and "ours priced with: {" in out
    assert result["cells"][0]["competent_user_static"]["torchtitan"]["peer_compiled"]


@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--grid", "smoke", "--margin", "-1"], "--margin must be in [0, 10), got -1.0"),
    (["simulate", "--grid", "smoke", "--fa3-conservative"], "it needs --ours-options matching, got 'default'"),
    (["simulate", "--ours-options", "matching"], "not --grid paper"),
    (["simulate", "--grid", "smoke", "--truth", "perturbed", "--ours-options", "matching"], "--ours-options"),
    (["plan", "--hardware", "TPUv5"], "unknown hardware profile 'TPUv5'; known profiles: A100-80G"),
    (["plan", "--layouts", "dp8", "--context", "64K", "--data", "github", "--global-batch-tokens", "2M"],
     "no candidate layout can hold it"),
    (["plan", "--layouts", "tp3", "--world-size", "3"], "does not divide the model's 32 attention heads"),
    (["plan", "--world-size", "1", "--model", "llama30b"], "has no layout on 1 x A800-80G"),
    (["plan", "--model", "llama99b"], "unknown model preset"),
    (["plan", "--data", "/no/such/corpus"], "neither a length generator"),
    (["plan", "--layouts", "dp4,dp8"], "covers 4 ranks"),
    (["check-calibration", "--steps", "4", "--warmup", "3"], "--warmup 3 leaves fewer than 2 of the 4 steps"),
    (["check-calibration", "--clock", "sundial"], "unknown clock 'sundial'"),
    (["check-calibration", "--train-fraction", "1.5"], "--train-fraction must be in (0, 1), got 1.5"),
])
def test_bad_inputs_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert "Traceback" not in err + out


def test_argument_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--context", "lots"])
    assert exc.value.code == 2
    assert "expected a token count" in capsys.readouterr().err


def test_every_model_setting_of_the_simulation_grid_plans() -> None:
    """Each (model, world size) of the paper grid plans one small cell (its longest context, the
    long-document data) and beats the hand-set rule; the whole 30-cell grid is the recipe
    ``hotspa simulate --json`` (BENCHMARKS.md), run before and after a cost-model change."""
    from lightning_hotspa.tools.simulate import GRID, simulate_grid

    assert len(GRID["settings"]) * len(GRID["contexts"]) * len(GRID["data"]) == 30
    small = {"settings": GRID["settings"], "contexts": [max(GRID["contexts"])], "data": ["github"]}
    result = simulate_grid(batches=1, sequences=128, grid=small)
    assert [(c.model, c.world_size) for c in result["cells"]] == [tuple(x) for x in GRID["settings"]]
    assert result["geomean_speedup_vs_hand_set"] > 1.0


def test_calibration_errors_hold_out_later_steps_per_clock() -> None:
    """The CPU clock is the fitted truth, the wall clock a noisy multiple of it: held-out errors of
    each clock, stage level = the slowest of the ranks' (4 per layout) seconds."""
    import numpy as np

    from lightning_hotspa.layout import Layout
    from lightning_hotspa.planner.profiled.calibration import Observation, encode_observations
    from lightning_hotspa.planner.solve.solver import CostModelPlanner
    from lightning_hotspa.tools.cli import calibration_errors

    layouts = ["dp4", "dp2xcp2"]
    truth = {"dp4": (3e-9, 2e-5, 0.02), "dp2xcp2": (1e-9, 1.5e-5, 0.05)}
    rng = np.random.default_rng(0)
    rows = []
    for _step in range(10):
        for _rank in range(4):
            obs, cpu = [], []
            for name in layouts:
                mbs = [list(rng.integers(64, 2048, size=rng.integers(1, 4))) for _ in range(rng.integers(1, 3))]
                o = Observation.from_lengths(Layout.parse(name), False, mbs, 1.0)
                a, b, c = truth[name]
                cpu.append(a * o.sum_sq + b * o.sum_len + c * o.micro_batches)
                obs.append(Observation(o.layout, False, o.sum_sq, o.sum_len, o.micro_batches,
                                       cpu[-1] * rng.uniform(1.0, 3.0), o.documents))
            rows.extend(np.column_stack([encode_observations(obs, [Layout.parse(x) for x in layouts]), cpu]))
    prior = CostModelPlanner(layouts, model="tiny", hardware="cpu-gloo")._analytic
    cpu = calibration_errors(np.asarray(rows), layouts, 10, 2, 0.5, prior, "cpu")
    wall = calibration_errors(np.asarray(rows), layouts, 10, 2, 0.5, prior, "wall")
    assert cpu["train_steps"] == cpu["held_out_steps"] == 4 and cpu["stages"] == 4 * 2
    assert cpu["stage_mean_error"] < 1e-6 and cpu["rank_mean_error"] < 1e-6 and cpu["noise_floor"] < 1e-6
    assert wall["stage_mean_error"] > 0.05 and wall["rank_mean_error"] > 0.05
    assert 0 < wall["noise_floor"] < wall["stage_mean_error"]  # a fit that saw the steps does better


@pytest.mark.slow
@pytest.mark.parametrize("data", ["commoncrawl", "github"])
def test_plan_never_reads_slower_than_its_static_reference(capsys: pytest.CaptureFixture[str], data: str) -> None:
    """Issue 54's case: dp64, the best static layout of the batch, was no candidate and the chosen plan
    read 0.988x of it; with github data no gain or margin was said."""
    import re

    code, out, err = run(capsys, "plan", "--model", "llama3-8b", "--world-size", "64", "--hardware", "H100",
                         "--context", "131072", "--data", data, "--global-batch-tokens", "4194304", "--ladder",
                         "auto", "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    first = re.search(r"^chosen (.+): ([0-9.]+) s; best static (\S+): ([0-9.]+) s -> predicted speed-up ([0-9.]+)x$",
                      out, re.M)
    assert first, out
    assert float(first[5]) >= 1.0 and first[3] in result["layouts"]  # the reference is a candidate
    assert result["best_static"]["layout"] == result["best_static_any"]["layout"] == first[3]
    if len({s["layout"] for s in result["stages"]}) == 1 and not any("blocks" in s for s in result["stages"]):
        margin = re.search(r"^best multi-layout plan priced: (.+): ([0-9.]+) s, gain ([0-9.]+)x, below the margin "
                           r"([0-9.]+)x$", out, re.M)
        assert margin, out
        assert float(margin[3]) < float(margin[4]) == pytest.approx(1 + DEFAULT_STATIC_MARGIN, abs=1e-3)


def test_plan_names_and_guard_lines() -> None:
    """The lines ``hotspa plan`` prints about the guard, from a real planner's solve."""
    from lightning_hotspa.planner.solve.solver import CostModelPlanner
    from lightning_hotspa.tools.cli import plan_guard_lines

    planner = CostModelPlanner(["dp8", "tp2xcp4"], model="llama7b", hardware="A800-80G", static_margin=9.0)
    plan = planner.plan(0, [30000, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100, 1200])
    lines = plan_guard_lines(plan, 2.0, "tp2xcp4", 2.0, planner)
    assert lines[0] == f"chosen {plan.stages[0].layout.name}: 2.000 s; best static tp2xcp4: 2.000 s -> predicted " \
        f"speed-up 1.000x"
    assert lines[1].startswith("best multi-layout plan priced: ") and lines[1].endswith("below the margin 10.000x")
    assert "->" in lines[1].split(": ")[1] or "blocks[" in lines[1]  # a multi-layout plan, named by its stages
    assert plan_guard_lines(plan, 2.0, None, None, planner)[0].endswith("no candidate holds every document alone)")


def test_long_commands_show_progress_on_stderr_and_keep_json_last_on_stdout(monkeypatch, capsys) -> None:
    import json

    from lightning_hotspa.tools.cli import main

    monkeypatch.setenv("HOTSPA_PROGRESS", "1")  # as a terminal would get it
    assert main(["simulate", "--grid", "smoke", "--batches", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "hotspa simulate" in err and "1/1" in err and "hotspa simulate" not in out
    assert json.loads(out.strip().splitlines()[-1])["command"] == "simulate"


def test_plan_on_a_corpus_shows_its_tokenizing_progress(monkeypatch, capsys, tmp_path) -> None:
    import json

    from lightning_hotspa.tools.cli import main

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": "x" * (50 + i)}) + "\n" for i in range(40)))
    monkeypatch.setenv("HOTSPA_PROGRESS", "1")
    assert main(["plan", "--data", str(tmp_path / "docs.jsonl"), "--global-batch-tokens", "2048",
                 "--context", "512", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "hotspa plan: tokenizing --data" in err and "40doc" in err.replace(" ", "")
    assert json.loads(out.strip().splitlines()[-1])["command"] == "plan"


def test_plan_prints_the_blocks_of_a_block_stage(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """``hotspa plan`` lists each block of a block stage: ranks, layout, copy, micro-batches, seconds. Priced on the
    all-gather-KV description this batch was chosen under (issue 38): under the KV ring's pricing no ladder wins it
    (tests/unit/test_ladder.py pins the same description, benchmarks/2026-12-06-kv-ring.md)."""
    from lightning_hotspa.planner.cost.runtime_profile import HOTSPA, RUNTIME_PROFILES

    earlier = dataclasses.replace(HOTSPA, cp_comm_overlap=False, kv_gather_recomputes_attention=True)
    monkeypatch.setitem(RUNTIME_PROFILES, "hotspa", earlier)
    code, out, err = run(capsys, "plan", "--model", "llama3-8b", "--world-size", "64", "--hardware", "H100",
                         "--data", "github", "--global-batch-tokens", "4M", "--context", "256K", "--step", "1",
                         "--layouts", "dp16xtp4,dp4xtp4xcp4:kv,dp2xtp4xcp8:kv4,tp4xcp16:kv8", "--ladder", "auto",
                         "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    (stage,) = [s for s in result["stages"] if "blocks" in s]
    blocks = stage["blocks"]
    assert len(blocks) >= 2 and stage["layout"].startswith("blocks[")
    spans = [tuple(int(x) for x in b["ranks"].split("-")) for b in blocks]
    assert sum(hi - lo + 1 for lo, hi in spans) == 64 and spans[0][0] == 0
    assert max(b["predicted_s"] for b in blocks) == pytest.approx(stage["compute_s"])
    assert sum(b["documents"] for b in blocks) == stage["documents"]
    for b in blocks:
        assert f"block {b['block']}: ranks {b['ranks']}, {b['layout']} ({b['copy']} copy {b['working']}" in out


def _subparsers(parser):
    import argparse

    for action in parser._actions:  # noqa: SLF001 - argparse keeps its actions there
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            yield from action.choices.items()


def test_every_argument_of_every_subcommand_has_help_and_shows_its_default() -> None:
    """Issue 54: ``hotspa plan --help`` left --world-size, --global-batch-tokens and --context bare."""
    import argparse

    from lightning_hotspa.tools.cli import build_parser

    commands = dict(_subparsers(build_parser()))
    assert {"plan", "simulate", "calibrate", "check-calibration", "memory", "export", "consolidate",
            "upgrade-checkpoint"} <= set(commands)
    for name, sub in commands.items():
        text = " ".join(sub.format_help().split())  # argparse wraps lines
        for action in sub._actions:  # noqa: SLF001
            if isinstance(action, argparse._HelpAction):  # noqa: SLF001
                continue
            where = f"hotspa {name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help.strip(), f"{where}: no help"
            default = action.default
            if default is None or default is False or default is argparse.SUPPRESS:
                continue
            assert f"(default: {default})" in text, f"{where}: its default {default!r} is not shown"


def test_model_and_hardware_lists_come_from_the_registries() -> None:
    from lightning_hotspa.model_shape import PRESET_SHAPES
    from lightning_hotspa.planner.cost.hardware import PROFILES
    from lightning_hotspa.tools.cli import build_parser

    plan = dict(_subparsers(build_parser()))["plan"]
    text = " ".join(plan.format_help().split())
    assert "llama3-8b" in text and "llama3-70b" in text
    for name in [*PRESET_SHAPES, *PROFILES]:
        assert name in text or name.startswith("artifact-"), name
