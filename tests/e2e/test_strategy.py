"""HotSPaStrategy under a real Lightning Trainer on 4 gloo ranks, against a single-process reference."""

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers import (
    FOUNDATION,
    LENGTHS,
    STAGE_ORDERS,
    fit_and_compare,
    lightning_rank_env,
    mixed_plan,
    rank_plans,
    rel_errors,
    tiny_lm,
    worst,
)

import lightning_hotspa  # noqa: F401  (registers "hotspa")
from lightning_hotspa import HotSPaStrategy
from lightning_hotspa.layout import Layout
from lightning_hotspa.models import LlamaLM


@pytest.mark.parametrize("precision, grad_tol, loss_tol, weight_tol", [
    # fp32: exact per step; over 3 steps Adam amplifies reduction-order noise of near-zero gradients
    ("32-true", 1e-5, 1e-5, 1e-4),
    # fp64 removes that noise: the whole 3-step trajectory must match
    ("64-true", 1e-10, 1e-12, 1e-9),
    # bf16 working copies and compute, fp32 home and optimizer state
    ("bf16-mixed", 5e-2, 1e-2, 5e-2),
])
def test_mixed_plans_over_every_layout_match_single_process(ranks, precision, grad_tol, loss_tol, weight_tol):
    result = ranks(4).run(fit_and_compare, FOUNDATION, 3, precision)[0]
    assert result["global_step"] == 3
    for step, errors in enumerate(result["grads"]):
        assert worst(errors)[1] <= grad_tol, (step, worst(errors))
    assert max(result["losses"]) <= loss_tol, result["losses"]
    assert worst(result["weights"])[1] <= weight_tol, worst(result["weights"])
    _check_one_reduction_per_tp_run(result["reductions"])


# all-gather-KV cp ("cp4:kv": the tiny Llama's 2 kv heads are fewer than cp) and the hybrid
# ("cp4:kv2": Ulysses over 2 ranks, KV gather over 2) next to Ulysses and plain dp
KV_LAYOUTS = ["dp4", "cp4:kv", "tp2xcp2:kv", "cp4:kv2", "cp4"]
KV_ORDERS = [KV_LAYOUTS, ["cp4:kv2", "tp2xcp2:kv", "dp4", "cp4", "cp4:kv"]]


@pytest.mark.slow
def test_all_gather_kv_and_hybrid_cp_match_single_process(ranks):
    """The core invariant for the new cp kinds: 3 AdamW steps of mixed plans, fp32."""
    result = ranks(4).run(fit_and_compare, KV_LAYOUTS, 3, "32-true", KV_ORDERS)[0]
    assert result["global_step"] == 3
    for step, errors in enumerate(result["grads"]):
        assert worst(errors)[1] <= 1e-5, (step, worst(errors))
    assert max(result["losses"]) <= 1e-5, result["losses"]
    assert worst(result["weights"])[1] <= 1e-4, worst(result["weights"])


# sharded working copies (":fsdp") over every cp kind, next to replicated ones of the same tp degree
# (dp4 vs dp4:fsdp: no gradient sharing) and of other tp degrees; "cp4:kv2:fsdp": the tiny Llama's
# 2 kv heads are fewer than cp. deal() gives dp groups uneven micro-batch counts: idle rounds run.
FSDP_LAYOUTS = ["dp4:fsdp", "dp2xtp2", "tp2xcp2:kv:fsdp", "cp4:kv2:fsdp", "dp2xcp2:fsdp", "dp4"]
FSDP_ORDERS = [FSDP_LAYOUTS, ["dp2xcp2:fsdp", "dp4:fsdp", "cp4:kv2:fsdp", "dp2xtp2", "dp4", "tp2xcp2:kv:fsdp"]]


@pytest.mark.parametrize("precision, grad_tol, loss_tol, weight_tol", [
    ("32-true", 1e-5, 1e-5, 1e-4),
    # bf16 gathers and compute, fp32 reduce-scatters into fp32 main grads
    pytest.param("bf16-mixed", 5e-2, 1e-2, 5e-2, marks=pytest.mark.slow),
])
def test_sharded_working_copies_match_single_process(ranks, precision, grad_tol, loss_tol, weight_tol):
    """The core invariant for fsdp layouts: 3 AdamW steps of mixed plans; two of the fsdp layouts
    recompute activations (the recomputation gathers each block again)."""
    result = ranks(4).run(fit_and_compare, FSDP_LAYOUTS, 3, precision, FSDP_ORDERS,
                          activation_checkpointing=["tp2xcp2:kv:fsdp", "dp2xcp2:fsdp"])[0]
    assert result["global_step"] == 3
    for step, errors in enumerate(result["grads"]):
        assert worst(errors)[1] <= grad_tol, (step, worst(errors))
    assert max(result["losses"]) <= loss_tol, result["losses"]
    assert worst(result["weights"])[1] <= weight_tol, worst(result["weights"])


# working copies sharded over part of dp x cp and replicated over the rest (HSDP, ":fsdp2"): over
# the dp dim (dp4:fsdp2), over the cp ranks only (dp2xcp2:kv:fsdp2, cp4:fsdp2: Ulysses over 4, the
# copy split over 2), next to a fully sharded peer (dp4:fsdp: another gradient kind) and replicated
# layouts; dp2xcp2:kv:fsdp2 recomputes activations. The stage end reduce-scatters the replicas.
HSDP_LAYOUTS = ["dp4:fsdp2", "dp2xtp2", "dp2xcp2:kv:fsdp2", "dp4:fsdp", "cp4:fsdp2", "dp4"]
HSDP_ORDERS = [HSDP_LAYOUTS, ["cp4:fsdp2", "dp4:fsdp2", "dp2xcp2:kv:fsdp2", "dp4", "dp4:fsdp", "dp2xtp2"]]


def test_working_copies_sharded_within_part_of_the_layout_match_single_process(ranks):
    """The core invariant for HSDP working copies: 3 AdamW steps of mixed plans, fp32."""
    result = ranks(4).run(fit_and_compare, HSDP_LAYOUTS, 3, "32-true", HSDP_ORDERS,
                          activation_checkpointing=["dp2xcp2:kv:fsdp2"])[0]
    assert result["global_step"] == 3
    for step, errors in enumerate(result["grads"]):
        assert worst(errors)[1] <= 1e-5, (step, worst(errors))
    assert max(result["losses"]) <= 1e-5, result["losses"]
    assert worst(result["weights"])[1] <= 1e-4, worst(result["weights"])
    hsdp = ("dp4:fsdp2", "cp4:fsdp2", "dp2xcp2:kv:fsdp2")
    alone = {layout: nbytes for layout, _, _, nbytes, _ in result["reductions"][0]}
    # a lone HSDP stage reduce-scatters its replicas' shards at its end: more than plain fsdp (only
    # the norm outside every unit), less than a replicated copy (the whole tp shard)
    assert alone["dp4:fsdp"] < alone["dp4:fsdp2"] == alone["cp4:fsdp2"] == alone["dp2xcp2:kv:fsdp2"], alone
    carried = [(layout, nbytes) for layout, _, _, nbytes, _ in result["reductions"][1] if layout in hsdp]
    # one kind of gradient (tp 1, split over 2 ranks): the run of 3 HSDP stages reduces once, at its end
    assert carried == [("cp4:fsdp2", 0), ("dp4:fsdp2", 0), ("dp2xcp2:kv:fsdp2", alone["dp4:fsdp2"])], carried


def _check_one_reduction_per_tp_run(steps):
    """Step 0 reduces at every stage (no two neighbours share tp): each layout's own reduction.
    Later steps carry gradients through runs of same-tp stages: 0 collectives until the run's last
    stage, which reduces exactly as a lone stage of its layout (the grads above are right only if
    the carried stages' gradients reached that reduction)."""
    alone = {layout: (count, nbytes) for layout, _, count, nbytes, _ in steps[0]}
    assert [layout for layout, *_ in steps[0]] == FOUNDATION and sum(c for c, _ in alone.values()) > 0
    for stages, order in zip(steps, STAGE_ORDERS):
        assert [layout for layout, *_ in stages] == order[:len(stages)]  # 12 documents: 4 stages
        for (layout, tp, count, nbytes, seconds), nxt in zip(stages, stages[1:] + [None]):
            if nxt is not None and nxt[1] == tp:
                assert (count, nbytes, seconds) == (0, 0, 0.0), (order, layout)
            else:
                assert (count, nbytes) == alone[layout], (order, layout)
    for stages in steps[1:]:  # fewer collectives than one reduction per stage
        assert sum(c for _, _, c, _, _ in stages) < sum(alone[layout][0] for layout, *_ in stages)


def _fit(model, layout_names, batches, steps, ckpt_path=None, **trainer_kwargs):
    with lightning_rank_env():
        trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=HotSPaStrategy(layout_names),
                            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False, **trainer_kwargs)
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None,
                                                                         collate_fn=lambda x: x),
                    ckpt_path=ckpt_path)
    return trainer


def checkpoint_phase(phase, layout_names, path):
    """'full': 3 steps; 'save': 2 steps then save; 'resume': load, then the third step only.
    fp64, so that the resumed run must match the uninterrupted one to rounding."""
    layouts = [Layout.parse(x) for x in layout_names]
    plans = [mixed_plan(s, LENGTHS[s % len(LENGTHS)], layouts) for s in range(3)]
    batches = rank_plans(plans, layouts, dist.get_rank())
    model = LlamaLM("tiny", seed=3, lr=2e-3, warmup_steps=1, max_steps=10)  # with an LR schedule to restore
    if phase == "full":
        _fit(model, layout_names, batches, 3, precision="64-true")
    elif phase == "save":
        trainer = _fit(model, layout_names, batches[:2], 2, precision="64-true")
        with lightning_rank_env():
            trainer.save_checkpoint(path)
    else:
        trainer = _fit(model, layout_names, batches[2:], 3, ckpt_path=path, precision="64-true")
        assert trainer.global_step == 3
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def test_checkpoint_at_world_4_resumes_at_world_2_with_other_layouts(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    full = ranks(4).run(checkpoint_phase, "full", FOUNDATION, path)[0]
    ranks(4).run(checkpoint_phase, "save", FOUNDATION, path)
    resumed = ranks(2).run(checkpoint_phase, "resume", ["dp2", "tp2", "cp2"], path)[0]
    errors = rel_errors(resumed, full)
    assert max(errors.values()) <= 1e-12, worst(errors)
    # a single-file export for inference holds the same (step-2) weights as the sharded checkpoint
    from lightning_hotspa.adapter.checkpoints.dcp_state import export_consolidated

    exported = export_consolidated(path, tmp_path / "model.pt")
    assert set(exported) == set(full) and torch.load(tmp_path / "model.pt")["model.norm.weight"].dtype == torch.float64


def _micro_batches(n, seed=0):
    """Equal target tokens per micro-batch, so a token mean equals DDP's mean of means."""
    from helpers import make_docs

    from lightning_hotspa.plan import pack_micro_batch

    return [pack_micro_batch(make_docs(100 + seed * 50 + i, [17, 9, 30])) for i in range(n)]


def plain_batches_vs_ddp():
    """An ordinary DataLoader (Lightning's DistributedSampler gives each rank its own micro-batch):
    our dp4 equals DDPStrategy, with gradient clipping and an LR schedule on."""
    from lightning.pytorch.strategies import DDPStrategy

    data = _micro_batches(12)
    finals = {}
    for name, strategy in (("hotspa", HotSPaStrategy(["dp4", "dp2xtp2"], default_layout="dp4")),
                           ("ddp", DDPStrategy())):
        model = LlamaLM("tiny", seed=5, lr=3e-3, warmup_steps=2, max_steps=10)
        with lightning_rank_env():
            trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=3, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                gradient_clip_val=0.05)
            trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        params = dict(model.named_parameters())
        finals[name] = {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
                        for n, p in params.items()}
        finals[name + "_lr"] = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
        finals[name + "_step"] = trainer.global_step
    return rel_errors(finals["hotspa"], finals["ddp"]), finals["hotspa_lr"], finals["ddp_lr"], finals["hotspa_step"]


def test_plain_dataloader_equals_ddp_with_clipping_and_schedule(ranks):
    errors, lr_ours, lr_ddp, steps = ranks(4).run(plain_batches_vs_ddp)[0]
    assert steps == 3 and lr_ours == lr_ddp
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, (worst, errors[worst])


def bad_setups():
    messages = {}
    cases = {
        "product": (["dp2"], LlamaLM("tiny")),
        "heads": (["dp4", "tp4"], LlamaLM({"preset": "tiny", "n_heads": 2, "n_kv_heads": 2})),
        "nest": (["dp4", "tp4", "dp2xtp2", "dp2xcp2", "cp4", "tp2xcp2"], LlamaLM("tiny")),
    }
    for key, (layouts, model) in cases.items():
        try:
            _fit(model, layouts, [], 1)
            messages[key] = None
        except Exception as e:  # noqa: BLE001
            messages[key] = f"{type(e).__name__}: {e}"
    return messages


def test_bad_configuration_fails_at_setup_with_clear_messages(ranks):
    messages = ranks(4).run(bad_setups)[0]
    assert "layout dp2 covers 2 ranks" in messages["product"] and "world size is 4" in messages["product"]
    assert "tp=4 does not divide n_heads=2" in messages["heads"]
    assert messages["nest"] is None  # all of these nest on a 2x2 mesh


@pytest.mark.parametrize("precision, match", [("16-true", "got '16-true'")])
def test_unsupported_precision_is_refused_when_the_trainer_is_built(precision, match):
    with pytest.raises(ValueError, match=match):
        L.Trainer(accelerator="cpu", devices=1, strategy=HotSPaStrategy(["dp1"]), precision=precision)


def test_strategy_arguments_are_validated():
    from lightning_hotspa.layout import LayoutError

    with pytest.raises(LayoutError, match="empty"):
        HotSPaStrategy([])
    with pytest.raises(LayoutError, match="cannot parse layout 'dp2xfoo'"):
        HotSPaStrategy(["dp2xfoo"])
    with pytest.raises(ValueError, match="tokens_per_rank must be a positive int, got 0"):
        HotSPaStrategy(tokens_per_rank=0)
    with pytest.raises(ValueError, match="activation_checkpointing must be"):
        HotSPaStrategy(activation_checkpointing="sometimes")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="hotspa", logger=False)
    assert isinstance(trainer.strategy, HotSPaStrategy)
    import importlib

    importlib.reload(lightning_hotspa)  # registering twice is harmless


def test_auto_checkpointing_follows_a_planner_that_decides_it_per_stage():
    """Under "auto" the strategy's own rule (tp*cp > 1 layouts) applies only when the planner does
    not decide checkpointing per stage: it would otherwise recompute stages the cost planner planned
    and priced without recomputation."""
    from lightning_hotspa.planner import PlannerBase
    from lightning_hotspa.planner.solve.solver import CostModelPlanner

    tp = Layout.parse("dp2xtp2")
    strategy = HotSPaStrategy(["dp4", "dp2xtp2"], activation_checkpointing="auto")
    assert strategy.activation_checkpointing_for(tp) and not strategy.activation_checkpointing_for(Layout.parse("dp4"))
    strategy._planner = CostModelPlanner(["dp4", "dp2xtp2"], model="tiny")
    assert not strategy.activation_checkpointing_for(tp)
    strategy._planner = PlannerBase()  # e.g. the threshold rule: stages carry no decision
    assert strategy.activation_checkpointing_for(tp)
    forced = HotSPaStrategy(["dp4", "dp2xtp2"], activation_checkpointing=True)
    forced._planner = CostModelPlanner(["dp4", "dp2xtp2"], model="tiny")
    assert forced.activation_checkpointing_for(tp)


def validate_and_log(log_dir):
    """Validation over step plans in several layouts, and the per-stage metrics reaching a logger."""
    from lightning.pytorch.loggers import CSVLogger

    layouts = [Layout.parse(x) for x in FOUNDATION]
    plans = [mixed_plan(s, LENGTHS[s % len(LENGTHS)], layouts) for s in range(2)]
    batches = rank_plans(plans, layouts, dist.get_rank())
    loader = torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda x: x)
    with lightning_rank_env():
        trainer = L.Trainer(accelerator="cpu", devices=4,
                            strategy=HotSPaStrategy(FOUNDATION, activation_checkpointing="auto"),
                            max_steps=2, logger=CSVLogger(log_dir, name="run", version=0), log_every_n_steps=1,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False, num_sanity_val_steps=0)
        model = tiny_lm()
        trainer.fit(model, train_dataloaders=loader, val_dataloaders=loader)
        metrics = trainer.validate(model, dataloaders=loader, verbose=False)
        weights = {n: p.detach().full_tensor() for n, p in model.named_parameters()}  # collective
    return metrics[0]["val/loss"], weights if dist.get_rank() == 0 else None


def _reference_val_loss(weights, plans):
    """What Lightning reports for ``val/loss`` logged per micro-batch with ``batch_size`` = its target
    tokens and ``sync_dist``: the token-weighted mean over every rank's slices. A tp group's ranks all
    log the same micro-batch, so a token of a stage with tp t counts t times; each token's loss comes
    from the single-process model on the whole document."""
    import torch.nn.functional as F
    from helpers import make_docs

    from lightning_hotspa.plan import pack_micro_batch

    ref = tiny_lm()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(weights[n])
    total = count = 0.0
    for plan in plans:
        mb = pack_micro_batch(make_docs(plan.step, plan.doc_lengths))
        with torch.no_grad():
            logits = ref(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
        token_loss = F.cross_entropy(logits.double(), mb.labels, ignore_index=-100, reduction="none")
        starts = mb.cu_seqlens.tolist()
        for stage in plan.stages:
            for doc in (d for group in stage.micro_batches for m in group for d in m):
                lo, hi = starts[doc], starts[doc + 1] - 1  # the last position has no target
                total += stage.layout.tp * float(token_loss[lo:hi].sum())
                count += stage.layout.tp * (hi - lo)
    return total / count


def test_validation_in_every_layout_and_stage_metrics_are_logged(ranks, tmp_path):
    import csv

    results = ranks(4).run(validate_and_log, str(tmp_path))
    val_losses = [v for v, _ in results]
    layouts = [Layout.parse(x) for x in FOUNDATION]
    plans = [mixed_plan(s, LENGTHS[s % len(LENGTHS)], layouts) for s in range(2)]
    expected = _reference_val_loss(results[0][1], plans)
    assert len(set(val_losses)) == 1 and abs(val_losses[0] - expected) <= 1e-5 * expected, (val_losses, expected)
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    keys = {c.split("/")[1] for c in columns if c.startswith("hotspa/") and c.endswith("/tokens_per_s")}
    keys -= {"tokens_per_s"}  # the step's own
    assert len(keys) >= len(layouts), sorted(columns)  # a metric key names the stage's bucket
    assert all(f"hotspa/{k}/switch_MB" in columns and f"hotspa/{k}/stage_s" in columns for k in keys)
    assert {"hotspa/step_s", "hotspa/switch_fraction", "train/loss", "val/loss"} <= columns
    step_rows = [r for r in rows if r["hotspa/step_s"]]
    assert len(step_rows) == 2 and all(float(r["hotspa/tokens_per_s"]) > 0 for r in step_rows)
