"""Differences between the torch versions the project supports (2.11-2.13), handled in one place.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``, which 2.11 lacks; the engine and the parallel
compute path keep the old names, so the FutureWarning they raise on 2.13 is silenced here, by
message, for those two calls only. Importing this module installs the filter.

:func:`outer_saved_tensor_hooks` peeks at torch's stack of saved-tensor hooks (a private binding,
kept here): the sharded working copy (``engine/fsdp.py``) installs its own hooks only where no one
else's (activation checkpointing's) own the saved tensors.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["C10D_DEPRECATION_MESSAGE", "outer_saved_tensor_hooks"]

#: The warning-message pattern of the two deprecated collectives (regex, as ``warnings`` wants).
C10D_DEPRECATION_MESSAGE = ".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated"

warnings.filterwarnings("ignore", message=C10D_DEPRECATION_MESSAGE, category=FutureWarning)


def outer_saved_tensor_hooks() -> bool:
    """True if saved-tensor hooks are active (e.g. inside ``torch.utils.checkpoint``'s forward or
    its recomputation): hooks pushed now would shadow them."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # not in this torch: assume none (checked on 2.11-2.13, where it exists)
        return False
    return top(False) is not None
