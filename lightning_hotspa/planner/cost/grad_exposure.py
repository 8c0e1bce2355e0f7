"""How much of a replicated copy's gradient reduction the last micro-batch's backward hides.

The runtime (``engine/gradients.py``, ``GradientReduction.overlap_next_backward``) cuts a stage's
working gradients into buckets of at most ``bucket_bytes`` (fp32) in REVERSE parameter order and
launches each one from the backward hook that completes it; the buckets run one after another on the
network while the backward goes on. A bucket ``k`` is ready when the backward has done everything but
the GEMMs of the parameters before it (the earlier layers), so the reduction ends at
``max_k (ready_k + sum_{j >= k} c_j)`` and what stays exposed after the backward is

    ``max(0, max_k (sum_{j >= k} c_j - hide * rest_k))``

with ``c_j`` a bucket's seconds, ``hide`` the backward seconds that can hide communication and
``rest_k`` the share of the backward's GEMM work still to run once bucket ``k`` is ready (0 for the
embedding's bucket, the last: its lookup has no GEMM after it). :func:`reduce_buckets` builds the
buckets of a :class:`~lightning_hotspa.model_shape.ModelShape` as the runtime does (one bucket stream;
the runtime keeps a separate one per (scatter, reduce) kind: the norms' is a few KiB) and the
fake world measures the same pairs on the real code path (``recipes/benchmark_hot_path.py``,
``reduce_exposure``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...model_shape import ModelShape

__all__ = ["REDUCE_BUCKET_BYTES", "exposed_share", "exposed_seconds", "reduce_buckets"]

#: the runtime's reduction bucket by ``HardwareProfile.device_type`` (engine/buckets.py: gloo 4 MiB on
#: a CPU, NCCL 100 MiB on a GPU; tests/unit/test_grad_exposure.py holds them equal)
REDUCE_BUCKET_BYTES = {"cpu": 4 * 2**20, "cuda": 100 * 2**20}


def _tensors(model: ModelShape, tp: int, layers: int) -> list[tuple[float, float]]:
    """(elements a rank reduces, share of the backward's GEMM work left when its gradient is ready) of
    every parameter, in REVERSE parameter order (the order the runtime fills buckets in).

    The backward runs the head (its blocked loss head recomputes the logits: 3 GEMMs, not 2), then
    per layer from the top: w2, the w1 / w3 pair, wo, the q / k / v projections. Under tp the pair and
    the projections are one column region each (``parallel/regions.py``): their weight gradients come
    together, after the region's input gradient; without tp autograd runs them last-made first (w3
    before w1, wv, wk, wq). A norm's gradient is ready with the GEMM before it in
    the backward; the embedding's last (its lookup has no GEMM)."""
    h, hd = model.hidden, int(model.head_dim or 0)
    vocab = model.padded_vocab_size * h / tp
    q, kv = model.n_heads * hd * h / tp, model.n_kv_heads * hd * h
    kv = kv if model.n_kv_heads % tp else kv / tp  # kv heads fewer than tp: replicated_partial (reduced whole)
    ffn = model.ffn_hidden * h / tp
    pair = 1 if model.ffn_matrices == 3 else 0  # w1 / w3 (SwiGLU); w2 alone otherwise
    regions = tp > 1
    # backward order: (elements, GEMM work, joins the next one's readiness)
    steps: list[tuple[float, float, bool]] = [(vocab, 1.5 * vocab, False), (h, 0.0, False)]  # head, final norm
    for _ in range(layers):
        steps += [(ffn, ffn, False)] + [(ffn, ffn, regions)] * pair + [(ffn, ffn, False), (h, 0.0, False)]
        steps += [(q, q, False), (kv, kv, regions), (kv, kv, regions), (q, q, False), (h, 0.0, False)]
    if not model.tie_embeddings:
        steps.append((vocab, 0.0, False))  # the embedding
    total = sum(g for _, g, _ in steps) or 1.0
    left, rest, waiting = total, [], 0
    for _, gemm, joins in steps:
        left -= gemm
        waiting += 1
        if not joins:  # this step and the ones joined to it are ready now
            rest += [max(left, 0.0) / total] * waiting
            waiting = 0
    # from backward order back to reverse parameter order: per layer w3 w2 w1 ffn_norm wo wv wk wq attention_norm
    order = [1, 0, 2, 3, 4, 5, 6, 7, 8] if pair else [0, 1, 2, 3, 4, 5, 6, 7]
    out = [(steps[0][0], rest[0]), (steps[1][0], rest[1])]
    for k in range(layers):
        first = 2 + k * len(order)
        out += [(steps[first + j][0], rest[first + j]) for j in order]
    if not model.tie_embeddings:
        out.append((vocab, 0.0))
    return out


def reduce_buckets(model: ModelShape, tp: int, bucket_bytes: float, grad_bytes: float = 4.0,
                   layers: int | None = None) -> list[tuple[float, float]]:
    """The buckets of a stage's reduction in launch order: (bytes of the bucket's input, share of the
    backward's GEMM work left once it launches: when its last gradient and every earlier bucket are ready).

    Args:
        model: the model's shape.
        tp: its tensor-parallel degree (a rank reduces its tp shard).
        bucket_bytes: the most bytes per bucket (a larger tensor goes alone), as ``BucketSizes``.
        grad_bytes: bytes per reduced element (fp32: 4).
        layers: transformer layers on this rank (default: all; a pipeline stage holds fewer).
    """
    buckets: list[list[float]] = []  # [bytes, rest when its last gradient is ready]
    size = None
    for elements, rest in _tensors(model, tp, model.n_layers if layers is None else layers):
        nbytes = elements * grad_bytes
        if size is None or size + nbytes > bucket_bytes:
            buckets.append([0.0, 1.0])
            size = 0.0
        size += nbytes
        buckets[-1][0] += nbytes
        buckets[-1][1] = min(buckets[-1][1], rest)
    out, ready = [], 1.0
    for b, r in buckets:  # launched in order: a bucket waits for the ones before it
        ready = min(ready, r)
        out.append((b, ready))
    return out


def exposed_seconds(seconds: Sequence[float], rest: Sequence[float], hide: float) -> float:
    """Seconds of the reduction left after the backward: buckets of ``seconds`` each, launched in order
    when ``rest`` of the backward's ``hide`` seconds are still to run, one on the network at a time.

    Args:
        seconds: each bucket's collective seconds, launch order.
        rest: each bucket's share of the backward still to run when it is ready (non-increasing).
        hide: backward seconds that communication can hide behind (0: all exposed).
    """
    tail, worst = 0.0, 0.0
    for c, r in zip(reversed(seconds), reversed(rest)):
        tail += c
        worst = max(worst, tail - hide * r)
    return worst


def exposed_share(buckets: Sequence[tuple[float, float]], hide_over_reduce: float) -> float:
    """Exposed share of a reduction whose seconds are proportional to its bytes, when the backward
    that hides it takes ``hide_over_reduce`` times the whole reduction (what the fake-world count and
    the model are compared on).

    Args:
        buckets: (bytes, rest) per bucket, launch order (:func:`reduce_buckets`).
        hide_over_reduce: hideable backward seconds over the reduction's seconds.
    """
    total = sum(b for b, _ in buckets)
    if total <= 0:
        return 0.0
    return exposed_seconds([b / total for b, _ in buckets], [r for _, r in buckets], hide_over_reduce)
