"""One check of token ids against the model's vocabulary, shared by every layout.

Why: an id past the vocabulary fails loudly only by accident. In pure data parallel the embedding
raises an IndexError (or a device-side assert on GPU); under tensor parallelism the id falls outside
every rank's vocab shard, reads a zero embedding and finds its target on no rank, so training goes
on silently wrong. Ids in the padded rows (``vocab_size <= id < padded_vocab_size``) are no real
token either. The model checks its inputs, the LightningModule its labels, and the parallel
embedding and loss check again for models that are not ours: all with this one message.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..host import host_reads
from ..host_facts import recall

__all__ = ["VocabularyError", "check_token_ids", "check_tokenizer_fits"]

#: id(tensor) -> (a weak reference to it, its version, ignore_index, the vocabulary it passed)
_PASSED: dict[int, tuple[weakref.ref, int, int | None, int]] = {}


class VocabularyError(ValueError):
    """Token ids (or a tokenizer) that do not fit the model's vocabulary; names both numbers."""


def _fix(largest: int, vocab_size: int) -> str:
    return (f"build the model with vocab_size >= {largest + 1} (presets: 'llama7b' etc. have the LLaMA-2 "
            f"32000, 'llama3-8b' the Llama-3 128256) or tokenize with the model's own tokenizer")


def check_token_ids(ids: Tensor, vocab_size: int, what: str = "input_ids",
                    ignore_index: int | None = None) -> None:
    """Raises :class:`VocabularyError` unless every id (except ``ignore_index``) is in ``[0, vocab_size)``.

    One min/max reduction and one host read (a sync on an accelerator) per tensor: a call on a
    tensor that already passed an equal or stricter check, unchanged since (same object, same
    version counter), returns at once. Under tp a micro-batch's ids meet the model's, the parallel
    embedding's and the vocab-parallel loss's checks; only the first pays.
    """
    if ids.numel() == 0:
        return
    known = recall(ids, "id_range")  # checked where the batch was built (plan.MicroBatch): no device read
    if known is not None and known[1] == ignore_index:
        low, high = known[0] or (0, 0)
        _raise_outside(low, high, vocab_size, what, ignore_index)
        return
    version = _version(ids)
    seen = _PASSED.get(id(ids))
    if (version is not None and seen is not None and seen[0]() is ids and seen[1] == version
            and seen[2] == ignore_index and seen[3] <= vocab_size):
        return
    with host_reads():  # real values even under the memory estimator's FakeTensorMode
        if ignore_index is not None:
            # ignore_index is never a valid id, so mapping it to 0 leaves min/max of the rest unchanged
            ids = ids.masked_fill(ids == ignore_index, 0)
        low, high = (int(v) for v in torch.stack(torch.aminmax(ids)).tolist())
    _raise_outside(low, high, vocab_size, what, ignore_index)
    if version is None:
        return
    if len(_PASSED) >= 64:  # only the current micro-batch's few tensors matter
        _PASSED.clear()
    _PASSED[id(ids)] = (weakref.ref(ids), version, ignore_index, vocab_size)


def _raise_outside(low: int, high: int, vocab_size: int, what: str, ignore_index: int | None) -> None:
    """Raises :class:`VocabularyError` naming the id outside ``[0, vocab_size)``, if any.

    Args:
        low, high: the smallest and largest id (``ignore_index`` excluded).
        vocab_size: the model's vocabulary.
        what: the tensor's name in the message.
        ignore_index: the label that stands for "no loss" (None for inputs).
    """
    if low < 0:
        hint = (f"; only {ignore_index} (no loss) may stand for a missing label" if ignore_index is not None
                else "")
        raise VocabularyError(f"{what} hold token id {low}: token ids are never negative{hint}; a negative id is a "
                              f"tokenizer or data bug, not a vocabulary size")
    if high >= vocab_size:
        raise VocabularyError(f"{what} hold token id {high}, outside the model's vocabulary of {vocab_size} "
                              f"ids (0..{vocab_size - 1}); {_fix(high, vocab_size)}")


def _version(t: Tensor) -> int | None:
    """The tensor's in-place version counter; None for inference tensors, which have none (their
    checks are never skipped)."""
    try:
        return t._version
    except RuntimeError:
        return None


def check_tokenizer_fits(tokenizer_vocab: int, model_vocab: int, where: str = "") -> None:
    """At setup: the tokenizer's largest id (``tokenizer_vocab - 1``) must be a row of the model."""
    if tokenizer_vocab > model_vocab:
        raise VocabularyError(f"{where}the tokenizer has {tokenizer_vocab} ids (largest {tokenizer_vocab - 1}) "
                              f"but the model's vocabulary has {model_vocab}; "
                              f"{_fix(tokenizer_vocab - 1, model_vocab)}")
