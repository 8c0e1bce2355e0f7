"""Per-block torch.compile (``compile_blocks``): one graph per block across document lengths, no graph
break, compiled equals eager (aot_eager, and inductor on CPU in one tiny case), recompile-limit hits
counted. The switching checks across layouts: tests/e2e/test_recipe_smoke_benchmark_compile.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_hotspa.adapter.lightning.compile_blocks import (
    check_compile_spec,
    compile_blocks,
    compile_counts,
    graphs_needed,
)
from lightning_hotspa.models import LlamaConfig
from lightning_hotspa.models.llama import Block
from lightning_hotspa.models.rope import position_ids_from_cu_seqlens, rotary_cos_sin

ROOT = Path(__file__).resolve().parents[2]
#: document-length mixes: one long document, many short ones, empty-free mixes of new lengths; the first has as many
#: tokens as the tiny model's head dim (16): with duck shaping the two shared a symbol and the first graph specialized
MIXES = ([16], [5, 7], [3, 9, 4], [2, 2, 2, 2, 2], [11, 1, 6])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch.fx.experimental._config as fx_config
    from torch._dynamo.utils import counters

    # compile_blocks sets these process-wide: restored after each test (torch's config modules, not monkeypatch)
    dynamo = torch._dynamo.config
    saved = (fx_config.backed_size_oblivious, fx_config.use_duck_shape, dynamo.recompile_limit,
             dynamo.accumulated_recompile_limit)
    side_effects = getattr(dynamo, "skip_fwd_side_effects_in_bwd_under_checkpoint", None)  # not in every torch
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    (fx_config.backed_size_oblivious, fx_config.use_duck_shape, dynamo.recompile_limit,
     dynamo.accumulated_recompile_limit) = saved
    if side_effects is not None:
        dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint = side_effects


def _inputs(config: LlamaConfig, lengths: list[int]):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(sum(lengths))
    x = torch.randn(int(cu[-1]), config.hidden, generator=g)
    cos, sin = rotary_cos_sin(position_ids_from_cu_seqlens(cu), config.head_dim, config.rope_theta, x.dtype)
    return x, cos, sin, cu, max(lengths)


def _compiled_vs_eager(backend: str, mixes, modes=("none",), **config) -> tuple[float, dict[str, int]]:
    """The worst relative error of a compiled block's output, input and weight gradients against the
    same block eager, over the length mixes and checkpointing ``modes`` ("none", "selective": the attention
    core recomputed, "full": the block under non-reentrant checkpointing, as the model runs them); and the
    dynamo counts. Compiled as the strategy compiles (``compile_blocks``: the token dim dynamic, sizes 0 / 1
    not specialized)."""
    cfg = LlamaConfig.preset("tiny", **config)
    torch.manual_seed(0)
    compiled, eager = Block(cfg), Block(cfg)
    eager.load_state_dict(compiled.state_dict())
    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([compiled])
    compile_blocks(holder, check_compile_spec({"backend": backend}))
    worst = 0.0
    for mode, lengths in itertools.product(modes, mixes):
        x, *rest = _inputs(cfg, lengths)
        pairs = []
        for block in (compiled, eager):
            xi = x.clone().requires_grad_()
            if mode == "full":
                out = checkpoint(block, xi, *rest, use_reentrant=False)
            else:
                out = block(xi, *rest, mode == "selective")
            out.square().sum().backward()
            pairs.append([out.detach(), xi.grad, *(p.grad for p in block.parameters())])
            block.zero_grad()
        worst = max(worst, *(float((a - b).norm() / b.norm()) for a, b in zip(*pairs, strict=True)))
    return worst, compile_counts()


def test_one_graph_across_document_lengths_no_break_equal_to_eager():
    # GQA (4 q / 2 kv heads) and a sliding window shorter than some documents: both paths of the op
    worst, counts = _compiled_vs_eager("aot_eager", MIXES, sliding_window=4)
    assert counts["compiled_graphs"] == 1, counts  # 5 mixes of lengths, one graph: the token dim is dynamic
    assert counts["graph_breaks"] == 0 and counts["skipped_frames"] == 0, counts
    assert worst <= 1e-6, worst


def test_inductor_block_equals_eager_on_cpu(monkeypatch):
    # the cache in a repo-ignored folder: the C++ build runs once per machine, later runs take seconds
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".hotspa_cache" / "inductor"))
    worst, counts = _compiled_vs_eager("inductor", MIXES[:2])
    assert counts["compiled_graphs"] == 1 and counts["graph_breaks"] == 0, counts
    assert worst <= 1e-5, worst


def test_checkpointing_modes_compile_once_each_equal_to_eager():
    """Selective (the core recomputed) and full checkpointing (the block under ``checkpoint``) through the
    compiled forward: one more graph for the selective variant (``graphs_needed``' x2), none for full."""
    worst, counts = _compiled_vs_eager("aot_eager", MIXES[:2], modes=("none", "selective", "full"))
    assert counts["compiled_graphs"] == 2 and counts["graph_breaks"] == 0, counts
    assert worst <= 1e-6, worst


def test_recompile_limit_hits_are_counted():
    torch._dynamo.config.recompile_limit, saved = 1, torch._dynamo.config.recompile_limit
    try:
        fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
        for n in (2, 3, 4):  # static shapes: each new size is a recompile, the second one past the limit
            fn(torch.ones(n))
    finally:
        torch._dynamo.config.recompile_limit = saved
    assert compile_counts()["cache_limit_hits"] >= 1


def test_compile_spec_defaults_to_a_dynamic_token_dim():
    assert check_compile_spec(True) == {"dynamic": True}
    assert check_compile_spec({"backend": "aot_eager"}) == {"dynamic": True, "backend": "aot_eager"}
    assert check_compile_spec({"dynamic": False}) == {"dynamic": False}
    assert check_compile_spec(False) is None
    assert graphs_needed(2, 3) == 14
