"""Where a user-given path points, and what may be written to one (docs/checkpoint-trust.md).

Reading: a file of a folder we load must resolve inside the folders it may come from (the folder
itself; for a ``huggingface_hub`` cache snapshot also its repo's ``blobs/``), so a symlink cannot
make us read a file elsewhere. Writing: an output that already exists must be a regular file (or a
folder, for a folder output) and not itself a symlink, so a device node, FIFO or socket is never
replaced; a failed write (full disk, a parent that is a file) is one line naming the path and the
cause, and its partial file is removed. Written files get the mode ``open()`` gives them
(``0o666 & ~umask``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["cause_of", "escapes", "points_to", "output_problem", "umask_mode", "write_output", "OutputError"]


class OutputError(OSError):
    """An output path that cannot or must not be written; the message names the path and the cause."""


def escapes(path: Path, roots: Sequence[Path]) -> Path | None:
    """The resolved target of ``path`` when it lies in none of ``roots`` (each resolved), else None.

    Args:
        path: a file (or folder) that may be a symlink or lie under one.
        roots: the folders it may resolve into.
    """
    target = path.resolve()
    for root in roots:
        root = root.resolve()
        if target == root or root in target.parents:
            return None
    return target


def points_to(path: Path, target: Path) -> str:
    """``'path' is a symlink to 'target'`` (or resolves there through a symlinked folder), for messages.

    Args:
        path: the path as given.
        target: where it resolves.
    """
    how = "is a symlink to" if path.is_symlink() else "resolves (through a symlink) to"
    return f"{str(path)!r} {how} {str(target)!r}"


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named "
          "pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a regular file"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def output_problem(path: Path, folder: bool = False, st: os.stat_result | None = None) -> str | None:
    """Why ``path`` must not be written as an output, or None: it is a symlink, or it exists and is
    not a regular file (``folder``: not a folder), or a parent of it is a file.

    Args:
        path: the output path as given (symlinked parent folders are fine).
        folder: the output is a folder (else a file).
        st: its ``lstat`` (tests pass one; default: read it).
    """
    try:
        st = st or os.lstat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        st = None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            return (f"{points_to(path, Path(os.path.realpath(path)))}; give the real path as the output (a symlink "
                    f"is not replaced)")
        wanted, test = ("a folder", stat.S_ISDIR) if folder else ("a regular file", stat.S_ISREG)
        if not test(st.st_mode):
            return f"{str(path)!r} exists and is {_kind(st.st_mode)}, not {wanted}: it is not replaced"
        return None
    for parent in Path(path).parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                return f"cannot write {str(path)!r}: its parent {str(parent)!r} is a file, not a folder"
            return None
    return None


def umask_mode() -> int:
    """``0o666 & ~umask``: the mode ``open()`` gives a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def cause_of(exc: BaseException) -> str:
    """One line: the OS's words for an OSError's errno (``No space left on device``), else the first line.

    Args:
        exc: the error a write raised.
    """
    if isinstance(exc, OSError) and exc.errno is not None:
        return os.strerror(exc.errno)
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def write_output(path: str | os.PathLike, write: Callable[[Path], None], what: str = "output") -> Path:
    """Writes a file output through ``<path>.tmp`` and renames it into place; a refused path or a
    failed write is an :class:`OutputError` naming the path and the cause, and no ``.tmp`` is left.

    Args:
        path: the output file.
        write: writes the whole file to the path it is given (the ``.tmp``).
        what: what the output is, for the message (``"hotspa consolidate output"``).
    """
    path = Path(path)
    problem = output_problem(path)
    if problem:
        raise OutputError(f"{what}: {problem}")
    part = path.with_name(path.name + ".tmp")
    try:
        write(part)
        os.chmod(part, umask_mode())
        os.replace(part, path)  # never a half-written file under the final name
    except Exception as exc:  # noqa: BLE001 - any failed write is one line naming the path and the cause
        try:
            part.unlink(missing_ok=True)
        except OSError:
            pass
        raise OutputError(f"{what}: cannot write {str(path)!r}: {cause_of(exc)}") from None
    return path
