"""docs/extending.md followed once per recipe: a dummy piece registered the way the recipe says (an
attention kernel, a cp kind, a model family, a hardware profile, a W&B metric), then the rest of the
package is checked to pick it up by name. Registries are patched with ``monkeypatch``, so each test
leaves them as they were."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_hotspa import cp_kinds as kinds
from lightning_hotspa.layout import Layout
from lightning_hotspa.model_shape import PRESET_SHAPES, ModelShape, describe_model
from lightning_hotspa.models import attention_kernels as ak
from lightning_hotspa.models.config import PRESETS, LlamaConfig
from lightning_hotspa.models.hf_config import ARCHITECTURES, HFConfigError, config_from_hf
from lightning_hotspa.models.llama import Llama
from lightning_hotspa.parallel.core_attention import CP_ATTENTION
from lightning_hotspa.planner.candidates import cp_kinds
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
from lightning_hotspa.planner.cost.cp_memory import MEMORY_TERMS
from lightning_hotspa.planner.cost.hardware import PROFILES, get_profile

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
RECIPES = ("An attention kernel", "A context-parallel kind", "A model family", "Training a new model family",
           "A hardware profile", "A W&B metric")


def test_each_recipe_tested_here_is_in_the_doc() -> None:
    headings = re.findall(r"^## (.+?)(?::|$)", DOC.read_text(encoding="utf-8"), flags=re.M)
    assert [h for h in RECIPES if h not in headings] == [], headings


def _packed(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu, max(lengths)


def test_a_registered_attention_kernel_is_selectable_and_runs_in_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    sdpa = ak.KERNELS["sdpa"]
    calls: list[int] = []

    def dummy(q, k, v, cu_seqlens, max_seqlen, window=None):
        calls.append(q.shape[0])
        return sdpa.call(q, k, v, cu_seqlens, max_seqlen, window=window)

    record = dataclasses.replace(sdpa, name="dummy_varlen", summary="sdpa, counted", call=dummy)
    monkeypatch.setattr(ak, "_RECORDS", (*ak._RECORDS, record))
    monkeypatch.setitem(ak.KERNELS, record.name, record)
    monkeypatch.setitem(ak.BACKENDS, record.name, dummy)
    ak._check_records()  # the registry's own check accepts it
    assert ak.select_attention_backend("dummy_varlen", "cpu") is dummy
    assert ak.kernel_of(dummy) is record and ak.kernel("dummy_varlen", "documents") is record
    config = LlamaConfig.preset("tiny")
    torch.manual_seed(0)
    ours = Llama(config)
    reference = Llama(config)
    reference.load_state_dict(ours.state_dict())
    ours.set_attention_backend("dummy_varlen")
    reference.set_attention_backend("sdpa")
    ids, pos, cu, longest = _packed([5, 9, 3], config.vocab_size)
    torch.testing.assert_close(ours(ids, pos, cu, longest), reference(ids, pos, cu, longest))
    assert calls == [17] * config.n_layers  # one packed call per layer
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unknown attention backend 'dummy_varlen'"):
        ak.select_attention_backend("dummy_varlen")


def test_a_registered_cp_kind_is_parsed_offered_priced_and_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dummy kind takes over the hybrid's splits (``Layout.parse``'s grammar is compiled from the
    suffixes at import, so a new suffix needs a new import; the dummy reuses ``:kv<m>``)."""
    hybrid = kinds.CP_KINDS["hybrid"]
    priced: list[tuple[int, int, int]] = []

    def exchanges(shape, tp, cp, cp_kv):
        priced.append((tp, cp, cp_kv))
        return hybrid.exchanges(shape, tp, cp, cp_kv)

    dummy = dataclasses.replace(hybrid, name="dummy", summary="the hybrid, counted", exchanges=exchanges,
                                offer=lambda tp, cp, n: 2 if cp == 8 else None)
    monkeypatch.setattr(kinds, "_RECORDS", tuple(dummy if k is hybrid else k for k in kinds._RECORDS))
    monkeypatch.delitem(kinds.CP_KINDS, "hybrid")
    monkeypatch.setitem(kinds.CP_KINDS, "dummy", dummy)
    kinds._check_records()
    with pytest.raises(ValueError, match=r"missing \['dummy'\], not registered \['hybrid'\]"):
        kinds.check_bound(CP_ATTENTION, "CP_ATTENTION")  # what the import-time check says until it is bound
    for table in (CP_ATTENTION, MEMORY_TERMS):
        monkeypatch.setitem(table, "dummy", table["hybrid"])
        monkeypatch.delitem(table, "hybrid")
        kinds.check_bound(table, "bound")
    layout = Layout.parse("tp2xcp8:kv2")
    assert layout.cp_kind == "dummy" and layout.name == "tp2xcp8:kv2"
    assert cp_kinds(1, 8, 8) == [1, 8, 2]  # the candidates offer what its record offers
    AnalyticCostModel("llama3-8b", "H100", 16).option(layout, False, capacity=65536)
    assert priced and priced[-1] == (2, 8, 2)  # the cost model prices its collectives


def test_a_registered_model_family_loads_and_is_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family sharing Llama's tensor layout: its Hugging Face architecture and a preset."""
    hf = {"architectures": ["DummyForCausalLM"], "model_type": "dummy", "vocab_size": 256, "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    with pytest.raises(HFConfigError, match="unsupported architecture \\['DummyForCausalLM'\\]"):
        config_from_hf(hf)
    monkeypatch.setitem(ARCHITECTURES, "DummyForCausalLM", "dummy")
    config = config_from_hf(hf)
    assert (config.hidden, config.n_layers, config.n_kv_heads) == (64, 2, 2)
    monkeypatch.setitem(PRESETS, "dummy-tiny", config)
    monkeypatch.setitem(PRESET_SHAPES, "dummy-tiny", config.shape())
    assert LlamaConfig.preset("dummy-tiny") == config
    shape = describe_model("dummy-tiny")
    assert isinstance(shape, ModelShape) and shape == ModelShape.from_hf_config(hf)
    assert AnalyticCostModel("dummy-tiny", "cpu-gloo", 4).model == shape


def test_a_registered_hardware_profile_is_priced_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_hotspa.adapter.recipes.hydra_recipe import hardware_profile

    fast = dataclasses.replace(PROFILES["H100"], name="Dummy-2xH100", peak_flops=2 * PROFILES["H100"].peak_flops)
    monkeypatch.setitem(PROFILES, fast.name, fast)
    assert get_profile("dummy-2xh100") is fast  # case-insensitive, as `hardware=` and the cost planner ask
    assert hardware_profile("Dummy-2xH100", "gpu") == "Dummy-2xH100"
    layout = Layout.parse("dp8")
    base = AnalyticCostModel("llama3-8b", "H100", 8).option(layout, False, capacity=8192)
    ours = AnalyticCostModel("llama3-8b", "Dummy-2xH100", 8).option(layout, False, capacity=8192)
    assert ours.linear < base.linear  # its compute rate is what prices the step


def _doc_callback() -> type:
    """The callback of extending.md's metric recipe, run as the doc writes it."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## A W&B metric"):]
    code = section[section.index("```python") + len("```python"):]
    namespace: dict = {}
    exec(compile(code[:code.index("```")], str(DOC), "exec"), namespace)  # noqa: S102 - our own doc
    return namespace["SwitchShare"]


def test_a_metric_callback_reaches_the_logger(tmp_path: Path) -> None:
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_hotspa import HotSPaStrategy
    from lightning_hotspa.data import HotSPaDataModule
    from lightning_hotspa.models import LlamaLM

    data = HotSPaDataModule(source="synthetic", source_kwargs={"num_documents": 32, "kind": "bimodal", "seed": 0,
                                                               "max_length": 256},
                            tokenizer="byte", tokens_per_batch=512, context_length=256, seed=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HotSPaStrategy(["dp1"], tokens_per_rank=512),
                        max_steps=2, logger=CSVLogger(tmp_path), callbacks=[_doc_callback()()], log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0)
    try:
        trainer.fit(LlamaLM("tiny", max_steps=2), datamodule=data)
    finally:  # Lightning leaves its one-rank gloo group behind; later tests in this process need none
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    rows = list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))
    shares = [float(r["mine/switch_share"]) for r in rows if r.get("mine/switch_share")]
    assert len(shares) == 2 and all(0.0 <= s <= 1.0 for s in shares), rows
