"""What every ``hotspa`` sub-command shares: its error type, argument types and help formatter.

``hotspa`` itself is :mod:`.cli`; sub-commands that live in their own module (export, consolidate,
memory, check-calibration) add their parser with these.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["CliError", "HelpFormatter", "SubParser", "positive_int", "registry_names", "token_count"]


class CliError(Exception):
    """A bad input; printed as one line, exit code 2."""


_MAX_TOKENS, _MAX_INT = 2**30, 2**31 - 1  # beyond them an argument is a typo, not a plan (numpy's int64 overflows)


def token_count(text: str) -> int:
    """``32768``, ``32K`` / ``32k`` (x1024), ``1M`` (x1024^2)."""
    t = text.strip().lower()
    mult = {"k": 1024, "m": 1024**2}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if mult > 1 else t) * mult)
    except (ValueError, OverflowError):  # OverflowError: 'inf'
        raise argparse.ArgumentTypeError(f"expected a token count like 32768, 32K or 1M, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    if value > _MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"token counts above {_MAX_TOKENS // 1024**2}M are out of range, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """A positive integer argument (at most 2^31 - 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if not 1 <= value <= _MAX_INT:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {_MAX_INT}, got {text!r}")
    return value


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one (not a flag's False, not None:
    the help says what None means), unless the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)"


class SubParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with :class:`HelpFormatter` (every sub-command's parser is one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def registry_names() -> dict[str, str]:
    """The registries' names as help text: model presets, hardware profiles, length generators."""
    from ..data.lengths import LENGTH_PROFILES
    from ..model_shape import PRESET_SHAPES
    from ..planner.cost.hardware import PROFILES

    return {"models": ", ".join(n for n in PRESET_SHAPES if not n.startswith("artifact-")),
            "hardware": ", ".join(PROFILES), "data": ", ".join(LENGTH_PROFILES)}
