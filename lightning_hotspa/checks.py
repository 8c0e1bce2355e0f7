"""Validation of plain numbers and JSON files, written once: every bad input gets an error naming its value.

``bool`` is rejected where an int is wanted (``True`` is an ``int`` in Python, and a YAML ``yes``
would otherwise pass as 1); numpy integers are accepted and returned as ``int``. Each caller
passes its own exception type (``LayoutError``, ``PlanError``, ``DataError``, ...), so the errors
stay the ones its callers catch.
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any

__all__ = ["check_int", "check_number", "is_int", "read_json_object"]


def is_int(value: Any) -> bool:
    """An integer (Python or numpy), but not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int_words(minimum: int) -> str:
    return {1: "a positive int", 0: "an int >= 0"}.get(minimum, f"an int >= {minimum}")


def check_int(value: Any, what: str, *, minimum: int = 1, error: type[Exception] = ValueError,
              hint: str = "") -> int:
    """``value`` as an ``int`` if it is an integer ``>= minimum``; else ``error`` naming ``what``
    and the value ("``what`` must be a positive int, got 0"). ``hint`` is appended to the
    requirement (e.g. " (0 = never)")."""
    if not is_int(value) or value < minimum:
        raise error(f"{what} must be {_int_words(minimum)}{hint}, got {value!r}")
    return int(value)


def check_number(value: Any, what: str, *, strict: bool = True, error: type[Exception] = ValueError) -> float:
    """``value`` as a ``float`` if it is a finite real number ``> 0`` (``>= 0`` with ``strict=False``)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and (value > 0 if strict else value >= 0)
    if not ok:
        raise error(f"{what} must be {'a positive number' if strict else 'a number >= 0'}, got {value!r}")
    if not math.isfinite(value):  # an infinite learning rate or weight decay: a run of NaNs naming no setting
        raise error(f"{what} must be a finite {'positive number' if strict else 'number >= 0'}, got {value!r}")
    return float(value)


def read_json_object(file: Path, *, error: type[Exception] = ValueError, hint: str = "",
                     what: str = "object") -> dict[str, Any]:
    """The JSON object in ``file``; else ``error`` naming the file and where it is broken.

    Args:
        file: the file to read (it exists).
        error: the exception type the caller's callers catch.
        hint: appended to the message of a file that is not valid JSON (e.g. "; cut off?").
        what: what the object is, for the message of a file that holds another JSON value.
    """
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{str(file)!r} is not UTF-8 text (byte {exc.start}){hint}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{str(file)!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
                    f"{hint}") from None
    if not isinstance(value, dict):
        raise error(f"{str(file)!r} holds a JSON {type(value).__name__}, not a {what}")
    return value
