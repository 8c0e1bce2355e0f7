"""What a user sees of one short ``make train``-like run (recipes/train.py, 4 processes started by
Lightning's own launcher, W&B offline by the recipe's own choice, CSV beside it): the W&B history
read back from the run's own ``.wandb`` file (per step only the stages that ran, their tokens adding
up to the data's batch), the CSV metrics, summary and timelines in the one default run folder, a
console free of the listed noise, and the checkpoint written at the end exported and loaded by
``transformers``. One run serves all four (~1 min; the launcher check had a run of its own before)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import pytest
from helpers import history_rows

from lightning_hotspa.adapter.observability.stats import bucket_key

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "recipes" / "train.py"
STEPS = 5  # the stdlib corpus at the defaults: steps 1-5 run 3 layouts, never all 3 in one step
OVERRIDES = [f"trainer.max_steps={STEPS}", "logger=wandb_csv", "callbacks.hotspa_monitor.table_every_n_steps=1",
             "callbacks.hotspa_monitor.timeline_every_n_steps=4", "expect_loss_ratio=1.5"]
TIMELINES = ["step_000001.png", "step_000004.png", "step_000005.png"]  # the first, every 4th, the last


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("user_run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOTSPA_CACHE_DIR": str(tmp / "cache"),
           "NETRC": str(tmp / "no_netrc")}
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_MODE", None)  # the recipe must go offline by itself (`make train` sets it too)
    proc = subprocess.run([sys.executable, str(TRAIN), *OVERRIDES], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list((tmp / "outputs").glob("*/*"))  # the default folder: outputs/<date>/<time>
    assert len(runs) == 1, f"ranks disagree on the run dir: {runs}"  # each child used the parent's
    return {"dir": runs[0], "stdout": proc.stdout, "stderr": proc.stderr, "tmp": tmp}


def _batch_tokens(steps: int) -> list[int]:
    """Tokens of the global batch of steps 1..steps, from the data alone (no planner, no ranks)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_hotspa.adapter.recipes.hydra_recipe import CONFIG_DIR, register_resolvers

    register_resolvers()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose("config", overrides=["output_dir=.", "run_name=t"])
    dm = instantiate(cfg.data, _convert_="all")
    dm.setup("fit")
    sampler = dm._train_sampler
    assert steps <= sampler.num_batches(0)
    return [sum(r.length for r in sampler.batch(0, s)) for s in range(steps)]


def test_wandb_history_has_per_step_stage_metrics_of_the_stages_that_ran(run: dict) -> None:
    runs = list((run["dir"] / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    rows = [r for r in history_rows(runs[0]) if "hotspa/tokens" in r]
    by_step = {int(r["trainer/global_step"]): r for r in rows}
    assert sorted(by_step) == list(range(STEPS)), sorted(by_step)  # Lightning logs step s+1 as s

    ran: dict[int, set[str]] = defaultdict(set)  # plan_table.csv: written by the monitor, not via W&B
    layouts_of: dict[int, set[str]] = defaultdict(set)
    for row in csv.DictReader((run["dir"] / "plan_table.csv").open()):
        ran[int(row["step"]) - 1].add(bucket_key(row["label"]))  # a stage's key is its bucket alone
        layouts_of[int(row["step"]) - 1].add(row["layout"])
    layouts = set().union(*layouts_of.values())
    assert len(layouts) >= 3 and all(len(lays) < len(layouts) for lays in layouts_of.values()), layouts_of

    for step, (row, batch) in enumerate(zip((by_step[s] for s in range(STEPS)), _batch_tokens(STEPS))):
        stage_keys = {k[len("hotspa/"):-len("/tokens")] for k in row
                      if k.startswith("hotspa/") and k.endswith("/tokens") and k != "hotspa/tokens"}
        assert stage_keys == ran[step], (step, stage_keys, ran[step])  # nothing carried over, no layout in a key
        stage_tokens = [row[f"hotspa/{k}/tokens"] for k in stage_keys]
        assert sum(stage_tokens) == row["hotspa/tokens"] == batch, (step, stage_tokens, batch)
        # one seconds figure per stage, every rate derived from it (Lightning logs float32: 1e-6)
        stage_s = {k: row[f"hotspa/{k}/stage_s"] for k in stage_keys}
        for k in stage_keys:
            assert row[f"hotspa/{k}/tokens_per_s"] == pytest.approx(row[f"hotspa/{k}/tokens"] / stage_s[k], rel=1e-6)
            parts = row[f"hotspa/{k}/switch_s"] + row[f"hotspa/{k}/compute_s"] + row[f"hotspa/{k}/reduce_s"]
            assert stage_s[k] <= parts * (1 + 1e-6) and stage_s[k] >= row[f"hotspa/{k}/compute_s"] * (1 - 1e-6)
        assert row["hotspa/between_s"] >= 0
        assert row["hotspa/step_s"] == pytest.approx(sum(stage_s.values()) + row["hotspa/between_s"], rel=1e-6)
        assert row["hotspa/tokens_per_s"] == pytest.approx(row["hotspa/tokens"] / row["hotspa/step_s"], rel=1e-6)
        assert row["hotspa/predicted_over_measured"] == pytest.approx(
            row["hotspa/predicted_step_s"] / row["hotspa/step_s"], rel=1e-6)
    history = history_rows(runs[0])
    tables = [r for r in history if r.get("hotspa/plan/_type") == "table-file"]
    assert len(tables) == STEPS  # the plan table, every table_every_n_steps (here 1)
    # every metric of a step on one step value: each plan table at its step's scalars' step
    assert sorted(int(t["trainer/global_step"]) for t in tables) == sorted(by_step)
    steps_of_any_row = {int(r["trainer/global_step"]) for r in history if "trainer/global_step" in r}
    assert steps_of_any_row == set(by_step), steps_of_any_row  # no row on a step of its own


def test_the_launchers_processes_share_one_run_folder_with_csv_summary_and_timelines(run: dict) -> None:
    """Lightning's launcher re-ran the script per process, each with the parent's run folder (one
    folder, a log per child); both loggers; the summary, plan table and timelines beside them."""
    folder = run["dir"]
    assert (folder / "train_ddp_process_3.log").exists() and (folder / ".hydra" / "config.yaml").exists()
    rows = list(csv.DictReader((folder / "csv" / "version_0" / "metrics.csv").open()))
    columns = set(rows[0])
    for key in ("train/step_loss", "hotspa/step_s", "hotspa/tokens_per_s", "hotspa/switch_fraction", "hotspa/mfu",
                "lr-AdamW/pg1"):
        assert key in columns, sorted(columns)
    assert any(c.endswith("/switch_MB") for c in columns) and any(c.endswith("/predicted_s") for c in columns)
    losses = [float(r["train/step_loss"]) for r in rows if r.get("train/step_loss")]
    assert len(losses) == STEPS and all(0 < x < 10 for x in losses)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["losses"] == pytest.approx(losses, rel=1e-5) and summary["buckets"]
    assert [Path(p).name for p in summary["timelines"]] == TIMELINES
    offline = list((folder / "wandb").glob("offline-run-*"))
    out = run["stdout"]
    assert "HotSPa summary" in out and f"wandb sync {offline[0]}" in out and "W&B: offline" in out
    assert "loss check:" in out and "timeline PNGs" in out


NOISE = ("LeafSpec", "The anonymous setting has no effect", "Epoch 0/-2", "`weights_only` was not set",
         "litlogger", "Tip: For seamless cloud logging", "Training: ", "0/?", "rank -> node map",
         "vocab_parallel_loss", "wandb: ", "Run data is saved locally", "You can sync this run")


def test_console_has_no_listed_noise_and_each_lightning_line_once(run: dict) -> None:
    text = run["stdout"] + run["stderr"]
    for line in NOISE:
        assert line not in text, line
    assert text.count("offline-run-") == 1 and "wandb sync " in text  # where the run is: once, with the command
    summary = text[text.index("HotSPa summary"):]
    assert "Epoch " not in summary  # the finished bar is not drawn again after the summary
    assert "pred/meas: the cost model's predicted seconds / the measured ones" in summary  # columns explained
    for line in ("GPU available: False", "`Trainer.fit` stopped: `max_steps=5` reached."):
        assert text.count(line) == 1, (line, text.count(line))
    assert "Epoch 0" not in text and "Epoch 1/1" in text  # counted from 1, of the epochs max_steps spans
    # rank 0 only, one redraw per step; the finished bar once more when the process exits (was 4 times)
    assert 1 <= text.count(f"{STEPS}/{STEPS} [") <= 2


def test_checkpoint_at_the_end_exports_and_loads_in_transformers(run: dict) -> None:
    import torch
    import transformers

    from lightning_hotspa.tools.cli import main

    ckpt = run["dir"] / "checkpoints" / f"step={STEPS}.ckpt"
    assert f"checkpoint: {ckpt}" in run["stdout"]
    out = run["tmp"] / "hf"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["export", str(ckpt), str(out)]) == 0
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]  # no foreign warning
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.tensor([list(b"def main():")])
    logits = model(ids).logits
    assert logits.shape[:2] == ids.shape and torch.isfinite(logits).all()
