"""Write an output directory as one transaction: all of it appears, or nothing changes; nothing of the user's lost.

``with atomic_dir(out) as tmp:`` yields a temporary sibling of ``out``; the caller writes everything into
``tmp``; on success a marker file (:data:`MARKER`) is added, every file and directory in it is fsynced, it
takes the place of ``out`` and the parent directory is fsynced. On any exception, SIGINT or SIGTERM the
temporary is removed and ``out`` is left as it was. A SIGKILL (or a power cut) cannot be cleaned up at once:
the temporary is left behind and recognised by the next run for the same ``out`` (see :func:`remove_stale`).

What may be replaced (:func:`check_out_dir`, called before any slow work, and again at the end):

- ``out`` absent or an empty directory; with ``force``, also an earlier output of the same command, recognised
  by its marker (``.oscar-output``, naming the kind of output), never a folder that merely contains a file
  of the right name, so a mistyped ``--out ~`` never deletes a home directory.
- never an input of the run (``inputs``: ``--model``, ``--artifact``, ``--export``...), nor a directory that
  contains one or lies inside one, with or without ``force``.
- ``out`` is claimed when first checked: a lock file beside it (``.OUT.oscar-lock``, ``flock``) makes a second
  run for the same ``out`` refuse at once, and what ``out`` was (absent, empty, an earlier output: its inode
  and mtime) is remembered. At the end ``out`` must still be that: an ``out`` that appeared or changed while
  the run worked is not replaced (the new output is kept beside it, under a name the error gives).
- the final step never overwrites: ``renameat2(RENAME_NOREPLACE)`` where ``out`` was absent, and with ``force``
  ``RENAME_EXCHANGE`` (the old output and the new one swap in one step, so there is no moment without an
  ``out``); plain ``rename`` where the filesystem has neither (it too refuses a non-empty directory).

Names (hidden siblings of ``out``; ``PID`` and ``START`` identify the process that made them, ``START``
being its start time in clock ticks from ``/proc/PID/stat``, so a reused pid is told apart)::

    .OUT.oscar-tmp-PID-START-TOKEN   the directory being written
    .OUT.oscar-old-PID-START-TOKEN   with --force: the previous ``out``, after the swap, until removed
    .OUT.oscar-lock                  the lock of a run claiming ``out`` (removed when it ends)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

_NAME = re.compile(r"\.(?P<out>.+)\.oscar-(?P<kind>tmp|old)-(?P<pid>[0-9]+)-(?P<start>[0-9]+)-(?P<token>[0-9a-f]{8})")

#: the file every output of this tool contains: ``{"tool": "oscar-export", "kind": KIND}``.
MARKER = ".oscar-output"


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) arrived while an output directory was being written; it was cleaned up."""


class OutputBusy(OSError):
    """Another run holds the lock of this ``--out``."""


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
    if _real(out) not in _claims and _remove_free_lock(_lock_path(out)):
        done.append(_lock_path(out))
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


# ---- what --out may be --------------------------------------------------------------------------------------


def marker_kind(directory: Path) -> str | None:
    """The kind named by ``directory``'s marker, or None (no marker, a link, or not one of ours)."""
    p = Path(directory) / MARKER
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        meta = json.loads(data)
    except ValueError:
        return None
    ok = isinstance(meta, dict) and meta.get("tool") == "oscar-export" and isinstance(meta.get("kind"), str)
    return meta["kind"] if ok else None


def _real(p: Path) -> Path:
    return Path(os.path.realpath(p))


def check_inputs(out: Path, inputs: Iterable[tuple[str, str | Path | None]], option: str = "--out") -> None:
    """Raise ``ValueError`` when ``out`` is, contains or lies inside one of ``inputs`` (``(option, path)`` pairs;
    paths that do not exist, and ``None``, are skipped), links resolved."""
    o = _real(out)
    for name, path in inputs:
        if path is None or not os.path.lexists(path):
            continue
        i = _real(Path(path))
        if o == i:
            why = "is"
        elif o.is_relative_to(i):
            why = "lies inside"
        elif i.is_relative_to(o):
            why = "contains"
        else:
            continue
        raise ValueError(f"{option} {out}: {why} the input {name} {path}; the output must be a directory apart from "
                         f"every input (nothing was written)")


def _probe_writable(out: Path, option: str) -> None:
    """Create and remove a file where ``out`` will be created (its nearest existing ancestor)."""
    parent = out.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"{option} {out}: cannot create it: {parent} is not a directory")
    probe = parent / f".{out.name}.oscar-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"{option} {out}: cannot create it: {parent} is not writable "
                              f"({os.strerror(e.errno or 0)})") from None


def check_writable(out: str | Path, option: str = "--out",
                   inputs: Iterable[tuple[str, str | Path | None]] = ()) -> Path:
    """For an output written in place (``eval --out``, re-run into the same directory): ``out`` apart from the
    ``inputs``, a directory or absent, and a file can be created in it (or where it will be created)."""
    out = Path(out)
    check_inputs(out, inputs, option)
    if out.is_symlink() and not out.is_dir() or os.path.lexists(out) and not out.is_dir():
        raise NotADirectoryError(f"{option} {out}: exists and is not a directory")
    _probe_writable(out / "x" if out.is_dir() else out, option)
    return out


@dataclass(frozen=True)
class _State:
    """What ``out`` was when it was claimed: absent, or a directory (``dev``, ``ino``, ``mtime_ns``)."""

    exists: bool
    ident: tuple[int, int, int] = (0, 0, 0)


def _state(out: Path) -> _State:
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return _State(False)
    return _State(True, (st.st_dev, st.st_ino, st.st_mtime_ns))


@dataclass
class _Claim:
    fd: int
    lock: Path
    state: _State


#: the outputs this process has claimed (resolved path -> claim), released by atomic_dir or :func:`release`.
_claims: dict[Path, _Claim] = {}


def _lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.oscar-lock"


def _claim(out: Path, option: str) -> _Claim:
    """Take ``out``'s lock (non-blocking) and remember its state; re-entrant within this process."""
    key = _real(out)
    if key in _claims:
        return _claims[key]
    lock = _lock_path(out)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputBusy(errno.EBUSY, f"{option} {out}: another oscar-export run (pid {holder}) is writing it; "
                                          f"wait for it to finish or choose another directory") from None
        try:  # the lock file may have been removed (by the run that held it) between our open and our lock
            same = os.path.samestat(os.fstat(fd), os.lstat(lock))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    claim = _Claim(fd, lock, _state(out))
    _claims[key] = claim
    return claim


def _remove_free_lock(lock: Path) -> bool:
    """Remove the lock file of a run that was killed (no process holds its lock); True if it was removed."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.samestat(os.fstat(fd), os.lstat(lock)):
            os.unlink(lock)
            return True
    except OSError:  # held by a live run, or gone
        pass
    finally:
        os.close(fd)
    return False


def release(out: str | Path | None = None) -> None:
    """Release the claim on ``out`` (every claim of this process when None): the lock file is removed."""
    keys = list(_claims) if out is None else [_real(Path(out))]
    for key in keys:
        claim = _claims.pop(key, None)
        if claim is None:
            continue
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(claim.fd), os.lstat(claim.lock)):
                os.unlink(claim.lock)
        os.close(claim.fd)


def check_out_dir(
    out: str | Path, force: bool = False, looks_like: str | None = None, option: str = "--out",
    inputs: Iterable[tuple[str, str | Path | None]] = (), claim: bool = False,
) -> Path:
    """Raise unless ``out`` can be written (module doc); with ``claim``, then claim it for this process.

    Args:
        out: the output directory.
        force: replace a non-empty ``out`` that is an earlier output of this kind (its marker names ``looks_like``).
        looks_like: the kind of output (the file every output of this command contains: ``oscar.json``...).
        option: the option's name in messages.
        inputs: ``(option, path)`` pairs ``out`` must stay apart from.
        claim: take ``out``'s lock and remember its state (a command checking before its slow work: ``cli.main``
            releases the claim when the command ends; ``atomic_dir`` claims, and releases, on its own). Where the
            parent of ``out`` does not exist yet nothing is created: the claim waits for ``atomic_dir``.

    Raises:
        ValueError: ``out`` overlaps an input. NotADirectoryError: ``out`` is a file or a link.
        FileExistsError: a non-empty directory without ``force``, or not an output of this kind.
        PermissionError: ``out`` cannot be created (a probe file in its parent). OutputBusy: another run has it.
    """
    out = Path(out)
    check_inputs(out, inputs, option)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise NotADirectoryError(f"{option} {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{option} {out}: already exists and is not empty; choose a new directory or "
                                  f"pass --force to replace it")
        kind = looks_like or "output"
        if marker_kind(out) != kind:
            raise FileExistsError(f"{option} {out}: not empty and does not look like an output of this command (no "
                                  f"{MARKER} marker of a {kind} output); refusing to replace it even with --force "
                                  f"(remove it yourself if it is yours to remove)")
    _probe_writable(out, option)
    if claim and out.parent.is_dir():
        _claim(out, option)
    return out


# ---- the transaction ----------------------------------------------------------------------------------------


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


def _changed(out: Path, tmp: Path, option: str, what: str) -> OutputChanged:
    """The error for an ``out`` that changed under the run; ``tmp`` is kept under a name the line gives."""
    kept = out.parent / f"{out.name}.oscar-new-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(tmp, kept)
    return OutputChanged(errno.EEXIST, f"{option} {out}: {what} while this run worked; it was not replaced, the new "
                                       f"output is kept in {kept}")


def _commit(tmp: Path, out: Path, old: Path, state: _State, force: bool, option: str) -> None:
    """Put ``tmp`` in the place of ``out``, which must still be what it was when claimed (``state``)."""
    now = _state(out)
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
        if _state(tmp) != state:  # something was added just before the swap: swap back, keep the new one
            _rename2(tmp, out, _RENAME_EXCHANGE)
            raise _changed(out, tmp, option, "changed")
        os.rename(tmp, old)
        return
    os.rename(out, old)
    if _state(old) != state:
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
        force: replace a non-empty ``out`` that is an earlier output of this kind.
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
        state = _claims[_real(out)].state
        tag = f"{os.getpid()}-{_start_time(os.getpid())}-{secrets.token_hex(4)}"
        tmp = out.parent / f".{out.name}.oscar-tmp-{tag}"
        old = out.parent / f".{out.name}.oscar-old-{tag}"
        with _signals_raise():
            tmp.mkdir(mode=0o700)
            try:
                yield tmp
                (tmp / MARKER).write_text(json.dumps({"tool": "oscar-export", "kind": looks_like or "output"}) + "\n")
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


__all__ = [
    "MARKER", "Interrupted", "OutputBusy", "OutputChanged", "atomic_dir", "check_inputs", "check_out_dir",
    "check_writable",
    "fsync_tree", "is_temporary", "marker_kind", "release", "remove_stale",
]
