"""The opaque context-parallel attention op of compiled blocks (``parallel/cp_attention_op.py``), with a stand-in
for the cp kinds: gradients through the recorded graph equal eager (inductor on CPU, whose buffer reuse overwrote a
recorded graph that shared storage with the op's inputs), no graph without a gradient, a clear error on a second
backward or a freed wrapper. The real cp kinds under compile, on 4 gloo ranks:
tests/e2e/test_recipe_smoke_benchmark_compile.py."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from lightning_hotspa.op_handles import handle_for
from lightning_hotspa.parallel import cp_attention_op as op

ROOT = Path(__file__).resolve().parents[2]


def stand_in(q, k, v):  # noqa: ANN001, ANN201
    """Saves q, k and v for backward, as the KV ring does."""
    return (q * k).sin() * v


class Wrapper:
    """What the op needs of a ``ParallelCoreAttention``: a handle and the cp attention (the stand-in)."""

    def __init__(self) -> None:
        self.handle = handle_for(self)

    def run_context_parallel(self, q, k, v, cu_seqlens, max_seqlen):  # noqa: ANN001, ANN201
        return stand_in(q, k, v)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _block(wrapper: Wrapper, x, y, cu_seqlens, max_seqlen, cp_op=True):  # noqa: ANN001, ANN202
    q, k, v = x * 2.0, y + 1.0, x - y
    out = op.cp_attention_op(wrapper, q, k, v, cu_seqlens, max_seqlen) if cp_op else stand_in(q, k, v)
    z = out * 3.0 + x  # as large as q: inductor may put it in q's buffer once the op has run
    return (z + 1.0).exp().sum(1, keepdim=True) * z


def test_inductor_gradients_through_the_recorded_graph_equal_eager(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".hotspa_cache" / "inductor"))
    wrapper = Wrapper()
    compiled = torch.compile(_block, backend="inductor", dynamic=True, fullgraph=True)
    for tokens in (8, 5):  # the token dim dynamic: one graph for both
        g = torch.Generator().manual_seed(tokens)
        x, y = (torch.randn(tokens, 4, 4, generator=g, requires_grad=True) for _ in range(2))
        cu = torch.tensor([0, tokens], dtype=torch.int32)
        got = torch.autograd.grad(compiled(wrapper, x, y, cu, tokens).square().sum(), (x, y))
        want = torch.autograd.grad(_block(wrapper, x, y, cu, tokens, cp_op=False).square().sum(), (x, y))
        for a, b in zip(got, want, strict=True):
            assert float((a - b).norm() / b.norm()) <= 1e-5  # without the op's copies: ~1e18


def test_no_graph_is_recorded_without_a_gradient_and_a_second_backward_is_refused():
    wrapper = Wrapper()
    q, k, v = (torch.randn(6, 2, 4, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with torch.no_grad():
        out = op.cp_attention_op(wrapper, q, k, v, cu, 6)
    _, tape = op._cp_attention(q, k, v, cu, 6, wrapper.handle, False)
    assert getattr(tape, "hotspa_graph", None) is None
    torch.testing.assert_close(out, stand_in(q, k, v).detach())

    out = op.cp_attention_op(wrapper, q, k, v, cu, 6)
    out.sum().backward(retain_graph=True)
    torch.testing.assert_close(q.grad, (k * (q * k).cos() * v).detach())
    with pytest.raises(RuntimeError, match="no recorded graph"):
        out.sum().backward()


class Recording(Wrapper):
    """A cp kind that saves what ``saves`` says, and remembers (weakly) the tensor owning the q it was handed."""

    def __init__(self, saves: bool) -> None:
        super().__init__()
        self.saves, self.seen = saves, []

    def run_context_parallel(self, q, k, v, cu_seqlens, max_seqlen):  # noqa: ANN001, ANN201
        self.seen.append(weakref.ref(q if q._base is None else q._base))  # the tensor owning q's memory
        return stand_in(q, k, v) if self.saves else q + k + v  # a sum saves nothing for backward


@pytest.mark.parametrize("saves", [False, True])
def test_the_tape_keeps_what_the_cp_kind_saves_and_nothing_more(saves):
    wrapper = Recording(saves)
    q, k, v = (torch.randn(6, 2, 4, requires_grad=True) for _ in range(3))
    out = op.cp_attention_op(wrapper, q, k, v, torch.tensor([0, 6], dtype=torch.int32), 6)
    gc.collect()
    assert (wrapper.seen[0]() is not None) == saves  # the op's copy of q: alive only if the kind saved it
    out.sum().backward()
    want = k * (q * k).cos() * v if saves else torch.ones_like(q)
    torch.testing.assert_close(q.grad, want.detach())


def test_a_freed_wrapper_is_named_not_guessed():
    wrapper = Wrapper()
    handle = wrapper.handle
    del wrapper
    gc.collect()
    q = torch.randn(4, 2, 4)
    with pytest.raises(RuntimeError, match=f"handle {handle}"):
        op._cp_attention(q, q, q, torch.tensor([0, 4], dtype=torch.int32), 4, handle, False)
