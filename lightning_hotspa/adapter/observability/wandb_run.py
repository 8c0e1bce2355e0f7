"""Weights & Biases without a key: decide online vs offline up front, and say where the run went.

Why decide ourselves: ``wandb.init`` without credentials either prompts (and hangs a non-interactive
job) or fails deep inside a child process. We look for a key the way ``wandb login`` stores one
(``WANDB_API_KEY``, an identity-token file, ``~/.netrc``), and without one we go offline, so the run
is still recorded on disk and can be uploaded later with ``wandb sync``. An explicit ``WANDB_MODE``
always wins. The decision is written to ``WANDB_MODE`` so processes Lightning launches later agree.
"""

from __future__ import annotations

import netrc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

__all__ = ["WandbDecision", "decide_wandb_mode", "drop_unset_wandb_init_keys", "find_api_key_source",
           "offline_run_message", "wandb_logger"]

_DEFAULT_HOST = "https://api.wandb.ai"


@dataclass(frozen=True)
class WandbDecision:
    """``mode`` is ``online``, ``offline`` or ``disabled``; ``reason`` is one line for the console."""

    mode: str
    reason: str


def find_api_key_source(env: dict[str, str] | None = None, home: Path | None = None) -> str | None:
    """Where a W&B credential was found (for the message), or None. Never reads the key out."""
    env = dict(os.environ) if env is None else env
    if env.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    if env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "WANDB_IDENTITY_TOKEN_FILE"
    host = urlparse(env.get("WANDB_BASE_URL") or _DEFAULT_HOST).hostname or "api.wandb.ai"
    path = Path(env["NETRC"]) if env.get("NETRC") else (home or Path.home()) / ".netrc"
    try:
        if path.is_file() and netrc.netrc(str(path)).authenticators(host):
            return str(path)
    except (OSError, netrc.NetrcParseError):
        return None
    return None


def decide_wandb_mode(offline: bool | str = "auto", env: dict[str, str] | None = None,
                      home: Path | None = None) -> WandbDecision:
    """``offline``: True / False, or ``"auto"`` (offline exactly when no credential is found)."""
    env = dict(os.environ) if env is None else env
    explicit = (env.get("WANDB_MODE") or "").strip().lower()
    if explicit in ("online", "offline", "disabled", "dryrun", "run", "shared"):  # wandb's own values
        mode = {"dryrun": "offline", "run": "online", "shared": "online"}.get(explicit, explicit)
        return WandbDecision(mode, f"WANDB_MODE={explicit} is set")
    if explicit:  # a typo (ofline, disabeld) must not pick another mode
        raise ValueError(f"WANDB_MODE={env.get('WANDB_MODE')!r} is not a W&B mode; use online, offline, disabled, "
                         f"shared (or dryrun / run), or unset it")
    if offline is True or (isinstance(offline, str) and offline.lower() == "true"):
        return WandbDecision("offline", "logger.wandb.offline=true")
    if offline is False or (isinstance(offline, str) and offline.lower() == "false"):
        return WandbDecision("online", "logger.wandb.offline=false")
    if offline != "auto":
        raise ValueError(f"wandb offline must be true, false or 'auto', got {offline!r}")
    source = find_api_key_source(env, home)
    if source is None:
        return WandbDecision("offline", "no W&B API key found (WANDB_API_KEY, ~/.netrc or `wandb login`)")
    return WandbDecision("online", f"W&B credentials from {source}")


def drop_unset_wandb_init_keys(logger: Any) -> None:
    """Remove ``anonymous=None`` from a ``WandbLogger``'s pending ``wandb.init`` arguments
    (``_wandb_init``, a private Lightning name): Lightning always passes it (``None`` unless asked), and
    wandb 0.31 prints "The anonymous setting has no effect" for any value it is given.

    Args:
        logger: a ``WandbLogger`` before its run starts.
    """
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and "anonymous" in init and init["anonymous"] is None:
        del init["anonymous"]


def wandb_logger(*, offline: bool | str = "auto", save_dir: str | None = None, **kwargs: Any) -> WandbLogger:
    """A :class:`WandbLogger` that runs offline by itself when there is no API key.

    Extra keyword arguments go to ``WandbLogger`` (``project``, ``name``, ``log_model``, ...).
    """
    decision = decide_wandb_mode(offline)
    if decision.mode in ("offline", "disabled"):
        os.environ["WANDB_MODE"] = decision.mode  # children launched later inherit it
        if kwargs.get("log_model"):
            kwargs["log_model"] = False  # model upload is impossible offline (WandbLogger refuses both)
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
    _announce(decision)
    if decision.mode == "offline" and "settings" not in kwargs:  # wandb's own lines say where the run is, twice:
        import wandb  # the monitor says it once, with the sync command (offline_run_message)

        kwargs["settings"] = wandb.Settings(silent=True)
    logger = WandbLogger(offline=decision.mode == "offline", save_dir=save_dir, **kwargs)
    drop_unset_wandb_init_keys(logger)  # wandb 0.31 warns about an `anonymous=None` it is handed
    logger.hotspa_wandb_decision = decision  # type: ignore[attr-defined]
    return logger


@rank_zero_only
def _announce(decision: WandbDecision) -> None:
    if decision.mode == "offline":  # where the run is and the sync command: once, at the end
        print(f"W&B: offline ({decision.reason}); the run's folder and its `wandb sync` command are printed at "
              f"the end.", flush=True)
    elif decision.mode == "disabled":
        print(f"W&B: disabled ({decision.reason}).", flush=True)


def offline_run_message(logger: WandbLogger) -> str:
    """After training: the run's folder and how to upload it (offline), or its URL (online)."""
    run = logger.experiment
    run_dir = Path(run.dir).parent if getattr(run, "dir", None) else None
    if getattr(run, "offline", False) or getattr(getattr(run, "settings", None), "mode", "") == "offline":
        if run_dir is None:
            return "W&B run: offline (no run folder)"
        return f"W&B run (offline), upload it with:  wandb sync {run_dir}"
    url = getattr(run, "url", None)
    return f"W&B run: {url}" if url else f"W&B run: {run_dir or 'disabled'}"
