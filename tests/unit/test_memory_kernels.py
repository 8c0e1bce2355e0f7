"""The memory-lean kernels (docs/DESIGN.md §11) against the plain expressions they replace: the same
loss and gradients (fp32, 1e-6 relative), and only the tensors they claim kept for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_hotspa.models import Llama, LlamaConfig, token_mean_cross_entropy
from lightning_hotspa.models.attention import sdpa_attention
from lightning_hotspa.models.kernels import SwiGLUDown, rms_norm
from lightning_hotspa.models.loss_head import linear_cross_entropy

EXACT = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


class _Saved:
    """Bytes of the distinct storages autograd saves while the context is open (their shapes too)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self.shapes: list[tuple[int, ...]] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.shapes.append(tuple(t.shape))
        return t

    def __enter__(self) -> _Saved:
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ctx.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def _plain_head(hidden, weight, labels):
    return token_mean_cross_entropy(F.linear(hidden, weight), labels)


@pytest.mark.parametrize("block", [7, 64, 1000])  # several blocks with a partial last one; one block
def test_blocked_loss_head_equals_the_plain_head(block: int) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=g, requires_grad=True)
    weight = torch.randn(96, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 96, (50,), generator=g)
    labels[::5] = -100
    ref = _plain_head(hidden, weight, labels)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, labels, vocab_block=block)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert abs(float(loss) - float(ref)) <= EXACT * abs(float(ref))
    for got, want in zip(grads, ref_grads, strict=True):
        assert _rel(got, want) <= EXACT


def test_blocked_loss_head_without_targets_is_zero_with_zero_gradients() -> None:
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.full((6,), -100), vocab_block=8)
    loss.backward()
    assert float(loss) == 0.0 and not hidden.grad.any() and not weight.grad.any()


def test_blocked_loss_head_keeps_no_tokens_x_vocab_tensor() -> None:
    tokens, vocab, hidden_size = 64, 4096, 16
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    with _Saved() as saved:
        linear_cross_entropy(hidden, weight, labels, vocab_block=512)
    assert all(shape != (tokens, vocab) for shape in saved.shapes), saved.shapes
    with _Saved() as plain:
        _plain_head(hidden, weight, labels)
    # the plain head keeps an fp32 [T, V] log-softmax; ours the inputs and a few floats per token
    assert saved.nbytes <= (hidden.numel() + weight.numel()) * 4 + tokens * 32 < plain.nbytes - tokens * vocab * 3


def test_bad_loss_head_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="vocab_block must be a positive int, got 0"):
        linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), vocab_block=0)
    with pytest.raises(ValueError, match=r"head weight \(5, 3\)"):
        linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the model's vocabulary of 5"):
        linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 5, 1]))


def _plain_rms(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def test_rms_norm_equals_the_plain_expression_and_saves_input_and_inverse_rms() -> None:
    x = torch.randn(40, 32, requires_grad=True)
    weight = torch.empty(32).uniform_(0.5, 1.5).requires_grad_()
    grad = torch.randn(40, 32)
    want = _plain_rms(x, weight, 1e-5)
    want_grads = torch.autograd.grad(want, (x, weight), grad)
    with _Saved() as saved:
        got = rms_norm(x, weight, 1e-5)
    got_grads = torch.autograd.grad(got, (x, weight), grad)
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert _rel(a, b) <= EXACT
    assert saved.nbytes == x.numel() * 4 + weight.numel() * 4 + 40 * 4  # x, weight, fp32 1/rms per token
    xb, wb = x.detach().bfloat16().requires_grad_(), weight.detach().bfloat16()
    with _Saved() as saved_bf16:
        out = rms_norm(xb, wb, 1e-5)
    assert torch.equal(out, _plain_rms(xb, wb, 1e-5))  # bit-identical forward in bf16 too
    assert saved_bf16.nbytes == xb.numel() * 2 + wb.numel() * 2 + 40 * 4


def test_swiglu_down_equals_the_plain_expression_and_saves_its_two_inputs() -> None:
    torch.manual_seed(0)
    down = SwiGLUDown(48, 16)
    a = torch.randn(30, 48, requires_grad=True)
    b = torch.randn(30, 48, requires_grad=True)
    grad = torch.randn(30, 16)
    want = F.linear(F.silu(a) * b, down.weight)
    want_grads = torch.autograd.grad(want, (a, b, down.weight), grad)
    with _Saved() as saved:
        got = down(a, b)
    got_grads = torch.autograd.grad(got, (a, b, down.weight), grad)
    assert torch.equal(got, want)
    for x, y in zip(got_grads, want_grads, strict=True):
        assert _rel(x, y) <= EXACT
    assert saved.nbytes == (a.numel() + b.numel() + down.weight.numel()) * 4


@pytest.mark.parametrize("lengths", [[40], [15, 25]])
def test_gqa_attention_saves_kv_unrepeated(lengths: list[int]) -> None:
    tokens = sum(lengths)
    q = torch.randn(tokens, 8, 16, requires_grad=True)
    k = torch.randn(tokens, 2, 16, requires_grad=True)
    v = torch.randn(tokens, 2, 16, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    with _Saved() as saved:
        out = sdpa_attention(q, k, v, cu, max(lengths))
    kv_saved = [s for s in saved.shapes if len(s) == 4 and s[-1] == 16 and s[1] == 2]
    repeated = [s for s in saved.shapes if len(s) == 4 and s[-1] == 16 and s[1] == 8]
    assert len(kv_saved) == 2 * len(lengths)  # k and v of each document, 2 heads
    assert len(repeated) == 2 * len(lengths)  # q and the output of each document only
    if len(lengths) == 1:  # one document: the output is a view of what SDPA saved, no copy
        assert out.untyped_storage().data_ptr() in saved.storages


def test_llama_loss_through_the_blocked_head_equals_logits_then_cross_entropy() -> None:
    torch.manual_seed(0)
    config = LlamaConfig.preset("tiny")
    model = Llama(config)
    ids = torch.randint(0, config.vocab_size, (70,))
    labels = torch.randint(0, config.vocab_size, (70,))
    labels[::7] = -100
    pos = torch.cat([torch.arange(30), torch.arange(40)])
    cu = torch.tensor([0, 30, 70])
    ref = token_mean_cross_entropy(model(ids, pos, cu, 40), labels)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.output.vocab_block = 37  # 320 padded rows: 9 blocks, the last partial
    loss = model(ids, pos, cu, 40, labels=labels)
    loss.backward()
    assert abs(float(loss) - float(ref)) <= EXACT * float(ref)
    for name, p in model.named_parameters():
        assert _rel(p.grad, ref_grads[name]) <= EXACT, name


def test_the_planner_prices_the_heads_own_vocab_block() -> None:
    from lightning_hotspa.models.loss_head import DEFAULT_VOCAB_BLOCK
    from lightning_hotspa.planner.cost.memory_model import HEAD_VOCAB_BLOCK

    assert HEAD_VOCAB_BLOCK == DEFAULT_VOCAB_BLOCK


def test_the_gpu_attention_stand_in_refuses_real_tensors() -> None:
    from lightning_hotspa.testing.gpu_attention import flash_varlen_standin

    q = torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="only runs under FakeTensorMode"):
        flash_varlen_standin(q, q, q, torch.tensor([0, 4]), 4)
