"""Activation bytes per token of one Llama step, ours next to its peers, with one tracker for all.

Every implementation runs the same shape (Llama-3 8B, Llama-2 7B) on one document of 4K and 8K tokens,
bf16 parameters, forward + token-mean loss + backward, no checkpointing, under ``FakeTensorMode`` (no
bytes behind the tensors). The tracker is torch's ``MemTracker`` (our lean per-op variant,
``testing/fake_world.py``) keeping the peak of the bytes that are neither parameters, gradients nor
optimizer state (activations and temporaries). Rows:

- ``ours_cpu``: our ``Llama`` with its CPU kernels (SDPA's flash kernel), loss through its blocked head;
- ``ours_gpu``: the same with the attention a GPU runs (a stand-in keeping what flash-attn's varlen
  kernel keeps, ``testing/gpu_attention.py``);
- ``hf_sdpa``: Hugging Face ``LlamaForCausalLM`` (``attn_implementation="sdpa"``, labels in the call);
- ``torchtitan``: not installable here (no network beyond PyPI wheels that pull a CUDA torch): the row
  is the figure measured on a GPU and quoted in issue 28 (``torchtitan_source`` says so).

Also: the loss head alone (hidden states in, loss and gradients out: bytes per token at the peak, the
slope between 4K and 8K tokens),
the planner's capacity of three layouts on H100, and ``hotspa memory``'s estimator against the memory
model on the ``--quick`` rows on both attention paths (max |measured / predicted - 1|).
Sequence parallelism: the estimator's activation bytes per token (the peak's slope between 4K and 8K
tokens, GPU attention path) of Llama-3 8B in tp1, tp2 and tp4 layouts on 4 ranks, their ratios to tp1
and the memory model's error on those rows (``sp_*`` keys).
The last line printed is one JSON object:

    python recipes/benchmark_memory_peers.py                 # everything (~15 minutes on 2 cores)
    python recipes/benchmark_memory_peers.py --no-estimator  # skip the estimator table
    python recipes/benchmark_memory_peers.py --sp-only       # the sequence-parallel rows alone
    python recipes/benchmark_memory_peers.py --smoke         # every row's code on the tiny preset (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lightning_hotspa.testing.fake_world import MemoryTracker, fake_mode, host_reads_real  # noqa: E402

SHAPES = {"llama3-8b": "llama3-8b", "llama2-7b": "llama7b"}  # issue name -> our preset
TOKENS = (4096, 8192)
#: issue 28's table: torchtitan 0.3 default on a GPU (fused RMSNorm, loss on 1/8 of the tokens at a time)
TORCHTITAN_ISSUE_FIGURES = {"llama3-8b": 5_635_532, "llama2-7b": 5_008_332}
#: sequence-parallel rows: (tp name, layout on SP_WORLD ranks) of Llama-3 8B
SP_LAYOUTS = (("tp1", "dp4"), ("tp2", "dp2xtp2"), ("tp4", "tp4"))
SP_WORLD = 4
#: ``hotspa memory`` rows of the estimator table (None: its QUICK_ROWS) and their hardware profile
ESTIMATOR_ROWS: tuple | None = None
ESTIMATOR_HARDWARE = "H100"
CAPACITY_ROWS = (("llama3-8b dp8:fsdp H100", "llama3-8b", 8, "dp8:fsdp"),
                 ("llama3-8b dp4xtp2 H100", "llama3-8b", 8, "dp4xtp2"),
                 ("llama3-70b dp8xtp8:fsdp H100", "llama3-70b", 64, "dp8xtp8:fsdp"))


class ActivationPeak(MemoryTracker):
    """The peak of activation + temporary bytes alone (parameters, gradients, optimizer state excluded)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.distributed._tools.mem_tracker import _MemRefType

        self._counted = (_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH)
        self.activation_peak = 0

    def _update_peak(self, peak_state: object) -> None:
        for dev, snap in self.tracker._curr_mem_snap.items():
            if getattr(dev, "type", dev) != "meta":
                self.activation_peak = max(self.activation_peak, sum(snap.get(k, 0) for k in self._counted))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created in ``dtype`` (fake parameters cannot be cast by ``module.to`` afterwards)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _ours(preset: str, tokens: int, gpu: bool) -> int:
    from lightning_hotspa.host import set_host_reads
    from lightning_hotspa.models import LlamaConfig, token_mean_cross_entropy
    from lightning_hotspa.models.llama import Llama

    config = LlamaConfig.preset(preset)
    ids, labels = torch.zeros(tokens, dtype=torch.long), torch.zeros(tokens, dtype=torch.long)
    pos, cu = torch.arange(tokens), torch.tensor([0, tokens], dtype=torch.int32)
    previous = set_host_reads(host_reads_real)
    try:
        with fake_mode():
            with _default_dtype(torch.bfloat16):
                model = Llama(config)
            if gpu:
                from lightning_hotspa.testing.gpu_attention import flash_varlen_standin

                model.set_attention_backend(flash_varlen_standin)
            with ActivationPeak() as mem:
                mem.track(model)
                if "labels" in inspect.signature(model.forward).parameters:
                    loss = model(ids, pos, cu, tokens, labels=labels)
                else:  # a checkout before the blocked loss head: logits, then the loss
                    loss = token_mean_cross_entropy(model(ids, pos, cu, tokens), labels)
                loss.backward()
    finally:
        set_host_reads(previous)
    return mem.activation_peak


def _hf(preset: str, tokens: int) -> int:
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    from lightning_hotspa.models import LlamaConfig

    c = LlamaConfig.preset(preset)
    hf = HFConfig(vocab_size=c.padded_vocab_size, hidden_size=c.hidden, intermediate_size=c.ffn_hidden,
                  num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                  rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, max_position_embeddings=max(TOKENS),
                  tie_word_embeddings=False, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    ids = torch.zeros(1, tokens, dtype=torch.long)
    with fake_mode():
        with _default_dtype(torch.bfloat16):
            model = LlamaForCausalLM(hf)
        model.train()
        with ActivationPeak() as mem:
            mem.track(model)
            model(input_ids=ids, labels=ids).loss.backward()
    return mem.activation_peak


def _loss_head_per_token(preset: str) -> dict[str, int]:
    """Bytes per token the loss head adds at its peak: the slope between 4K and 8K tokens, so what does
    not grow with the tokens (the head's weight gradient) is left out; plain vs blocked head."""
    small, large = _loss_head(preset, TOKENS[0]), _loss_head(preset, TOKENS[1])
    return {k: round((large[k] - small[k]) / (TOKENS[1] - TOKENS[0])) for k in large}


def _loss_head(preset: str, tokens: int) -> dict[str, int]:
    """Peak bytes of the loss head alone (hidden states in, loss and gradients out): plain vs blocked."""
    import torch.nn.functional as F

    from lightning_hotspa.host import set_host_reads
    from lightning_hotspa.models import LlamaConfig, token_mean_cross_entropy

    c = LlamaConfig.preset(preset)
    out = {}
    labels = torch.zeros(tokens, dtype=torch.long)
    previous = set_host_reads(host_reads_real)
    with fake_mode():
        weight = torch.nn.Parameter(torch.empty(c.padded_vocab_size, c.hidden, dtype=torch.bfloat16))
        hidden = torch.empty(tokens, c.hidden, dtype=torch.bfloat16, requires_grad=True)
        heads = {"plain": lambda: token_mean_cross_entropy(F.linear(hidden, weight), labels)}
        try:
            from lightning_hotspa.models.loss_head import linear_cross_entropy

            heads["blocked"] = lambda: linear_cross_entropy(hidden, weight, labels)
        except ImportError:  # a checkout before it
            pass
        for name, head in heads.items():
            with ActivationPeak() as mem:
                mem.track(weight)
                head().backward()
            out[name] = mem.activation_peak
            weight.grad = hidden.grad = None
    set_host_reads(previous)
    return out


def _capacity() -> dict[str, int]:
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel, resolve_model

    return {name: AnalyticCostModel(resolve_model(model), "H100", world).capacity(Layout.parse(lay), False)
            for name, model, world, lay in CAPACITY_ROWS}


def _estimator() -> dict[str, float]:
    from lightning_hotspa.tools import memory

    out = {}
    for path in getattr(memory, "ATTENTION_PATHS", ("cpu",)):
        kwargs = {"attention": path} if hasattr(memory, "ATTENTION_PATHS") else {}
        rows = memory.QUICK_ROWS if ESTIMATOR_ROWS is None else ESTIMATOR_ROWS
        out[path] = memory.estimate_rows(rows, ESTIMATOR_HARDWARE, log=lambda *a: None, **kwargs)["max_rel_error"]
    return out


def _sequence_parallel(preset: str = "llama3-8b") -> dict[str, object]:
    """Per-token activation bytes of ``preset`` per tp degree, measured by ``hotspa memory``'s estimator
    on the GPU path (slope of the peak between :data:`TOKENS`), next to the memory model's."""
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.models.config import LlamaConfig
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
    from lightning_hotspa.tools.memory import estimate_layout

    config = LlamaConfig.preset(preset)
    cm = AnalyticCostModel(config, "H100", SP_WORLD)
    measured, predicted, peak_errors = {}, {}, {}
    for name, layout in SP_LAYOUTS:
        lay = Layout.parse(layout)
        peaks = {t: estimate_layout(config, SP_WORLD, lay, t, attention="gpu")["peak_bytes"] for t in TOKENS}
        model = {t: cm.peak_bytes(lay, False, t) for t in TOKENS}
        span = TOKENS[1] - TOKENS[0]
        measured[name] = round((peaks[TOKENS[1]] - peaks[TOKENS[0]]) / span)
        predicted[name] = round((model[TOKENS[1]] - model[TOKENS[0]]) / span)
        peak_errors[name] = round(max(abs(peaks[t] / model[t] - 1) for t in TOKENS), 4)
        print(f"sp {preset} {layout:>8}: {measured[name]:10,} B/token measured, {predicted[name]:10,} predicted, "
              f"peak error {peak_errors[name]}", flush=True)
    return {"sp_activation_bytes_per_token": {"model": preset, "world": SP_WORLD, "attention": "gpu",
                                              "measured": measured, "predicted": predicted},
            "sp_activation_ratio": {k: round(measured[k] / measured["tp1"], 4) for k in measured if k != "tp1"},
            "sp_model_vs_estimator_max_rel_error": {
                "per_token": round(max(abs(predicted[k] / measured[k] - 1) for k in measured), 4),
                "peak": max(peak_errors.values())}}


def _smoke() -> None:
    """``--smoke``: every row's code on the tiny preset, small token counts and one estimator row on the
    cpu-gloo profile (seconds, for the test suite); no torchtitan figure exists for it, so no ratio."""
    global SHAPES, TOKENS, SP_LAYOUTS, ESTIMATOR_ROWS, ESTIMATOR_HARDWARE
    SHAPES, TOKENS = {"tiny": "tiny"}, (256, 512)
    SP_LAYOUTS = SP_LAYOUTS[:2]  # tiny's 2 kv heads split over tp2 at most
    ESTIMATOR_ROWS, ESTIMATOR_HARDWARE = (("tiny", 4, ("dp4", "dp2xtp2")),), "cpu-gloo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-estimator", action="store_true", help="skip the hotspa memory table")
    parser.add_argument("--no-hf", action="store_true", help="skip Hugging Face transformers")
    parser.add_argument("--no-sp", action="store_true", help="skip the sequence-parallel rows")
    parser.add_argument("--sp-only", action="store_true", help="only the sequence-parallel rows")
    parser.add_argument("--smoke", action="store_true", help="tiny preset, small token counts: the code path only")
    args = parser.parse_args()
    if args.smoke:
        _smoke()
    start = time.perf_counter()
    if args.sp_only:
        result = _sequence_parallel(next(iter(SHAPES.values())))
        result["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(result))
        return
    per_token: dict[str, dict[str, int]] = {"ours_cpu": {}, "ours_gpu": {}, "hf_sdpa": {}, "torchtitan": {}}
    for shape, preset in SHAPES.items():
        for tokens in TOKENS:
            rows = {"ours_cpu": _ours(preset, tokens, gpu=False), "ours_gpu": _ours(preset, tokens, gpu=True)}
            if not args.no_hf:
                rows["hf_sdpa"] = _hf(preset, tokens)
            for impl, nbytes in rows.items():
                per_token[impl][f"{shape}@{tokens}"] = round(nbytes / tokens)
                print(f"{impl:>9} {shape} {tokens:>5} tokens: {nbytes / tokens:12,.0f} B/token", flush=True)
        for impl in ("ours_cpu", "ours_gpu", "hf_sdpa"):
            values = [per_token[impl][f"{shape}@{t}"] for t in TOKENS if f"{shape}@{t}" in per_token[impl]]
            if values:
                per_token[impl][shape] = max(values)
        if shape in TORCHTITAN_ISSUE_FIGURES:
            per_token["torchtitan"][shape] = TORCHTITAN_ISSUE_FIGURES[shape]
    result = {
        "bytes_per_token": per_token,
        "ours_over_torchtitan": {s: round(per_token["ours_gpu"][s] / TORCHTITAN_ISSUE_FIGURES[s], 4)
                                 for s in SHAPES if s in TORCHTITAN_ISSUE_FIGURES},
        "ours_cpu_over_torchtitan": {s: round(per_token["ours_cpu"][s] / TORCHTITAN_ISSUE_FIGURES[s], 4)
                                     for s in SHAPES if s in TORCHTITAN_ISSUE_FIGURES},
        "loss_head_bytes_per_token": {s: _loss_head_per_token(p) for s, p in SHAPES.items()},
        "capacity_tokens": _capacity(),
        "torchtitan_source": "issue 28's GPU figures (torchtitan is not installed here)",
    }
    if not args.no_sp:
        result.update(_sequence_parallel(next(iter(SHAPES.values()))))
    if not args.no_estimator:
        errors = _estimator()
        result["estimator_vs_model_max_rel_error"] = max(errors.values())
        result["estimator_vs_model_by_path"] = errors
        result["estimator_rows"] = "QUICK_ROWS" if ESTIMATOR_ROWS is None else ESTIMATOR_ROWS
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
