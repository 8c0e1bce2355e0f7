"""Any LightningModule: ``Trainer(strategy="hotspa")`` on a module without a tp plan picks the
layouts it supports and trains exactly like DDP."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers import lightning_rank_env, rel_errors
from torch import nn

import lightning_hotspa  # noqa: F401  (registers "hotspa")
from lightning_hotspa.adapter.lightning.module_layouts import supported_layouts
from lightning_hotspa.layout import Layout
from lightning_hotspa.models import LlamaLM
from lightning_hotspa.models.attention import sdpa_attention


class PlainMLP(L.LightningModule):
    """What a user writes: an MLP regressor, AdamW, an ordinary DataLoader; no tp plan."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class WithAttentionCore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.core_attention = sdpa_attention


def test_supported_layouts_follow_what_the_module_has():
    assert supported_layouts(LlamaLM("tiny"), 4) is None  # tp plan: the default candidates
    layouts, why = supported_layouts(nn.Linear(2, 2), 4)
    assert layouts == [Layout(dp=4)] and "defines no tp_plan" in why and "no core_attention" in why
    layouts, why = supported_layouts(WithAttentionCore(), 8)
    assert [str(x) for x in layouts] == ["dp8", "dp4xcp2", "dp2xcp4", "cp8"] and "splits its core_attention" in why
    assert supported_layouts(WithAttentionCore(), 6)[0] == [Layout(dp=6)]


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * 6 * 8, 8, generator=g)
    y = x[:, :1].sin() + 0.1 * torch.randn(x.shape[0], 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def plain_module_vs_ddp() -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    finals, layouts = {}, None
    for name, strategy in (("hotspa", "hotspa"), ("ddp", DDPStrategy())):
        model = PlainMLP()
        with lightning_rank_env():
            trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=6, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(model, torch.utils.data.DataLoader(_data(), batch_size=8))
        if name == "hotspa":
            layouts = [str(x) for x in trainer.strategy.layouts]
        finals[name] = {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
                        for n, p in model.named_parameters()}
    start = {n: p.detach() for n, p in PlainMLP().named_parameters()}
    dist.barrier()
    return {"layouts": layouts, "errors": rel_errors(finals["hotspa"], finals["ddp"]),
            "moved": min(rel_errors(finals["ddp"], start).values())}


@pytest.mark.slow
def test_plain_lightning_module_with_auto_layouts_equals_ddp(ranks):
    result = ranks(4).run(plain_module_vs_ddp)[0]
    assert result["layouts"] == ["dp4"]
    assert result["moved"] > 1e-3  # six AdamW steps really changed the weights
    worst = max(result["errors"], key=result["errors"].get)
    assert result["errors"][worst] <= 1e-6, (worst, result["errors"][worst])
