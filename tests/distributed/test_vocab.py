"""Vocabulary safety: ids past the model's vocabulary fail with one clear error in every layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_hotspa.models import LlamaConfig, LlamaLM
from lightning_hotspa.models.vocab import VocabularyError, check_token_ids, check_tokenizer_fits
from lightning_hotspa.plan import pack_micro_batch


def _batch(last_id: int):
    return pack_micro_batch([torch.tensor([1, 2, 3, last_id, 5]), torch.tensor([7, 8, 9])])


@pytest.mark.parametrize("bad", [260, 319, 32000])  # 260..319: the padded rows of the tiny preset
def test_out_of_range_input_ids_are_refused(bad):
    lm = LlamaLM("tiny")
    lm.training_step(_batch(259))  # the largest real id is fine
    with pytest.raises(VocabularyError, match=rf"token id {bad}, outside the model's vocabulary of 260"):
        lm.training_step(_batch(bad))


def test_a_negative_id_is_named_as_a_data_bug_not_a_vocabulary_size():
    lm = LlamaLM("tiny")
    with pytest.raises(VocabularyError, match=r"hold token id -1: token ids are never negative") as info:
        lm.training_step(_batch(-1))
    assert "vocab_size >=" not in str(info.value)
    mb = _batch(4)
    mb.labels[0] = -5
    with pytest.raises(VocabularyError, match=r"labels hold token id -5.*only -100 \(no loss\)"):
        lm.training_step(mb)


def test_out_of_range_labels_are_refused():
    lm, mb = LlamaLM("tiny"), _batch(4)
    mb.labels[0] = 300
    with pytest.raises(VocabularyError, match="labels hold token id 300"):
        lm.training_step(mb)


def test_presets_carry_the_real_vocabularies():
    assert LlamaConfig.preset("llama7b").vocab_size == LlamaConfig.preset("1b").vocab_size == 32000
    assert LlamaConfig.preset("llama3-8b").vocab_size == 128256
    assert {n for n, c in __import__("lightning_hotspa.models.config", fromlist=["PRESETS"]).PRESETS.items()
            if c.vocab_size == 30592} == {"artifact-llama7b", "artifact-llama13b", "artifact-llama30b"}


def test_tokenizer_larger_than_the_model_fails_at_datamodule_setup(tmp_path):
    from lightning_hotspa.data import HotSPaDataModule

    check_tokenizer_fits(32000, 32000)
    (tmp_path / "a.txt").write_text("hello world " * 20)
    dm = HotSPaDataModule("text", {"path": str(tmp_path)}, "byte", use_cache=False,
                          tokens_per_batch=64, context_length=32)
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(config=LlamaConfig.preset("tiny", vocab_size=200)),
                                 strategy=None)
    with pytest.raises(VocabularyError,
                       match=r"tokenizer has 257 ids \(largest 256\) but the model's vocabulary has 200"):
        dm.setup("fit")


def run_tp_refusals() -> dict[str, str]:
    """dp2xtp2: an id outside every rank's vocab shard (the model's own check switched off, as for a model
    that is not ours) is refused by the parallel embedding and the vocab-parallel loss alike."""
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.parallel.loss import vocab_parallel_cross_entropy
    from lightning_hotspa.parallel.model import ParallelModel

    world = WorldMesh(["dp2xtp2"])
    group = world.layout_groups(Layout.parse("dp2xtp2")).tp
    out = {}
    emb = torch.nn.Module()
    emb.tok = torch.nn.Embedding(8, 4)  # each tp rank would hold 8 of 16 rows
    parallel = ParallelModel(emb, {"tok.weight": "vocab"}, world)
    parallel.activate(world.layouts[0], {"tok.weight": torch.nn.Parameter(torch.randn(8, 4))})
    for key, fn in {"embedding": lambda: emb.tok(torch.tensor([3, 16])),
                    "loss": lambda: vocab_parallel_cross_entropy(torch.randn(2, 8), torch.tensor([-100, 16]), group)
                    }.items():
        try:
            fn()
            out[key] = "no error"
        except VocabularyError as e:
            out[key] = str(e)
    # loss_fn opt-in: a module with a loss_fn and one vocab head keeps its loss_fn unless it opts in
    for opt_in in (False, True):
        head = torch.nn.Module()
        head.out = torch.nn.Linear(4, 16)
        head.loss_fn = original = torch.nn.functional.cross_entropy
        if opt_in:
            head.vocab_parallel_loss = True
        pm = ParallelModel(head, {"out.weight": "vocab", "out.bias": "vocab"}, world)
        out[f"opt_in={opt_in}"] = (pm.loss_parallel, head.loss_fn is original)
    dist.barrier()
    return out


def test_tensor_parallel_paths_refuse_ids_outside_every_shard_and_loss_fn_is_opt_in(ranks):
    for result in ranks(4).run(run_tp_refusals):
        assert "token id 16, outside the model's vocabulary of 16" in result["embedding"], result
        assert "labels hold token id 16" in result["loss"], result
        assert result["opt_in=False"] == (False, True) and result["opt_in=True"] == (True, False), result


def test_check_token_ids_ignores_only_the_ignore_index():
    check_token_ids(torch.tensor([-100, 0, 9]), 10, ignore_index=-100)
    with pytest.raises(VocabularyError):
        check_token_ids(torch.tensor([-100, 10]), 10, ignore_index=-100)


def test_a_tensor_that_passed_is_not_read_again_until_it_changes(monkeypatch):
    """Under tp one micro-batch's ids meet 2-4 checks; each would be a host sync on a GPU. The
    same unchanged tensor after an equal or stricter check costs nothing; anything else is read."""
    calls = []
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: calls.append(1) or real(t))
    ids = torch.tensor([1, 5, 9])
    check_token_ids(ids, 10)
    check_token_ids(ids, 10)
    check_token_ids(ids, 16)  # a looser check (the padded vocabulary of a vocab-parallel embedding)
    assert len(calls) == 1
    check_token_ids(ids, 9 + 1, ignore_index=-100)  # another ignore_index: read again
    assert len(calls) == 2
    check_token_ids(ids.clone(), 10)  # another tensor
    assert len(calls) == 3
    with pytest.raises(VocabularyError, match="token id 9"):
        check_token_ids(ids, 9)  # stricter: read again, and it fails
    ids[0] = 12  # changed in place: its version moved
    with pytest.raises(VocabularyError, match="token id 12"):
        check_token_ids(ids, 10)
    with torch.inference_mode():  # inference tensors carry no version counter: always read
        made = torch.tensor([1, 2])
        before = len(calls)
        check_token_ids(made, 10)
        check_token_ids(made, 10)
        assert len(calls) == before + 2
        with pytest.raises(VocabularyError):
            check_token_ids(torch.tensor([11]), 10)
