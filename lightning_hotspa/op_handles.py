"""Integer handles for the Python objects a custom op must find when it runs (a compiled graph holds no objects).

Why: a ``torch.library`` custom op takes tensors, numbers and strings; one that runs eager code around a model's
own objects (:mod:`lightning_hotspa.parallel.cp_attention_op`: the layer's attention wrapper, its state and groups)
gets an int and looks the object up here. Weakly held: a handle does not keep a model alive, and a freed one is
named in the error.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["handle_for", "object_for"]

_OBJECTS: list[weakref.ref] = []


def handle_for(obj: Any) -> int:
    """A new handle for ``obj`` (weakly held).

    Args:
        obj: any object that takes weak references.
    """
    _OBJECTS.append(weakref.ref(obj))
    return len(_OBJECTS) - 1


def object_for(handle: int, what: str) -> Any:
    """The object of ``handle``; a RuntimeError naming ``what`` and the handle when it is unknown or freed.

    Args:
        handle: from :func:`handle_for`.
        what: what the caller looks for (the error's words).
    """
    found = _OBJECTS[handle]() if 0 <= handle < len(_OBJECTS) else None
    if found is None:
        raise RuntimeError(f"{what}: no object with handle {handle} (its model was freed)")
    return found
