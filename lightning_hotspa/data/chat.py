"""Instruction / chat data: JSONL conversations, tokenized with the tokenizer's chat template, loss
on the assistant's tokens only.

How the prompt mask travels: the token cache, the mini-batch sampler and the planner see one flat
id stream per document, so :class:`ChatTemplateTokenizer` writes prompt tokens as ``id + V`` (``V``
the tokenizer's vocabulary; the cache then stores int32). Nothing upstream of the rank's plan needs
to know: lengths, packing, splitting of long conversations and context-parallel slicing work on the
stream as on any document. When a rank's plan is cut, :func:`apply_prompt_mask` turns ids back
(``id - V``), sets the labels that would predict a prompt token to -100, and recounts
``num_target_tokens`` and the step's ``global_target_tokens``, so the token-mean loss is the mean over
response tokens of the whole mini-batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import BadRecordPolicy, DataError, require
from .source_base import Document, DocumentSource, _existing, files_fingerprint, list_files
from .tokenizer import Tokenizer

__all__ = ["ChatJsonlSource", "ChatTemplateTokenizer", "apply_prompt_mask", "response_targets"]

ROLES = ("system", "user", "assistant", "tool")


def _messages(row: Any, fields: Mapping[str, str]) -> list[dict[str, str]]:
    """The conversation of one row: ``messages`` as is, or built from prompt / response (+ system)."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
    if fields["messages"] in row:
        messages = row[fields["messages"]]
    elif fields["prompt"] in row and fields["response"] in row:
        messages = [{"role": "user", "content": row[fields["prompt"]]},
                    {"role": "assistant", "content": row[fields["response"]]}]
        if row.get(fields["system"]):
            messages.insert(0, {"role": "system", "content": row[fields["system"]]})
    else:
        raise ValueError(f"no {fields['messages']!r} field and no {fields['prompt']!r} + {fields['response']!r} "
                         f"fields (keys: {sorted(row)[:8]})")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{fields['messages']!r} must be a non-empty list")
    for m in messages:
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ValueError(f"a message needs a role in {list(ROLES)} and a string content, got {m!r:.80}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant message: nothing to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class ChatJsonlSource(DocumentSource):
    """One conversation per JSONL line: ``{"messages": [{"role", "content"}, ...]}`` or
    ``{"prompt": ..., "response": ...}`` (optional ``"system"``). Documents are the normalized
    conversation as JSON text, which :class:`ChatTemplateTokenizer` renders."""

    def __init__(self, path: str | os.PathLike[str], *, messages_field: str = "messages",
                 prompt_field: str = "prompt", response_field: str = "response", system_field: str = "system",
                 on_bad_record: BadRecordPolicy = "raise") -> None:
        super().__init__(on_bad_record)
        self.root = _existing(path, type(self).__name__)
        self.files = list_files(self.root, (".jsonl",), what=type(self).__name__)
        self.fields = {"messages": messages_field, "prompt": prompt_field, "response": response_field,
                       "system": system_field}

    def _documents(self) -> Iterator[Document]:
        for file in self.files:
            with open(file, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"{file}:{lineno}"
                    try:
                        messages = _messages(json.loads(line), self.fields)
                    except (ValueError, json.JSONDecodeError) as exc:
                        self._bad(where, str(exc))
                        continue
                    yield where, json.dumps(messages, ensure_ascii=False)

    def fingerprint(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "fields": self.fields, **files_fingerprint(self.root, self.files)}


class ChatTemplateTokenizer(Tokenizer):
    """A Hugging Face tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json`` with a
    ``chat_template``) that encodes :class:`ChatJsonlSource` documents with prompt tokens as
    ``id + token_vocab_size`` (see the module doc). ``vocab_size`` is the encoding's id range
    (twice the tokenizer's); ``token_vocab_size`` is what the model must hold."""

    def __init__(self, path: str | os.PathLike[str], *, chat_template: str | None = None) -> None:
        self.path = Path(path).expanduser()
        if not (self.path / "tokenizer.json").is_file():
            raise DataError(f"ChatTemplateTokenizer: {str(self.path)!r} has no tokenizer.json")
        transformers = require("transformers", "ChatTemplateTokenizer (chat templates)")
        self._tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(self.path))
        if chat_template is not None:
            self._tok.chat_template = chat_template
        if not getattr(self._tok, "chat_template", None):
            raise DataError(f"ChatTemplateTokenizer: {str(self.path)!r} has no chat_template in its "
                            f"tokenizer_config.json (pass chat_template=...)")
        self.token_vocab_size = len(self._tok)
        self.vocab_size = 2 * self.token_vocab_size
        self.eos_id = self._tok.eos_token_id
        self._digest = hashlib.sha256(b"".join(
            (self.path / f).read_bytes() for f in ("tokenizer.json", "tokenizer_config.json")
            if (self.path / f).is_file()) + self._tok.chat_template.encode()).hexdigest()

    @property
    def prompt_offset(self) -> int:
        """Prompt tokens are stored as ``id + prompt_offset`` (the DataModule undoes it per plan)."""
        return self.token_vocab_size

    @property
    def storage_dtype(self) -> np.dtype:
        return np.dtype(np.int32)

    def _ids(self, messages: Sequence[Mapping[str, str]], generation_prompt: bool) -> list[int]:
        text = self._tok.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=generation_prompt)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def encode(self, doc: bytes | str) -> np.ndarray:
        messages = json.loads(doc)
        ids = self._ids(messages, False)
        response = np.zeros(len(ids), dtype=bool)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start, turn = len(self._ids(messages[:i], True)), self._ids(messages[: i + 1], False)
            if ids[: len(turn)] != turn:
                raise DataError("ChatTemplateTokenizer: the chat template does not render a conversation as "
                                "a prefix of its continuation; the assistant turns cannot be found")
            response[start:len(turn)] = True
        out = np.asarray(ids, dtype=np.int64)
        return np.where(response, out, out + self.token_vocab_size).astype(np.int32)

    def fingerprint(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "sha256": self._digest}


def response_targets(docs: Sequence[np.ndarray], offset: int) -> int:
    """Labels with a loss in these (encoded) documents: positions whose next token is a response token."""
    return sum(int((np.asarray(d)[1:] < offset).sum()) for d in docs)


def _unmask(mb: Any, offset: int) -> Any:
    ids, labels = mb.input_ids, mb.labels
    labels = labels.masked_fill(labels >= offset, -100)  # predicting a prompt token: no loss
    ids = torch.where(ids >= offset, ids - offset, ids)
    return dataclasses.replace(mb, input_ids=ids, labels=labels, num_target_tokens=int((labels != -100).sum()))


def apply_prompt_mask(plan: Any, docs: Sequence[np.ndarray], offset: int) -> Any:
    """A rank's plan with the prompt encoding undone (module doc); ``docs``: the whole step's documents."""
    stages = tuple(dataclasses.replace(s, micro_batches=tuple(_unmask(mb, offset) for mb in s.micro_batches))
                   for s in plan.stages)
    return dataclasses.replace(plan, stages=stages, global_target_tokens=response_targets(docs, offset))
