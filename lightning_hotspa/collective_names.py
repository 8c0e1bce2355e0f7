"""Failed collectives: which process group one ran in (noted on the exception, read where it is
reported), and whether an exception is one at all (:func:`is_collective_failure`).

Why: gloo's error for a dead peer says "Connection closed by peer [addr]:port", not which of the
runtime's groups the rank was waiting in (its block's cp group, a tp group, the unit gathers' shard
group, the world); a mixed-cp round runs different ones on different ranks at the same moment. The
runtime's collectives are issued and waited on inside :func:`collective`, which notes the collective
and its group (the ``RankGroup``'s name and ranks) on any exception leaving it;
:func:`failed_collective` reads the note back from an exception's chain (``adapter/lightning/reliability.py``
puts it into the :class:`CollectiveError` it raises). One mechanism: nothing else guesses the group.
The error and its test live on this floor so that the checkpoint code (``adapter/checkpoints``) tells
a failed collective from a bad file without importing the Lightning seam.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["CollectiveError", "collective", "failed_collective", "is_collective_failure", "ranks_text"]

_ATTR = "hotspa_collective"


@contextlib.contextmanager
def collective(what: str, group: Any) -> Iterator[None]:
    """Runs the body; an exception leaving it carries ``(what, ranks, name)`` (the innermost note wins).

    Args:
        what: the collective, e.g. ``"an all-to-all"``.
        group: the ``RankGroup`` it runs on (its ``desc`` names it, as NCCL's watchdog does), or the
            global ranks of an unnamed group (the world).
    """
    try:
        yield
    except BaseException as exc:
        if getattr(exc, _ATTR, None) is None:
            ranks: Sequence[int] = getattr(group, "ranks", group)
            note = (what, tuple(int(r) for r in ranks), str(getattr(group, "desc", "") or ""))
            with contextlib.suppress(AttributeError, TypeError):  # an exception type without attributes
                setattr(exc, _ATTR, note)
        raise


def ranks_text(ranks: Sequence[int]) -> str:
    """The ranks of a group, the first 8 and the last of a larger one.

    Args:
        ranks: global ranks.
    """
    ranks = tuple(ranks)
    if len(ranks) <= 16:
        return str(list(ranks))
    return "[" + ", ".join(map(str, ranks[:8])) + f", ..., {ranks[-1]}] ({len(ranks)} ranks)"


def failed_collective(exc: BaseException | None) -> str | None:
    """``"<what> on process group '<name>' (ranks [..])"`` (an unnamed group: ``"<what> over ranks
    [..]"``) of the first noted exception in ``exc``'s chain, else None.

    Args:
        exc: the exception a failed step raised.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        note = getattr(exc, _ATTR, None)
        if note is not None:
            what, ranks, name = note
            if name:
                return f"{what} on process group '{name}' (ranks {ranks_text(ranks)})"
            return f"{what} over ranks {ranks_text(ranks)}"
        exc = exc.__cause__ or exc.__context__
    return None


class CollectiveError(RuntimeError):
    """A collective failed or timed out (usually: another rank died); the message says where this rank was."""


# gloo raises plain RuntimeErrors such as "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer"
_COLLECTIVE_MARKERS = re.compile(r"gloo|nccl|Connection (closed|reset)|[Tt]imed out|timeout|c10d|ProcessGroup|"
                                 r"[Bb]roken pipe|peer", re.IGNORECASE)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or something in its cause chain) is a failed or timed-out collective (a
    :class:`CollectiveError` is one already reported: False).

    Args:
        exc: the exception to classify.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CollectiveError):
            return False  # already wrapped
        dist_error = getattr(dist, "DistError", None)
        if dist_error is not None and isinstance(exc, dist_error):
            return True
        if type(exc).__name__ == "CheckpointException" or isinstance(exc, (RuntimeError, ConnectionError)):
            if _COLLECTIVE_MARKERS.search(str(exc)):
                return True
        exc = exc.__cause__ or exc.__context__
    return False
