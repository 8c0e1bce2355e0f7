"""Forked rank processes for jobs that must die like real ones (killed, hung, crashed mid-step).

Unlike :class:`~.spawn.RankPool`, each rank is a plain ``os.fork`` child that runs one function
and exits: a test can SIGKILL it, watch the others fail, and read every exit code and time.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["ForkedExit", "free_port", "run_forked_ranks"]


def free_port() -> int:
    """A free TCP port on localhost (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ForkedExit:
    """How the ranks ended: exit codes (negative: the signal), when each exited, who was still
    running at the deadline (killed then)."""

    codes: dict[int, int] = field(default_factory=dict)
    times: dict[int, float] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)


def run_forked_ranks(world: int, rank_main: Callable[[int], None], deadline_s: float,
                     end_if_alone: int | None = None) -> ForkedExit:
    """Forks ``world`` children running ``rank_main(rank)`` (exit code 1 and a traceback on any
    exception), waits until all exit or ``deadline_s`` passes, then SIGKILLs the rest.
    ``end_if_alone``: a rank that is meant to hang silently, killed once every other rank is gone."""
    start = time.time()
    pids = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_main(rank)
            except BaseException:  # noqa: BLE001 - printed for the test; the exit code says it failed
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
        pids[pid] = rank
    out = ForkedExit()
    while pids and time.time() - start < deadline_s:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if end_if_alone is not None and list(pids.values()) == [end_if_alone]:
                os.kill(next(iter(pids)), signal.SIGKILL)  # the others are gone: end the silent one
            time.sleep(0.05)
            continue
        rank = pids.pop(pid)
        out.codes[rank] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.times[rank] = time.time()
    out.hung = sorted(pids.values())
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return out
