"""The bundle's manifest (kernels/aot/manifest.py): the checks that each binary still is what it says.

The ``bundle`` fixture (the probe kernels' bundle) is tests/kernels/conftest.py's.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("triton")

from oscar_export.kernels.aot.manifest import MANIFEST, BundleError, read_manifest  # noqa: E402


def test_manifest_detects_tampered_binary(bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    cubin = sorted(copy.glob("*.cubin"))[0]
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"{cubin.name}: sha256 .* does not match manifest"):
        read_manifest(copy)


def test_manifest_detects_missing_file_and_wrong_params(bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    sorted(copy.glob("*.ptx"))[0].unlink()
    with pytest.raises(BundleError, match="bundle file missing"):
        read_manifest(copy)
    copy2 = tmp_path / "c"
    shutil.copytree(bundle, copy2)
    data = json.loads((copy2 / MANIFEST).read_text())
    data["kernels"][0]["params"].pop()
    (copy2 / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(BundleError, match="parameter list does not match"):
        read_manifest(copy2)


def test_manifest_detects_binary_swapped_for_another_kernel(bundle, tmp_path):
    """A binary with a valid file but the wrong kernel inside (sha256 updated too) fails the symbol check."""
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    data = json.loads((copy / MANIFEST).read_text())
    a, b = data["kernels"][0], next(k for k in data["kernels"] if k["symbol"] != data["kernels"][0]["symbol"])
    a["cubin"] = dict(b["cubin"])
    (copy / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(BundleError, match="not found in the cubin"):
        read_manifest(copy)


def test_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="not a kernel bundle"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text("{")
    with pytest.raises(BundleError, match="not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": 99}))
    with pytest.raises(BundleError, match="format 99"):
        read_manifest(tmp_path)


def test_manifest_entry_lookup_errors(bundle):
    m = read_manifest(bundle)
    with pytest.raises(BundleError, match="no kernel 'nope' for sm_90"):
        m.entry("nope", "sm_90")


def test_manifest_records_key_bits_and_refuses_unknown(bundle, tmp_path):
    """The key code widths are recorded (default [2]); an old manifest without them reads as [2]; a width this
    version does not know, or a malformed field, is refused on load with one clear error."""
    assert read_manifest(bundle, verify=False).key_bits == [2]
    for name, value, ok in (("old", None, True), ("k4", [4, 2], True), ("k8", [2, 8], False), ("int", 4, False),
                            ("dup", [2, 2], False), ("empty", [], False)):
        copy = tmp_path / name
        shutil.copytree(bundle, copy)
        data = json.loads((copy / MANIFEST).read_text())
        if value is None:
            data.pop("key_bits")
        else:
            data["key_bits"] = value
        (copy / MANIFEST).write_text(json.dumps(data))
        if ok:
            assert read_manifest(copy).key_bits == ([2] if value is None else [2, 4])
        else:
            with pytest.raises(BundleError, match="key_bits"):
                read_manifest(copy)
    with pytest.raises(BundleError, match=r"key_bits: unknown key code widths \[8\]; this version knows \[2, 4\]"):
        read_manifest(tmp_path / "k8")


def test_manifest_records_packing_and_refuses_unknown(bundle, tmp_path):
    """The page packing is recorded (default linear); an old manifest without it reads as linear; an unknown
    packing is refused on load with one clear error."""
    assert read_manifest(bundle, verify=False).packing == {"key": "linear", "value": "linear"}
    for name, edit, ok in (
        ("old", lambda d: d.pop("packing"), True),
        ("mma", lambda d: d.__setitem__("packing", {"key": "mma16", "value": "mma16"}), True),
        ("bad", lambda d: d.__setitem__("packing", {"key": "linear", "value": "zigzag"}), False),
        ("shape", lambda d: d.__setitem__("packing", "mma16"), False),
    ):
        copy = tmp_path / name
        shutil.copytree(bundle, copy)
        data = json.loads((copy / MANIFEST).read_text())
        edit(data)
        (copy / MANIFEST).write_text(json.dumps(data))
        if ok:
            assert read_manifest(copy).packing["key"] == ("linear" if name == "old" else "mma16")
        else:
            with pytest.raises(BundleError, match="packing"):
                read_manifest(copy)
    with pytest.raises(BundleError, match=r"packing.value: unknown packing 'zigzag'; this version knows"):
        read_manifest(tmp_path / "bad")
