"""What the planner and the cost model know of a decoder: its sizes, never its class.

:class:`ModelShape` holds the numbers that price a step (layers, hidden, query / key-value heads and
their width, the feed-forward width and matrix count, the vocabulary and whether the LM head reuses
the embedding) and the counts made from them (parameters, training FLOPs per token). It is filled
from a preset name (:data:`PRESET_SHAPES`, the same table ``models.config.PRESETS`` is built from),
from a Hugging Face ``config.json`` (:meth:`ModelShape.from_hf_config`), from any config that
describes itself (``LlamaConfig.shape()``), or by hand. :func:`describe_model` is the one way in;
``planner/`` and the cost model import no model class (tests/unit/test_architecture.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .checks import check_int

__all__ = ["ModelShape", "PRESET_SHAPES", "describe_model"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder's sizes, as the cost model prices them.

    Args:
        vocab_size: token ids.
        hidden: the residual stream's width.
        n_layers: decoder layers.
        n_heads: query heads.
        n_kv_heads: key / value heads (grouped-query attention: fewer than ``n_heads``).
        ffn_hidden: the feed-forward width.
        head_dim: one head's width; None: ``hidden // n_heads`` (Llama). Qwen3-style models state
            their own (attention width ``n_heads * head_dim`` need not be ``hidden``).
        ffn_matrices: ``hidden x ffn_hidden`` matrices per layer: 3 for SwiGLU, 2 for a GELU MLP.
        tie_embeddings: the LM head reuses the embedding matrix.
        qkv_bias: biases on the q / k / v projections.
        vocab_multiple: the embedding and head get ``vocab_size`` rounded up to a multiple of this.
    """

    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    head_dim: int | None = None
    ffn_matrices: int = 3
    tie_embeddings: bool = False
    qkv_bias: bool = False
    vocab_multiple: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "ffn_matrices",
                     "vocab_multiple"):
            check_int(getattr(self, name), f"ModelShape.{name}")
        for name in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelShape.{name} must be a bool, got {getattr(self, name)!r}")
        if self.head_dim is None:
            if self.hidden % self.n_heads:
                raise ValueError(f"ModelShape.hidden={self.hidden} is not divisible by n_heads={self.n_heads}; "
                                 f"give head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        check_int(self.head_dim, "ModelShape.head_dim")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelShape.n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}")

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of ``vocab_multiple``."""
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Exact parameter count (padded vocabulary; two norm weights per layer and a final one).

        Args:
            include_embedding: count the input embedding (never twice when tied to the head).
        """
        h, hd = self.hidden, int(self.head_dim or 0)
        attention = h * self.n_heads * hd * 2 + h * self.n_kv_heads * hd * 2  # wq, wo, wk, wv
        if self.qkv_bias:
            attention += (self.n_heads + 2 * self.n_kv_heads) * hd
        per_layer = attention + self.ffn_matrices * h * self.ffn_hidden + 2 * h
        head = self.padded_vocab_size * h  # the LM head (a matmul, also when tied)
        total = self.n_layers * per_layer + h + head
        if include_embedding and not self.tie_embeddings:
            total += self.padded_vocab_size * h
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token of a document of ``seq_len`` tokens: 6 x the
        matmul parameters, plus QK^T and AV (2 x 2 x attention width per (query, key) pair forward,
        x3 with backward) over the (s + 1) / 2 keys a causal token sees on average.

        Args:
            seq_len: the document's length, >= 1.
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len!r}")
        dense = 6.0 * self.num_params(include_embedding=False)
        attention = 12.0 * self.n_layers * self.n_heads * int(self.head_dim or 0) * (seq_len + 1) / 2.0
        return dense + attention

    def replace(self, **changes: Any) -> ModelShape:
        """This shape with some fields replaced (``head_dim`` recomputed unless given)."""
        if "head_dim" not in changes and ("hidden" in changes or "n_heads" in changes):
            changes["head_dim"] = None
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any) -> ModelShape:
        """A Hugging Face decoder config (``config.json`` as a mapping, or a ``PretrainedConfig``):
        ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``
        (default: the attention heads), ``intermediate_size``, ``vocab_size``, ``head_dim`` (optional),
        ``tie_word_embeddings``, ``attention_bias`` (Qwen2's q/k/v biases are implied by its
        ``model_type``).

        Args:
            config: the config, as a mapping or an object with ``to_dict()`` / attributes.
        """
        data = config if isinstance(config, Mapping) else (
            config.to_dict() if callable(getattr(config, "to_dict", None)) else vars(config))
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if data.get(k) is None]
        if missing:
            raise ValueError(f"a Hugging Face decoder config needs {missing}; got keys {sorted(data)}")
        heads = data["num_attention_heads"]
        return cls(vocab_size=data["vocab_size"], hidden=data["hidden_size"], n_layers=data["num_hidden_layers"],
                   n_heads=heads, n_kv_heads=data.get("num_key_value_heads") or heads,
                   ffn_hidden=data["intermediate_size"], head_dim=data.get("head_dim"),
                   tie_embeddings=bool(data.get("tie_word_embeddings", False)),
                   qkv_bias=bool(data.get("attention_bias", False)) or data.get("model_type") == "qwen2"
                   or "Qwen2ForCausalLM" in (data.get("architectures") or ()),
                   vocab_multiple=1)


def _shape(vocab: int, hidden: int, layers: int, heads: int, kv: int, ffn: int, **kw: Any) -> ModelShape:
    return ModelShape(vocab_size=vocab, hidden=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                      ffn_hidden=ffn, **kw)


_LLAMA2_VOCAB, _LLAMA3_VOCAB, _ARTIFACT_VOCAB = 32000, 128256, 30592

#: The named shapes (``models.config.PRESETS`` adds each one's Llama settings: RoPE, context).
PRESET_SHAPES: dict[str, ModelShape] = {
    # Tests: 2 layers, GQA (4 q heads over 2 kv heads), byte vocab + specials padded to 320.
    "tiny": _shape(260, 64, 2, 4, 2, 176, vocab_multiple=64),
    # CPU demo, about 10M parameters, byte vocabulary (+ specials such as <eos> = 256).
    "small": _shape(260, 384, 6, 8, 4, 1024, vocab_multiple=64),
    # 1B class: TinyLlama's shape, with the LLaMA-2 tokenizer (32000 ids).
    "1b": _shape(_LLAMA2_VOCAB, 2048, 22, 32, 4, 5632),
    # The paper's shapes (docs/REFERENCE.md §2) with the real LLaMA-2 vocabulary.
    "llama7b": _shape(_LLAMA2_VOCAB, 4096, 32, 32, 32, 11008),
    "llama13b": _shape(_LLAMA2_VOCAB, 5120, 40, 40, 40, 13824),
    "llama30b": _shape(_LLAMA2_VOCAB, 6656, 60, 64, 64, 17920),
    # Llama 3 / 3.1 ("The Llama 3 Herd of Models", table 3): GQA 8 kv heads, the 128256-id vocabulary.
    "llama3-8b": _shape(_LLAMA3_VOCAB, 4096, 32, 32, 8, 14336),
    "llama3-70b": _shape(_LLAMA3_VOCAB, 8192, 80, 64, 8, 28672),
    # The HotSPa artifact's models exactly (vocabulary 30592): for comparisons with its numbers.
    "artifact-llama7b": _shape(_ARTIFACT_VOCAB, 4096, 32, 32, 32, 11008),
    "artifact-llama13b": _shape(_ARTIFACT_VOCAB, 5120, 40, 40, 40, 13824),
    "artifact-llama30b": _shape(_ARTIFACT_VOCAB, 6656, 60, 64, 64, 17920),
}


def describe_model(model: ModelShape | str | Mapping[str, Any] | Any) -> ModelShape:
    """The :class:`ModelShape` of ``model``: a shape itself, a preset name (:data:`PRESET_SHAPES`), a
    config that describes itself (a ``shape()`` method, e.g. ``LlamaConfig``) or a Hugging Face
    config (a mapping or object with ``hidden_size``).

    Args:
        model: what to describe.
    """
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        if model not in PRESET_SHAPES:
            raise ValueError(f"unknown model preset {model!r}; known presets: {sorted(PRESET_SHAPES)} "
                             f"(or give a ModelShape, a LlamaConfig or a Hugging Face config)")
        return PRESET_SHAPES[model]
    if callable(getattr(model, "shape", None)):
        shape = model.shape()
        if isinstance(shape, ModelShape):
            return shape
    if isinstance(model, Mapping) or hasattr(model, "hidden_size"):
        return ModelShape.from_hf_config(model)
    raise TypeError(f"cannot describe {type(model).__name__} {model!r} as a model shape: give a preset name, a "
                    f"ModelShape, a LlamaConfig or a Hugging Face config")
