"""Strict JSON for untrusted files, and terminal-safe text for error messages.

:func:`parse_json` accepts finite numbers only, refuses repeated keys and bounds nesting
(``LIMITS.max_json_depth``); the ``json_*`` checks type one field each (a bool is a bool, an int an int, not
``3.0``). Every failure is one :class:`~.artifact_format.ArtifactError` (a ``ValueError``) naming the field,
what was expected and what came, with the value shown by :func:`describe` / :func:`printable` (control
characters escaped, length bounded). Used for the artifact and for every JSON file the CLI reads back.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

from .artifact_format import LIMITS, ArtifactError


def printable(x: Any, limit: int = 200) -> str:
    """``str(x)`` safe for a terminal: control and format characters (ESC, CR, BEL, bidi overrides, C1...)
    written as ``\\xNN`` / ``\\uNNNN`` escapes, at most ``limit`` characters (``...`` marks a cut)."""
    s = x if isinstance(x, str) else str(x)
    out = []
    n = 0
    for c in s[: limit + 1]:
        if c.isprintable():
            e = c
        else:
            o = ord(c)
            e = f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"
        out.append(e)
        n += len(e)
        if n > limit:
            break
    text = "".join(out)
    return text if len(text) <= limit and len(s) <= limit else text[: limit - 3] + "..."


def describe(x: Any) -> str:
    """A short, terminal-safe description of a JSON value for an error message."""
    if isinstance(x, str):
        return repr(printable(x, 60))
    if isinstance(x, bool) or x is None:
        return repr(x)
    if isinstance(x, int):
        return repr(x) if abs(x) < 10**30 else f"an int of {len(str(abs(x)))} digits"
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, list):
        return "a list"
    if isinstance(x, dict):
        return "a JSON object"
    return f"a {type(x).__name__}"


def json_int(x: Any, where: str, lo: int, hi: int, multiple_of: int = 1) -> int:
    """``x`` if it is a JSON int (not a bool, not 3.0) in ``[lo, hi]``, else :class:`ArtifactError`."""
    if type(x) is not int or not lo <= x <= hi or x % multiple_of:
        what = f"a multiple of {multiple_of} in" if multiple_of > 1 else "an int in"
        raise ArtifactError(f"{where}: expected {what} [{lo}, {hi}], got {describe(x)}")
    return x


def json_bool(x: Any, where: str) -> bool:
    if type(x) is not bool:
        raise ArtifactError(f"{where}: expected true or false, got {describe(x)}")
    return x


def json_kind(x: Any) -> str:
    """The JSON type of ``x`` in words."""
    if x is None:
        return "null"
    names = {dict: "a JSON object", list: "a list", str: "a str", bool: "a bool", int: "an int", float: "a float"}
    return names.get(type(x), f"a {type(x).__name__}")


def json_str(x: Any, where: str, limit: int = 256, optional: bool = False) -> str | None:
    if optional and x is None:
        return None
    if not isinstance(x, str) or len(x) > limit:
        got = f"{len(x)} characters" if isinstance(x, str) else json_kind(x)
        raise ArtifactError(f"{where}: expected a string of at most {limit} characters"
                            f"{' or null' if optional else ''}, got {got}")
    return x


def json_object(x: Any, where: str, optional: bool = False) -> dict | None:
    if optional and x is None:
        return None
    if not isinstance(x, dict):
        raise ArtifactError(f"{where}: expected a JSON object{' or null' if optional else ''}, got {json_kind(x)}")
    return x


def json_keys(d: dict, where: str, required: Sequence[str], allowed: Sequence[str] | None = None) -> None:
    missing = [k for k in required if k not in d]
    if missing:
        raise ArtifactError(f"{where}: missing keys {missing}")
    if allowed is not None:
        extra = sorted(printable(k, 40) for k in d if k not in allowed)
        if extra:
            raise ArtifactError(f"{where}: unexpected keys {extra[:4]}{'...' if len(extra) > 4 else ''}")


def json_depth(x: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), computed without recursion."""
    depth, stack = 0, [(x, 0)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            d += 1
            depth = max(depth, d)
            stack.extend((v, d) for v in (node.values() if isinstance(node, dict) else node))
    return depth


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {printable(text, 40)} is not finite in float64")
    return v


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all distinct (a repeated key is refused: which value counts is ambiguous)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {printable(dup, 80)!r} in one object")
    return out


def parse_json(text: str | bytes, where: str) -> Any:
    """Strict JSON: finite numbers only, nesting at most ``LIMITS.max_json_depth``; raises :class:`ArtifactError`."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        value = json.loads(text, parse_float=_finite_float, parse_constant=_reject_constant,
                           object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ArtifactError(f"{where}: not valid JSON (nested deeper than {LIMITS.max_json_depth} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{where}: not valid JSON ({printable(e, 160)})") from None
    if json_depth(value) > LIMITS.max_json_depth:
        raise ArtifactError(f"{where}: not valid JSON (nested deeper than {LIMITS.max_json_depth} levels)")
    return value



__all__ = ["describe", "json_bool", "json_depth", "json_int", "json_keys", "json_kind", "json_object", "json_str",
           "parse_json", "printable"]
