"""What ``build`` serves: the files of the exported checkpoint it understands, copied as regular files only.

An export folder may hold more than ``export`` wrote: a stray file (copied byte for byte into what is served), a
symbolic link (``ln -s . loop`` made ``copytree`` nest the folder into itself until the kernel's ELOOP), a
``config.json`` ``auto_map`` with its ``modeling_*.py`` (remote code, live in the served checkpoint). So:

- only names of a Hugging Face checkpoint as ``export`` writes it are taken (:data:`CHECKPOINT_FILES`, the
  safetensors shards of its index, the bundled artifact, the ``--tp`` rank folders); anything else is left out
  and named in the list :func:`checkpoint_files` returns;
- a symbolic link anywhere among them, or anything but a regular file, is refused;
- each file is opened once, with ``O_NOFOLLOW``, checked by ``fstat`` on that descriptor (a regular file of the
  size it had when listed) and copied from it: nothing is checked on a path and then read through another;
- ``config.json`` is served without ``auto_map`` (no remote code; the OSCAR model classes are the package's own).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

#: top-level files of a checkpoint written by ``export`` (``save_pretrained`` of the model and its tokenizer).
CHECKPOINT_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
})
#: the safetensors shards of a large checkpoint (named in ``model.safetensors.index.json``).
SHARD = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")
#: the files of the bundled artifact folder and of a ``--tp`` rank folder (``tensor_parallel``).
ARTIFACT_FILES = frozenset({"oscar.json", "rotations.safetensors"})
RANK_FILES = ARTIFACT_FILES | {"attention.safetensors"}
#: ``config.json`` keys that make transformers import code shipped with the checkpoint.
REMOTE_CODE_KEYS = ("auto_map",)


def _regular(p: Path, root: Path) -> os.stat_result:
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{p}: a symbolic link in the checkpoint {root}; build copies regular files only "
                         f"(replace the link by the file it points to)")
    return st


def checkpoint_files(root: str | Path, artifact_dir: str = "oscar_artifact") -> tuple[dict[str, int], list[str]]:
    """``({relative path: size}, [left out])``: the files of the checkpoint ``root`` that ``build`` copies, and
    the entries it leaves out. Raises ``ValueError`` for a symbolic link or a non-regular file among them."""
    root = Path(root)
    take: dict[str, int] = {}
    left: list[str] = []

    def add(rel: str) -> None:
        st = _regular(root / rel, root)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{root / rel}: not a regular file; build copies regular files only")
        take[rel] = st.st_size

    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        name = entry.name
        if entry.is_symlink():
            _regular(root / name, root)
        if name in CHECKPOINT_FILES or SHARD.fullmatch(name):
            add(name)
        elif name == artifact_dir or re.fullmatch(r"tp[0-9]+", name):
            _regular(root / name, root)
            folders = [name] if name == artifact_dir else [f"{name}/{r.name}" for r in sorted(
                os.scandir(root / name), key=lambda e: e.name) if re.fullmatch(r"rank[0-9]+", r.name)]
            for folder in folders:
                _regular(root / folder, root)
                allowed = ARTIFACT_FILES if folder == artifact_dir else RANK_FILES
                for f in sorted(os.scandir(root / folder), key=lambda e: e.name):
                    if f.name in allowed:
                        add(f"{folder}/{f.name}")
                    else:
                        left.append(f"{folder}/{f.name}")
        else:
            left.append(name)
    return take, left


def _without_remote_code(data: bytes, where: Path) -> bytes:
    cfg = json.loads(data)
    if not isinstance(cfg, dict) or not any(k in cfg for k in REMOTE_CODE_KEYS):
        return data
    for k in REMOTE_CODE_KEYS:
        cfg.pop(k, None)
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


def copy_checkpoint(root: str | Path, files: dict[str, int], dest: str | Path) -> None:
    """Copy ``files`` (from :func:`checkpoint_files`) of ``root`` into ``dest``: each opened once with
    ``O_NOFOLLOW``, checked on its descriptor (a regular file of the listed size), copied from that descriptor;
    ``config.json`` without ``auto_map``."""
    root, dest = Path(root), Path(dest)
    for rel, size in files.items():
        src = root / rel
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise ValueError(f"{src}: changed while build read the checkpoint (now {st.st_size:,} bytes, was "
                                 f"{size:,}); nothing was built")
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(fd, "rb", closefd=False) as f_in, open(target, "xb") as f_out:
                if rel == "config.json":
                    f_out.write(_without_remote_code(f_in.read(size + 1), src))
                else:
                    copied = 0
                    while chunk := f_in.read(1 << 22):
                        copied += len(chunk)
                        if copied > size:
                            raise ValueError(f"{src}: grew while build copied it; nothing was built")
                        f_out.write(chunk)
        finally:
            os.close(fd)


__all__ = ["CHECKPOINT_FILES", "REMOTE_CODE_KEYS", "checkpoint_files", "copy_checkpoint"]
