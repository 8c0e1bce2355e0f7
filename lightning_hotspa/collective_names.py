"""Which process group a failed collective ran in: noted on the exception, read where it is reported.

Why: gloo's error for a dead peer says "Connection closed by peer [addr]:port", not which of the
runtime's groups the rank was waiting in (its block's cp group, a tp group, the unit gathers' shard
group, the world); a mixed-cp round runs different ones on different ranks at the same moment. The
runtime's collectives run inside :func:`collective`, which notes the group's ranks on any exception
leaving it; :func:`failed_collective` reads the note back from an exception's chain
(``adapter/reliability.py`` puts it into the ``CollectiveError`` it raises).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

__all__ = ["collective", "failed_collective"]

_ATTR = "hotspa_collective"


@contextlib.contextmanager
def collective(what: str, ranks: Sequence[int]) -> Iterator[None]:
    """Runs the body; an exception leaving it carries ``(what, ranks)`` (the innermost note wins).

    Args:
        what: the collective, e.g. ``"the cp all-to-all"``.
        ranks: the global ranks of its group.
    """
    try:
        yield
    except BaseException as exc:
        if getattr(exc, _ATTR, None) is None:
            with contextlib.suppress(AttributeError, TypeError):  # an exception type without attributes
                setattr(exc, _ATTR, (what, tuple(int(r) for r in ranks)))
        raise


def failed_collective(exc: BaseException | None) -> str | None:
    """``"<what> over ranks [..]"`` of the first noted exception in ``exc``'s chain, else None.

    Args:
        exc: the exception a failed step raised.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        note = getattr(exc, _ATTR, None)
        if note is not None:
            what, ranks = note
            return f"{what} over ranks {list(ranks)}"
        exc = exc.__cause__ or exc.__context__
    return None
