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
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .errors import BadRecordPolicy, DataError
from .source_base import Document, DocumentSource, _existing, files_fingerprint, list_files, utf8_problem
from .tokenizer import ChatTemplateTokenizer

__all__ = ["ChatJsonlSource", "ChatTemplateTokenizer", "apply_prompt_mask", "check_chat_pairing", "response_targets"]

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
    first = next(i for i, m in enumerate(messages) if m["role"] != "system")
    if messages[first]["role"] == "assistant":
        raise ValueError(f"message {first} (the first after any system message) is the assistant's: a conversation "
                         f"starts with a user (or tool) turn that the reply answers")
    bad = [i for i, m in enumerate(messages) if utf8_problem(m["content"])]
    if bad:
        raise ValueError(f"message {bad[0]} content: {utf8_problem(messages[bad[0]]['content'])}")
    empty = [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m["content"].strip()]
    if empty:
        raise ValueError(f"assistant message {empty[0]} (of {len(messages)}) has empty content: its reply would be "
                         f"only the template's end token")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _utf8(raw: bytes) -> str:
    """One line as text; a line that is not UTF-8 is a ``ValueError`` naming the byte (a bad record)."""
    problem = utf8_problem(raw)
    if problem:
        raise ValueError(problem)
    return raw.decode("utf-8")


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
            with open(file, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    where = f"{file}:{lineno}"
                    try:
                        messages = _messages(json.loads(_utf8(raw)), self.fields)
                    except (ValueError, json.JSONDecodeError) as exc:
                        self._bad(where, str(exc))
                        continue
                    yield where, json.dumps(messages, ensure_ascii=False)

    def fingerprint(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "fields": self.fields, **files_fingerprint(self.root, self.files)}


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


def check_chat_pairing(source: Any, tokenizer: Any, name: str) -> None:
    """Chat sources need the chat tokenizer (prompt masking) and the chat tokenizer needs chat documents.

    Args:
        source: the DataModule's document source (None: a tokenized corpus).
        tokenizer: its tokenizer.
        name: the owner named in the error.
    """
    if source is None:
        return
    chat_source, chat_tokenizer = isinstance(source, ChatJsonlSource), isinstance(tokenizer, ChatTemplateTokenizer)
    if chat_source and not chat_tokenizer:
        raise DataError(f"{name}: a {type(source).__name__} needs the chat tokenizer (tokenizer='chat', "
                        f"path=<a tokenizer folder with a chat_template>); {type(tokenizer).__name__} would train on "
                        f"the raw JSON text, with loss on the prompts")
    if chat_tokenizer and not chat_source:
        raise DataError(f"{name}: the chat tokenizer renders conversations of a ChatJsonlSource (source='chat_jsonl'); "
                        f"{type(source).__name__} yields plain text: use tokenizer='hf' with the same path for it")
