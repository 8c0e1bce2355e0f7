"""Console noise a user cannot act on: third-party warnings filtered by their exact message, and
each Lightning log line printed once under Hydra.

Why exact messages: a blanket filter (a category, a module) would also hide the warnings a user
can act on. Each entry of :data:`UNACTIONABLE_WARNINGS` names one message, why it is noise, and is
matched in full (``re.escape``), so a reworded or new warning still shows.

Why Lightning lines twice under Hydra: the ``lightning`` package logger has a console handler of
its own (stderr, ``INFO: ...``) and also propagates to the root logger, where Hydra's job logging
has put a console handler (stdout) and the run's log file. :func:`one_console_handler` drops
Lightning's own console handler once the root logger has one, so each line shows once (Hydra's,
also kept in the run folder's log file).
"""

from __future__ import annotations

import logging
import re
import warnings

__all__ = ["ADVERTS", "UNACTIONABLE_WARNINGS", "filter_unactionable_warnings", "one_console_handler"]

#: (exact message prefix, category, why a user cannot act on it)
UNACTIONABLE_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    ("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
     "treespec.is_leaf()` instead.", FutureWarning,
     "torch 2.13 deprecates LeafSpec; Lightning 2.6's own utilities/_pytree.py still uses it, once per rank"),
)

#: (logger, exact message prefix, why): log lines that sell something, dropped by their exact text
ADVERTS: tuple[tuple[str, str, str], ...] = (
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud logging and experiment tracking, try "
     "installing [litlogger](https://pypi.org/project/litlogger/)",
     "Lightning 2.6 advertises its hosted logger on every Trainer built without one"),
)

_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


class _DropAdverts(logging.Filter):
    """Drops a record whose message starts with one of ``prefixes`` (everything else passes)."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def _drop_adverts() -> None:
    """Each logger of :data:`ADVERTS` gets one :class:`_DropAdverts` filter (idempotent)."""
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, prefix, _why in ADVERTS:
        by_logger[name] = (*by_logger.get(name, ()), prefix)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdverts) for f in logger.filters):
            logger.addFilter(_DropAdverts(prefixes))


def filter_unactionable_warnings() -> None:
    """Ignore each warning of :data:`UNACTIONABLE_WARNINGS`, by its exact message and category (every
    other warning keeps showing), and drop the log lines of :data:`ADVERTS`. Idempotent: ``warnings``
    drops a filter it already has."""
    for message, category, _why in UNACTIONABLE_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    _drop_adverts()


def one_console_handler() -> None:
    """Under a root logger with handlers (Hydra's job logging), drop the console handlers Lightning's
    package loggers added for themselves and let their records reach the root's: one line each.
    Without root handlers nothing changes (Lightning's own handler is then the only one)."""
    root = logging.getLogger()
    if not root.handlers:
        return
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # a console handler, not a file
                logger.removeHandler(handler)
        logger.propagate = True
