"""``calibration/safe_json.py``: strict JSON of untrusted files (nesting, finite numbers, repeated keys, one type per
field) and terminal-safe error text, as the artifact loader applies them."""

from __future__ import annotations

from pathlib import Path

import pytest

from oscar_export.calibration.artifact import load_artifact
from oscar_export.calibration.artifact_format import LIMITS, META_FILE, ArtifactError
from oscar_export.calibration.safe_json import printable

from helpers import refused, written


def test_printable_escapes_terminal_controls():
    s = "ok\x1b[2J\x1b]0;pwned\x07\r\n\u202e\x9b"
    out = printable(s)
    assert out.isprintable() and "\x1b" not in out and "\\x1b[2J" in out and "\\u202e" in out
    assert printable("x" * 1000, limit=20) == "x" * 17 + "..."
    assert printable("plain text: ä") == "plain text: ä"


def test_error_messages_escape_strings_from_the_file(tmp_path):
    err = refused(written(tmp_path, lambda m: m.__setitem__("format", "\x1b[31mevil")), "expected format")
    assert "\x1b" not in str(err)


def test_overflowing_float_literal_refused(tmp_path):
    d = written(tmp_path)
    text = (d / META_FILE).read_text()
    (d / META_FILE).write_text(text.replace('"sink": 4', '"sink": 1e999', 1))
    refused(d, "not valid JSON .*1e999")


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deep_nesting_refused(tmp_path, depth):
    d = written(tmp_path)
    text = (d / META_FILE).read_text()
    deep = "[" * depth + "]" * depth
    (d / META_FILE).write_text(text.replace('"config": {', f'"deep": {deep}, "config": {{', 1))
    refused(d, f"nested deeper than {LIMITS.max_json_depth}")


def test_missing_layout_field_named(tmp_path):
    refused(written(tmp_path, lambda m: m["layout"]["key"].pop("group_size")),
            "layout.key: missing keys \\['group_size'\\]")


@pytest.mark.parametrize(
    "path,value,match",
    [
        (("values_prerotated",), "false", "values_prerotated: expected true or false, got 'false'"),
        (("values_prerotated",), 0, "values_prerotated: expected true or false, got 0"),
        (("layout", "key", "codebook"), "no", "layout.key.codebook: expected true or false, got 'no'"),
        (("layout", "sink"), 64.5, "layout.sink: expected an int in \\[0, 16384\\], got 64.5"),
        (("layout", "sink"), 10**12, "layout.sink: expected an int in \\[0, 16384\\], got 1000000000000"),
        (("layout", "sink"), True, "layout.sink: expected an int in \\[0, 16384\\], got True"),
        (("layout", "window"), -1, "layout.window: expected an int in \\[0, 65536\\], got -1"),
        (("layout", "page_size"), 2**40, "layout.page_size: expected an int in \\[16, 1024\\], got 1099511627776"),
        (("layout", "num_kv_heads"), 3.0, "layout.num_kv_heads: expected an int in \\[1, 256\\], got 3.0"),
        (("layout", "head_dim"), "16", "layout.head_dim: expected an int in \\[16, 512\\], got '16'"),
        (("layout", "key", "bits"), 2.0, "layout.key.bits: expected an int in \\[2, 2\\], got 2.0"),
        (("layout", "key", "granularity"), ["token"], "layout.key.granularity: expected one of"),
        (("layout", "value"), [1, 2], "layout.value: expected a JSON object, got a list"),
        (("layout", "extra"), 1, "layout: unexpected keys \\['extra'\\]"),
        (("fingerprint", "num_hidden_layers"), 2.0, "fingerprint.num_hidden_layers: expected an int"),
        (("fingerprint", "vocab_size"), 1e300, "fingerprint.vocab_size: expected an int"),
        (("fingerprint", "model_type"), 7, "fingerprint.model_type: expected a string"),
        (("fingerprint", "rope"), "x", "fingerprint.rope: expected a JSON object or null, got a str"),
        (("fingerprint",), [], "fingerprint: expected a JSON object, got a list"),
        (("num_layers",), 2.0, "num_layers: expected an int in \\[1, 1024\\], got 2.0"),
        (("tensor_file",), "../../etc/passwd", "tensor_file: expected 'rotations.safetensors'"),
        (("config",), "x", "config: expected a JSON object, got a str"),
        (("stats",), [1], "stats: expected a JSON object, got a list"),
        (("format_version",), 1.0, "unsupported format_version 1.0"),
        (("format_version",), True, "unsupported format_version True"),
    ],
    ids=lambda x: str(x)[:24],
)
def test_json_types_and_bounds(tmp_path, path, value, match):
    def edit(m):
        node = m
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    refused(written(tmp_path, edit), match)


def _edit_meta(d: Path, text: str) -> None:
    (d / "oscar.json").write_text(text)


def test_duplicate_keys_are_refused(art_dir):
    """Duplicate keys in oscar.json are refused (else the last one would silently win)."""
    text = (art_dir / "oscar.json").read_text()
    assert text.count('"values_prerotated": false') == 1
    _edit_meta(art_dir, text.replace('"values_prerotated": false', '"values_prerotated": true, '
                                                                   '"values_prerotated": false', 1))
    with pytest.raises(ArtifactError, match="duplicate key 'values_prerotated' in one object"):
        load_artifact(art_dir)
