"""What ``--out`` may be, checked before any slow work, and the claim that keeps it so until the output is written.

:func:`check_out_dir` (called before any slow work; :func:`oscar_export.atomic_dir.atomic_dir` calls it again
at the end) allows:

- ``out`` absent or an empty directory; with ``force``, also an earlier output of the same command, recognised
  by its marker (:data:`MARKER`, naming the kind of output), never a folder that merely contains a file
  of the right name, so a mistyped ``--out ~`` never deletes a home directory.
- never an input of the run (``inputs``: ``--model``, ``--artifact``, ``--export``...), nor a directory that
  contains one or lies inside one, with or without ``force``.
- ``out`` is claimed when first checked: a lock file beside it (``.OUT.oscar-lock``, ``flock``) makes a second
  run for the same ``out`` refuse at once, and what ``out`` was (absent, empty, an earlier output: its inode
  and mtime, :class:`OutState`) is remembered, for the transaction to compare at the end (an ``out`` that
  appeared or changed while the run worked is not replaced).

:func:`check_writable` is the check of an output written in place (``eval --out``): no claim, no transaction.

Names (a hidden sibling of ``out``, holding the pid of the run that claimed it)::

    .OUT.oscar-lock                  the lock of a run claiming ``out`` (removed when it ends)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

#: the file every output of this tool contains: ``{"tool": "oscar-export", "kind": KIND, "files": [NAME, ...]}`` (the
#: top-level names it was written with).
MARKER = ".oscar-output"
#: the most of a marker read (its file list names every shard of a large checkpoint).
MARKER_MAX_BYTES = 1 << 20


class OutputBusy(OSError):
    """Another run holds the lock of this ``--out``."""


def _marker(directory: Path) -> dict | None:
    """``directory``'s marker as a dict, or None (no marker, a link, not a regular file, or not one of ours)."""
    p = Path(directory) / MARKER
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MARKER_MAX_BYTES)
    finally:
        os.close(fd)
    try:
        meta = json.loads(data)
    except ValueError:
        return None
    ok = isinstance(meta, dict) and meta.get("tool") == "oscar-export" and isinstance(meta.get("kind"), str)
    return meta if ok else None


def marker_kind(directory: Path) -> str | None:
    """The kind named by ``directory``'s marker, or None (no marker, a link, or not one of ours)."""
    meta = _marker(directory)
    return meta["kind"] if meta is not None else None


def marker_files(directory: Path) -> list[str] | None:
    """The top-level names the output ``directory`` was written with (its marker's list), or None (no marker, or one
    written without the list)."""
    files = (_marker(directory) or {}).get("files")
    ok = isinstance(files, list) and all(isinstance(f, str) for f in files)
    return files if ok else None


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
class OutState:
    """What ``out`` was when it was claimed: absent, or a directory (``dev``, ``ino``, ``mtime_ns``)."""

    exists: bool
    ident: tuple[int, int, int] = (0, 0, 0)


def out_state(out: Path) -> OutState:
    """What is at ``out`` now (compared with the claimed state: equal while nothing was added or replaced)."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return OutState(False)
    return OutState(True, (st.st_dev, st.st_ino, st.st_mtime_ns))


@dataclass
class _Claim:
    fd: int
    lock: Path
    state: OutState


#: the outputs this process has claimed (resolved path -> claim), released by :func:`release` (``atomic_dir`` and
#: ``cli.main`` call it).
_claims: dict[Path, _Claim] = {}


def _lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.oscar-lock"


def _open_lock(lock: Path, out: Path, option: str) -> int:
    """The lock file of ``out``, opened (created if absent): a regular file, or one clear error naming it."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise type(e)(e.errno, f"{option} {out}: cannot open its lock file {lock} ({os.strerror(e.errno or 0)}); "
                               f"remove it if it is not a file of yours") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileExistsError(errno.EEXIST, f"{option} {out}: its lock file {lock} is not a regular file; remove it "
                                            f"(or choose another directory) and run again")
    return fd


def _claim(out: Path, option: str) -> _Claim:
    """Take ``out``'s lock (non-blocking) and remember its state; re-entrant within this process."""
    key = _real(out)
    if key in _claims:
        return _claims[key]
    lock = _lock_path(out)
    while True:
        fd = _open_lock(lock, out, option)
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
    claim = _Claim(fd, lock, out_state(out))
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


def remove_stale_lock(out: Path) -> Path | None:
    """Remove ``out``'s lock file when it is left by a run that was killed (not this process's, and no process holds
    it); returns the lock file if it was removed."""
    lock = _lock_path(out)
    if _real(out) not in _claims and _remove_free_lock(lock):
        return lock
    return None


def claimed_state(out: Path) -> OutState:
    """What ``out`` was when this process claimed it (:func:`check_out_dir` with ``claim``; KeyError without)."""
    return _claims[_real(out)].state


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


__all__ = [
    "MARKER", "OutState", "OutputBusy", "check_inputs", "check_out_dir", "check_writable", "claimed_state",
    "marker_files", "marker_kind", "out_state", "release", "remove_stale_lock",
]
