"""Run a function on N local CPU ranks over gloo, with a hard deadline instead of a possible hang.

Used by the tests and the benchmark recipes. A :class:`RankPool` keeps its ranks (and their process
group) alive between calls, because starting 4 torch processes costs seconds on a 2-core machine;
any failure or timeout tears the pool down, so a broken process group never leaks into the next call.
A pool whose ranks hold more than :data:`MAX_GROUPS` process groups after a call is restarted before
the next one: each gloo group keeps two worker threads and a transport loop that polls, and a pool
that had run a few hundred tests held ~670 threads per rank, busy enough to take a core of the two.
Destroying a call's groups instead is not safe: torch caches DeviceMesh lookups by mesh equality,
and a later mesh of the same shape then resolves a destroyed group (docs/DESIGN.md §9).

Ranks are spawned fresh interpreters unless :func:`use_fork_server` was called: then they fork from
one server process that imported torch, Lightning and the given modules once, so a new rank costs no
imports (``import lightning`` alone is ~8 s of CPU on the 2-core CI box; the test suite starts pools
dozens of times). A forked rank takes the caller's environment, working folder and ``sys.path`` as
they are when the pool starts, as a spawned one does.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import importlib.util
import os
import queue
import sys
import tempfile
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch.multiprocessing as mp

__all__ = ["MAX_GROUPS", "RankPool", "RankFailure", "run_on_ranks", "start_fork_server", "use_fork_server"]

#: process groups a pooled rank may hold after a call before the pool is restarted (3 threads each)
MAX_GROUPS = 64
#: the start method of new ranks: "spawn", or "forkserver" after :func:`use_fork_server`
_START_METHOD = "spawn"


def use_fork_server(*modules: str) -> None:
    """Start later pools' ranks from one fork server that imports torch and ``modules`` once.

    Args:
        modules: importable module names the server loads before forking ranks (e.g. ``"lightning"``).
            Takes effect only before the server's first start (the first pool started after this call).
    """
    global _START_METHOD
    for name in modules:
        if not isinstance(name, str) or not name:
            raise ValueError(f"use_fork_server takes module names, got {name!r}")
        try:  # the server skips a module it cannot import without a word: refuse it here
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ValueError(f"use_fork_server: no module {name!r} on sys.path")
    mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", __name__, *modules])
    _START_METHOD = "forkserver"


def start_fork_server() -> None:
    """Start the fork server now without waiting for its imports (they then overlap the caller's own
    work); the first pool would otherwise start it and wait. Nothing to do unless :func:`use_fork_server`
    was called. The server imports with this moment's environment and ``sys.path``; its ranks still take
    their pool's caller's."""
    if _START_METHOD == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _fault_path(init_file: str, rank: int) -> str:
    """Where rank ``rank`` of the pool whose rendezvous file is ``init_file`` dumps its stacks on a fatal signal."""
    return os.path.join(os.path.dirname(init_file), f"fatal-signal-rank{rank}.txt")


def _fatal_stacks(init_file: str, ranks: list[int]) -> str:
    """The Python stacks the dead ``ranks`` dumped (faulthandler), one section per rank that wrote any."""
    out = []
    for r in ranks:
        try:
            with open(_fault_path(init_file, r)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            out.append(f"\n--- rank {r} (fatal signal; faulthandler) ---\n{text}")
    return "".join(out)


class RankFailure(RuntimeError):
    """A rank raised, or the ranks did not finish before the deadline."""


def _worker(rank: int, world: int, init_file: str, tasks, results, collective_timeout_s: float,
            caller: tuple[dict[str, str], str, list[str]]) -> None:
    env, cwd, path = caller  # a forked rank starts with the fork server's; take the caller's, as spawn does
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from ..torch_compat import process_groups

    torch.set_num_threads(1)
    # what the rank holds now (the fork server's imports: ~420K objects) lives as long as it does: out of
    # every later full collection, which scanned them all (a recipe's gc.collect per Trainer fit took ~0.6 s)
    gc.freeze()
    # a fatal signal (SIGSEGV in a native kernel or transport) leaves every thread's Python stack in a
    # file the parent appends to its RankFailure: otherwise a dead rank says only its exit code
    fault_file = open(_fault_path(init_file, rank), "w")  # noqa: SIM115 - open for the process's life
    faulthandler.enable(file=fault_file, all_threads=True)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=collective_timeout_s),
    )
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args, kwargs = task
            faulthandler.enable(file=fault_file, all_threads=True)  # again: a task's libraries may re-point it
            try:
                value = fn(*args, **kwargs)
                ForkingPickler.dumps(value)  # fail here, not silently in the queue's feeder thread
                results.put((rank, True, (value, len(process_groups()))))
            except BaseException:  # noqa: BLE001 - reported to the parent, which raises
                results.put((rank, False, traceback.format_exc()))
                # leave at once: a rank still blocked in a collective with this one (e.g. the step's
                # world gather) fails on the closed connection instead of waiting out the timeout;
                # the parent tears the pool down after any failure anyway
                results.close()
                results.join_thread()
                os._exit(1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world`` spawned ranks with an initialized gloo process group, reused across calls."""

    def __init__(self, world: int, collective_timeout_s: float = 60.0) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.world = world
        self.collective_timeout_s = collective_timeout_s
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context(_START_METHOD)
        self._dir = tempfile.TemporaryDirectory(prefix="hotspa-rdzv-")
        init_file = self._init_file = os.path.join(self._dir.name, "rendezvous")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        caller = (dict(os.environ), os.getcwd(), list(sys.path))
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world, init_file, self._tasks[r], self._results,
                                               self.collective_timeout_s, caller), daemon=True)
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 240.0, **kwargs: Any) -> list[Any]:
        """Calls ``fn(*args, **kwargs)`` on every rank; returns the per-rank results in rank order.

        ``fn`` must be importable by name (defined at module level) and find its rank through
        ``torch.distributed``.
        """
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        while len(results) + len(errors) < self.world:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, ok, value = self._results.get(timeout=max(0.1, min(remaining, 1.0)))
            except queue.Empty:
                # a rank that reported its failure exits (the others then fail fast): not "died"
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results
                        and r not in errors]
                if remaining <= 0 or dead:
                    missing = sorted(set(range(self.world)) - set(results) - set(errors))
                    codes = {r: self._procs[r].exitcode for r in dead}
                    stacks = _fatal_stacks(self._init_file, dead)  # before close() removes the folder
                    self.close(force=True)
                    why = f"ranks died (exit codes {codes})" if dead else f"timed out after {timeout_s:.0f}s"
                    raise RankFailure(f"{getattr(fn, '__name__', fn)}: {why}; no result from ranks {missing}"
                                      + "".join(f"\n--- rank {r} ---\n{t}" for r, t in errors.items())
                                      + stacks) from None
                continue
            (results if ok else errors)[rank] = value
        if errors:
            self.close(force=True)
            first = min(errors)
            raise RankFailure(f"{getattr(fn, '__name__', fn)} failed on ranks {sorted(errors)}; rank {first}:\n"
                              f"{errors[first]}")
        if max(groups for _, groups in results.values()) > MAX_GROUPS:
            self.close(force=True)  # idle ranks: nothing to flush; the next call starts fresh ones
        return [results[r][0] for r in range(self.world)]

    def close(self, force: bool = False) -> None:
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._dir.cleanup()


def run_on_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 240.0, **kwargs: Any) -> list[Any]:
    """One-shot: spawn ``world`` ranks, run ``fn`` on each, tear down."""
    pool = RankPool(world)
    try:
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)
    finally:
        pool.close()
