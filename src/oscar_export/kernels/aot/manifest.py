"""The bundle's ``manifest.json``: what each binary is, and the checks that it still is.

A bundle directory holds, per kernel variant and target, ``<name>.<arch>.cubin`` and ``<name>.<arch>.ptx``
plus one ``manifest.json``::

    {"format": 1, "triton_version": "3.9.0", "ptxas": {"sm_90": "13.x"}, "ptx_version": 88,
     "kernels": [{"name", "arch", "symbol", "params": [{"name", "type", "bytes"}], "hidden_params": 2,
                  "constexprs", "grid", "num_warps", "num_stages", "shared", "spec",
                  "cubin": {"file", "sha256", "bytes"}, "ptx": {"file", "sha256", "bytes"}}],
     "packing": {"key": "linear", "value": "linear"}, "key_bits": [2, 4]}

``packing`` is the code packing of the pages the kernels read and write (``RowFormat.packing``); a manifest
without it (built before the field existed) means ``"linear"``, one naming a packing this version does not
know is refused. ``key_bits`` lists the key code widths (``RowFormat.bits``) the bundle has variants for (the
``_k4`` variants of ``bundle.layout_tag`` serve the layers with 4-bit keys); without it ``[2]``; a width this
version does not know (``layout.CODE_BITS``) is refused.

``read_manifest`` validates the structure and, unless told not to, every binary's sha256 and that the
cubin and PTX name the manifest's symbol with the manifest's parameter count. Errors name the file and
what was expected vs found. Plain JSON, no pickle: bundles travel between machines and users.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..layout import CODE_BITS, check_packing
from .spec import KernelSpec

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
#: hidden trailing pointer parameters of Triton >= 3.3 kernels (global and profile scratch).
HIDDEN_PARAMS = 2
#: maximum dynamic shared memory per block (opt-in) by target.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
TARGETS = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90}


class BundleError(ValueError):
    """A kernel bundle that is missing, malformed or does not match its manifest."""


def manifest_packing(packing: Any, where: str = "packing") -> dict[str, str]:
    """The manifest's ``packing`` section, checked: ``{"key": .., "value": ..}``, ``None`` = both linear."""
    if packing is None:
        return {"key": "linear", "value": "linear"}
    if not isinstance(packing, dict) or sorted(packing) != ["key", "value"]:
        raise BundleError(f"{where}: expected {{'key': .., 'value': ..}}, got {packing!r:.200}")
    for side in ("key", "value"):
        try:
            check_packing(packing[side], f"{where}.{side}")
        except ValueError as e:
            raise BundleError(str(e)) from None
    return {"key": packing["key"], "value": packing["value"]}


def manifest_key_bits(key_bits: Any, where: str = "key_bits") -> list[int]:
    """The manifest's ``key_bits`` section, checked: a non-empty list of known code widths, ``None`` = ``[2]``."""
    if key_bits is None:
        return [2]
    if (not isinstance(key_bits, list) or not key_bits
            or not all(type(b) is int for b in key_bits) or len(set(key_bits)) != len(key_bits)):
        raise BundleError(f"{where}: expected a list of distinct code widths, got {key_bits!r:.200}")
    unknown = [b for b in key_bits if b not in CODE_BITS]
    if unknown:
        raise BundleError(f"{where}: unknown key code widths {unknown}; this version knows {list(CODE_BITS)}")
    return sorted(key_bits)


def parse_arch(arch: str | int) -> int:
    """``"sm_90"`` or ``90`` -> 90; unknown targets raise ``ValueError`` naming the known ones."""
    if isinstance(arch, int) and arch in TARGETS.values():
        return arch
    if isinstance(arch, str) and arch in TARGETS:
        return TARGETS[arch]
    raise ValueError(f"unknown GPU arch {arch!r}: expected one of {sorted(TARGETS)}")


def arch_name(cap: int) -> str:
    return f"sm_{cap}"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ptx_entry_params(ptx: str, symbol: str) -> int:
    """Number of ``.param`` entries of ``.entry symbol(...)`` in PTX text."""
    m = re.search(r"\.entry\s+" + re.escape(symbol) + r"\s*\((.*?)\)", ptx, flags=re.S)
    if m is None:
        raise BundleError(f"PTX has no entry {symbol!r}")
    return len(re.findall(r"\.param\b", m.group(1)))


@dataclass(frozen=True)
class KernelEntry:
    """One (variant, target) of the bundle, as recorded in the manifest."""

    spec: KernelSpec
    arch: int
    symbol: str
    shared: int
    cubin_file: str
    cubin_sha256: str
    ptx_file: str
    ptx_sha256: str

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def num_params(self) -> int:
        """Parameters the driver sees: the user's plus the hidden scratch pointers."""
        return len(self.spec.params) + HIDDEN_PARAMS

    def param_bytes(self) -> list[int]:
        """Driver-side byte size of every parameter, hidden ones included."""
        return [p.nbytes for p in self.spec.params] + [8] * HIDDEN_PARAMS

    def to_dict(self, cubin: bytes, ptx: bytes) -> dict[str, Any]:
        d = self.spec.to_dict()
        return {
            "name": self.name,
            "arch": arch_name(self.arch),
            "symbol": self.symbol,
            "params": d["params"],
            "hidden_params": HIDDEN_PARAMS,
            "constexprs": d["constexprs"],
            "grid": d["grid"],
            "num_warps": self.spec.num_warps,
            "num_stages": self.spec.num_stages,
            "shared": self.shared,
            "spec": d,
            "cubin": {"file": self.cubin_file, "sha256": sha256(cubin), "bytes": len(cubin)},
            "ptx": {"file": self.ptx_file, "sha256": sha256(ptx), "bytes": len(ptx)},
        }


@dataclass(frozen=True)
class Manifest:
    root: Path
    data: dict[str, Any]
    entries: tuple[KernelEntry, ...]

    def entry(self, name: str, arch: str | int) -> KernelEntry:
        cap = parse_arch(arch)
        for e in self.entries:
            if e.name == name and e.arch == cap:
                return e
        have = sorted({(e.name, arch_name(e.arch)) for e in self.entries})
        raise BundleError(f"bundle {self.root}: no kernel {name!r} for {arch_name(cap)}; it holds {have}")

    @property
    def packing(self) -> dict[str, str]:
        """``{"key": .., "value": ..}``: the page packing the bundle's kernels were built for."""
        return manifest_packing(self.data.get("packing"))

    @property
    def key_bits(self) -> list[int]:
        """The key code widths the bundle has kernel variants for (``[2]``, or ``[2, 4]`` with 4-bit key layers)."""
        return manifest_key_bits(self.data.get("key_bits"))

    def archs(self) -> list[str]:
        return sorted({arch_name(e.arch) for e in self.entries})

    def binary(self, entry: KernelEntry, kind: str) -> bytes:
        """Bytes of ``entry``'s ``"cubin"`` or ``"ptx"`` (checked against the manifest's sha256)."""
        file, digest = (entry.cubin_file, entry.cubin_sha256) if kind == "cubin" else (entry.ptx_file, entry.ptx_sha256)
        data = _read(self.root / file)
        if sha256(data) != digest:
            raise BundleError(f"{self.root / file}: sha256 {sha256(data)[:16]}... does not match manifest "
                              f"{digest[:16]}...")
        return data


def _read(path: Path) -> bytes:
    if not path.is_file():
        raise BundleError(f"bundle file missing: {path}")
    return path.read_bytes()


def write_manifest(root: Path, data: dict[str, Any]) -> None:
    (root / MANIFEST).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def read_manifest(root: str | Path, verify: bool = True) -> Manifest:
    """Load and check ``root/manifest.json``; with ``verify`` also every binary (sha256, symbol, params)."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise BundleError(f"{root}: not a kernel bundle (no {MANIFEST})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: not valid JSON ({e})") from None
    if data.get("format") != FORMAT_VERSION:
        raise BundleError(f"{path}: format {data.get('format')!r}, expected {FORMAT_VERSION}")
    manifest_packing(data.get("packing"), f"{path}: packing")
    manifest_key_bits(data.get("key_bits"), f"{path}: key_bits")
    entries = []
    for k in data.get("kernels", []):
        try:
            spec = KernelSpec.from_dict(k["spec"])
            entry = KernelEntry(
                spec=spec, arch=parse_arch(k["arch"]), symbol=k["symbol"], shared=int(k["shared"]),
                cubin_file=k["cubin"]["file"], cubin_sha256=k["cubin"]["sha256"],
                ptx_file=k["ptx"]["file"], ptx_sha256=k["ptx"]["sha256"],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"{path}: malformed kernel entry {k.get('name', '?')!r}: {e}") from None
        if k.get("hidden_params") != HIDDEN_PARAMS or len(k["params"]) != len(spec.params):
            raise BundleError(f"{path}: {entry.name}: parameter list does not match its spec")
        entries.append(entry)
    if not entries:
        raise BundleError(f"{path}: the manifest lists no kernels")
    manifest = Manifest(root, data, tuple(entries))
    if verify:
        for e in entries:
            cubin = manifest.binary(e, "cubin")
            ptx = manifest.binary(e, "ptx").decode()
            if e.symbol.encode() + b"\0" not in cubin:
                raise BundleError(f"{root / e.cubin_file}: symbol {e.symbol!r} not found in the cubin")
            n = ptx_entry_params(ptx, e.symbol)
            if n != e.num_params:
                raise BundleError(f"{root / e.ptx_file}: {n} parameters, manifest says {e.num_params}")
    return manifest


__all__ = [
    "FORMAT_VERSION", "HIDDEN_PARAMS", "MANIFEST", "SHARED_LIMIT", "TARGETS", "BundleError", "KernelEntry",
    "Manifest", "arch_name", "manifest_key_bits", "manifest_packing",
    "parse_arch", "ptx_entry_params", "read_manifest", "sha256", "write_manifest",
]
