"""Write an output directory as one transaction: all of it appears, or nothing changes; nothing of the user's lost.

``with atomic_dir(out) as tmp:`` yields a temporary sibling of ``out``; the caller writes everything into
``tmp``; on success a marker file (:data:`oscar_export.out_dir.MARKER`) is added, every file and directory in it
is fsynced, it takes the place of ``out`` and the parent directory is fsynced. On any exception, SIGINT or SIGTERM
the temporary is removed and ``out`` is left as it was. A SIGKILL (or a power cut) cannot be cleaned up at once:
the temporary is left behind and recognised by the next run for the same ``out`` (see :func:`remove_stale`).

What ``out`` may be, and the claim on it, is :mod:`oscar_export.out_dir` (``check_out_dir``, called here first).
At the end ``out`` must still be what it was when claimed: an ``out`` that appeared or changed while the run
worked is not replaced (the new output is kept beside it, under a name the error gives). With ``force`` the
entries of the earlier ``out`` that this tool did not write (the names its marker does not list, e.g. the user's
``NOTES.txt``) are kept: linked (or copied) into the new output before it takes ``out``'s place, and named on stderr.
The final step never overwrites: ``renameat2(RENAME_NOREPLACE)`` where ``out`` was absent, and with ``force``
``RENAME_EXCHANGE`` (the old output and the new one swap in one step, so there is no moment without an ``out``);
plain ``rename`` where the filesystem has neither (it too refuses a non-empty directory).

Names (hidden siblings of ``out``; ``PID`` and ``START`` identify the process that made them, ``START``
being its start time in clock ticks from ``/proc/PID/stat``, so a reused pid is told apart)::

    .OUT.oscar-tmp-PID-START-TOKEN   the directory being written
    .OUT.oscar-old-PID-START-TOKEN   with --force: the previous ``out``, after the swap, until removed
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Iterable, Iterator

from oscar_export.out_dir import (
    MARKER,
    OutState,
    check_out_dir,
    claimed_state,
    marker_files,
    out_state,
    release,
    remove_stale_lock,
)

_NAME = re.compile(r"\.(?P<out>.+)\.oscar-(?P<kind>tmp|old)-(?P<pid>[0-9]+)-(?P<start>[0-9]+)-(?P<token>[0-9a-f]{8})")


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) arrived while an output directory was being written; it was cleaned up."""


class OutputChanged(OSError):
    """``--out`` appeared or changed while this run worked; it was not replaced."""


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
    A stale ``oscar-old`` directory is the previous output of a run killed during a replace without
    ``RENAME_EXCHANGE``: when ``out`` does not exist it is renamed back to ``out``; otherwise it is removed.
    """
    out = Path(out)
    done = []
    try:
        entries = list(out.parent.iterdir())
    except FileNotFoundError:
        return done
    lock = remove_stale_lock(out)
    if lock is not None:
        done.append(lock)
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


_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the C library or the filesystem does not support it."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(e, os.strerror(e), str(src), None, str(dst))


def _place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out`` unless something is at ``out`` (an empty directory counts, as for ``rename``)."""
    try:
        if not _rename2(tmp, out, _RENAME_NOREPLACE):
            os.rename(tmp, out)  # refuses a non-empty directory and a file; replaces an empty directory
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(e.errno, "exists") from None
        raise


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link of the regular file ``src`` at ``dst`` (no data copied), or a copy where links are refused."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        if not Path(src).is_file():
            raise
        shutil.copy2(src, dst)


def users_entries(out: Path, written: Iterable[str]) -> list[str]:
    """The entries of the earlier output ``out`` that this tool did not write: not named by its marker's file
    list, or (a marker without one) not among ``written``, the names of the new output."""
    listed = marker_files(out)
    ours = set(listed if listed is not None else written) | {MARKER}
    return sorted(e.name for e in os.scandir(out) if e.name not in ours)


def keep_users_entries(out: Path, tmp: Path, option: str) -> list[str]:
    """Link (or copy) the user's entries of ``out`` (:func:`users_entries`) into ``tmp``, the new output, before
    it takes ``out``'s place; returns their names. A name the new output holds too is refused (nothing replaced)."""
    names = users_entries(out, (e.name for e in os.scandir(tmp)))
    for name in names:
        src, dst = out / name, tmp / name
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, f"{option} {out}: {name} there was not written by oscar-export and the "
                                                f"new output has a {name} too; nothing was replaced (move yours away "
                                                f"and run again)")
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif src.is_dir():
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(src), str(dst))
    return names


def _changed(out: Path, tmp: Path, option: str, what: str) -> OutputChanged:
    """The error for an ``out`` that changed under the run; ``tmp`` is kept under a name the line gives."""
    kept = out.parent / f"{out.name}.oscar-new-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(tmp, kept)
    return OutputChanged(errno.EEXIST, f"{option} {out}: {what} while this run worked; it was not replaced, the new "
                                       f"output is kept in {kept}")


def _commit(tmp: Path, out: Path, old: Path, state: OutState, force: bool, option: str) -> None:
    """Put ``tmp`` in the place of ``out``, which must still be what it was when claimed (``state``)."""
    now = out_state(out)
    if not state.exists:
        if now.exists and not (out.is_dir() and not any(out.iterdir())):
            raise _changed(out, tmp, option, "appeared")
        try:
            _place(tmp, out)
        except FileExistsError:
            raise _changed(out, tmp, option, "appeared") from None
        return
    if now != state or not out.is_dir() or out.is_symlink():
        raise _changed(out, tmp, option, "changed")
    if not any(out.iterdir()):
        try:
            out.rmdir()
            _place(tmp, out)
        except OSError:
            raise _changed(out, tmp, option, "changed") from None
        return
    if not force:  # claimed as a non-empty directory only with force (check_out_dir)
        raise _changed(out, tmp, option, "changed")
    if _rename2(tmp, out, _RENAME_EXCHANGE):  # out is the new output now, tmp the old one
        if out_state(tmp) != state:  # something was added just before the swap: swap back, keep the new one
            _rename2(tmp, out, _RENAME_EXCHANGE)
            raise _changed(out, tmp, option, "changed")
        os.rename(tmp, old)
        return
    os.rename(out, old)
    if out_state(old) != state:
        os.rename(old, out)
        raise _changed(out, tmp, option, "changed")
    try:
        _place(tmp, out)
    except FileExistsError:
        raise _changed(out, tmp, option, "appeared") from None


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
def atomic_dir(
    out: str | Path, force: bool = False, looks_like: str | None = None,
    inputs: Iterable[tuple[str, str | Path | None]] = (), option: str = "--out",
) -> Iterator[Path]:
    """Yield a temporary directory beside ``out`` that becomes ``out`` when the block succeeds (module doc).

    Args:
        out: the output directory (absent, empty, or with ``force`` an earlier output of this kind).
        force: replace a non-empty ``out`` that is an earlier output of this kind (what this tool did not write
            there is kept: :func:`keep_users_entries`).
        looks_like: the kind of output (a file every output of this kind contains: ``oscar.json``...); written
            into the marker, and required of the marker of an ``out`` that ``force`` replaces.
        inputs: ``(option, path)`` pairs ``out`` must stay apart from (:func:`check_inputs`).
    """
    out = Path(out)
    inputs = list(inputs)
    with contextlib.ExitStack() as stack:
        stack.callback(release, out)
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out)
        check_out_dir(out, force, looks_like, option, inputs, claim=True)  # or finds this process's claim
        state = claimed_state(out)
        tag = f"{os.getpid()}-{_start_time(os.getpid())}-{secrets.token_hex(4)}"
        tmp = out.parent / f".{out.name}.oscar-tmp-{tag}"
        old = out.parent / f".{out.name}.oscar-old-{tag}"
        with _signals_raise():
            tmp.mkdir(mode=0o700)
            kept: list[str] = []
            try:
                yield tmp
                written = sorted(e.name for e in os.scandir(tmp))
                (tmp / MARKER).write_text(json.dumps({"tool": "oscar-export", "kind": looks_like or "output",
                                                      "files": written}) + "\n")
                if force and state.exists and out.is_dir() and not out.is_symlink():
                    kept = keep_users_entries(out, tmp, option)
                tmp.chmod(0o755)
                fsync_tree(tmp)
                _commit(tmp, out, old, state, force, option)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                if old.exists() and not os.path.lexists(out):
                    os.rename(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
            _fsync_path(out.parent, directory=True)
            if kept:
                print(f"{option} {out}: kept what oscar-export did not write there: {', '.join(kept)}", file=sys.stderr)


__all__ = ["Interrupted", "OutputChanged", "atomic_dir", "fsync_tree", "is_temporary", "keep_users_entries",
           "remove_stale", "users_entries"]
