"""Sequence parallelism inside tp (docs/DESIGN.md §11): norms and the residual stream hold 1/tp of
the tokens on each tp rank, and every step still equals the single process — with GQA (kv heads
split, and fewer kv heads than tp), packed documents whose token count tp does not divide (the last
document padded), tp x cp, and along a 3-step fp64 trajectory. The norm weights' gradients are the
tensors that need the sum over tp that sequence parallelism adds."""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import (
    LlamaFusedLoss,
    dealt_stage,
    fit_and_compare,
    home_grad_errors,
    single_process_reference,
    tiny_lm,
    worst,
)
from torch import nn

from lightning_hotspa.layout import Layout, LayoutError
from lightning_hotspa.models import LlamaConfig, llama_tp_plan, param_roles
from lightning_hotspa.models.llama import RMSNorm
from lightning_hotspa.parallel.state import ParallelState
from lightning_hotspa.parallel.tensor_parallel import install_tensor_parallel
from lightning_hotspa.plan import pack_micro_batch

TOLERANCE = 1e-5
# with one dp group both micro-batches hold an odd number of tokens (203, 189): tp 2 and 4 pad the last
# document (under cp each rank's count is even already: cp pads every document to 2*cp chunks)
DOC_LENGTHS = [45, 7, 131, 20, 63, 3, 89, 34]


def _docs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(b"sp-docs"))
    return [torch.randint(0, 256, (n,), generator=g) for n in DOC_LENGTHS]


def _watch_token_shares(module: nn.Module) -> list[int]:
    """Per norm call: the micro-batch's token count over the rows the norm saw (tp under sequence
    parallelism, 1 without)."""
    shares: list[int] = []
    current = {"tokens": 0}

    def on_embedding(_, args):
        current["tokens"] = args[0].shape[0]

    def on_norm(_, args):
        shares.append(current["tokens"] // args[0].shape[0])

    module.model.tok_embeddings.register_forward_pre_hook(on_embedding)
    for sub in module.modules():
        if isinstance(sub, RMSNorm):
            sub.register_forward_pre_hook(on_norm)
    return shares


def run_sequence_parallel(layouts: list[str], kv_heads: int, tp_overlap: bool = True, tp_regather: bool = True
                          ) -> dict:
    """Each layout as one step (two micro-batches per dp group) against the single process: loss
    and per-tensor gradient errors, and the token shares the norms saw."""
    from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.parallel.model import ParallelModel
    from lightning_hotspa.placements import build_shardings
    from lightning_hotspa.plan import StepPlan, slice_plan

    config = LlamaConfig.preset("tiny", n_kv_heads=kv_heads)
    build = lambda: LlamaFusedLoss(config)  # noqa: E731
    docs = _docs()
    ref_loss, init, ref_grads = single_process_reference(build, docs)
    world = WorldMesh(layouts)
    module = build()
    roles = param_roles(module, llama_tp_plan(config, max(Layout.parse(x).tp for x in layouts), prefix="model."))
    shardings = build_shardings({n: tuple(p.shape) for n, p in module.named_parameters()}, roles, world.shape)
    home = build_home_parameters(world, shardings, lambda name, shape: init[name])
    parallel = ParallelModel(module, roles, world, tp_overlap=tp_overlap, tp_regather=tp_regather)
    parallel.restore(home)
    engine = SwitchEngine(world, shardings, home)
    shares = _watch_token_shares(module)
    results = {}
    for name in layouts:
        plan = StepPlan(0, tuple(DOC_LENGTHS), (dealt_stage(name, list(range(len(DOC_LENGTHS)))),))
        mine = slice_plan(plan, docs, world.shape, world.rank)
        loss_sum, padded = torch.zeros((), dtype=torch.float64), 0
        shares.clear()
        for stage in mine.stages:
            engine.materialize(stage.layout)
            parallel.activate(stage.layout, engine.working)
            for mb in stage.micro_batches:
                plain = pack_micro_batch([docs[i] for i in mb.doc_ids], mb.cp_size, mb.cp_rank)
                padded += int(mb.input_ids.numel() != plain.input_ids.numel())
                with parallel.micro_batch(mb):
                    loss = module.training_step(mb)
                (loss * (mb.num_target_tokens / plan.global_target_tokens)).backward()
                if parallel.state.groups.tp.index == 0:
                    loss_sum += float(loss.detach()) * mb.num_target_tokens / plan.global_target_tokens
            engine.reduce_gradients()
        errors = home_grad_errors(parallel, engine, home, loss_sum, ref_grads)
        results[name] = {"loss_err": abs(float(loss_sum) - ref_loss) / abs(ref_loss), "errors": errors,
                         "shares": sorted(set(shares)), "padded": padded}
    return results


def _check(per_rank: list[dict], layouts: list[str]) -> None:
    for rank_result in per_rank:
        for name in layouts:
            r, tp = rank_result[name], Layout.parse(name).tp
            assert r["shares"] == [tp], (name, r["shares"])  # the norms saw 1/tp of the tokens
            assert r["loss_err"] <= TOLERANCE, (name, r["loss_err"])
            norms = {n: e for n, e in r["errors"].items() if "norm" in n}
            assert len(norms) == 5 and max(norms.values()) <= TOLERANCE, (name, norms)
            worst = max(r["errors"], key=r["errors"].get)
            assert r["errors"][worst] <= TOLERANCE, (name, worst, r["errors"][worst])


def test_tp2_with_gqa_and_documents_tp_does_not_divide_matches_single_process(ranks):
    """2 ranks, tiny Llama with 4 query / 2 kv heads (kv heads split over tp2), every micro-batch an
    odd number of tokens (its last document padded)."""
    per_rank = ranks(2).run(run_sequence_parallel, ["tp2"], 2, timeout_s=300)
    _check(per_rank, ["tp2"])
    assert all(r["tp2"]["padded"] > 0 for r in per_rank)


def test_tp2xcp2_and_tp4_with_fewer_kv_heads_than_tp_match_single_process(ranks):
    """4 ranks: tp2 x cp2 (each cp rank's tokens cut further over tp), tp4 with 2 kv heads (the kv
    projections replicated_partial) and dp2 x tp2."""
    layouts = ["tp2xcp2", "tp4", "dp2xtp2"]
    per_rank = ranks(4).run(run_sequence_parallel, layouts, 2, timeout_s=600)
    _check(per_rank, layouts)
    assert all(r["tp4"]["padded"] > 0 for r in per_rank)


@pytest.mark.parametrize("overlap,regather", [(False, True), (True, False), (False, False)])
def test_without_tp_overlap_or_the_regather_tp4_and_dp2xtp2_match_single_process(ranks, overlap, regather):
    """The other three settings of tp overlap (issue 52, on by default) and of the backward re-gather (on
    by default; off keeps each region's gathered input): every one equals the single process."""
    layouts = ["tp4", "dp2xtp2"]
    per_rank = ranks(4).run(run_sequence_parallel, layouts, 2, overlap, regather, timeout_s=600)
    _check(per_rank, layouts)


def run_trajectory() -> dict | None:
    """3 AdamW steps in fp64 over tp layouts under a real Trainer (helpers.fit_and_compare), with the
    token shares the norms saw."""
    seen = []

    def watched(dtype=torch.float32):
        model = tiny_lm(dtype)
        seen.append(_watch_token_shares(model))
        return model

    orders = [["tp2xcp2", "dp4", "tp4", "dp2xtp2"], ["tp4", "dp2xtp2", "tp2xcp2", "dp4"],
              ["dp4", "tp2xcp2", "dp2xtp2", "tp4"]]
    result = fit_and_compare(orders[0], 3, "64-true", stage_orders=orders, make_model=watched)
    if result is not None:
        result["shares"] = sorted(set(seen[0]))
    return result


def test_three_step_fp64_trajectory_over_sequence_parallel_layouts_matches_single_process(ranks):
    result = ranks(4).run(run_trajectory, timeout_s=600)[0]
    assert result["global_step"] == 3
    assert result["shares"] == [1, 2, 4], result["shares"]  # dp4, tp2 layouts, tp4
    for step, errors in enumerate(result["grads"]):
        assert worst(errors)[1] <= 1e-10, (step, worst(errors))
    assert max(result["losses"]) <= 1e-12, result["losses"]
    assert worst(result["weights"])[1] <= 1e-9, worst(result["weights"])


def run_indivisible() -> str:
    """A hand-built micro-batch whose token count tp2 does not divide: the error names both."""
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.parallel.model import ParallelModel

    config = LlamaConfig.preset("tiny")
    module = LlamaFusedLoss(config)
    roles = param_roles(module, llama_tp_plan(config, 2, prefix="model."))
    world = WorldMesh(["tp2"])
    parallel = ParallelModel(module, roles, world)
    params = {n: nn.Parameter(p.detach().clone()) for n, p in module.named_parameters()}
    local = {n: nn.Parameter(p.detach().chunk(2, dim=0 if roles[n] in ("colwise", "vocab") else 1)[world.rank]
                             .clone()) if roles[n] in ("colwise", "vocab", "rowwise") else p
             for n, p in params.items()}
    parallel.activate(Layout.parse("tp2"), local)
    mb = pack_micro_batch([_docs()[0]])  # 45 tokens, built without tp_size
    try:
        with parallel.micro_batch(mb):
            module.training_step(mb)
    except LayoutError as err:
        return str(err)
    return "no error"


def test_a_micro_batch_tp_does_not_divide_is_refused_with_the_counts(ranks):
    for message in ranks(2).run(run_indivisible):
        assert "45 tokens on this rank are not divisible by tp=2" in message, message
        assert "pack_micro_batch(..., tp_size=2)" in message, message


def test_pack_pads_the_last_document_to_a_multiple_of_tp_on_every_cp_rank():
    docs = [torch.arange(1, 8), torch.arange(1, 7)]  # 13 tokens
    for cp in (1, 2):
        for tp in (1, 2, 3, 4):
            padded = [pack_micro_batch(docs, cp, rank, tp_size=tp) for rank in range(cp)]
            plain = [pack_micro_batch(docs, cp, rank) for rank in range(cp)]
            for mb, ref in zip(padded, plain):
                assert mb.input_ids.numel() % tp == 0, (cp, tp, mb.input_ids.numel())
                assert mb.input_ids.numel() - ref.input_ids.numel() < 2 * tp  # under 2*cp*tp in all
                assert mb.cu_seqlens[1] == ref.cu_seqlens[1]  # only the last document grows
            # the padding has no targets (under cp the last document's targets may move between ranks)
            assert sum(mb.num_target_tokens for mb in padded) == sum(mb.num_target_tokens for mb in plain) == 11
    with pytest.raises(Exception, match="tp_size must be a positive int, got 0"):
        pack_micro_batch(docs, tp_size=0)


class _NoEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = RMSNorm(8, 1e-5), nn.Linear(8, 16), nn.Linear(16, 8)


def test_a_sequence_parallel_plan_refuses_replicated_weights_and_needs_a_vocab_embedding():
    """'sequence' roles turn sequence parallelism on: a 'replicated' weight would then get one rank's
    partial gradient (named), and without a vocab embedding nothing splits the tokens."""
    config = LlamaConfig.preset("tiny")
    module = LlamaFusedLoss(config)
    roles = param_roles(module, llama_tp_plan(config, 2, prefix="model."))
    roles["model.norm.weight"] = "replicated"
    with pytest.raises(LayoutError, match=r"give \['model.norm.weight'\] the role 'sequence'"):
        install_tensor_parallel(module, roles, ParallelState())
    plain = _NoEmbedding()
    roles = {"norm.weight": "sequence", "up.weight": "colwise", "up.bias": "colwise", "down.weight": "rowwise",
             "down.bias": "sequence"}
    with pytest.raises(LayoutError, match="splits the tokens at a 'vocab' nn.Embedding, and the plan has none"):
        install_tensor_parallel(plain, roles, ParallelState())
