"""Tokenizers with one small interface: ``encode(bytes | str) -> int32 array``.

The byte tokenizer needs no files and accepts any bytes (the stdlib corpus has non-UTF-8 files);
the Hugging Face one loads a ``tokenizer.json``; the chat one applies its chat template and marks prompt
tokens (data/chat.py). Both expose a ``fingerprint()`` so the token
cache is invalidated when the tokenizer changes.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError, require

COMMON_EOS_TOKENS: tuple[str, ...] = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")


class Tokenizer(abc.ABC):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    eos_id: int | None

    @abc.abstractmethod
    def encode(self, doc: bytes | str) -> np.ndarray:
        """Token ids of one document as a 1-D int32 array."""

    def encode_batch(self, docs: Sequence[bytes | str]) -> list[np.ndarray]:
        """Several documents at once (overridden where batching is faster)."""
        return [self.encode(d) for d in docs]

    @abc.abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """JSON-able identity: changes whenever ``encode`` could give different ids."""

    @property
    def storage_dtype(self) -> np.dtype:
        """Smallest dtype holding every id: uint16 halves the on-disk cache for small vocabs."""
        return np.dtype(np.uint16) if self.vocab_size <= 1 << 16 else np.dtype(np.int32)


class ByteTokenizer(Tokenizer):
    """One token per byte (ids 0..255), then optional special tokens from id 256 on.

    A ``str`` is encoded as UTF-8 (``surrogatepass``, so no string can fail). ``append_eos``
    adds the ``<eos>`` id after every document; packing marks document ends with
    ``cu_seqlens`` anyway, so it is off by default.
    """

    def __init__(
        self, special_tokens: Sequence[str] = ("<eos>",), *, append_eos: bool = False
    ) -> None:
        self.special_tokens = tuple(special_tokens)
        if len(set(self.special_tokens)) != len(self.special_tokens):
            raise DataError(
                f"ByteTokenizer special_tokens must be unique, got {self.special_tokens}"
            )
        self.vocab_size = 256 + len(self.special_tokens)
        self.eos_id = self.token_to_id("<eos>") if "<eos>" in self.special_tokens else None
        if append_eos and self.eos_id is None:
            raise DataError("ByteTokenizer append_eos=True needs '<eos>' among special_tokens")
        self.append_eos = append_eos

    def token_to_id(self, token: str) -> int:
        """Id of a special token."""
        try:
            return 256 + self.special_tokens.index(token)
        except ValueError:
            raise DataError(f"ByteTokenizer has no special token {token!r}") from None

    def encode(self, doc: bytes | str) -> np.ndarray:
        raw = doc.encode("utf-8", errors="surrogatepass") if isinstance(doc, str) else bytes(doc)
        ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int32)
        if self.append_eos:
            ids = np.append(ids, np.int32(self.eos_id))
        return ids

    def decode(self, ids: np.ndarray) -> bytes:
        """The bytes back (special ids dropped): for tests and debugging."""
        arr = np.asarray(ids)
        return arr[arr < 256].astype(np.uint8).tobytes()

    def fingerprint(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "special_tokens": list(self.special_tokens),
            "append_eos": self.append_eos,
        }


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file.

    Bytes are decoded as UTF-8 with replacement characters (HF tokenizers take ``str``).
    ``eos_token`` picks the end-of-sequence token; by default the first of
    :data:`COMMON_EOS_TOKENS` that the vocabulary has, else ``None``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        eos_token: str | None = None,
        add_special_tokens: bool = False,
    ) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise DataError(f"HFTokenizer: tokenizer file does not exist: {str(self.path)!r}")
        tokenizers = require("tokenizers", f"HFTokenizer({str(self.path)!r})")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise DataError(f"HFTokenizer: cannot load {str(self.path)!r} ({exc})") from exc
        self.add_special_tokens = add_special_tokens
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_token = eos_token
        self.eos_id = self._find_eos(eos_token)
        self._sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()

    def _find_eos(self, eos_token: str | None) -> int | None:
        if eos_token is not None:
            found = self._tok.token_to_id(eos_token)
            if found is None:
                raise DataError(f"HFTokenizer: {str(self.path)!r} has no token {eos_token!r}")
            return int(found)
        for name in COMMON_EOS_TOKENS:
            found = self._tok.token_to_id(name)
            if found is not None:
                return int(found)
        return None

    @staticmethod
    def _text(doc: bytes | str) -> str:
        return doc if isinstance(doc, str) else bytes(doc).decode("utf-8", errors="replace")

    def encode(self, doc: bytes | str) -> np.ndarray:
        enc = self._tok.encode(self._text(doc), add_special_tokens=self.add_special_tokens)
        return np.asarray(enc.ids, dtype=np.int32)

    def encode_batch(self, docs: Sequence[bytes | str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(
            [self._text(d) for d in docs], add_special_tokens=self.add_special_tokens
        )
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def fingerprint(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "sha256": self._sha256,
            "eos_token": self.eos_token,
            "add_special_tokens": self.add_special_tokens,
        }


class ChatTemplateTokenizer(Tokenizer):
    """A Hugging Face tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json`` with a
    ``chat_template``) that encodes :class:`~.chat.ChatJsonlSource` documents with prompt tokens as
    ``id + token_vocab_size`` (see :mod:`.chat`). ``vocab_size`` is the encoding's id range
    (twice the tokenizer's); ``token_vocab_size`` is what the model must hold."""

    def __init__(self, path: str | os.PathLike[str], *, chat_template: str | None = None) -> None:
        self.path = Path(path).expanduser()
        if not (self.path / "tokenizer.json").is_file():
            raise DataError(f"ChatTemplateTokenizer: {str(self.path)!r} has no tokenizer.json")
        transformers = require("transformers", "ChatTemplateTokenizer (chat templates)")
        try:
            self._tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(self.path))
        except Exception as exc:  # noqa: BLE001 - a JSONDecodeError or the Rust side's error names no file
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise DataError(f"ChatTemplateTokenizer: cannot load the tokenizer in {str(self.path)!r} (tokenizer.json "
                            f"or tokenizer_config.json corrupt or cut off?): {type(exc).__name__}: {first}") from None
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
        self._check_template()

    def _check_template(self) -> None:
        """A two-turn probe conversation must give the assistant's reply some target tokens (else
        :meth:`encode` raises, naming the template: every label would be -100)."""
        probe = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}]
        try:
            self.encode(json.dumps(probe))
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template that fails on the probe is named here
            raise DataError(f"ChatTemplateTokenizer: the chat template of {str(self.path)!r} fails on a "
                            f"user + assistant conversation: {type(exc).__name__}: {exc}") from None
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
        if not response.any():
            raise DataError(f"ChatTemplateTokenizer: the chat template of {str(self.path)!r} renders no tokens of the "
                            f"assistant's turns in this conversation ({doc[:80]!r}): every label would be -100, it "
                            f"would train on nothing; use a template that renders the assistant's turns")
        out = np.asarray(ids, dtype=np.int64)
        return np.where(response, out, out + self.token_vocab_size).astype(np.int32)

    def fingerprint(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "sha256": self._digest}


def build_tokenizer(kind: str, /, **kwargs: Any) -> Tokenizer:
    """Build a tokenizer by name (for configs): ``"byte"``, ``"hf"`` or ``"chat"`` (``path=`` required)."""
    kinds: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer, "hf": HFTokenizer, "chat": ChatTemplateTokenizer}
    if kind not in kinds:
        raise DataError(f"unknown tokenizer kind {kind!r}; known kinds: {sorted(kinds)}")
    try:
        return kinds[kind](**kwargs)
    except TypeError as exc:
        raise DataError(
            f"build_tokenizer({kind!r}): bad arguments {sorted(kwargs)} ({exc})"
        ) from exc
