"""Shape of a Llama-style decoder, with the presets and counts the planner needs.

The config is frozen and validated up front so that a bad value fails at construction with
its name, not later as a shape error deep inside a sharded forward pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["LlamaConfig", "PRESETS"]


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
    # degree we use divides them evenly (uneven DTensor shards misalign; see DESIGN.md §7).
    vocab_multiple: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads",
                     "ffn_hidden", "max_seq_len", "vocab_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {value!r}")
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
        ffn = 3 * h * self.ffn_hidden
        per_layer = attention + ffn + 2 * h  # two RMSNorm weights
        head = self.padded_vocab_size * h  # untied LM head
        total = self.n_layers * per_layer + h + head
        if include_embedding:
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


_LLAMA_VOCAB = 30592  # the HotSPa artifact's (Megatron-padded) LLaMA vocabulary

PRESETS: dict[str, LlamaConfig] = {
    # Tests: 2 layers, GQA (4 q heads over 2 kv heads), byte vocab + specials padded to 320.
    # The byte tokenizer's ids are 0..255 and its specials from 256 on (up to 4 fit here).
    "tiny": LlamaConfig(vocab_size=260, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        ffn_hidden=176, max_seq_len=2048, vocab_multiple=64),
    # CPU demo, about 10M parameters, byte vocabulary (+ specials such as <eos> = 256).
    "small": LlamaConfig(vocab_size=260, hidden=384, n_layers=6, n_heads=8, n_kv_heads=4,
                         ffn_hidden=1024, max_seq_len=4096, vocab_multiple=64),
    # 1B class (TinyLlama-like shape with the LLaMA vocabulary).
    "1b": LlamaConfig(vocab_size=_LLAMA_VOCAB, hidden=2048, n_layers=22, n_heads=32,
                      n_kv_heads=4, ffn_hidden=5632, max_seq_len=32768),
    # The paper's shapes (REFERENCE.md).
    "llama7b": LlamaConfig(vocab_size=_LLAMA_VOCAB, hidden=4096, n_layers=32, n_heads=32,
                           n_kv_heads=32, ffn_hidden=11008, max_seq_len=32768),
    "llama13b": LlamaConfig(vocab_size=_LLAMA_VOCAB, hidden=5120, n_layers=40, n_heads=40,
                            n_kv_heads=40, ffn_hidden=13824, max_seq_len=32768),
    "llama30b": LlamaConfig(vocab_size=_LLAMA_VOCAB, hidden=6656, n_layers=60, n_heads=64,
                            n_kv_heads=64, ffn_hidden=17920, max_seq_len=32768),
    # Llama 3 / 3.1 shapes (GQA, 8 kv heads; "The Llama 3 Herd of Models", table 3; 128K context
    # for 3.1); the long-context simulator grid prices them up to 512K tokens.
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             ffn_hidden=14336, max_seq_len=131072),
    "llama3-70b": LlamaConfig(vocab_size=128256, hidden=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              ffn_hidden=28672, max_seq_len=131072),
}
