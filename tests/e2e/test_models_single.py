"""Single-process, fp32 tests of the Llama model, its attention backends, init and TP plan."""

from __future__ import annotations

import copy
import dataclasses
import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hotspa.models import (
    IGNORE_INDEX,
    Llama,
    LlamaConfig,
    LlamaLM,
    build_llama,
    check_tp_compatible,
    init_parameter,
    init_weights,
    llama_tp_plan,
    param_roles,
    position_ids_from_cu_seqlens,
    repeat_kv,
    sdpa_attention,
    select_attention_backend,
    shard_dim,
)

TINY = LlamaConfig.preset("tiny")


def _packed(lengths: list[int], seed: int = 0, vocab: int = 256) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "input_ids": torch.randint(0, vocab, (total,), generator=gen),
        "position_ids": position_ids_from_cu_seqlens(cu),
        "cu_seqlens": cu,
        "max_seqlen": max(lengths),
    }


@pytest.fixture(scope="module")
def tiny_model() -> Llama:
    return build_llama(TINY, seed=0).eval()


def _run(model: Llama, batch: dict[str, object]) -> Tensor:
    with torch.no_grad():
        return model(**batch)


# ---------------------------------------------------------------------------------------------
# Document masking and positions


def test_perturbing_one_document_leaves_the_others_unchanged(tiny_model: Llama) -> None:
    lengths = [6, 9, 7]
    batch = _packed(lengths)
    base = _run(tiny_model, batch)
    changed = dict(batch)
    ids = batch["input_ids"].clone()
    ids[6:15] = (ids[6:15] + 17) % 256  # every token of document 1
    changed["input_ids"] = ids
    out = _run(tiny_model, changed)
    torch.testing.assert_close(out[:6], base[:6], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[15:], base[15:], rtol=0, atol=1e-6)
    assert not torch.allclose(out[6:15], base[6:15])  # the perturbation did reach document 1


@pytest.mark.parametrize("lengths", [[5, 12, 8], [1, 3, 7, 13, 2], [17], [1, 1, 1]])
def test_packed_equals_each_document_alone(tiny_model: Llama, lengths: list[int]) -> None:
    batch = _packed(lengths, seed=len(lengths))
    packed = _run(tiny_model, batch)
    start = 0
    for length in lengths:
        alone = _packed([length])
        alone["input_ids"] = batch["input_ids"][start:start + length]
        torch.testing.assert_close(
            packed[start:start + length], _run(tiny_model, alone), rtol=1e-5, atol=1e-5
        )
        start += length


def test_position_ids_restart_at_every_document(tiny_model: Llama) -> None:
    cu = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)  # includes an empty document
    assert position_ids_from_cu_seqlens(cu).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    # The model must read position_ids: a different (non-shifted) numbering changes outputs.
    batch = _packed([9])
    base = _run(tiny_model, batch)
    shuffled = dict(batch, position_ids=torch.tensor([0, 2, 1, 3, 4, 5, 6, 8, 7]))
    assert not torch.allclose(_run(tiny_model, shuffled)[2:], base[2:], atol=1e-4)


def test_rotary_scores_depend_only_on_relative_position() -> None:
    from lightning_hotspa.models import apply_rotary, rotary_cos_sin

    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(m: int, n: int) -> float:
        cos, sin = rotary_cos_sin(torch.tensor([m, n]), 16, 10000.0, torch.float32)
        return float((apply_rotary(q, cos[:1], sin[:1]) * apply_rotary(k, cos[1:], sin[1:])).sum())

    assert score(5, 2) == pytest.approx(score(105, 102), rel=1e-4, abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


def test_empty_documents_and_bad_cu_seqlens(tiny_model: Llama) -> None:
    batch = _packed([4, 5])
    with_empty = dict(batch, cu_seqlens=torch.tensor([0, 4, 4, 9], dtype=torch.int32))
    torch.testing.assert_close(_run(tiny_model, with_empty), _run(tiny_model, batch))
    with pytest.raises(ValueError, match="cu_seqlens"):
        _run(tiny_model, dict(batch, cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32)))


# ---------------------------------------------------------------------------------------------
# Grouped-query attention and shard-agnostic forward


def test_gqa_equals_mha_with_repeated_kv_heads(tiny_model: Llama) -> None:
    mha_config = dataclasses.replace(TINY, n_kv_heads=TINY.n_heads)
    mha = build_llama(mha_config, seed=1).eval()
    group, hd = TINY.n_heads // TINY.n_kv_heads, TINY.head_dim
    state = {}
    for name, param in tiny_model.state_dict().items():
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            # [hkv * d, hidden] -> each kv head's rows repeated for its contiguous q-head group.
            param = param.view(-1, hd, param.shape[1]).repeat_interleave(group, dim=0)
            param = param.reshape(-1, param.shape[-1])
        state[name] = param
    mha.load_state_dict(state)
    batch = _packed([7, 10])
    torch.testing.assert_close(_run(mha, batch), _run(tiny_model, batch), rtol=1e-5, atol=1e-5)


def _shard(linear: nn.Linear, role: str, tp: int, rank: int) -> nn.Linear:
    dim = shard_dim(role)
    weight = linear.weight.detach()
    if dim is not None:
        weight = weight.chunk(tp, dim=dim)[rank]
    local = copy.deepcopy(linear)  # the same module type: w2 is a SwiGLUDown
    local.weight = nn.Parameter(weight.clone())
    return local


@pytest.mark.parametrize("config_kv,tp", [(2, 2), (2, 4), (1, 4), (4, 4)])
def test_block_forward_runs_unchanged_on_tp_shards(config_kv: int, tp: int) -> None:
    """Column/row-sharded attention and FFN, summed over ranks, equal the unsharded block."""
    config = dataclasses.replace(TINY, n_kv_heads=config_kv)
    model = build_llama(config, seed=3).eval()
    plan = llama_tp_plan(config, tp)
    roles = param_roles(model, plan)
    attn, ffn = model.layers[0].attention, model.layers[0].feed_forward
    batch = _packed([5, 11])
    x = torch.randn(16, config.hidden)
    cos, sin = _rope_tables(batch["position_ids"], config)
    args = (cos, sin, batch["cu_seqlens"], batch["max_seqlen"])
    with torch.no_grad():
        want_attn, want_ffn = attn(x, *args), ffn(x)
        got_attn = torch.zeros_like(want_attn)
        got_ffn = torch.zeros_like(want_ffn)
        for rank in range(tp):
            local = type(attn)(config)
            for proj in ("wq", "wk", "wv", "wo"):
                role = roles[f"layers.0.attention.{proj}.weight"]
                setattr(local, proj, _shard(getattr(attn, proj), role, tp, rank))
            if roles["layers.0.attention.wk.weight"] == "replicated_partial":
                head = rank // (tp // config.n_kv_heads)  # the kv head this rank's q heads use
                local.core_attention = _select_kv(head, head + 1)
            got_attn += local(x, *args)
            local_ffn = type(ffn)(config)
            for proj in ("w1", "w2", "w3"):
                role = roles[f"layers.0.feed_forward.{proj}.weight"]
                setattr(local_ffn, proj, _shard(getattr(ffn, proj), role, tp, rank))
            got_ffn += local_ffn(x)
    torch.testing.assert_close(got_attn, want_attn, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ffn, want_ffn, rtol=1e-5, atol=1e-5)


def _rope_tables(position_ids: Tensor, config: LlamaConfig) -> tuple[Tensor, Tensor]:
    from lightning_hotspa.models import rotary_cos_sin

    return rotary_cos_sin(position_ids, config.head_dim, config.rope_theta, torch.float32)


def _select_kv(start: int, stop: int):
    def core(q, k, v, cu_seqlens, max_seqlen):
        return sdpa_attention(q, k[:, start:stop], v[:, start:stop], cu_seqlens, max_seqlen)

    return core


def test_repeat_kv_groups_are_contiguous() -> None:
    kv = torch.arange(2).view(1, 2, 1).float()
    assert repeat_kv(kv, 6).flatten().tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="multiple"):
        repeat_kv(kv, 3)


# ---------------------------------------------------------------------------------------------
# Attention backends


def test_backend_selection() -> None:
    assert select_attention_backend("sdpa") is sdpa_attention
    with pytest.raises(ValueError, match="unknown attention backend 'flashy'"):
        select_attention_backend("flashy")
    with pytest.raises(ValueError, match="only on CUDA"):
        select_attention_backend("flash_varlen", device="cpu")
    assert "flash_attn" not in sys.modules  # never imported eagerly


def test_flash_varlen_backend_plumbing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flash path (lazy import, causal, varlen args) matches SDPA via a stand-in kernel."""
    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=False):
        calls.append((cu_q.dtype, max_q, max_k, causal))
        assert causal and torch.equal(cu_q, cu_k)
        return sdpa_attention(q, k, v, cu_q, max_q)

    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake_varlen)
    )
    from lightning_hotspa.models.attention import flash_varlen_attention

    q, k, v = torch.randn(12, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    cu = torch.tensor([0, 5, 12], dtype=torch.int64)
    out = flash_varlen_attention(q, k, v, cu, 7)
    torch.testing.assert_close(out, sdpa_attention(q, k, v, cu, 7))
    assert calls == [(torch.int32, 7, 7, True)]


def test_torch_varlen_backend_plumbing(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.attention.varlen as varlen

    from lightning_hotspa.models.attention import torch_varlen_attention

    def fake_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                    window_size=(-1, -1), enable_gqa=False):
        assert window_size == (-1, 0) and enable_gqa and cu_seq_q.dtype == torch.int32
        return sdpa_attention(query, key, value, cu_seq_q, max_q)

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu = torch.tensor([0, 2, 9])
    torch.testing.assert_close(torch_varlen_attention(q, k, v, cu, 7),
                               sdpa_attention(q, k, v, cu, 7))


def test_sdpa_backend_is_causal_within_documents() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 2, 8), torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out = sdpa_attention(q, k, v, cu, 6)
    k_full, v_full = repeat_kv(k, 2), repeat_kv(v, 2)
    scores = torch.einsum("thd,shd->hts", q, k_full) / 8**0.5
    doc = torch.tensor([0] * 4 + [1] * 6)
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(10, 10, dtype=torch.bool).tril()
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, torch.einsum("hts,shd->thd", probs, v_full))


def _grad_fn_names(t: Tensor) -> set[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or type(fn).__name__ in seen:
            continue
        seen.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_backend_takes_the_memory_bounded_cpu_flash_kernel(dtype: torch.dtype) -> None:
    """3-D inputs fall back to the math kernel (s x s scores in memory): the backend must not."""
    q = torch.randn(12, 4, 16, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(12, 2, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    out = sdpa_attention(q, k, v, torch.tensor([0, 5, 12]), 7)
    names = _grad_fn_names(out)
    assert "ScaledDotProductFlashAttentionForCpuBackward0" in names, sorted(names)


# ---------------------------------------------------------------------------------------------
# Activation checkpointing


def test_activation_checkpointing_gives_identical_gradients() -> None:
    batch = _packed([6, 10, 3])
    grads, block_calls = {}, {}
    for enabled in (False, True):
        model = build_llama(TINY, seed=5)
        model.set_activation_checkpointing(enabled)
        count = [0]
        model.layers[0].register_forward_pre_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        model(**batch).square().mean().backward()
        grads[enabled] = {n: p.grad.clone() for n, p in model.named_parameters()}
        block_calls[enabled] = count[0]
    assert block_calls == {False: 1, True: 2}  # checkpointing really recomputes the block
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------
# Initialization and construction


def test_seeded_init_is_reproducible_and_per_parameter() -> None:
    a, b = build_llama(TINY, seed=7), build_llama(TINY, seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    c = build_llama(TINY, seed=8)
    assert not torch.equal(a.output.weight, c.output.weight)
    # Same shape, different names -> different values.
    assert not torch.equal(a.layers[0].attention.wq.weight, a.layers[1].attention.wq.weight)
    # One parameter in isolation equals its value inside the model, whatever else exists.
    name = "layers.1.feed_forward.w1.weight"
    alone = init_parameter(name, (TINY.ffn_hidden, TINY.hidden), 7, n_layers=TINY.n_layers)
    assert torch.equal(alone, a.get_parameter(name))
    deeper = build_llama(dataclasses.replace(TINY, n_layers=3), seed=7)
    assert torch.equal(deeper.get_parameter(name), alone)
    # Scales: norms are ones, residual outputs shrink by 1/sqrt(2 n_layers).
    assert torch.equal(a.norm.weight, torch.ones(TINY.hidden))
    wo_std = float(a.layers[0].attention.wo.weight.detach().std())
    assert abs(wo_std - 0.02 / (2 * TINY.n_layers) ** 0.5) < 0.002
    assert abs(float(a.tok_embeddings.weight.detach().std()) - 0.02) < 0.002


@pytest.mark.parametrize("name,shape", [("layers.0.feed_forward.w1.weight", (176, 130)),
                                        ("layers.0.attention.wo.weight", (70, 200)),
                                        ("norm.weight", (64,)), ("layers.1.x.weight", (3, 5, 70))])
def test_tiled_init_any_slice_equals_that_slice_of_the_full_parameter(name, shape) -> None:
    """Each rank generates only its shard: every slice, tile-aligned or not, matches the full value."""
    full = init_parameter(name, shape, 3, n_layers=2)
    assert full.shape == shape
    for dim in range(len(shape)):
        n = shape[dim]
        for start, stop in [(0, n), (0, 1), (n // 3, n // 2), (63 % n, min(n, 129)), (n - 1, n), (2, 2)]:
            part = init_parameter(name, shape, 3, n_layers=2, dim=dim, start=start, stop=stop)
            assert torch.equal(part, full.narrow(dim, start, stop - start)), (dim, start, stop)
    with pytest.raises(ValueError, match=r"slice \[0, 999\) out of range"):
        init_parameter(name, shape, 3, n_layers=2, dim=0, start=0, stop=999)


def test_init_weights_materializes_meta_model() -> None:
    with torch.device("meta"):
        model = Llama(TINY)
    init_weights(model, seed=7)
    reference = build_llama(TINY, seed=7)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert not p.is_meta and torch.equal(p, ref), name


def test_meta_device_7b_allocates_nothing() -> None:
    config = LlamaConfig.preset("llama7b")
    with torch.device("meta"):
        model = Llama(config)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == config.num_params()


def test_preset_sizes() -> None:
    def count(name: str) -> int:
        return LlamaConfig.preset(name).num_params()

    assert 6.5e9 < count("llama7b") < 7.0e9
    assert 12.5e9 < count("llama13b") < 13.5e9
    assert 30e9 < count("llama30b") < 34e9
    assert 0.9e9 < count("1b") < 1.3e9
    assert 8e6 < count("small") < 12e6
    assert LlamaConfig.preset("tiny").padded_vocab_size == 320
    assert LlamaConfig.preset("llama7b").padded_vocab_size == 32000
    assert LlamaConfig.preset("llama3-8b").padded_vocab_size == 128256
    assert LlamaConfig.preset("artifact-llama7b").padded_vocab_size == 30592
    assert TINY.num_params() == sum(p.numel() for p in build_llama(TINY, 0).parameters())
    # Attention makes long documents dearer per token; the dense part is 6 x matmul params.
    c = LlamaConfig.preset("llama7b")
    assert c.flops_per_token(32768) > c.flops_per_token(1024) > 6 * 6.4e9


# ---------------------------------------------------------------------------------------------
# LightningModule and loss


@dataclass
class _MicroBatch:
    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    num_target_tokens: int


def _micro_batch(lengths: list[int], seed: int = 0) -> _MicroBatch:
    batch = _packed(lengths, seed=seed)
    ids = batch["input_ids"]
    labels = torch.full_like(ids, IGNORE_INDEX)
    start = 0
    for length in lengths:  # shift inside each document; the last token has no target
        labels[start:start + length - 1] = ids[start + 1:start + length]
        start += length
    return _MicroBatch(labels=labels, num_target_tokens=int((labels != -100).sum()), **batch)


def test_loss_ignores_masked_positions() -> None:
    lm = LlamaLM("tiny", seed=0)
    mb = _micro_batch([5, 8])
    loss = lm.training_step(mb, 0)
    logits = lm.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
    keep = mb.labels != IGNORE_INDEX
    torch.testing.assert_close(loss, F.cross_entropy(logits[keep], mb.labels[keep]))
    # Changing what sits under -100 positions' tokens' labels changes nothing.
    mb.labels[3] = IGNORE_INDEX
    mb.num_target_tokens -= 1
    keep = mb.labels != IGNORE_INDEX
    torch.testing.assert_close(
        lm.training_step(mb, 0), F.cross_entropy(logits[keep], mb.labels[keep])
    )


def test_loss_without_targets_is_zero_with_a_graph() -> None:
    lm = LlamaLM("tiny", seed=0)
    mb = _micro_batch([4])
    mb.labels.fill_(IGNORE_INDEX)
    mb.num_target_tokens = 0
    loss = lm.training_step(mb, 0)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert all(float(p.grad.abs().sum()) == 0.0 for p in lm.parameters())


def test_lightning_module_optimizer_and_tp_hooks() -> None:
    lm = LlamaLM("tiny", seed=3, lr=1e-3, warmup_steps=2, max_steps=10)
    conf = lm.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert lrs[-1] < lrs[2]
    name = "model.layers.0.attention.wo.weight"
    assert torch.equal(lm.init_parameter(name), lm.get_parameter(name))
    assert set(param_roles(lm, lm.tp_plan(2)).values()) >= {"colwise", "rowwise", "vocab"}
    with torch.device("meta"):
        meta_lm = LlamaLM("tiny", seed=3)
    assert all(p.is_meta for p in meta_lm.parameters())


def test_trainer_fit_smoke() -> None:
    import lightning as L

    batches = [_micro_batch([7, 9, 4], seed=i) for i in range(3)]
    lm = LlamaLM("tiny", seed=0, lr=1e-2, warmup_steps=1, max_steps=3)
    def loss() -> float:
        mb = batches[0]
        with torch.no_grad():
            logits = lm(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
        return float(lm.loss_fn(logits, mb.labels))

    before = loss()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(lm, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == 3
    assert "train/loss" in trainer.callback_metrics
    assert loss() < before


# ---------------------------------------------------------------------------------------------
# Tensor-parallel plan


def test_tp_plan_roles() -> None:
    model = build_llama(TINY, seed=0)
    roles2 = param_roles(model, llama_tp_plan(TINY, 2))
    assert len(roles2) == len(list(model.parameters()))
    assert roles2["layers.1.attention.wk.weight"] == "colwise"
    assert roles2["tok_embeddings.weight"] == "vocab"
    assert roles2["output.weight"] == "vocab"  # LM head: vocab-sharded logits
    assert roles2["layers.0.feed_forward.w2.weight"] == "rowwise"
    assert roles2["norm.weight"] == roles2["layers.0.ffn_norm.weight"] == "sequence"  # sequence parallel
    roles4 = param_roles(model, llama_tp_plan(TINY, 4))  # 2 kv heads < tp 4
    assert roles4["layers.0.attention.wv.weight"] == "replicated_partial"


def test_tp_plan_errors() -> None:
    model = build_llama(TINY, seed=0)
    plan = llama_tp_plan(TINY, 2)
    missing = {k: v for k, v in plan.items() if k != "norm"}
    with pytest.raises(ValueError, match=r"no tp-plan pattern matches .*'norm.weight'"):
        param_roles(model, missing)
    with pytest.raises(ValueError, match="conflicting"):
        param_roles(model, {**plan, "*.w1": "rowwise"})
    with pytest.raises(ValueError, match="unknown tensor-parallel role 'diagonal'"):
        param_roles(model, {**plan, "norm": "diagonal"})
    with pytest.raises(ValueError, match="tp=3 does not divide n_heads=4"):
        check_tp_compatible(TINY, 3)
    with pytest.raises(ValueError, match="ffn_hidden=100"):
        check_tp_compatible(dataclasses.replace(TINY, ffn_hidden=100, n_heads=8, n_kv_heads=8), 8)
    with pytest.raises(ValueError, match="tp=8 does not divide padded_vocab_size=260"):
        check_tp_compatible(
            dataclasses.replace(TINY, vocab_multiple=4, n_heads=8, n_kv_heads=8), 8
        )
    with pytest.raises(ValueError, match="tp=4 and n_kv_heads=3"):
        check_tp_compatible(dataclasses.replace(TINY, hidden=96, n_heads=12, n_kv_heads=3), 4)


# ---------------------------------------------------------------------------------------------
# Config validation


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"hidden": -64}, "hidden must be a positive int, got -64"),
        ({"n_layers": 0}, "n_layers must be a positive int, got 0"),
        ({"vocab_size": 2.5}, "vocab_size must be a positive int, got 2.5"),
        ({"norm_eps": 0.0}, "norm_eps must be a positive number, got 0.0"),
        ({"n_heads": 5}, "hidden=64 is not divisible by n_heads=5"),
        ({"n_kv_heads": 3}, "n_kv_heads=3 does not divide n_heads=4"),
        ({"hidden": 12, "n_heads": 4}, "head_dim=3"),
    ],
)
def test_bad_config_values_are_named(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaConfig.preset("tiny", **overrides)


def test_unknown_preset_lists_the_names() -> None:
    with pytest.raises(ValueError, match=r"unknown LlamaConfig preset 'huge'.*llama7b"):
        LlamaConfig.preset("huge")
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.hidden = 32  # type: ignore[misc]
