"""Write an output directory as one transaction: all of it appears, or nothing changes.

``with atomic_dir(out) as tmp:`` yields a temporary sibling of ``out``; the caller writes everything into
``tmp``; on success every file and directory in it is fsynced, it is renamed to ``out`` and the parent
directory is fsynced. On any exception, SIGINT or SIGTERM the temporary is removed and ``out`` is left as it
was. A SIGKILL (or a power cut) cannot be cleaned up at once: the temporary is left behind and recognised
by the next run for the same ``out`` (see :func:`remove_stale`).

Names (hidden siblings of ``out``; ``PID`` and ``START`` identify the process that made them, ``START``
being its start time in clock ticks from ``/proc/PID/stat``, so a reused pid is told apart)::

    .OUT.oscar-tmp-PID-START-TOKEN   the directory being written
    .OUT.oscar-old-PID-START-TOKEN   with --force: the previous ``out``, moved aside just before the rename

An existing non-empty ``out`` is refused unless ``force=True``, and even then only when it looks like an
output of the same command (``looks_like``: a file it must contain, e.g. ``oscar.json``), so a mistyped
``--out ~`` never deletes a home directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import threading
from pathlib import Path
from typing import Iterator

_NAME = re.compile(r"\.(?P<out>.+)\.oscar-(?P<kind>tmp|old)-(?P<pid>[0-9]+)-(?P<start>[0-9]+)-(?P<token>[0-9a-f]{8})")


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) arrived while an output directory was being written; it was cleaned up."""


def _start_time(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks since boot (0 where /proc is not available)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the command name may contain spaces


def _alive(pid: int, start: int) -> bool:
    """Whether the process that made a temporary (``pid`` started at ``start``) is still running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: not ours to judge
    return start == 0 or _start_time(pid) in (0, start)


def is_temporary(path: Path) -> bool:
    """Whether ``path``'s name is one this module gives its temporaries (nothing else is ever removed)."""
    return _NAME.fullmatch(Path(path).name) is not None


def remove_stale(out: Path) -> list[Path]:
    """Remove temporaries of ``out`` left by runs that no longer exist; returns what was removed or restored.

    Only directories (not links) named exactly as :data:`_NAME`, owned by this user, whose process is gone.
    A stale ``oscar-old`` directory is the previous output of a run killed between its two renames: when
    ``out`` does not exist it is renamed back to ``out``; otherwise it is removed.
    """
    out = Path(out)
    done = []
    try:
        entries = list(out.parent.iterdir())
    except FileNotFoundError:
        return done
    for p in sorted(entries, key=lambda p: p.name):
        m = _NAME.fullmatch(p.name)
        if m is None or m["out"] != out.name or p.is_symlink() or not p.is_dir():
            continue
        try:
            if p.stat().st_uid != os.getuid() or _alive(int(m["pid"]), int(m["start"])):
                continue
            if m["kind"] == "old" and not os.path.lexists(out):
                os.rename(p, out)
            else:
                shutil.rmtree(p, ignore_errors=True)
        except FileNotFoundError:  # another run cleaned it up first
            continue
        done.append(p)
    return done


def check_out_dir(out: str | Path, force: bool = False, looks_like: str | None = None, option: str = "--out") -> Path:
    """Raise unless ``out`` can be written: absent, an empty directory, or (``force``) an earlier output.

    Raises ``NotADirectoryError`` when ``out`` is a file, ``FileExistsError`` for a non-empty directory without
    ``force`` (or one that does not contain ``looks_like``), ``PermissionError`` when its parent is not writable.
    """
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise NotADirectoryError(f"{option} {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{option} {out}: already exists and is not empty; choose a new directory or "
                                  f"pass --force to replace it")
        if looks_like is not None and not (out / looks_like).exists():
            raise FileExistsError(f"{option} {out}: not empty and does not look like an output of this command "
                                  f"(no {looks_like}); refusing to replace it even with --force")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{option} {out}: cannot create it: {parent} is not writable")
    return out


def _fsync_path(path: Path, directory: bool) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError:
        if not directory:  # some filesystems cannot fsync a directory; a file must reach the disk
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every regular file under ``root``, then every directory bottom up (``root`` last)."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                _fsync_path(p, directory=False)
        _fsync_path(Path(dirpath), directory=True)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT raise :class:`Interrupted` (so ``finally``/``except`` clean up)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def atomic_dir(out: str | Path, force: bool = False, looks_like: str | None = None) -> Iterator[Path]:
    """Yield a temporary directory beside ``out`` that becomes ``out`` when the block succeeds (module doc).

    Args:
        out: the output directory (absent, empty, or with ``force`` an earlier output).
        force: replace a non-empty ``out`` (only one containing ``looks_like``, when given).
        looks_like: a file name every output of this kind contains (``oscar.json``, ``config.json``...).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    check_out_dir(out, force, looks_like)
    tag = f"{os.getpid()}-{_start_time(os.getpid())}-{secrets.token_hex(4)}"
    tmp = out.parent / f".{out.name}.oscar-tmp-{tag}"
    old = out.parent / f".{out.name}.oscar-old-{tag}"
    with _signals_raise():
        tmp.mkdir(mode=0o700)
        try:
            yield tmp
            tmp.chmod(0o755)
            fsync_tree(tmp)
            if out.is_dir() and any(out.iterdir()):  # force (checked above): move the old output aside first
                os.rename(out, old)
            elif out.is_dir():
                out.rmdir()
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not os.path.lexists(out):
                os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
        _fsync_path(out.parent, directory=True)


__all__ = ["Interrupted", "atomic_dir", "check_out_dir", "fsync_tree", "is_temporary", "remove_stale"]
