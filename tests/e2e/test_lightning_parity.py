"""Everyday Lightning features under ``strategy="hotspa"`` behave as under DDP or are refused at setup
(issue 27): 2 gloo ranks, the tiny preset, uneven and empty dp groups."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from helpers import deal, lightning_rank_env, rank_plans

import lightning_hotspa  # noqa: F401  (registers "hotspa")
from lightning_hotspa import HotSPaStrategy
from lightning_hotspa.layout import Layout
from lightning_hotspa.models import LlamaLM
from lightning_hotspa.plan import StepPlan
from lightning_hotspa.testing.spawn import RankPool

DP2 = [Layout.parse("dp2")]


class LoggingLM(LlamaLM):
    """The tiny LlamaLM logging a synced value per micro-batch, and remembering what it logged."""

    def __init__(self) -> None:
        super().__init__("tiny", seed=3, lr=2e-3)
        self.train_logged: list[list[float]] = []
        self.train_tokens: list[list[int]] = []  # per step, in the order the micro-batches ran
        self.val_logged: list[tuple[float, int]] = []

    def training_step(self, batch, batch_idx=0):
        loss = self._loss(batch)
        if not self.train_logged or self.train_logged[-1][0] != self.trainer.global_step:
            self.train_logged.append([self.trainer.global_step])
            self.train_tokens.append([])
        self.train_logged[-1].append(float(loss))
        self.train_tokens[-1].append(int(batch.num_target_tokens))
        self.log("mb_loss", loss.detach(), on_step=True, on_epoch=True, sync_dist=True,
                 batch_size=int(batch.num_target_tokens))
        self.log("mb_max", loss.detach(), on_step=True, on_epoch=False, sync_dist=True, reduce_fx="max")
        return loss

    def validation_step(self, batch, batch_idx=0):
        loss = self._loss(batch)
        self.val_logged.append((float(loss), int(batch.num_target_tokens)))
        self.log("val/loss", loss, sync_dist=True, batch_size=int(batch.num_target_tokens))
        return loss


def _uneven_plans(steps: int, docs: int) -> list[StepPlan]:
    """dp2 plans of ``docs`` documents, two per micro-batch, group 0 holding the most (3 docs pairs:
    rank 0 two micro-batches, rank 1 one; 1 pair: rank 1 none)."""
    lengths = [[9, 20, 14, 6, 31, 12][:docs], [17, 5, 26, 11, 8, 23][:docs]]
    return [StepPlan(s, tuple(lengths[s % 2]), (deal(DP2[0], list(range(docs))),)) for s in range(steps)]


def _loader(batches):
    return torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda x: x)


def _trainer(steps: int, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=HotSPaStrategy(["dp2"], timeout=20),
                     max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False, **kwargs)


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def log_with_uneven_micro_batches() -> dict:
    """Row 1: ``self.log(sync_dist=True)`` per micro-batch; rank 0 runs 2 micro-batches, rank 1 one."""
    batches = rank_plans(_uneven_plans(2, 6), DP2, dist.get_rank())
    with lightning_rank_env():
        trainer = _trainer(2, num_sanity_val_steps=0)
        model = LoggingLM()
        trainer.fit(model, train_dataloaders=_loader(batches))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("mb_")}
    return {"counts": [len(b.micro_batches) for b in batches], "logged": _gather(model.train_logged),
            "tokens": _gather(model.train_tokens),  # run order: a replicated stage runs its costliest last
            "metrics": metrics}


def test_sync_dist_logging_with_uneven_micro_batches_per_rank(ranks):
    results = ranks(2).run(log_with_uneven_micro_batches, timeout_s=240)
    assert results[0]["counts"] == [2, 2] and results[1]["counts"] == [1, 1]  # really uneven
    logged, tokens = results[0]["logged"], results[0]["tokens"]
    last = [v for rank in logged for v in rank[-1][1:]]  # every micro-batch's loss of the last step
    values = [v for rank in logged for step in rank for v in step[1:]]
    weights = [t for rank in tokens for step in rank for t in step]
    for r in results:  # the same on every rank
        m = r["metrics"]
        assert abs(m["mb_loss_step"] - sum(last) / len(last)) <= 1e-6 * abs(m["mb_loss_step"]), (m, last)
        assert m["mb_max"] == max(last), (m, last)
        epoch = sum(v * w for v, w in zip(values, weights)) / sum(weights)
        assert abs(m["mb_loss_epoch"] - epoch) <= 1e-6 * epoch, (m, epoch)


def validate_with_an_empty_rank(mode: str) -> dict:
    """Row 2: validation where rank 1 holds no micro-batch at all (one pair of documents per plan)."""
    train = rank_plans(_uneven_plans(1, 6), DP2, dist.get_rank())
    val = rank_plans(_uneven_plans(2, 2), DP2, dist.get_rank())
    with lightning_rank_env():
        trainer = _trainer(1, num_sanity_val_steps=0)
        model = LoggingLM()
        if mode == "fit":
            trainer.fit(model, train_dataloaders=_loader(train), val_dataloaders=_loader(val))
            value = float(trainer.callback_metrics["val/loss"])
        else:
            value = trainer.validate(model, dataloaders=_loader(val), verbose=False)[0]["val/loss"]
    return {"counts": [len(b.micro_batches) for b in val], "value": value, "logged": _gather(model.val_logged)}


def test_validation_with_a_rank_holding_no_micro_batch(ranks):
    for mode in ("fit", "validate"):
        results = ranks(2).run(validate_with_an_empty_rank, mode, timeout_s=240)
        assert results[1]["counts"] == [0, 0] and results[0]["counts"] == [1, 1]
        logged = [x for rank in results[0]["logged"] for x in rank]
        expected = sum(v * t for v, t in logged) / sum(t for _, t in logged)
        for r in results:
            assert abs(r["value"] - expected) <= 1e-6 * expected, (mode, r["value"], expected)


TP_LAYOUTS = ["dp2", "tp2"]


def _tp_plans(steps: int) -> list[StepPlan]:
    """Plans with a dp2 stage and a tp2 stage each."""
    lengths = [[9, 20, 14, 6, 31, 12], [17, 5, 26, 11, 8, 23]]
    return [StepPlan(s, tuple(lengths[s % 2]), (deal(DP2[0], [0, 1, 2, 3]), deal(Layout.parse("tp2"), [4, 5])))
            for s in range(steps)]


def reuse_a_fitted_module() -> dict:
    """Row 6: a module fitted with tp layouts, then validated, fitted and predicted by new Trainers."""
    layouts = [Layout.parse(x) for x in TP_LAYOUTS]
    train = rank_plans(_tp_plans(1), layouts, dist.get_rank())
    val = rank_plans(_tp_plans(2), layouts, dist.get_rank())

    def trainer(steps=1):
        return L.Trainer(accelerator="cpu", devices=2, strategy=HotSPaStrategy(TP_LAYOUTS, timeout=20), max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)

    out = {}
    with lightning_rank_env():
        model = LlamaLM("tiny", seed=3, lr=2e-3)
        first = trainer()
        first.fit(model, train_dataloaders=_loader(train))
        out["same"] = first.validate(model, dataloaders=_loader(val), verbose=False)[0]["val/loss"]
        out["new"] = trainer().validate(model, dataloaders=_loader(val), verbose=False)[0]["val/loss"]
        before = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        trainer(1).fit(model, train_dataloaders=_loader(train))
        after = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out["moved"] = min(float((after[n] - before[n]).norm()) for n in before)
    return out


def test_a_fitted_module_is_reused_by_a_new_trainer(ranks):
    for r in ranks(2).run(reuse_a_fitted_module, timeout_s=300):
        assert abs(r["new"] - r["same"]) <= 1e-6 * r["same"], r
        assert r["moved"] > 0, r


class PredictingLM(LlamaLM):
    """The tiny LlamaLM whose ``predict_step`` returns its micro-batch's documents and logits."""

    def predict_step(self, batch, batch_idx=0):
        return batch.doc_ids, self(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)


def predict_every_micro_batch() -> dict:
    """Row 3: ``trainer.predict`` on plans whose tp2 stage (documents 0-1) runs after a dp2 stage."""
    layouts = [Layout.parse(x) for x in TP_LAYOUTS]
    lengths = [9, 20, 14, 6, 31, 12, 7, 10]
    plans = [StepPlan(0, tuple(lengths), (deal(DP2[0], [2, 3, 4, 5, 6, 7]), deal(Layout.parse("tp2"), [0, 1])))]
    batches = rank_plans(plans, layouts, dist.get_rank())
    with lightning_rank_env():
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HotSPaStrategy(TP_LAYOUTS, timeout=20),
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False)
        model = PredictingLM("tiny", seed=3)
        predictions = trainer.predict(model, dataloaders=_loader(batches))
    return {"micro_batches": len(batches[0].micro_batches),
            "outputs": [[(list(d), x.detach()) for d, x in p] for p in predictions]}


def test_predict_returns_every_micro_batch_in_document_order(ranks):
    from helpers import make_docs

    from lightning_hotspa.plan import pack_micro_batch

    reference = PredictingLM("tiny", seed=3)
    lengths = [9, 20, 14, 6, 31, 12, 7, 10]
    docs = make_docs(0, lengths)
    results = ranks(2).run(predict_every_micro_batch, timeout_s=240)
    assert [r["micro_batches"] for r in results] == [3, 2]  # rank 0: 2 in dp2 + 1 in tp2; rank 1: 1 + 1
    for r in results:
        (outputs,) = r["outputs"]  # one Lightning batch
        assert len(outputs) == r["micro_batches"], [d for d, _ in outputs]
        firsts = [min(d) for d, _ in outputs]
        assert firsts == sorted(firsts) and firsts[0] == 0, firsts
        for doc_ids, logits in outputs:
            mb = pack_micro_batch([docs[i] for i in doc_ids])
            with torch.no_grad():
                ref = reference(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
            # a tp2 micro-batch's last document is padded to an even token count (sequence parallel)
            extra = logits.shape[0] - ref.shape[0]
            assert logits.shape[1:] == ref.shape[1:] and 0 <= extra < 2, (doc_ids, logits.shape, ref.shape)
            assert float((logits[:ref.shape[0]] - ref).norm() / ref.norm()) <= 1e-5, doc_ids


class _GradRecorder(L.Callback):
    """The full gradients and weights each optimizer step sees (collectives: every rank gathers)."""

    def __init__(self):
        self.grads, self.weights = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        full = {n: p for n, p in pl_module.named_parameters()}
        self.grads.append({n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                           for n, p in full.items()})
        self.weights.append({n: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                             for n, p in full.items()})


def accumulate_two_plans() -> dict:
    """Row 7: ``accumulate_grad_batches=2`` over two tp/dp plans = one optimizer step."""
    layouts = [Layout.parse(x) for x in TP_LAYOUTS]
    batches = rank_plans(_tp_plans(2), layouts, dist.get_rank())
    recorder = _GradRecorder()
    with lightning_rank_env():
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HotSPaStrategy(TP_LAYOUTS, timeout=20), max_steps=1,
                            accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            callbacks=[recorder])
        trainer.fit(LlamaLM("tiny", seed=3, lr=2e-3), train_dataloaders=_loader(batches))
    return {"grads": recorder.grads, "weights": recorder.weights, "global_step": trainer.global_step}


def test_accumulated_plans_equal_one_plan_of_all_their_tokens(ranks):
    from helpers import make_docs, rel_errors

    from lightning_hotspa.plan import pack_micro_batch

    result = ranks(2).run(accumulate_two_plans, timeout_s=240)[0]
    assert result["global_step"] == 1 and len(result["grads"]) == 1
    model = LlamaLM("tiny", seed=3, lr=2e-3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(result["weights"][0][n])
    docs = [d for plan in _tp_plans(2) for d in make_docs(plan.step, plan.doc_lengths)]
    model.training_step(pack_micro_batch(docs), 0).backward()
    errors = rel_errors(result["grads"][0], {n: p.grad for n, p in model.named_parameters()})
    assert max(errors.values()) <= 1e-5, max(errors.items(), key=lambda kv: kv[1])


class PlainNet(L.LightningModule):
    """A plain module (no tp plan), AdamW, an ordinary DataLoader."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class _NormRecorder(L.Callback):
    """Lightning's ``grad_norm`` (DDP) or ours (hotspa) in every ``on_before_optimizer_step``."""

    def __init__(self, ours: bool):
        self.ours, self.totals, self.hand = ours, [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

        norms = (lightning_hotspa.grad_norm if self.ours else lightning_grad_norm)(pl_module, 2)
        self.totals.append(float(norms["grad_2.0_norm_total"]))
        # summed by hand: shard-local under hotspa (docs/lightning-parity.md), the norm under DDP
        self.hand.append(sum(float(p.grad.norm()) ** 2 for p in pl_module.parameters()) ** 0.5)


def _plain_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)  # 2 ranks x 4 batches of 8: one epoch = 2 steps of 2 batches
    return torch.utils.data.TensorDataset(x, x[:, :1].sin() + 0.1 * torch.randn(64, 1, generator=g))


def plain_module_vs_ddp_accumulating(ckpt_dir: str) -> dict:
    """4 AdamW steps with clipping and accumulate_grad_batches=2; hotspa resumes after 2 of them."""
    from lightning.pytorch.strategies import DDPStrategy

    def fit(strategy, epochs, model, recorder, ckpt_path=None):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                            accumulate_grad_batches=2, gradient_clip_val=0.05, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder])
        trainer.fit(model, torch.utils.data.DataLoader(_plain_data(), batch_size=8), ckpt_path=ckpt_path)
        return trainer

    out = {}
    with lightning_rank_env():
        ddp, ddp_norms = PlainNet(), _NormRecorder(ours=False)
        fit(DDPStrategy(), 2, ddp, ddp_norms)
        ours, our_norms = PlainNet(), _NormRecorder(ours=True)
        first = fit("hotspa", 1, ours, our_norms)
        path = f"{ckpt_dir}/after_epoch_0.ckpt"
        first.save_checkpoint(path)
        resumed = PlainNet()
        out["steps"] = fit(HotSPaStrategy(), 2, resumed, our_norms, ckpt_path=path).global_step
    finals = {n: p.detach().full_tensor() for n, p in resumed.named_parameters()}
    from helpers import rel_errors

    out["errors"] = rel_errors(finals, {n: p.detach() for n, p in ddp.named_parameters()})
    out["norms"], out["ddp_norms"] = our_norms.totals, ddp_norms.totals
    out["hand"], out["ddp_hand"] = _gather(our_norms.hand), ddp_norms.hand
    return out


def test_plain_module_equals_ddp_with_clipping_accumulation_and_resume(ranks, tmp_path):
    r = ranks(2).run(plain_module_vs_ddp_accumulating, str(tmp_path), timeout_s=300)[0]
    assert r["steps"] == 4 and len(r["norms"]) == len(r["ddp_norms"]) == 4
    assert min(r["ddp_norms"]) > 0.05  # clipping acts in every step
    for ours, ddp in zip(r["norms"], r["ddp_norms"]):
        assert abs(ours - ddp) <= 1e-6 * ddp, (r["norms"], r["ddp_norms"])
    worst = max(r["errors"], key=r["errors"].get)
    assert r["errors"][worst] <= 1e-6, (worst, r["errors"][worst])
    # a hand-summed float(p.grad.norm()) is DDP's norm under DDP, but this rank's shards' under hotspa
    assert all(abs(h - d) <= 1e-6 * d for h, d in zip(r["ddp_hand"], r["ddp_norms"]))
    for rank_hand in r["hand"]:
        assert all(h < 0.999 * n for h, n in zip(rank_hand, r["norms"])), (r["hand"], r["norms"])


class PlainNetSeeing(PlainNet):
    """PlainNet remembering each training loss's dtype and value."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.seen.append((str(loss.dtype), float(loss)))
        return loss


def plain_module_bf16_mixed() -> dict:
    """Row 5: ``precision="bf16-mixed"`` on a plain module with fp32 inputs, hotspa and DDP."""
    from lightning.pytorch.strategies import DDPStrategy

    out = {}
    with lightning_rank_env():
        for name, strategy in (("ddp", DDPStrategy()), ("hotspa", HotSPaStrategy())):
            model = PlainNetSeeing()
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, precision="bf16-mixed",
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False)
            trainer.fit(model, torch.utils.data.DataLoader(_plain_data(), batch_size=8))
            out[name] = model.seen
    return out


def test_bf16_mixed_on_a_plain_module_runs_under_autocast_like_ddp(ranks):
    for r in ranks(2).run(plain_module_bf16_mixed, timeout_s=240):
        assert [d for d, _ in r["hotspa"]] == ["torch.float32"] * 2, r
        (_, ours), (_, ddp) = r["hotspa"][0], r["ddp"][0]  # the same weights: the first step's loss
        assert abs(ours - ddp) <= 1e-6 * ddp, r


def fit_and_save(path: str) -> dict:
    """Row 9: a checkpoint folder of a LlamaLM fitted with tp layouts; its full weights."""
    layouts = [Layout.parse(x) for x in TP_LAYOUTS]
    with lightning_rank_env():
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HotSPaStrategy(TP_LAYOUTS, timeout=20), max_steps=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False)
        model = LlamaLM("tiny", seed=3, lr=2e-3)
        trainer.fit(model, train_dataloaders=_loader(rank_plans(_tp_plans(1), layouts, dist.get_rank())))
        trainer.save_checkpoint(path)
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def test_consolidated_checkpoint_loads_with_load_from_checkpoint(ranks, tmp_path):
    from lightning_hotspa.tools.cli import main

    weights = ranks(2).run(fit_and_save, str(tmp_path / "step1"), timeout_s=240)[0]
    out = tmp_path / "step1.ckpt"
    assert main(["consolidate", str(tmp_path / "step1"), str(out)]) == 0
    ckpt = torch.load(out, weights_only=True)  # plain types only
    assert ckpt["global_step"] == 1
    model = LlamaLM.load_from_checkpoint(out)
    assert model.hparams.lr == 2e-3 and model.hparams.seed == 3
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), weights[name]), name


def compiled_vs_eager() -> dict:
    """Row 8: ``compile_blocks`` (aot_eager: dynamo and AOT autograd, no C++ build) against eager; the tiny
    Llama with one block (its own two: each rank traced twice the graphs, 21.4 s alone on the dev box)."""
    import dataclasses

    from helpers import rel_errors

    from lightning_hotspa.models import LlamaConfig

    layouts = [Layout.parse(x) for x in TP_LAYOUTS]
    batches = rank_plans(_tp_plans(2), layouts, dist.get_rank())
    grads, compiled = {}, None
    with lightning_rank_env():
        for name, option in (("eager", False), ("compiled", {"backend": "aot_eager"})):
            recorder = _GradRecorder()
            trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                                strategy=HotSPaStrategy(TP_LAYOUTS, timeout=60, runtime={"compile_blocks": option}),
                                enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                                callbacks=[recorder])
            model = LlamaLM(dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=1), seed=3, lr=2e-3)
            trainer.fit(model, train_dataloaders=_loader(batches))
            grads[name] = recorder.grads
            if option:
                compiled = [getattr(b.__dict__.get("forward"), "hotspa_compiled_block", False)
                            for b in model.model.layers]
    from lightning_hotspa.adapter.lightning.compile_blocks import compile_counts

    errors = [max(rel_errors(c, e).values()) for c, e in zip(grads["compiled"], grads["eager"])]
    return {"compiled": compiled, "graphs": compile_counts()["compiled_graphs"], "errors": errors}


def test_per_block_compile_equals_eager():
    # fresh ranks, not the session's shared pool: in the whole suite, Dynamo tracing in a rank that earlier
    # tests ran in failed inside Dynamo ("dictionary changed size during iteration"); alone it passes
    pool = RankPool(2)
    try:
        results = pool.run(compiled_vs_eager, timeout_s=290)
    finally:
        pool.close()
    for r in results:
        assert r["compiled"] and all(r["compiled"]) and r["graphs"] >= 1, r
        assert len(r["errors"]) == 2 and max(r["errors"]) <= 1e-5, r


class _LightningGradNorm(L.Callback):
    """Lightning's own ``grad_norm`` where a user would call it."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

        lightning_grad_norm(pl_module, 2)


def lightning_grad_norm_under_hotspa() -> str:
    with lightning_rank_env():
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="hotspa", max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[_LightningGradNorm()])
        try:
            trainer.fit(PlainNet(), torch.utils.data.DataLoader(_plain_data(), batch_size=8))
        except RuntimeError as exc:
            return str(exc)
    return "no error"


def test_lightnings_grad_norm_fails_naming_ours(ranks):
    messages = ranks(2).run(lightning_grad_norm_under_hotspa, timeout_s=120)
    assert all(m.startswith("use lightning_hotspa.grad_norm(module, norm_type)") for m in messages), messages


def test_load_from_checkpoint_of_a_checkpoint_folder_names_hotspa_consolidate(tmp_path):
    import pytest

    (tmp_path / "epoch=0-step=2.ckpt").mkdir()
    with pytest.raises(IsADirectoryError, match="hotspa consolidate"):
        LlamaLM.load_from_checkpoint(tmp_path / "epoch=0-step=2.ckpt")
