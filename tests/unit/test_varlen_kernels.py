"""The Hopper-class packed kernels (models/varlen_kernels.py) through stand-ins of their libraries, on CPU.

No GPU ran any of them (none was lent): each library's varlen entry point is stood in by a reference with
its documented semantics (causal aligned bottom-right, ``window_size`` (left, 0), GQA native for FA3 / FA4,
cuDNN without GQA), and the tests check the plumbing: ONE call per micro-batch, its arguments, and that
the documents kernels equal SDPA per document and the packed chunk kernels equal the per-chunk SDPA
kernel over a real cp geometry (outputs and q / k / v gradients, fp64).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from lightning_hotspa.models import chunk_attention as chunks
from lightning_hotspa.models import varlen_kernels as vk
from lightning_hotspa.models.attention import repeat_kv, sdpa_attention
from lightning_hotspa.models.attention_kernels import KERNELS, auto_order, chunk_kernel_for, select_attention_backend
from lightning_hotspa.parallel import kv_gather
from lightning_hotspa.plan import pack_micro_batch


def _reference_varlen(q, k, v, cu_q, cu_k, window, gqa=True):
    """FlashAttention's varlen semantics on CPU: sequence i's queries over its keys, causal bottom-right."""
    if not gqa:
        assert k.shape[1] == q.shape[1], "this library takes no GQA"
    outs = []
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        first = (k1 - k0) - (q1 - q0)
        outs.append(chunks.chunk_attention(q[q0:q1], k[k0:k1], v[k0:k1], first, 0, window))
    return torch.cat(outs)


class _Library:
    """A stand-in varlen entry point that records its calls."""

    def __init__(self, gqa=True):
        self.calls, self.gqa = [], gqa

    def fa3(self, q, k, v, cu_q, cu_k, max_q, max_k, causal=False, window_size=(-1, -1)):
        self.calls.append((cu_q.dtype, max_q, max_k, causal, tuple(window_size)))
        assert causal
        window = None if window_size[0] < 0 else window_size[0] + 1
        return _reference_varlen(q, k, v, cu_q, cu_k, window), torch.zeros(1)  # old releases: (out, lse)

    def fa4(self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            causal=False, window_size=(None, None)):
        assert qv is None and causal
        self.calls.append((cu_seqlens_q.dtype, max_seqlen_q, max_seqlen_k, causal, tuple(window_size)))
        window = None if window_size[0] is None else window_size[0] + 1
        return _reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, window), torch.zeros(1)

    def cudnn(self, q, k, v, bias, cu_q, cu_k, max_q, max_k, lse, dropout, causal, debug):
        assert bias is None and lse and dropout == 0.0 and causal and not debug and torch.equal(cu_q, cu_k)
        self.calls.append((cu_q.dtype, max_q, max_k, causal, None))
        return (_reference_varlen(q, k, v, cu_q, cu_k, None, gqa=False),)


@pytest.fixture
def library(monkeypatch):
    lib = _Library()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.SimpleNamespace(flash_attn_varlen_func=lib.fa3))
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = lib.fa4
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(cute=cute))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setattr(torch.ops.aten, "_cudnn_attention_forward", lib.cudnn, raising=False)
    return lib


def _qkv(tokens, grad=True):
    torch.manual_seed(0)
    return tuple(torch.randn(tokens, h, 8, dtype=torch.float64, requires_grad=grad) for h in (4, 2, 2))


@pytest.mark.parametrize("name,window", [("fa3_varlen", None), ("fa3_varlen", 3), ("fa4_varlen", None),
                                         ("fa4_varlen", 3), ("cudnn_varlen", None)])
def test_documents_kernel_is_one_packed_call_equal_to_sdpa(library, name, window):
    q, k, v = _qkv(17)
    cu = torch.tensor([0, 5, 6, 17])
    fn = KERNELS[name].call
    out = fn(q, k, v, cu, 11) if window is None else fn(q, k, v, cu, 11, window=window)
    ref = sdpa_attention(q, k, v, cu, 11) if window is None else sdpa_attention(q, k, v, cu, 11, window=window)
    assert len(library.calls) == 1  # ONE call for three documents
    dtype, max_q, max_k, causal, win = library.calls[0]
    assert (dtype, max_q, max_k, causal) == (torch.int32, 11, 11, True)
    if name != "cudnn_varlen":
        assert win == ((-1, 0) if name == "fa3_varlen" else (None, None) if window is None else (window - 1, 0)) \
            or win == (window - 1, 0)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b)


def test_cudnn_repeats_kv_and_refuses_a_window():
    assert KERNELS["cudnn_varlen"].repeats_kv and not KERNELS["fa3_varlen"].repeats_kv
    assert "sliding window" in KERNELS["cudnn_varlen"].reason(window=4)
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="no sliding window"):
        vk.VARLEN_CALLS["cudnn"](q, q, q, torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4, 3)


@pytest.mark.parametrize("family,kernel", [("fa3", "fa3_chunks"), ("fa4", "fa4_chunks")])
@pytest.mark.parametrize("window", [None, 7])
def test_packed_chunks_are_one_call_equal_to_the_per_chunk_kernel(library, family, kernel, window):
    """A cp4 rank's chunks (KV index 1 of 2, Ulysses 2) in ONE packed call equal sdpa_chunk per chunk:
    output and the q / gathered k / v gradients (the packing's backward sums each key over its chunks)."""
    cu = pack_micro_batch([torch.zeros(n, dtype=torch.long) for n in (45, 16, 130)], cp_size=4, cp_rank=1).cu_seqlens
    g = kv_gather.kv_geometry(cu, 4, 2, 2, 1, window)
    rows = g.blocks[-1][1]
    torch.manual_seed(3)
    q = torch.randn(rows, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(g.full_tokens, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    record = KERNELS[kernel]
    assert record.packed and record.role == "chunks"
    out, kept = record.call(q, k, v, g.blocks, window)
    assert kept == () and len(library.calls) == 1  # ONE call for every chunk of the micro-batch
    assert library.calls[0][1:3] == (max(b[1] - b[0] for b in g.blocks), max(b[3] - b[2] for b in g.blocks))
    ref, _ = chunks.sdpa_chunks_forward(q, k, v, g.blocks, window)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    got = record.backward(grad, q, k, v, kept, g.blocks, window)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    assert len(library.calls) == 2  # backward: the one call re-run
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_the_kv_gather_runs_the_packed_chunks_beside_a_hopper_kernel(library):
    """Beside fa3_varlen the KV gather runs fa3_chunks: one call forward, one in backward, and the same
    output and gradients as the KV ring beside sdpa (cp 1 in one process; the chunks' math: the test above)."""
    import torch.distributed as dist

    from lightning_hotspa.layout import Layout
    from lightning_hotspa.mesh import LayoutGroups, RankGroup

    one = RankGroup((), (0,), 0, None)
    groups = LayoutGroups(Layout.parse("dp1"), one, one, one, one, one)
    mb = pack_micro_batch([torch.zeros(n, dtype=torch.long) for n in (6, 10)], cp_size=1, cp_rank=0)
    q, k, v = _qkv(16)
    assert chunk_kernel_for(KERNELS["fa3_varlen"].call, q, None).name == "fa3_chunks"
    assert chunk_kernel_for(KERNELS["cudnn_varlen"].call, q, None).name == "torch_flash_chunks"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from lightning_hotspa.parallel import kv_ring  # beside sdpa the KV ring runs (its CPU block kernel)

        outs = [kv_gather.kv_gather_attention(q, k, v, mb.cu_seqlens, groups, mb, core=KERNELS["fa3_varlen"].call),
                kv_ring.kv_ring_attention(q, k, v, mb.cu_seqlens, groups, mb, core=sdpa_attention)]
        grad = torch.randn_like(outs[0])
        grads = [torch.autograd.grad(o, (q, k, v), grad) for o in outs]
    finally:
        dist.destroy_process_group()
    assert len(library.calls) == 2
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_auto_picks_by_compute_capability(monkeypatch):
    import lightning_hotspa.models.attention_kernels as ak

    assert auto_order("cpu") == ("flash_varlen", "torch_varlen", "sdpa")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for major, first in ((9, "fa3_varlen"), (10, "fa4_varlen"), (8, "flash_varlen")):
        monkeypatch.setattr(ak, "_capability", lambda device, m=major: (m, 0))
        assert auto_order("cuda:0")[0] == first
    monkeypatch.setattr(ak, "_capability", lambda device: (8, 0))
    assert "sm80" in KERNELS["fa3_varlen"].reason("cuda", torch.bfloat16)
    assert "only on CUDA" in KERNELS["fa4_varlen"].reason("cpu")
    with pytest.raises(ValueError, match="fa3_varlen.*unavailable"):
        select_attention_backend("fa3_varlen", device="cpu")


def test_the_memory_model_reads_what_each_kernel_keeps():
    """cuDNN (no GQA) keeps K / V at the query heads' width; the packed chunks add their copies to the
    KV gather's backward peak."""
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel

    def saved(backend):
        return AnalyticCostModel("llama3-8b", "H100", 8, attention_backend=backend).attention_saved_bytes(1)

    m = AnalyticCostModel("llama3-8b", "H100", 8)
    extra_kv = 2 * m.param_bytes * (m.attn_width - m.kv_width)
    assert saved("cudnn_varlen") - saved("fa3_varlen") == pytest.approx(extra_kv)
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.planner.cost.kv_gather_memory import kv_gather_extra_bytes

    par = Layout.parse("dp2xcp4:kv")
    plain = AnalyticCostModel("llama3-8b", "H100", 8, chunk_kernel="sdpa_chunk")
    packed = AnalyticCostModel("llama3-8b", "H100", 8, chunk_kernel="fa3_chunks")
    assert kv_gather_extra_bytes(packed, par, 65536) > kv_gather_extra_bytes(plain, par, 65536)


def test_repeat_kv_is_what_the_cudnn_path_feeds():
    kv = torch.arange(2.0).view(1, 2, 1)
    assert repeat_kv(kv, 4).flatten().tolist() == [0, 0, 1, 1]
