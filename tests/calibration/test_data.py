"""``calibration/data.py``: the built-in pydoc text and its calibration / evaluation split, text and JSONL files,
and the cut into fixed-length token sequences."""

from __future__ import annotations

import pytest

from oscar_export.calibration.data import pydoc_text, read_text_file, token_sequences

from helpers import ByteTokenizer


def test_data_sources(tmp_path):
    cal, ev = pydoc_text("calibration"), pydoc_text("evaluation")
    assert abs(len(cal) / (len(cal) + len(ev)) - 0.7) < 1e-3 and cal[-50:] not in ev
    with pytest.raises(ValueError, match="part: expected"):
        pydoc_text("test")
    j = tmp_path / "d.jsonl"
    j.write_text('{"text": "hello"}\n\n{"id": 1, "body": "world"}\n"plain"\n')
    assert read_text_file(j) == "hello\n\nworld\n\nplain"
    j.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(ValueError, match="d.jsonl:2: not valid JSON"):
        read_text_file(j)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text_file(tmp_path / "missing.txt")
    tok = ByteTokenizer(256)
    seqs = token_sequences("abcdefgh" * 10, tok, 8, 5, seed=1)
    assert seqs.shape == (5, 8) and len({tuple(s.tolist()) for s in seqs}) == 1  # periodic text
    with pytest.raises(ValueError, match="calibration data too short: 80 tokens hold 10 sequences of 8, 11 needed"):
        token_sequences("abcdefgh" * 10, tok, 8, 11)
