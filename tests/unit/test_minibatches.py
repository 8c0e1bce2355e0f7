"""Token-budget mini-batches: every token once per epoch, determinism, resume, clear errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hotspa.data import (
    ChunkRef,
    DataError,
    MiniBatchSampler,
    TokenizedCorpus,
    chunk_tokens,
)


def all_batches(sampler: MiniBatchSampler, epoch: int) -> list[list[ChunkRef]]:
    return [sampler.batch(epoch, s) for s in range(sampler.num_batches(epoch))]


@st.composite
def sampler_args(draw: st.DrawFn) -> dict:
    lengths = draw(st.lists(st.integers(0, 300), min_size=1, max_size=40).filter(any))
    context = draw(st.integers(1, 64))
    budget = context + draw(st.integers(0, 200))
    return {
        "lengths": lengths,
        "tokens_per_batch": budget,
        "context_length": context,
        "seed": draw(st.integers(0, 2**32)),
    }


@given(sampler_args(), st.integers(0, 3))
@settings(max_examples=150, deadline=None)
def test_every_token_in_exactly_one_minibatch_per_epoch(args: dict, epoch: int) -> None:
    sampler = MiniBatchSampler(**args)
    budget, context = args["tokens_per_batch"], args["context_length"]
    batches = all_batches(sampler, epoch)
    used = Counter()
    for b, refs in enumerate(batches):
        sizes = [r.length for r in refs]
        assert refs and sum(sizes) <= budget
        assert all(0 < n <= context for n in sizes)
        if b + 1 < len(batches):  # next-fit: a batch closes only when the next chunk won't fit
            assert sum(sizes) + batches[b + 1][0].length > budget
        for r in refs:
            used.update((r.doc, t) for t in range(r.start, r.start + r.length))
    expected = Counter((d, t) for d, n in enumerate(args["lengths"]) for t in range(n))
    assert used == expected  # the multiset of (document, position): nothing lost, nothing twice


def test_truncate_keeps_only_first_chunk_and_raise_names_document() -> None:
    lengths = [10, 3, 0, 25]
    trunc = MiniBatchSampler(lengths, 16, 8, long_doc_policy="truncate")
    refs = sorted(r for b in all_batches(trunc, 0) for r in b)
    assert refs == [ChunkRef(0, 0, 8), ChunkRef(1, 0, 3), ChunkRef(3, 0, 8)]
    with pytest.raises(
        DataError, match="document 'big.txt' has 25 tokens, more than context_length=8"
    ):
        MiniBatchSampler([3, 25], 16, 8, long_doc_policy="raise", doc_ids=["a", "big.txt"])
    with pytest.raises(DataError, match="document index 0 has 10 tokens.*2 such documents"):
        MiniBatchSampler(lengths, 16, 8, long_doc_policy="raise")


def test_split_chunks_are_consecutive_context_pieces() -> None:
    sampler = MiniBatchSampler([20], 8, 8)
    assert sorted(r for b in all_batches(sampler, 0) for r in b) == [
        ChunkRef(0, 0, 8),
        ChunkRef(0, 8, 8),
        ChunkRef(0, 16, 4),
    ]


def test_composition_is_deterministic_and_depends_on_seed_and_epoch() -> None:
    lengths = np.random.default_rng(0).integers(1, 500, size=300)
    a = MiniBatchSampler(lengths, 2048, 256, seed=7)
    b = MiniBatchSampler(lengths.tolist(), 2048, 256, seed=7)
    assert all_batches(a, 0) == all_batches(b, 0) and all_batches(a, 3) == all_batches(b, 3)
    assert all_batches(a, 0) != all_batches(a, 1)
    assert all_batches(a, 0) != all_batches(MiniBatchSampler(lengths, 2048, 256, seed=8), 0)
    # Asking for epochs out of order (as a resumed run does) changes nothing.
    c = MiniBatchSampler(lengths, 2048, 256, seed=7)
    assert c.batch(3, 2) == a.batch(3, 2) and c.batch(0, 5) == a.batch(0, 5)


def _order(seed: int, epoch: int, n: int = 6) -> list[int]:
    """The epoch's chunk order, read off one-token batches (a budget of one chunk each)."""
    sampler = MiniBatchSampler([1] * n, tokens_per_batch=1, context_length=1, seed=seed)
    return [r.doc for b in all_batches(sampler, epoch) for r in b]


def test_the_epoch_order_is_a_uniform_shuffle_of_the_chunks() -> None:
    """Every (seed, epoch) gives a permutation, and over seeds every chunk lands at every position
    about equally often (600 seeds x 6 positions: 100 expected, sd ~9; a sort by length, a rotation
    or an unshuffled epoch lands far outside 60-140). Epochs of one seed differ too."""
    orders = [_order(seed, 0) for seed in range(600)]
    assert all(sorted(o) == list(range(6)) for o in orders)
    where_first = Counter(o.index(0) for o in orders)
    assert all(60 <= where_first[p] <= 140 for p in range(6)), where_first
    assert len({tuple(_order(7, epoch)) for epoch in range(30)}) >= 25


def test_resume_from_state_dict_reproduces_remaining_batches() -> None:
    lengths = np.random.default_rng(1).integers(1, 300, size=200)
    run = MiniBatchSampler(lengths, 1024, 128, seed=3)
    it = iter(run)
    seen = [next(it) for _ in range(5)]
    state = run.state_dict()
    assert (state["epoch"], state["step"]) == (0, 5)
    rest = list(it) + list(run)  # the rest of epoch 0, then all of epoch 1
    resumed = MiniBatchSampler(lengths, 1024, 128, seed=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # Lightning calls this on resume; same epoch keeps the step
    again = list(resumed) + list(resumed)
    assert again == rest
    assert seen + rest[: run.num_batches(0) - 5] == all_batches(run, 0)
    resumed.set_epoch(4)
    assert (resumed.epoch, resumed.step) == (4, 0) and len(resumed) == resumed.num_batches(4)


def test_state_from_other_config_or_out_of_range_is_refused() -> None:
    sampler = MiniBatchSampler([100, 200, 300], 512, 128, seed=1)
    state = sampler.state_dict()
    with pytest.raises(DataError, match=r"tokens_per_batch.: \(512, 1024\)"):
        MiniBatchSampler([100, 200, 300], 1024, 128, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="tokens_per_epoch"):
        MiniBatchSampler([100, 200, 301], 512, 128, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="saved step must be in"):
        sampler.load_state_dict({**state, "step": 99})
    with pytest.raises(DataError, match="epoch must be an int >= 0, got -1"):
        sampler.load_state_dict({**state, "epoch": -1})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens_per_batch": 0}, "tokens_per_batch must be a positive int, got 0"),
        ({"tokens_per_batch": -5}, "got -5"),
        ({"tokens_per_batch": 1.5}, "got 1.5"),
        ({"context_length": 0}, "context_length must be a positive int, got 0"),
        (
            {"tokens_per_batch": 64, "context_length": 128},
            "tokens_per_batch=64 is smaller than context_length=128",
        ),
        ({"seed": -1}, "seed must be an int >= 0, got -1"),
        ({"long_doc_policy": "drop"}, "long_doc_policy must be one of.*'drop'"),
        ({"lengths": [3, -1]}, "document 1 has -1"),
        ({"lengths": [[1, 2]]}, "1-D sequence of integers"),
        ({"lengths": [1.5, 2.0]}, "dtype float64"),
        ({"lengths": [0, 0]}, "every document is empty"),
    ],
)
def test_bad_values_are_named(kwargs: dict, match: str) -> None:
    args = {"lengths": [10, 20], "tokens_per_batch": 256, "context_length": 128, **kwargs}
    with pytest.raises(DataError, match=match):
        MiniBatchSampler(**args)


def test_bad_step_and_epoch_are_named() -> None:
    sampler = MiniBatchSampler([10, 20], 256, 128)
    with pytest.raises(DataError, match=r"step must be in \[0, 1\) for epoch 0, got 1"):
        sampler.batch(0, 1)
    with pytest.raises(DataError, match="epoch must be an int >= 0, got -2"):
        sampler.num_batches(-2)


def test_chunk_refs_slice_tokens_back_into_documents() -> None:
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 1000, size=n) for n in (37, 0, 5, 64, 130)]
    corpus = TokenizedCorpus.from_token_arrays(docs)
    sampler = MiniBatchSampler(corpus.lengths, 96, 32, seed=11)
    pieces: dict[int, list[tuple[int, np.ndarray]]] = {}
    for refs in sampler:
        for r in refs:
            pieces.setdefault(r.doc, []).append((r.start, chunk_tokens(corpus, r)))
    assert len(corpus) == 4 and corpus.stats.empty_skipped == 1
    for i in range(len(corpus)):
        rebuilt = np.concatenate([t for _, t in sorted(pieces[i], key=lambda p: p[0])])
        assert np.array_equal(rebuilt, corpus.doc(i))
    with pytest.raises(DataError, match="runs past the end of document 0"):
        chunk_tokens(corpus, ChunkRef(0, 30, 10))
