"""What ``recipes/train.py`` does with a composed Hydra config: check it, build every object from its
``_target_``, fit, report.

Why checks before building: with ``devices=4`` Lightning re-runs the script in 3 more processes, so a
mistake found during ``trainer.fit`` is printed four times, after seconds of start-up, wrapped in
launcher noise. Config mistakes are caught here, in the first process, and reported as one short
:class:`ConfigError` line that names the key, what was wrong and the valid choices.
"""

from __future__ import annotations

import importlib.resources
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from ...checks import check_int, is_int
from ..lightning.strategy_options import MOVED, moved_message
from .moved_targets import check_moved_targets

__all__ = ["ConfigError", "CONFIG_DIR", "check_config", "check_overrides", "find_config_dir", "group_options",
           "hardware_profile", "register_resolvers", "run_dir_name", "train"]


def find_config_dir() -> Path:
    """The top-level ``configs/`` folder: the package ``lightning_hotspa.configs`` that pyproject.toml
    maps to it (a wheel, an editable install), else the one beside the package (a checkout run
    without installing, as ``recipes/train.py`` allows)."""
    try:
        found = Path(str(importlib.resources.files("lightning_hotspa.configs")))
    except (ImportError, OSError):  # not installed, or an install made before configs/ moved
        found = None
    if found is None or not (found / "config.yaml").is_file():
        found = Path(__file__).resolve().parents[3] / "configs"
    return found


CONFIG_DIR = find_config_dir()
REQUIRED_GROUPS = ("model", "strategy", "data", "trainer")
_STRATEGY_TARGETS = ("lightning_hotspa.HotSPaStrategy", "lightning_hotspa.adapter.lightning.strategy.HotSPaStrategy")


class ConfigError(ValueError):
    """A config mistake; the message is meant to be printed as is (no traceback)."""


def hardware_profile(profile: str | None, accelerator: str) -> str:
    """The hardware group's profile, or the one this machine's accelerator implies (for configs that
    build a cost-model planner before any process exists)."""
    from ..observability.telemetry import detect_hardware

    if profile:
        return profile
    device, name = "cpu", ""
    if accelerator in ("gpu", "cuda", "auto"):
        import torch

        if torch.cuda.is_available():
            device, name = "cuda", torch.cuda.get_device_name(0)
        elif accelerator != "auto":
            device = "cuda"
    found = detect_hardware(None, 1.0, device, name)[0]
    if found is None:
        raise ConfigError(f"hardware: cannot tell the profile of {name or accelerator!r}; choose one with "
                          f"hardware=NAME ({', '.join(group_options('hardware'))})")
    return found


def run_dir_name(default: str) -> str:
    """A run folder name every rank agrees on without talking: the launcher's job id where there is
    one (torchrun's rendezvous id, SLURM's job id), else ``default`` (the time). Lightning's own
    launcher needs none of this: it hands its children the parent's ``hydra.run.dir``."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return f"slurm-{os.environ['SLURM_JOB_ID']}-{os.environ.get('SLURM_STEP_ID', '0')}"
    return default


def register_resolvers() -> None:
    """``${hotspa_div:a,b}`` (integer division, to size memory from the context),
    ``${hotspa_profile:profile,accelerator}`` (:func:`hardware_profile`) and
    ``${hotspa_run_dir:default}`` (:func:`run_dir_name`)."""
    if not OmegaConf.has_resolver("hotspa_div"):
        OmegaConf.register_new_resolver("hotspa_div", lambda a, b: int(a) // int(b))
    if not OmegaConf.has_resolver("hotspa_profile"):
        OmegaConf.register_new_resolver("hotspa_profile", hardware_profile)
    if not OmegaConf.has_resolver("hotspa_run_dir"):
        OmegaConf.register_new_resolver("hotspa_run_dir", run_dir_name, use_cache=True)


def group_options(group: str) -> list[str]:
    """Names of the bundled options of a config group (for error messages and tests)."""
    folder = CONFIG_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


# ------------------------------------------------------------------ checks
def _world_size(trainer_cfg: Any) -> int | None:
    """devices x num_nodes when both are plain ints (None for "auto" and friends)."""
    devices, nodes = trainer_cfg.get("devices", 1), trainer_cfg.get("num_nodes", 1)
    if isinstance(devices, (list, ListConfig)):
        devices = len(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if not is_int(devices) or devices < 1:
        return None
    return devices * nodes if is_int(nodes) and nodes >= 1 else None


def _layout_error(world: int | None, problem: str) -> ConfigError:
    from ..lightning.strategy import default_layouts

    if world is None:
        valid = "'auto', or a list of {dp, tp, cp} whose product dp*tp*cp is the world size"
    else:
        example = ", ".join("{" + (", ".join(f"{k}: {getattr(x, k)}" for k in ("dp", "tp", "cp")
                                             if getattr(x, k) > 1) or "dp: 1") + "}"
                            for x in default_layouts(world))
        valid = (f"'auto', or a list of {{dp, tp, cp}} with dp*tp*cp = {world} (trainer.devices x "
                 f"trainer.num_nodes), e.g. [{example}]")
    return ConfigError(f"strategy.layouts: {problem}. Valid: {valid}")


def check_strategy_keys(strategy_cfg: Any) -> None:
    """A HotSPaStrategy key that moved into an option group (``strategy.compile_blocks`` ->
    ``strategy.runtime.compile_blocks``) is the strategy's own one-line error, before anything is built."""
    if strategy_cfg.get("_target_") not in _STRATEGY_TARGETS:
        return
    for key in strategy_cfg:
        if key in MOVED:
            raise ConfigError(moved_message(str(key)))


def check_overrides(args: list[str]) -> str | None:
    """The moved-key error for a command-line override ``strategy.<old key>=...`` (Hydra would refuse it
    first, saying only that the key is not in the config), else None."""
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+~")
        group, _, leaf = key.partition(".")
        if "=" in arg and group == "strategy" and leaf in MOVED:
            return moved_message(leaf)
    return None


def check_layouts(strategy_cfg: Any, trainer_cfg: Any) -> None:
    """``strategy.layouts`` is "auto" or a list of layouts of the world size that share one mesh."""
    from ...layout import Layout, LayoutError, MeshShape, parse_layouts

    spec = strategy_cfg.get("layouts", "auto")
    world = _world_size(trainer_cfg)
    if isinstance(spec, str):
        if spec != "auto":
            raise _layout_error(world, f"got the string {spec!r}; write a list, e.g. [{spec}]")
        return
    if not isinstance(spec, (list, ListConfig)):
        raise _layout_error(world, f"got {spec!r} ({type(spec).__name__})")
    items = [OmegaConf.to_container(x) if isinstance(x, DictConfig) else x for x in spec]
    try:
        layouts = [Layout.parse(x) for x in items]
        if world is not None:
            MeshShape.for_layouts(parse_layouts(layouts, world), world)
    except LayoutError as exc:
        raise _layout_error(world, str(exc)) from None
    if not layouts:
        raise _layout_error(world, "the list is empty")


def _check_context(cfg: DictConfig) -> None:
    """With the rule planner: the context must fit the largest micro-batch some layout holds."""
    from ...layout import LayoutError, parse_layouts
    from ...planner.rule import ThresholdPlanner
    from ..lightning.strategy import default_layouts

    s, world = cfg.strategy, _world_size(cfg.trainer)
    context = cfg.data.get("context_length")
    planner_cfg = s.get("planner")
    if isinstance(planner_cfg, DictConfig) and isinstance(context, int):
        bounds = [b[0] if isinstance(b, (list, ListConfig)) else b for b in planner_cfg.get("buckets") or []]
        above = [b for b in bounds if isinstance(b, int) and b > context]
        if above:
            raise ConfigError(f"strategy.planner.buckets: bound(s) {above} are above data.context_length={context}; "
                              f"no document is longer than the context, so those buckets never fill: lower them "
                              f"or raise data.context_length")
    if world is None or s.get("_target_") not in _STRATEGY_TARGETS or s.get("planner", "rule") != "rule":
        return
    spec = s.get("layouts", "auto")
    try:
        layouts = default_layouts(world) if spec == "auto" else parse_layouts(
            [OmegaConf.to_container(x) if isinstance(x, DictConfig) else x for x in spec], world)
        planner = ThresholdPlanner(layouts, int(s.get("tokens_per_rank", 4096)))
    except (LayoutError, ValueError, TypeError):
        return  # reported elsewhere, or not ours to judge
    longest = planner.buckets[-1]
    if isinstance(context, int) and context > longest.high:
        raise ConfigError(
            f"data.context_length={context} is longer than any layout's micro-batch holds ({longest.high} tokens "
            f"in {longest.layout} with strategy.tokens_per_rank={s.get('tokens_per_rank')}); lower "
            f"data.context_length or raise strategy.tokens_per_rank")


#: (key, kind, minimum or None, what is valid beyond it): the values a recipe run type-checks before
#: building anything; kinds: "int" (check_int), "number" (check_number, > 0), "number0" (>= 0)
VALUE_CHECKS = (
    ("seed", "int", 0, ""),
    ("trainer.max_steps", "int", -1, " (-1: no limit)"),
    ("trainer.min_steps", "int", 0, " or null"),
    ("trainer.max_epochs", "int", -1, " (-1: no limit) or null"),
    ("trainer.min_epochs", "int", 0, " or null"),
    ("trainer.log_every_n_steps", "int", 1, ""),
    ("trainer.gradient_clip_val", "number0", None, " or null (no clipping)"),
    ("expect_loss_ratio", "number", None, " or null"),
    ("model.lr", "number", None, ""),
    ("model.weight_decay", "number0", None, ""),
    ("model.warmup_steps", "int", 0, ""),
    ("model.seed", "int", 0, ""),
    ("strategy.tokens_per_rank", "int", 1, ""),
    ("data.tokens_per_batch", "int", 1, ""),
    ("data.context_length", "int", 1, ""),
)


def check_values(cfg: DictConfig) -> None:
    """The plain values of :data:`VALUE_CHECKS` (where the config has them; null allowed where the
    hint says so) have their type and range, else a ConfigError naming the key and the value
    (``trainer.max_steps=lots``, ``seed=abc``, ``trainer.max_epochs=1.5``, ``model.lr=fast``)."""
    from ...checks import check_number

    for key, kind, minimum, hint in VALUE_CHECKS:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
        if not isinstance(node, DictConfig) or leaf not in node:
            continue
        value = node[leaf]
        if value is None and "null" in hint:
            continue
        if kind == "int":
            check_int(value, key, minimum=minimum, hint=hint, error=ConfigError)
            continue
        try:
            check_number(value, key, strict=kind == "number", error=ConfigError)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; valid: a number{hint}") from None


def check_config(cfg: DictConfig) -> None:
    """Raises :class:`ConfigError` (one line) for what would otherwise fail late or obscurely."""
    check_moved_targets(cfg, error=ConfigError)
    for group in REQUIRED_GROUPS:
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(f"config group {group!r} has no object to build (no _target_); choose one "
                              f"of {group_options(group)} with {group}=NAME, or give your own _target_")
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        key = getattr(exc, "full_key", None) or "a value"
        raise ConfigError(f"{key} is required (it is ??? in the config): set it on the command line, "
                          f"e.g. {key}=...") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot resolve the config: {_first_line(exc)}") from None
    check_values(cfg)
    check_strategy_keys(cfg.strategy)
    check_layouts(cfg.strategy, cfg.trainer)
    _check_context(cfg)


# ------------------------------------------------------------------ building
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def build(name: str, node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` with a one-line :class:`ConfigError` naming the group on failure."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as exc:
        cause = _root_cause(exc)
        target = node.get("_target_", "?") if isinstance(node, (DictConfig, Mapping)) else "?"
        what = _first_line(cause) if cause is not exc else _first_line(exc)
        raise ConfigError(f"{name}: could not build {target}: {what}") from exc


def _build_all(name: str, node: Any) -> list[Any]:
    """Every non-null entry of a mapping of objects (``logger``, ``callbacks``)."""
    if not isinstance(node, DictConfig):
        return []
    return [build(f"{name}.{key}", value) for key, value in node.items() if value is not None]


def checkpoint_callback(node: Any) -> Any:
    """A ``ModelCheckpoint`` every ``checkpoint.every_n_steps`` optimizer steps keeping the newest
    ``checkpoint.keep`` (by step), or None when periodic checkpoints are off."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if node is None or node.get("every_n_steps") is None:
        return None
    every, keep = node.get("every_n_steps"), node.get("keep", 2)
    check_int(every, "checkpoint.every_n_steps", hint=" or null (off)", error=ConfigError)
    if not is_int(keep) or keep == 0 or keep < -1:
        raise ConfigError(f"checkpoint.keep must be a positive int or -1 (all), got {keep!r}")
    dirpath = node.get("dirpath")
    if not dirpath:
        raise ConfigError("checkpoint.dirpath is empty; give the folder periodic checkpoints go to")
    return ModelCheckpoint(dirpath=str(dirpath), every_n_train_steps=every, save_top_k=keep, monitor="step",
                           mode="max", filename="{epoch}-{step}")


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """``ckpt_path``, with ``latest`` meaning the newest checkpoint in ``checkpoint.dirpath`` that
    every rank has (``latest:<dirpath>``, which HotSPaStrategy resolves with one collective once the
    processes are up: with node-local folders, the newest step every node has committed; none: an
    error), and ``latest_or_scratch`` the same, starting from scratch when there is none."""
    from ..checkpoints.nodes import LATEST_OR_SCRATCH_PREFIX, LATEST_PREFIX

    spec = cfg.get("ckpt_path")
    if spec not in ("latest", "latest_or_scratch"):
        return spec
    node = cfg.get("checkpoint") or {}
    dirpath = node.get("dirpath")
    if not dirpath:
        raise ConfigError(f"ckpt_path={spec} needs checkpoint.dirpath (the folder to look in)")
    return f"{LATEST_PREFIX if spec == 'latest' else LATEST_OR_SCRATCH_PREFIX}{dirpath}"


def save_final_checkpoint(trainer: Any, node: Any) -> Path | None:
    """With ``checkpoint.at_end``: the trained state as ``<dirpath>/step=S.ckpt`` for ``hotspa export``
    / ``consolidate`` or a resume; a periodic checkpoint of that step already there (``...-step=S.ckpt``)
    is used instead. Every rank calls it (the save is collective); returns the folder.

    Args:
        trainer: the Trainer after ``fit``.
        node: the ``checkpoint`` config node (``at_end``, ``dirpath``), or None.
    """
    if node is None or not node.get("at_end") or trainer.global_step == 0:
        return None
    dirpath = node.get("dirpath")
    if not dirpath:
        raise ConfigError("checkpoint.at_end needs checkpoint.dirpath (the folder to write to)")
    folder, step = Path(str(dirpath)), trainer.global_step
    found = sorted(folder.glob(f"*step={step}.ckpt")) if folder.is_dir() else []
    path = found[0] if found else folder / f"step={step}.ckpt"
    if not found:  # the same answer on every rank: the folder changes only in a (collective) save
        trainer.save_checkpoint(str(path), weights_only=False)  # full: resumable too
    if trainer.global_rank == 0:
        print(f"checkpoint: {path}\n  as a Hugging Face folder:  hotspa export {path} <out_dir>", flush=True)
    return path


def build_trainer(cfg: DictConfig) -> Any:
    """Strategy, loggers and callbacks first, then the Trainer that gets them."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    strategy = build("strategy", cfg.strategy)
    loggers = _build_all("logger", cfg.get("logger"))
    callbacks = _build_all("callbacks", cfg.get("callbacks"))
    if not loggers:  # Lightning refuses a LearningRateMonitor without a logger
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    extra = {}
    saver = checkpoint_callback(cfg.get("checkpoint"))
    if saver is not None:
        callbacks.append(saver)
        extra["enable_checkpointing"] = True
    make = build("trainer", cfg.trainer, _partial_=True)
    try:
        return make(strategy=strategy, logger=loggers or False, callbacks=callbacks, **extra)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"trainer: {_first_line(exc)}") from exc


# ------------------------------------------------------------------ the run
def _note_torchrun_run_dir() -> None:
    """torchrun without a rendezvous id starts each rank's Hydra separately, each naming its run
    folder by its own clock: say how to make them agree."""
    if os.environ.get("TORCHELASTIC_RUN_ID") != "none" or os.environ.get("RANK", "0") != "0":
        return
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.hydra)
    except (ValueError, ImportError):
        return
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        print("note: torchrun without --rdzv-id: pass hydra.run.dir=outputs/NAME so all ranks share one "
              "output folder",
              file=sys.stderr, flush=True)


def train(cfg: DictConfig) -> int:
    """Check, build, fit, report; returns the process exit status (non-zero: the loss check failed)."""
    import lightning as L

    from ..observability.callbacks import HotSPaMonitor
    from ..observability.quiet_logs import filter_unactionable_warnings, one_console_handler

    register_resolvers()
    one_console_handler()  # Hydra's job logging is set up by now: each Lightning line once
    filter_unactionable_warnings()
    check_config(cfg)
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    trainer = build_trainer(cfg)
    datamodule = build("data", cfg.data)
    with trainer.init_module(empty_init=bool(cfg.get("empty_init", False))):
        model = build("model", cfg.model)
    _note_torchrun_run_dir()
    if os.environ.get("LOCAL_RANK", "0") == "0" and "GROUP_RANK" in os.environ:  # one line per torchrun node
        print(f"hotspa: node {os.environ['GROUP_RANK']} (ranks from {os.environ.get('RANK')}, "
              f"{os.environ.get('LOCAL_WORLD_SIZE')} per node) writes to run folder {cfg.output_dir}", flush=True)
    trainer.fit(model, datamodule=datamodule, ckpt_path=resolve_ckpt_path(cfg))
    save_final_checkpoint(trainer, cfg.get("checkpoint"))
    monitor = next((c for c in trainer.callbacks if isinstance(c, HotSPaMonitor)), None)
    expected = cfg.get("expect_loss_ratio")
    if trainer.global_rank != 0 or expected is None:
        return 0
    ratio = monitor.summary.loss_ratio() if monitor is not None else None
    if ratio is None:
        print("loss check: no step losses were recorded (is HotSPaMonitor among the callbacks?)", flush=True)
        return 1
    ok = ratio[2] <= float(expected)
    print(f"loss check: mean of last 10 steps / first step = {ratio[1]:.4f} / {ratio[0]:.4f} = {ratio[2]:.3f}x "
          f"({'OK' if ok else 'FAILED'}: target <= {float(expected)}x)", flush=True)
    return 0 if ok else 1
