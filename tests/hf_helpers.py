"""Tiny random Hugging Face models built locally (nothing is downloaded) and their per-document
reference results: what our packed, parallel runs must equal."""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F

DOC_LENGTHS = [40, 7, 25, 64, 3, 19, 33, 12]  # 40 and 64 are longer than Mistral's test window
WINDOW = 24
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def hf_model(arch: str, seed: int = 0, **extra):
    """A random fp32 ``*ForCausalLM``; every tensor (biases and norms too) random, so no mapping
    mistake hides behind zeros or ones."""
    import transformers

    extra = dict(extra)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**BASE, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}, **extra)
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**BASE, sliding_window=WINDOW, **extra)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**BASE, **{"tie_word_embeddings": True, **extra})
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5 if "norm" in name else
                        0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def docs(vocab: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(b"hf-docs"))
    return [torch.randint(0, vocab, (n,), generator=g) for n in DOC_LENGTHS]


def hf_reference(model, documents):
    """Per-document logits (position t predicts token t+1, as in transformers), the token-mean loss
    over all documents, and the gradients (Hugging Face names)."""
    model.zero_grad()
    logits = [model(d[None]).logits[0] for d in documents]
    total = sum(F.cross_entropy(lg[:-1], d[1:], reduction="sum") for lg, d in zip(logits, documents))
    targets = sum(len(d) - 1 for d in documents)
    loss = total / targets
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return [lg.detach() for lg in logits], float(loss.detach()), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))
