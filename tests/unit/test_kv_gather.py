"""All-gather-KV geometry and its one-kernel-call-per-chunk attention, single process (the 4-rank
equivalence, sliding window and GQA with fewer kv heads than cp included, is in test_parallel.py)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hotspa.models import chunk_attention as chunks
from lightning_hotspa.models.attention import sdpa_attention
from lightning_hotspa.parallel import kv_gather
from lightning_hotspa.plan import pack_micro_batch
from lightning_hotspa.testing.host_syncs import count_host_syncs


def _mb(lengths, cp, rank):
    return pack_micro_batch([torch.zeros(n, dtype=torch.long) for n in lengths], cp_size=cp, cp_rank=rank)


@pytest.mark.parametrize("window", [None, 20])
def test_geometry_is_one_kernel_call_per_local_chunk(window):
    lengths, cp, ulysses, kv = [45, 7, 130, 19], 4, 2, 2
    cu = _mb(lengths, cp, 0).cu_seqlens  # every cp rank has the same local lengths
    for kv_index in range(kv):
        g = kv_gather.kv_geometry(cu, cp, ulysses, kv, kv_index, window)
        assert sorted(g.perm.tolist()) == list(range(g.full_tokens))  # a permutation of all rows
        assert torch.equal(g.perm[g.full_index], torch.arange(g.full_tokens))
        rows = sorted(r for q0, q1, *_ in g.blocks for r in range(q0, q1))
        assert rows == list(range(ulysses * int(cu[-1])))  # each query row in exactly one call
        assert len(g.blocks) == 2 * ulysses * len(lengths)  # one call per local query chunk
        for q0, q1, k0, k1, first, lo in g.blocks:
            assert k1 - k0 == first + (q1 - q0) - lo  # keys up to the chunk's last query position
            assert lo == (0 if window is None else max(0, first - window + 1))


def test_geometry_reads_no_device_value_when_the_batch_filed_its_bounds():
    mb = _mb([45, 130], 4, 1)
    with count_host_syncs() as log:
        kv_gather.kv_geometry(mb.cu_seqlens, 4, 1, 4, 1)
    assert log.count == 0, dict(log.ops)


class _Calls(TorchDispatchMode):
    """Counts attention-kernel calls (the SDPA kernels' forward ops)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name.startswith("_scaled_dot_product") and not name.endswith("backward"):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("window", [None, 5, 11, 40])
def test_chunk_is_bottom_right_causal_in_one_gqa_call(window):
    """Each chunk of a document, with the window's keys only, equals the same rows of the whole
    document's attention (fp64), in one kernel call, with K/V of 2 heads for 4 query heads."""
    torch.manual_seed(0)
    full, n = 24, 6
    q = torch.randn(full, 4, 8, dtype=torch.float64)
    k, v = torch.randn(full, 2, 8, dtype=torch.float64), torch.randn(full, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, full], dtype=torch.int32)
    ref = sdpa_attention(q, k, v, cu, full, window=window) if window else sdpa_attention(q, k, v, cu, full)
    for first in range(0, full, n):
        lo = 0 if window is None else max(0, first - window + 1)
        mode = _Calls()
        with mode:
            out = chunks.chunk_attention(q[first:first + n], k[lo:first + n], v[lo:first + n], first, lo, window)
        assert mode.calls == 1, (first, mode.calls)
        torch.testing.assert_close(out, ref[first:first + n])


def test_chunk_backward_matches_the_whole_document():
    torch.manual_seed(1)
    full, n, first, window = 32, 8, 16, 12
    q, k, v = (torch.randn(full, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, full], dtype=torch.int32)
    grad = torch.randn(n, 4, 8, dtype=torch.float64)
    ref = sdpa_attention(q, k, v, cu, full, window=window)[first:first + n]
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    lo = first - window + 1
    out = chunks.chunk_attention(q[first:first + n], k[lo:first + n], v[lo:first + n], first, lo, window)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), expected):
        torch.testing.assert_close(got, want)


def test_chunk_rejects_a_too_small_window():
    from lightning_hotspa.layout import LayoutError

    with pytest.raises(LayoutError, match="window must be >= 1, got 0"):
        kv_gather.kv_gather_attention(*(torch.zeros(4, 2, 8) for _ in range(3)), torch.tensor([0, 4]),
                                      _groups(), window=0)


def _groups():
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.mesh import LayoutGroups, RankGroup

    one = RankGroup((), (0,), 0, None)
    return LayoutGroups(Layout.parse("dp1"), one, one, one, one, one)


def test_cpu_chunks_take_two_calls_without_a_mask_and_match_the_one_call():
    """On CPU a chunk is at most 2 flash calls (prefix, causal diagonal) with no [C, S] mask, and its
    output and gradients (from the saved output and log-sum-exp) equal the one masked call (fp64)."""
    torch.manual_seed(2)
    n = 8
    for first, lo in ((0, 0), (16, 0), (24, 5)):
        q = torch.randn(n, 4, 8, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(first + n - lo, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
        ref = chunks.chunk_attention(q, k, v, first, lo)
        grad = torch.randn_like(ref)
        expected = torch.autograd.grad(ref, (q, k, v), grad)
        mode = _Calls()
        with mode, torch.no_grad():
            out, lse = chunks.chunk_forward(q, k, v, first, lo)
            got = chunks.chunk_backward(grad, q, k, v, out, lse, first, lo)
        assert mode.calls == (1 if first == lo else 2), mode.calls
        torch.testing.assert_close(out, ref)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)


def test_kv_backward_on_cpu_recomputes_no_forward():
    """The KV-gather backward on CPU runs the kernels' backward only (no attention forward again),
    and forward and gradients equal the whole documents' attention (fp64)."""
    torch.manual_seed(3)
    lengths = [24, 40]
    mb = _mb(lengths, 1, 0)
    tokens = int(mb.cu_seqlens[-1])
    q, k, v = (torch.randn(tokens, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    ref = sdpa_attention(q, k, v, mb.cu_seqlens, max(lengths))
    grad = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a KV group of one
    try:
        out = kv_gather.kv_gather_attention(q, k, v, mb.cu_seqlens, _groups(), mb)
        mode = _Calls()
        with mode:
            got = torch.autograd.grad(out, (q, k, v), grad)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(out, ref)
    assert mode.calls == 0, mode.calls
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_the_kv_gather_runs_the_chunk_kernel_the_registry_sets_beside_the_core_attention():
    """The chunk kernel follows the model's core attention (registry records), not a global: the
    flash stand-in (the memory estimator's GPU path) gets the one-call SDPA chunks on CPU tensors, and
    "auto" / sdpa on CPU get the CPU flash chunks unless a window or a dtype rules them out."""
    import functools

    from lightning_hotspa.models.attention_kernels import auto_attention, chunk_kernel_for
    from lightning_hotspa.testing.gpu_attention import flash_varlen_standin

    q = torch.zeros(4, 2, 8)
    assert chunk_kernel_for(flash_varlen_standin, q, None).name == "sdpa_chunk"
    assert chunk_kernel_for(auto_attention, q, None).name == "cpu_flash_chunks"
    assert chunk_kernel_for(functools.partial(sdpa_attention, window=3), q, 3).name == "sdpa_chunk"
    assert chunk_kernel_for(sdpa_attention, q.half(), None).name == "sdpa_chunk"
    assert chunk_kernel_for(lambda *a: a, q.double(), None).name == "cpu_flash_chunks"  # unknown: as auto


def _saved_by_the_kv_gather(core) -> int:
    """How many tensors the KV gather's autograd function keeps for backward under ``core``."""
    import torch.distributed as dist

    mb = _mb([16], 1, 0)
    q, k, v = (torch.randn(16, h, 8, requires_grad=True) for h in (4, 2, 2))
    saved = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            kv_gather.kv_gather_attention(q, k, v, mb.cu_seqlens, _groups(), mb, core=core)
    finally:
        dist.destroy_process_group()
    return len(saved)


def test_the_flash_stand_in_chunks_keep_no_log_sum_exp_in_the_kv_gather():
    """Under the stand-in the KV gather keeps only q, k, v (sdpa_chunk); under sdpa the merged output
    and log-sum-exp too (cpu_flash_chunks): the two memory-model term sets, seen in what is saved."""
    from lightning_hotspa.models.attention_kernels import KERNELS
    from lightning_hotspa.testing.gpu_attention import flash_varlen_standin

    assert (KERNELS["sdpa_chunk"].saves_lse, KERNELS["sdpa_chunk"].saves_output) == (False, False)
    assert (KERNELS["cpu_flash_chunks"].saves_lse, KERNELS["cpu_flash_chunks"].saves_output) == (True, True)
    assert _saved_by_the_kv_gather(flash_varlen_standin) == 3
    assert _saved_by_the_kv_gather(sdpa_attention) == 5
