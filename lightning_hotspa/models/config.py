"""Shape of a Llama-style decoder, with the presets and counts the planner needs.

The config is frozen and validated up front so that a bad value fails at construction with
its name, not later as a shape error deep inside a sharded forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..checks import check_int, check_number

__all__ = ["ARTIFACT_VOCAB", "Llama3RopeScaling", "LLAMA2_VOCAB", "LLAMA3_VOCAB", "LlamaConfig", "PRESETS"]


@dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama-3.1-style RoPE frequency scaling (Hugging Face ``rope_type: "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor
                and self.original_max_position_embeddings > 0):
            raise ValueError(f"Llama3RopeScaling needs factor > 0, 0 < low_freq_factor < high_freq_factor "
                             f"and original_max_position_embeddings > 0, got {self}")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Hyper-parameters of the decoder; ``head_dim = hidden // n_heads``."""

    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 4096
    # The embedding and LM head get ``padded_vocab_size`` rows so that every tensor-parallel
    # degree we use divides them evenly (uneven DTensor shards misalign: docs/DESIGN.md §7, trap "uneven shards").
    vocab_multiple: int = 128
    # Architecture variants found in released checkpoints (Hugging Face Llama / Mistral / Qwen2):
    qkv_bias: bool = False  # biases on the q / k / v projections (Qwen2)
    tie_embeddings: bool = False  # the LM head reuses the embedding matrix (no ``output`` module)
    rope_scaling: Llama3RopeScaling | None = None  # Llama-3.1 long-context frequency scaling
    sliding_window: int | None = None  # a query sees at most this many keys, itself included (Mistral)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):  # Hydra / JSON hand a mapping
            object.__setattr__(self, "rope_scaling", Llama3RopeScaling(**self.rope_scaling))
        for name in ("qkv_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig.{name} must be a bool, got {getattr(self, name)!r}")
        window = self.sliding_window
        if window is not None:
            check_int(window, "LlamaConfig.sliding_window", hint=" or None")
        for name in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads",
                     "ffn_hidden", "max_seq_len", "vocab_multiple"):
            check_int(getattr(self, name), f"LlamaConfig.{name}")
        for name in ("rope_theta", "norm_eps"):
            check_number(getattr(self, name), f"LlamaConfig.{name}")
        if self.hidden % self.n_heads:
            raise ValueError(
                f"LlamaConfig.hidden={self.hidden} is not divisible by n_heads={self.n_heads}"
            )
        if (self.hidden // self.n_heads) % 2:
            raise ValueError(
                f"LlamaConfig head_dim={self.hidden // self.n_heads} (hidden={self.hidden} / "
                f"n_heads={self.n_heads}) must be even for rotary embeddings"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_kv_heads={self.n_kv_heads} does not divide "
                f"n_heads={self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of ``vocab_multiple``."""
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named preset, optionally with some fields replaced."""
        if name not in PRESETS:
            raise ValueError(
                f"unknown LlamaConfig preset {name!r}; known presets: {sorted(PRESETS)}"
            )
        return dataclasses.replace(PRESETS[name], **overrides)

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Exact parameter count of :class:`Llama` built from this config (padded vocab)."""
        h, hd = self.hidden, self.head_dim
        attention = h * self.n_heads * hd * 2 + h * self.n_kv_heads * hd * 2  # wq, wo, wk, wv
        if self.qkv_bias:
            attention += (self.n_heads + 2 * self.n_kv_heads) * hd
        ffn = 3 * h * self.ffn_hidden
        per_layer = attention + ffn + 2 * h  # two RMSNorm weights
        head = self.padded_vocab_size * h  # the LM head (a matmul, also when tied)
        total = self.n_layers * per_layer + h + head
        if include_embedding and not self.tie_embeddings:  # tied: the head's matrix is the embedding
            total += self.padded_vocab_size * h
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token of a document of ``seq_len`` tokens.

        Dense part: 6 x the matmul parameters (the embedding lookup is not a matmul).
        Attention part: QK^T and AV cost 2 * 2 * n_heads * head_dim FLOPs per (query, key)
        pair forward, x3 for forward + backward; causal masking means a token of a document
        of length s attends to (s + 1) / 2 keys on average.
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len!r}")
        dense = 6.0 * self.num_params(include_embedding=False)
        attn_width = self.n_heads * self.head_dim
        attention = 12.0 * self.n_layers * attn_width * (seq_len + 1) / 2.0
        return dense + attention


LLAMA2_VOCAB = 32000  # the LLaMA / LLaMA-2 SentencePiece tokenizer (Hugging Face "meta-llama/Llama-2-*")
LLAMA3_VOCAB = 128256  # the Llama-3 tiktoken-based tokenizer (128000 + 256 reserved specials)
ARTIFACT_VOCAB = 30592  # the HotSPa artifact's Megatron-padded vocabulary: planning comparisons only


def _llama(vocab: int, hidden: int, layers: int, heads: int, kv: int, ffn: int, **kw: Any) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden=hidden, n_layers=layers, n_heads=heads,
                       n_kv_heads=kv, ffn_hidden=ffn, max_seq_len=kw.pop("max_seq_len", 32768), **kw)


PRESETS: dict[str, LlamaConfig] = {
    # Tests: 2 layers, GQA (4 q heads over 2 kv heads), byte vocab + specials padded to 320.
    # The byte tokenizer's ids are 0..255 and its specials from 256 on (up to 4 fit here).
    "tiny": LlamaConfig(vocab_size=260, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        ffn_hidden=176, max_seq_len=2048, vocab_multiple=64),
    # CPU demo, about 10M parameters, byte vocabulary (+ specials such as <eos> = 256).
    "small": LlamaConfig(vocab_size=260, hidden=384, n_layers=6, n_heads=8, n_kv_heads=4,
                         ffn_hidden=1024, max_seq_len=4096, vocab_multiple=64),
    # 1B class: TinyLlama's shape, which uses the LLaMA-2 tokenizer (32000 ids).
    "1b": _llama(LLAMA2_VOCAB, 2048, 22, 32, 4, 5632),
    # The paper's shapes (docs/REFERENCE.md §2) with the real LLaMA-2 vocabulary.
    "llama7b": _llama(LLAMA2_VOCAB, 4096, 32, 32, 32, 11008),
    "llama13b": _llama(LLAMA2_VOCAB, 5120, 40, 40, 40, 13824),
    "llama30b": _llama(LLAMA2_VOCAB, 6656, 60, 64, 64, 17920),
    # Llama 3 / 3.1 shapes ("The Llama 3 Herd of Models", table 3; 128K context for 3.1): GQA 8 kv heads,
    # RoPE theta 500000, the 128256-id vocabulary; the long-context simulator grid prices them to 512K.
    "llama3-8b": _llama(LLAMA3_VOCAB, 4096, 32, 32, 8, 14336, rope_theta=500000.0, max_seq_len=131072),
    "llama3-70b": _llama(LLAMA3_VOCAB, 8192, 80, 64, 8, 28672, rope_theta=500000.0, max_seq_len=131072),
    # The HotSPa artifact's models exactly (vocabulary 30592): for comparisons with its numbers.
    "artifact-llama7b": _llama(ARTIFACT_VOCAB, 4096, 32, 32, 32, 11008),
    "artifact-llama13b": _llama(ARTIFACT_VOCAB, 5120, 40, 40, 40, 13824),
    "artifact-llama30b": _llama(ARTIFACT_VOCAB, 6656, 60, 64, 64, 17920),
}
