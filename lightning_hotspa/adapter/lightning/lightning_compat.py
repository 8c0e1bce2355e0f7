"""Every private Lightning name the adapter uses, in one place (as ``torch_compat`` does for torch).

Lightning 2.x keeps these underscored; when one moves, this is the only file to change. Each is
used for what a strategy of Lightning's own does with it: launching ranks, starting the process
group, calling the hooks around a backward, syncing a logged value, creating a logged metric.
One private name lives elsewhere: the ``WandbLogger``'s pending ``_wandb_init`` arguments, in
``adapter/observability/wandb_run.py`` (observability/ sits below this folder and imports nothing from it).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized as distributed_is_initialized,
)
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from lightning.pytorch.trainer import call as _call
from lightning.pytorch.trainer.connectors.logger_connector.result import (
    _Metadata,
    _ResultMetric,
    _Sync,
)

__all__ = ["ResultMetric", "accumulates", "SubprocessScriptLauncher", "Sync", "call_callback_hooks", "call_module_hook",
           "default_process_group_backend", "distributed_is_initialized", "init_dist_connection",
           "forget_logged", "result_metadata", "sync_ddp_if_available", "trainer_results"]

ResultMetric = _ResultMetric
Sync = _Sync


def call_callback_hooks(trainer: Any, hook: str, *args: Any) -> None:
    """Lightning's ``call._call_callback_hooks``: ``hook`` on every callback, in the Trainer's order.

    Args:
        trainer: the running Trainer.
        hook: the hook's name.
        args: its arguments after ``trainer, pl_module``.
    """
    _call._call_callback_hooks(trainer, hook, *args)


def call_module_hook(trainer: Any, hook: str, *args: Any) -> Any:
    """Lightning's ``call._call_lightning_module_hook``: ``hook`` on the LightningModule, profiled.

    Args:
        trainer: the running Trainer.
        hook: the hook's name.
        args: its arguments.
    """
    return _call._call_lightning_module_hook(trainer, hook, *args)


def result_metadata(description: dict[str, Any]) -> Any:
    """The metadata of a logged metric (``_Metadata``) from a plain description of it.

    Args:
        description: ``fx``, ``name``, ``prog_bar``, ``logger``, ``on_step``, ``on_epoch``, ``reduce_fx``
            (``"mean"``, ``"sum"``, ``"max"`` or ``"min"``), ``add_dataloader_idx``, ``dataloader_idx``.
    """
    import torch

    reduce_fx = {"mean": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min}[description["reduce_fx"]]
    return _Metadata(fx=description["fx"], name=description["name"], prog_bar=description["prog_bar"],
                     logger=description["logger"], on_step=description["on_step"], on_epoch=description["on_epoch"],
                     reduce_fx=reduce_fx, add_dataloader_idx=description["add_dataloader_idx"],
                     dataloader_idx=description["dataloader_idx"])


def trainer_results(trainer: Any) -> Any:
    """The running loop's logged-metric collection (``trainer._results``), or None outside a loop.

    Args:
        trainer: the Trainer, or None.
    """
    return getattr(trainer, "_results", None) if trainer is not None else None


def forget_logged(results: Any, prefix: str) -> None:
    """Mark every value logged under a name starting with ``prefix`` as not logged this step.

    Lightning keeps each ``self.log`` key of an epoch in its result collection and hands the loggers
    every key's last value at every step, also the steps that did not log it (a stage that did not
    run would read as its last value). A reset value is left out until the next ``log`` of its name.

    Args:
        results: the loop's logged-metric collection (:func:`trainer_results`), or None.
        prefix: the start of the names to forget, e.g. ``"hotspa/"``.
    """
    if results is None:
        return
    for metric in results.values():
        if isinstance(metric, _ResultMetric) and metric.meta.name.startswith(prefix) and not metric.has_reset:
            metric.reset()


def accumulates(trainer: Any) -> bool:
    """Whether the running training batch only accumulates (no optimizer step after it).

    Args:
        trainer: the fitting Trainer.
    """
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())
