"""Instruction data: JSONL conversations through a chat template (a tokenizer built here with
``tokenizers``: nothing is downloaded), loss on the assistant's tokens only, planned like any document."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import WORDS, make_tokenizer

pytest.importorskip("transformers")

from lightning_hotspa.data import HotSPaDataModule  # noqa: E402
from lightning_hotspa.data.chat import ChatTemplateTokenizer  # noqa: E402
from lightning_hotspa.layout import Layout, MeshShape  # noqa: E402
from lightning_hotspa.planner.rule import ThresholdPlanner  # noqa: E402

ROWS = [
    {"messages": [{"role": "system", "content": "fine"}, {"role": "user", "content": "hello how are you"},
                  {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "what is two plus two"},
                  {"role": "assistant", "content": "four"}]},
    {"prompt": "what is sky", "response": "sky is blue"},
    {"prompt": "hello", "response": "hello world", "system": "thanks"},
    {"prompt": " ".join(WORDS * 2), "response": " ".join(WORDS)},  # 60 tokens: a cp2 document
]


@pytest.fixture
def chat(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS * 4) + "\n")
    return tok_dir, data


def test_template_marks_only_assistant_tokens(chat):
    tok_dir, _ = chat
    tok = ChatTemplateTokenizer(tok_dir)
    v = tok.token_vocab_size
    ids = tok.encode(json.dumps(ROWS[0]["messages"]))
    words = [tok._tok.convert_ids_to_tokens(int(i) % v) for i in ids]
    response = [w for w, i in zip(words, ids) if i < v]
    assert response == ["fine", "thanks", "<|end|>", "four", "<|end|>"]
    assert words[:3] == ["<|system|>", "fine", "<|end|>"] and all(i >= v for i in ids[:3])


def test_datamodule_plans_chat_with_loss_on_responses_only(chat, tmp_path):
    from lightning_hotspa.data.datamodule import _ChunkTokens
    from lightning_hotspa.models import LlamaLM

    tok_dir, data = chat
    layouts = [Layout(dp=2), Layout(cp=2)]  # conversations over 32 tokens go to cp2
    dm = HotSPaDataModule("chat_jsonl", {"path": str(data)}, "chat", {"path": str(tok_dir)},
                          tokens_per_batch=160, context_length=64, cache_dir=str(tmp_path / "cache"),
                          planner=ThresholdPlanner(layouts, 32), mesh_shape=MeshShape.for_layouts(layouts, 2), rank=0)
    dm.setup("fit")
    v = dm._tokenizer.token_vocab_size
    dataset = dm._dataset("train")
    plan, refs = dataset.global_plan(0, 0)
    docs = [np.asarray(d) for d in _ChunkTokens(dataset.corpus, refs)]
    assert {s.layout for s in plan.stages} == set(layouts)  # both layouts used: dp and cp slicing
    expected = sum(int((d[1:] < v).sum()) for d in docs)
    plans = []
    for rank in (0, 1):
        dataset.rank = rank
        plans.append(dataset[0])
    assert plans[0].global_target_tokens == plans[1].global_target_tokens == expected
    assert expected < sum(len(d) - 1 for d in docs)  # prompts are really excluded
    mbs = [mb for p in plans for mb in p.micro_batches]
    assert all(int(mb.input_ids.max()) < v for mb in mbs)  # the prompt encoding never reaches the model
    assert sum(mb.num_target_tokens for mb in mbs) == expected  # cp ranks hold disjoint chunks
    # the strategy's token mean (each slice's mean loss x its share of the targets) equals the mean
    # cross entropy over response tokens of every whole conversation
    model = LlamaLM({"preset": "tiny", "vocab_size": v, "vocab_multiple": 8})
    dp_mbs = [mb for mb in mbs if mb.cp_size == 1]
    ours = sum(float(model.training_step(mb).detach()) * mb.num_target_tokens for mb in dp_mbs)
    total = count = 0
    for mb in dp_mbs:
        for i in mb.doc_ids:
            ids = torch.as_tensor(np.where(docs[i] >= v, docs[i] - v, docs[i]), dtype=torch.long)
            logits = model.model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32), len(ids))
            keep = torch.as_tensor(docs[i][1:] < v)
            total += float(F.cross_entropy(logits[:-1][keep], ids[1:][keep], reduction="sum").detach())
            count += int(keep.sum())
    assert count == sum(mb.num_target_tokens for mb in dp_mbs) > 0
    assert abs(ours - total) <= 1e-5 * abs(total)


def test_bad_conversations_are_named(tmp_path):
    from lightning_hotspa.data import DataError
    from lightning_hotspa.data.chat import ChatJsonlSource

    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1.*no assistant message"):
        list(ChatJsonlSource(tmp_path / "bad.jsonl"))
