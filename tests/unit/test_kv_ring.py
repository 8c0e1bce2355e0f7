"""The KV ring's geometry and block kernels, single process (the 2- and 4-rank equivalence, sliding window
and GQA with fewer kv heads than cp included, is in tests/distributed/test_parallel.py and test_kv_ring_ranks.py)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hotspa.models import chunk_attention as chunks
from lightning_hotspa.models.attention import sdpa_attention
from lightning_hotspa.parallel import kv_ring
from lightning_hotspa.plan import pack_micro_batch
from lightning_hotspa.testing.host_syncs import count_host_syncs


def _mb(lengths, cp, rank):
    return pack_micro_batch([torch.zeros(n, dtype=torch.long) for n in lengths], cp_size=cp, cp_rank=rank)


def _positions(lengths, cp, ulysses, kv, b):
    """(document, position) of each row a KV rank ``b`` holds (after the Ulysses exchange)."""
    rows = []
    for a in range(ulysses):
        r = a * kv + b
        mb = _mb(lengths, cp, r)
        cu = mb.cu_seqlens.tolist()
        for d in range(len(cu) - 1):
            c = (cu[d + 1] - cu[d]) // 2
            rows += [(d, r * c + i) for i in range(c)] + [(d, (2 * cp - 1 - r) * c + i) for i in range(c)]
    return rows


@pytest.mark.parametrize("window", [None, 3, 20])
def test_every_visible_pair_is_in_exactly_one_block_of_one_step(window):
    """Over the ring's steps each (query row, key row) pair a causal (windowed) attention sees lies in
    exactly one block, no invisible pair is computed unmasked, and each query chunk starts at its diagonal."""
    lengths, cp, ulysses, kv = [45, 7, 130, 19], 4, 2, 2
    for b in range(kv):
        cu = _mb(lengths, cp, b).cu_seqlens  # every cp rank has the same local lengths
        g = kv_ring.ring_geometry(cu, cp, ulysses, kv, b, window)
        queries = _positions(lengths, cp, ulysses, kv, b)
        seen = {}
        for s, blocks in enumerate(g.steps):
            keys = _positions(lengths, cp, ulysses, kv, (b - s) % kv)
            for blk in blocks:
                mask = g.mask(blk, torch.float64, torch.device("cpu"))
                for i in range(blk.q0, blk.q1):
                    for j in range(blk.k0, blk.k1):
                        (dq, pq), (dk, pk) = queries[i], keys[j]
                        visible = dq == dk and pk <= pq and (window is None or pk > pq - window)
                        if blk.causal:
                            computed = j - blk.k0 <= i - blk.q0
                        else:
                            computed = mask is None or mask[i - blk.q0, j - blk.k0] == 0
                        assert computed == visible, (s, blk, i, j)
                        if visible:
                            seen[(i, dk, pk)] = seen.get((i, dk, pk), 0) + 1
            if s == 0:
                firsts = [blk for blk in blocks if blk.first]
                assert list(blocks[:len(firsts)]) == firsts and all(blk.k0 == blk.q0 for blk in firsts)
                assert sorted(r for blk in firsts for r in range(blk.q0, blk.q1)) == list(range(len(queries)))
        want = sum(min(p + 1, window or p + 1) for _, p in queries)
        assert len(seen) == want and set(seen.values()) == {1}


def test_geometry_reads_no_device_value_when_the_batch_filed_its_bounds():
    mb = _mb([45, 130], 4, 1)
    with count_host_syncs() as log:
        kv_ring.ring_geometry(mb.cu_seqlens, 4, 1, 4, 1)
    assert log.count == 0, dict(log.ops)


class _Calls(TorchDispatchMode):
    """Counts attention-kernel forward calls (the SDPA kernels' forward ops)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name.startswith("_scaled_dot_product") and not name.endswith("backward"):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("window", [None, 3, 7, 13])
def test_cpu_blocks_merged_by_lse_equal_the_document_and_backward_from_the_merge(window):
    """One document of 4 chunks as blocks (full, diagonal, band with rows that see nothing): merged by
    their log-sum-exps they equal the whole document's attention, and each block's backward from the
    merged output and log-sum-exp sums to the whole document's gradients, with no forward re-run (fp64, GQA)."""
    torch.manual_seed(0)
    c, n = 6, 4
    q = torch.randn(n * c, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(n * c, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, n * c], dtype=torch.int32)
    ref = sdpa_attention(q, k, v, cu, n * c, window=window) if window else sdpa_attention(q, k, v, cu, n * c)
    grad = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    blocks = []
    for cq in range(n):
        for ck in range(cq + 1):
            blk = kv_ring._block((cq * c, c, cq), (ck * c, c, ck), window)
            if blk is not None:
                blocks.append(blk)
    geometry = kv_ring.RingGeometry((tuple(blocks),), window)
    out = torch.empty(q.shape, dtype=torch.float64)
    lse = torch.empty(4, n * c, dtype=torch.float64)
    done = set()
    with torch.no_grad():
        for blk in sorted(blocks, key=lambda b: b.k0 != b.q0):
            blk = kv_ring.RingBlock(blk.q0, blk.q1, blk.k0, blk.k1, blk.causal, blk.offset, blk.q0 not in done)
            done.add(blk.q0)
            o, s = chunks.cpu_block_forward(q[blk.q0:blk.q1], k[blk.k0:blk.k1], v[blk.k0:blk.k1], blk.causal,
                                            geometry.mask(blk, q.dtype, q.device))
            kv_ring._merge(out, lse, blk, o, s)
        torch.testing.assert_close(out, ref)
        got = [torch.zeros_like(t) for t in (q, k, v)]
        mode = _Calls()
        with mode:
            for blk in blocks:
                r = slice(blk.q0, blk.q1)
                gq, gk, gv = chunks.cpu_block_backward(grad[r], q[r], k[blk.k0:blk.k1], v[blk.k0:blk.k1], out[r],
                                                       lse[:, r], blk.causal, geometry.mask(blk, q.dtype, q.device))
                got[0][r] += gq
                got[1][blk.k0:blk.k1] += gk
                got[2][blk.k0:blk.k1] += gv
        assert mode.calls == 0, mode.calls
    if window is not None and window < c:
        assert any(blk.offset is not None and blk.offset >= c for blk in blocks)  # a band with unseen rows
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_a_too_small_window_is_refused():
    from lightning_hotspa.layout import LayoutError

    with pytest.raises(LayoutError, match="window must be >= 1, got 0"):
        kv_ring.kv_ring_attention(*(torch.zeros(4, 2, 8) for _ in range(3)), torch.tensor([0, 4]), _groups(),
                                  window=0)


def _groups():
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.mesh import LayoutGroups, RankGroup

    one = RankGroup((), (0,), 0, None)
    return LayoutGroups(Layout.parse("dp1"), one, one, one, one, one)


@pytest.mark.parametrize("window", [None, 10])
def test_a_ring_of_one_equals_the_documents_and_its_backward_runs_no_forward(window):
    """A KV group of one (no shift): forward and gradients equal the whole documents' attention, and the
    backward runs the kernels' backward only (no attention forward again) (fp64)."""
    torch.manual_seed(3)
    lengths = [24, 40]
    mb = _mb(lengths, 1, 0)
    tokens = int(mb.cu_seqlens[-1])
    q, k, v = (torch.randn(tokens, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    extra = {} if window is None else {"window": window}
    ref = sdpa_attention(q, k, v, mb.cu_seqlens, max(lengths), **extra)
    grad = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    out = kv_ring.kv_ring_attention(q, k, v, mb.cu_seqlens, _groups(), mb, window=window)
    mode = _Calls()
    with mode:
        got = torch.autograd.grad(out, (q, k, v), grad)
    torch.testing.assert_close(out, ref)
    assert mode.calls == 0, mode.calls
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_the_ring_runs_the_chunk_kernel_the_registry_sets_beside_the_core_attention():
    """The block kernel follows the model's core attention (registry records): the flash stand-in (the
    memory estimator's GPU path) gets the CUDA kernel's record, "auto" / sdpa on CPU the CPU flash blocks
    (a window included: they take its band mask), and a dtype no kernel runs here is named."""
    import functools

    from lightning_hotspa.models.attention_kernels import auto_attention, chunk_kernel_for
    from lightning_hotspa.testing.gpu_attention import flash_varlen_standin

    q = torch.zeros(4, 2, 8)
    assert chunk_kernel_for(flash_varlen_standin, q, None).name == "sdpa_chunk"
    assert chunk_kernel_for(auto_attention, q, None).name == "cpu_flash_chunks"
    assert chunk_kernel_for(functools.partial(sdpa_attention, window=3), q, 3).name == "cpu_flash_chunks"
    assert chunk_kernel_for(lambda *a: a, q.double(), None).name == "cpu_flash_chunks"  # unknown: as auto
    with pytest.raises(ValueError, match="no chunk kernel runs on device\\(type='cpu'\\) with torch.float16"):
        chunk_kernel_for(sdpa_attention, q.half(), None)


def test_the_ring_keeps_its_output_and_log_sum_exp_on_both_kernels():
    """Both block kernels keep q, the local k / v, the merged output and log-sum-exp (the memory model's
    terms), the CUDA one seen under the estimator's fake tensors."""
    from lightning_hotspa.models.attention_kernels import KERNELS
    from lightning_hotspa.testing.fake_world import fake_mode
    from lightning_hotspa.testing.gpu_attention import flash_varlen_standin

    for name in ("sdpa_chunk", "cpu_flash_chunks"):
        assert (KERNELS[name].saves_lse, KERNELS[name].saves_output) == (True, True)
    for core, fake in ((sdpa_attention, False), (flash_varlen_standin, True)):
        mb = _mb([16], 1, 0)
        saved = []
        with fake_mode() if fake else torch.no_grad(), torch.enable_grad():
            q, k, v = (torch.randn(16, h, 8, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
            with torch.autograd.graph.saved_tensors_hooks(lambda t, keep=saved.append: keep(t) or t, lambda t: t):
                kv_ring.kv_ring_attention(q, k, v, mb.cu_seqlens, _groups(), mb, core=core)
        assert len(saved) == 5, (core, len(saved))
