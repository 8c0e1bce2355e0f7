"""Tensor + context parallel compute path vs the single-process model (docs/DESIGN.md §3).

For every layout the forward loss and every parameter gradient (reduced by the switch engine into
the home store, compared as full tensors) must equal the single-process model's on the same global
micro-batch set with a token-mean loss: per tensor ||ours - ref|| / ||ref|| <= 1e-5 in fp32. Two
models: the tiny Llama (GQA with 2 kv heads, so tp4 needs replicated_partial kv) with a
vocab-parallel loss, and a GPT-style model with biases, fused QKV and a gathered LM head, written
here with its own plan. All layouts run in ONE pool call (spawning ranks dominates on 2 cores).
"""

from __future__ import annotations

import time
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import LlamaFusedLoss, LlamaLoss, dealt_stage, home_grad_errors, single_process_reference
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters
from lightning_hotspa.layout import Layout, LayoutError
from lightning_hotspa.mesh import LayoutGroups, RankGroup, WorldMesh
from lightning_hotspa.models import LlamaConfig, param_roles
from lightning_hotspa.models.attention import sdpa_attention
from lightning_hotspa.parallel.collectives import (
    all_to_all_heads_to_tokens,
    all_to_all_tokens_to_heads,
    gather_last_dim,
)
from lightning_hotspa.parallel.context_parallel import install_context_parallel
from lightning_hotspa.parallel.core_attention import ParallelCoreAttention, kv_head_range
from lightning_hotspa.parallel.model import ParallelModel
from lightning_hotspa.parallel.state import ParallelState
from lightning_hotspa.parallel.tensor_parallel import (
    TPForward,
    install_tensor_parallel,
    module_kinds,
)
from lightning_hotspa.placements import build_shardings
from lightning_hotspa.plan import Stage, StepPlan, pack_micro_batch, slice_plan
from lightning_hotspa.shard_rows import all_gather_rows, reduce_scatter_rows

# Ulysses (cp4), all-gather-KV (":kv", the tiny Llama's 2 kv heads are fewer than cp=4) and the
# hybrid (cp4:kv2: Ulysses over 2, KV gather over 2)
LAYOUTS = ["dp4", "dp2xtp2", "tp4", "dp2xcp2", "tp2xcp2", "cp4", "cp4:kv", "tp2xcp2:kv", "cp4:kv2"]
DOC_LENGTHS = [45, 7, 130, 19, 64, 3, 88, 33]  # odd lengths, one shorter than 2*cp, one long
TOLERANCE = 1e-5
TINY = LlamaConfig.preset("tiny")


# ----------------------------------------------------------------------------------- the models


class GPTAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)  # rows grouped per head: [q k v] of head 0, ...
        self.proj = nn.Linear(hidden, hidden)
        self.core_attention = sdpa_attention

    def forward(self, x, cu_seqlens, max_seqlen):
        q, k, v = self.qkv(x).view(x.shape[0], -1, 3, self.head_dim).unbind(2)
        return self.proj(self.core_attention(q, k, v, cu_seqlens, max_seqlen).reshape(x.shape[0], -1))


class GPTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = GPTAttention(hidden, heads)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x, cu_seqlens, max_seqlen):
        x = x + self.attn(self.ln1(x), cu_seqlens, max_seqlen)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Not a Llama: learned positions, LayerNorm, biases everywhere, fused QKV, GELU, no loss_fn."""

    VOCAB = 96

    def __init__(self, hidden: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.tok, self.pos = nn.Embedding(self.VOCAB, hidden), nn.Embedding(256, hidden)
        self.blocks = nn.ModuleList(GPTBlock(hidden, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, self.VOCAB)
        for p in self.parameters():  # LayerNorm starts at 1 / 0: make every tensor asymmetric
            nn.init.normal_(p, 0.0 if p.dim() > 1 else 0.5, 0.2)
        self.checkpointing = False

    def set_activation_checkpointing(self, enabled: bool) -> None:
        self.checkpointing = enabled

    def training_step(self, mb):
        x = self.tok(mb.input_ids) + self.pos(mb.position_ids)
        for block in self.blocks:
            if self.checkpointing:
                x = checkpoint(block, x, mb.cu_seqlens, mb.max_seqlen, use_reentrant=False)
            else:
                x = block(x, mb.cu_seqlens, mb.max_seqlen)
        logits = self.head(self.ln_f(x))
        targets = (mb.labels != -100).sum().clamp(min=1)
        return F.cross_entropy(logits, mb.labels, ignore_index=-100, reduction="sum") / targets

    @staticmethod
    def plan() -> dict[str, str]:
        return {
            "tok": "vocab", "pos": "replicated", "blocks.*.ln*": "replicated", "ln_f": "replicated",
            "blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj.weight": "rowwise",
            "blocks.*.attn.proj.bias": "replicated", "blocks.*.fc1": "colwise",
            "blocks.*.fc2.weight": "rowwise", "blocks.*.fc2.bias": "replicated",
            "head": "vocab",  # colwise with its output gathered
        }


MODELS = {"llama": (lambda: LlamaLoss(TINY), LlamaLoss.plan, 256),
          "llama_fused": (lambda: LlamaFusedLoss(TINY), LlamaLoss.plan, 256),
          "gpt": (TinyGPT, TinyGPT.plan, TinyGPT.VOCAB)}
# GQA with 2 kv heads (fewer than cp=4) and a sliding window shorter than 5 of the 8 documents
TINY_WINDOW = LlamaConfig.preset("tiny", sliding_window=16)
WINDOW_MODELS = {"llama-window": (lambda: LlamaLoss(TINY_WINDOW), lambda: LlamaLoss.plan(TINY_WINDOW), 256)}
CP_KINDS = ["cp4", "cp4:kv", "cp4:kv2", "tp2xcp2:kv"]  # Ulysses, all-gather-KV, hybrid, KV under tp


def _docs(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(b"docs"))
    return [torch.randint(0, vocab, (n,), generator=g) for n in DOC_LENGTHS]


# ----------------------------------------------------------------------------------- the runner


def _cases(layouts: list[str], selective: bool = False) -> dict[str, tuple[Stage, ...]]:
    everything = list(range(len(DOC_LENGTHS)))
    if selective:  # each layout's stage recomputing the attention core; one step mixing every mode
        cases = {name + "+sac": (dealt_stage(name, everything, "selective"),) for name in layouts}
        modes = ("selective", "full", "none")
        cases["mixed"] = tuple(dealt_stage(name, everything[i::len(layouts)], modes[i % 3])
                               for i, name in enumerate(layouts))
        first = layouts[0]  # one layout split: selective for some documents, plain for the rest
        cases["split"] = (dealt_stage(first, everything[::2], "selective"), dealt_stage(first, everything[1::2]))
        return cases
    cases = {name: (dealt_stage(name, everything),) for name in layouts}
    for name in ("dp2xtp2", "tp2xcp2", "cp4", "cp4:kv2"):
        if name in layouts:
            cases[name + "+ac"] = (dealt_stage(name, everything, checkpointing=True),)
    if len(layouts) > 1:  # one step over all layouts: each stage a share of the documents
        cases["multi-stage"] = tuple(dealt_stage(name, everything[i::len(layouts)]) for i, name in enumerate(layouts))
    return cases


def _fingerprint(module: nn.Module) -> list[tuple]:
    """What installing wraps: forwards, hooks and attention cores (identity, not just count)."""
    return [(name, id(m.__dict__.get("forward")), len(m._forward_hooks), len(m._forward_pre_hooks),
             id(getattr(m, "core_attention", None))) for name, m in module.named_modules()]


def run_equivalence(model_key: str, layouts: list[str], tolerance_probe: bool = False, selective: bool = False) -> dict:
    """On every rank: each case's loss and max per-tensor gradient error vs single process
    (``selective``: the selective-checkpointing cases of :func:`_cases`)."""
    build, plan_fn, vocab = (MODELS | WINDOW_MODELS)[model_key]
    docs = _docs(vocab)
    ref_loss, init, ref_grads = single_process_reference(build, docs)
    world = WorldMesh(layouts)
    module = build()
    roles = param_roles(module, plan_fn())
    shardings = build_shardings({n: tuple(p.shape) for n, p in module.named_parameters()}, roles, world.shape)
    home = build_home_parameters(world, shardings, lambda name, shape: init[name])
    parallel = ParallelModel(module, roles, world)
    parallel.restore(home)
    engine = SwitchEngine(world, shardings, home)
    before, switches = _fingerprint(module), 0
    results, seconds = {}, {"run": 0.0, "compare": 0.0}
    for case, stages in _cases(layouts, selective).items():
        start, modes = time.perf_counter(), []
        plan = StepPlan(0, tuple(DOC_LENGTHS), stages)
        mine = slice_plan(plan, docs, world.shape, world.rank)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for stage in mine.stages:
            if engine.active is None:
                engine.materialize(stage.layout)
            else:
                engine.switch(stage.layout)
            switches += 1
            parallel.activate(stage.layout, engine.working, stage.activation_checkpointing)
            modes.append(str(getattr(getattr(module, "model", None), "activation_checkpointing", None)))
            for mb in stage.micro_batches:
                with parallel.micro_batch(mb):
                    loss = module.training_step(mb)
                scaled = loss * (mb.num_target_tokens / plan.global_target_tokens)
                scaled.backward()  # outside the micro-batch context, as the strategy does
                if parallel.state.groups.tp.index == 0:  # tp ranks hold copies of one loss
                    loss_sum += float(scaled.detach())
            engine.reduce_gradients()
        seconds["run"] += time.perf_counter() - start
        start = time.perf_counter()
        errors = home_grad_errors(parallel, engine, home, loss_sum, ref_grads)  # the all-reduce counts here
        seconds["compare"] += time.perf_counter() - start
        worst = max(errors, key=errors.get)
        results[case] = {"loss_err": abs(float(loss_sum) - ref_loss) / abs(ref_loss),
                         "max_grad_err": errors[worst], "worst": worst, "modes": modes}
    return {"cases": results, "seconds": seconds, "switches": switches, "rewrapped": _fingerprint(module) != before,
            "hooks": parallel.hooks, "tp_forwards": sum(isinstance(m.__dict__.get("forward"), TPForward)
                                                        for m in module.modules())}


def run_collectives_order() -> dict:
    """tp4 / cp4 groups are NOT in shard order on a 2x2 mesh: gathers and all-to-alls must map."""
    world = WorldMesh(LAYOUTS)
    group = world.layout_groups(Layout.parse("tp4")).tp
    mine = torch.full((2, 3), float(group.index))
    gathered = gather_last_dim(mine, group)
    heads = torch.arange(8.0).repeat(2, 1).unsqueeze(-1) + 100 * group.index  # [T=2, H=8, 1]
    tokens = all_to_all_heads_to_tokens(heads, group)  # [8, 2, 1]: shard s's tokens at rows 2s
    back = all_to_all_tokens_to_heads(tokens, group)
    # the row collectives (sequence parallelism, the KV gather; gloo: an all-to-all of n copies), with
    # shards of one row (whose copies a reshape would leave a non-contiguous view) and of three
    rows = {}
    for n in (1, 3):
        shard = torch.arange(n * 2.0).view(n, 2) + 100 * group.index
        full = all_gather_rows(shard, group)
        rows[n] = {"sources": (full[:, 0] // 100).tolist(),
                   "scattered": reduce_scatter_rows(full, group).tolist() == (4 * shard).tolist()}
    return {"in_shard_order": group.in_shard_order, "gathered": gathered[0].tolist(),
            "token_sources": (tokens[:, 0, 0] // 100).tolist(), "head_block": (tokens[0, :, 0] % 100).tolist(),
            "roundtrip": torch.equal(back, heads), "rows": rows}


def run_cp_errors() -> list[str]:
    """A micro-batch not packed for the layout's cp fails clearly on every rank, before the all-to-all."""
    world = WorldMesh(LAYOUTS)
    module = TinyGPT()
    roles = param_roles(module, TinyGPT.plan())
    parallel = ParallelModel(module, roles, world)
    params = {n: nn.Parameter(p.detach().clone()) for n, p in module.named_parameters()}
    parallel.activate(Layout.parse("dp2xcp2"), params)
    messages = []
    for cp_size in (1, 4):
        mb = pack_micro_batch(_docs(TinyGPT.VOCAB)[:2], cp_size=cp_size, cp_rank=0)
        try:
            with parallel.micro_batch(mb):
                module.training_step(mb)
        except LayoutError as err:
            messages.append(str(err))
    dist.barrier()
    return messages


# ----------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def equivalence(ranks):
    pool = ranks(4)
    return {key: pool.run(run_equivalence, key, LAYOUTS, timeout_s=300) for key in MODELS}


SELECTIVE_LAYOUTS = ["dp2", "tp2", "cp2", "cp2:kv"]  # 2 ranks: data, tensor, Ulysses and KV-gather cp


@pytest.mark.parametrize("model_key", ["llama", "llama_fused"])
def test_selective_checkpointing_matches_single_process(ranks, model_key):
    """The invariant with selective checkpointing (attention core recomputed): each layout alone, a step
    mixing selective / full / none, a layout split selective + plain; 2 gloo ranks, 1e-5 (fp32)."""
    per_rank = ranks(2).run(run_equivalence, model_key, SELECTIVE_LAYOUTS, False, True, timeout_s=300)
    cases = per_rank[0]["cases"]
    assert set(cases) == {x + "+sac" for x in SELECTIVE_LAYOUTS} | {"mixed", "split"}
    assert cases["mixed"]["modes"] == ["selective", "full", "none", "selective"] and cases["split"]["modes"] == [
        "selective", "none"] and all(cases[x + "+sac"]["modes"] == ["selective"] for x in SELECTIVE_LAYOUTS)
    _every_case_within_tolerance(per_rank, model_key)


def _every_case_within_tolerance(per_rank, model_key):
    for rank_result in per_rank:
        for case, r in rank_result["cases"].items():
            assert r["loss_err"] <= TOLERANCE, (model_key, case, r)
            assert r["max_grad_err"] <= TOLERANCE, (model_key, case, r)


@pytest.mark.parametrize("model_key", list(MODELS))
def test_every_layout_matches_single_process(equivalence, model_key):
    per_rank = equivalence[model_key]
    cases = per_rank[0]["cases"]
    assert set(cases) >= set(LAYOUTS) | {"multi-stage", "dp2xtp2+ac", "tp2xcp2+ac", "cp4+ac", "cp4:kv2+ac"}
    _every_case_within_tolerance(per_rank, model_key)


@pytest.mark.parametrize("model_key", list(MODELS))
def test_switching_rewraps_nothing(equivalence, model_key):
    for rank_result in equivalence[model_key]:
        assert rank_result["switches"] >= 10
        assert not rank_result["rewrapped"]
    # llama: 2 layers x 7 linears + embedding + head = 16 forwards, 2 kv selections, 1 loss;
    # + 2 attention cores for cp
    expected = {"llama": (16 + 2 + 1 + 2, 16), "llama_fused": (16 + 2 + 1 + 2, 16),
                "gpt": (2 * 4 + 2 + 2, 2 * 4 + 2)}[model_key]
    assert (equivalence[model_key][0]["hooks"], equivalence[model_key][0]["tp_forwards"]) == expected


def test_sliding_window_matches_single_process_on_every_cp_kind(ranks):
    """The window reaches every cp kind's attention (all-gather-KV once dropped it silently)."""
    for rank_result in ranks(4).run(run_equivalence, "llama-window", CP_KINDS, timeout_s=600):
        assert set(rank_result["cases"]) >= set(CP_KINDS) | {"multi-stage", "cp4+ac", "cp4:kv2+ac"}
        for case, r in rank_result["cases"].items():
            assert r["loss_err"] <= TOLERANCE and r["max_grad_err"] <= TOLERANCE, (case, r)


def test_single_rank_world_matches(tmp_path):
    """The "1 rank" layout: the same machinery in this process on a world of one (no hooks)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        result = run_equivalence("llama", ["dp1"])
    finally:
        dist.destroy_process_group()
    assert result["hooks"] == 0
    assert result["cases"]["dp1"]["max_grad_err"] <= TOLERANCE
    assert result["cases"]["dp1"]["loss_err"] <= TOLERANCE


def test_collectives_map_slots_to_shards(ranks):
    results = ranks(4).run(run_collectives_order)
    for shard_of_rank, r in zip((0, 2, 1, 3), results, strict=True):
        assert not r["in_shard_order"]
        assert r["gathered"] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0]
        assert r["token_sources"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
        assert r["head_block"] == [2.0 * shard_of_rank, 2.0 * shard_of_rank + 1]
        for n, got in r["rows"].items():  # every member's rows in shard order; the sum of block `index`
            assert got["sources"] == [float(s) for s in range(4) for _ in range(n)], (n, got)
            assert got["scattered"], n
        assert r["roundtrip"]


def test_cp_rejects_micro_batch_packed_for_another_cp(ranks):
    for messages in ranks(4).run(run_cp_errors):
        assert len(messages) == 2
        assert all("sliced for cp_size" in m for m in messages), messages


# --------------------------------------------------------------- install / activate time errors
def _groups(tp: int, cp: int) -> LayoutGroups:
    def group(n: int) -> RankGroup:
        return RankGroup((), tuple(range(n)), 0, None)

    return LayoutGroups(Layout(tp=tp, cp=cp), tp=group(tp), cp=group(cp), dp=group(1))


def test_kv_head_range_matches_the_llama_plan():
    """tp rank r needs kv heads [r*kv/tp, (r+1)*kv/tp) if tp divides them, else head r // (tp/kv)."""
    for config in (TINY, LlamaConfig.preset("small"), LlamaConfig.preset("1b")):
        q, kv = config.n_heads, config.n_kv_heads
        for tp in (1, 2, 4, 8):
            if q % tp:
                continue
            for r in range(tp):
                if kv % tp == 0:
                    expected = (r * kv // tp, (r + 1) * kv // tp)
                else:
                    expected = (r // (tp // kv), r // (tp // kv) + 1)
                assert kv_head_range(q, kv, tp, r) == expected, (config, tp, r)


def test_layout_that_cannot_split_heads_fails_at_activate():
    wrapper = ParallelCoreAttention(sdpa_attention, ParallelState(), "layers.0.attention")
    wrapper.context_parallel = wrapper.select_kv = True
    wrapper.heads = (4, 2)
    wrapper.validate(_groups(2, 2))  # fine
    with pytest.raises(LayoutError, match="tp=8 does not divide the 4 query heads"):
        wrapper.validate(_groups(8, 1))
    with pytest.raises(LayoutError, match="cp=4 does not divide the 2 query heads"):
        wrapper.validate(_groups(2, 4))
    wrapper.select_kv = False
    with pytest.raises(LayoutError, match="replicated_partial"):
        wrapper.validate(_groups(4, 1))
    with pytest.raises(LayoutError, match="straddle"):
        kv_head_range(12, 2, 3, 0)  # 4 query heads per rank, 6 per kv head
    assert kv_head_range(6, 3, 3, 1) == (1, 2)


def test_plan_errors_name_the_parameter():
    gpt = TinyGPT()
    good = param_roles(gpt, TinyGPT.plan())
    assert module_kinds(gpt, good)["head"] == "gather"
    bad_bias = {**good, "blocks.0.fc2.bias": "rowwise"}
    with pytest.raises(LayoutError, match="blocks.0.fc2: a 'rowwise' weight needs its bias"):
        module_kinds(gpt, bad_bias)
    with pytest.raises(LayoutError, match="pos: an nn.Embedding supports"):
        module_kinds(gpt, {**good, "pos.weight": "colwise"})
    with pytest.raises(LayoutError, match="LayerNorm holds parameters"):
        module_kinds(gpt, {**good, "ln_f.weight": "colwise"})
    class ScaledLinear(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    gpt.blocks[0].fc1 = ScaledLinear(32, 128)
    with pytest.raises(LayoutError, match="blocks.0.fc1: ScaledLinear overrides Linear.forward"):
        module_kinds(gpt, good)
    gpt.blocks[0].fc1 = nn.Linear(32, 128)
    with pytest.raises(LayoutError, match="miss parameters"):
        module_kinds(gpt, {k: v for k, v in good.items() if k != "head.bias"})
    with pytest.raises(LayoutError, match="loss_parallel needs"):
        install_tensor_parallel(gpt, good, ParallelState(), loss_parallel=True)
    with pytest.raises(LayoutError, match="core_attention"):
        install_context_parallel(nn.Sequential(nn.Linear(4, 4)), ParallelState())
