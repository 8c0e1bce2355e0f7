"""Differences between the torch versions the project supports (2.11-2.13), handled in one place.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``, which 2.11 lacks; the engine and the parallel
compute path keep the old names, so the FutureWarning they raise on 2.13 is silenced here, by
message, for those two calls only. Importing this module installs the filter.
"""

from __future__ import annotations

import warnings

__all__ = ["C10D_DEPRECATION_MESSAGE"]

#: The warning-message pattern of the two deprecated collectives (regex, as ``warnings`` wants).
C10D_DEPRECATION_MESSAGE = ".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated"

warnings.filterwarnings("ignore", message=C10D_DEPRECATION_MESSAGE, category=FutureWarning)
