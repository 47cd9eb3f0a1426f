"""The report: tables with intervals and needle counts, JSON, the two plots, merging runs."""

from __future__ import annotations

import json

import pytest

from oscar_export.eval.niah_scoring import summarize
from oscar_export.eval.report import headline, markdown, merge, write_all


def result():
    rows = [{"method": m, "task": t, "length": 1024, "ok": ok, "index": i}
            for m, k in (("bf16", 4), ("a", 1)) for t in ("single", "multikey", "multivalue")
            for i, ok in enumerate([True] * k + [False] * (4 - k))]
    score = {"ppl": 11.0, "dppl_pct": 10.0, "kl": 0.1, "top1": 0.9, "positions": 1023, "ppl_q": 12.0,
             "dppl_pct_q": 20.0, "kl_q": 0.2, "top1_q": 0.8, "positions_q": 639}
    return {
        "methods": [{"name": n, "kind": "x", "description": n, "bits": {"1024": b}}
                    for n, b in (("bf16", 16.0), ("a", 3.1))],
        "text": {"lengths": {"1024": {"windows": 1,
                                      "scores": {"bf16": {**score, "kl": 0.0, "dppl_pct": 0.0}, "a": score}}}},
        "niah": {"config": {"lengths": [1024], "tasks": ["single", "multikey", "multivalue"], "needles": 4,
                            "split": "report"}, "summary": summarize(rows), "rows": rows, "methods": ["bf16", "a"]},
        "skipped": {"hf-hqq-int2": "QuantizedCache(backend='hqq') needs the package hqq"},
        "command": "x",
    }


def test_markdown_states_needles_intervals_and_int2_positions():
    md = markdown(result())
    assert "| a | 3.100 | 11.000 | 10.00 | 0.1000 | 0.9000 | 20.00 | 0.2000 | 0.8000 | 639/1023 |" in md
    assert "4 needles per task and length, 12 questions per method" in md
    assert "| bf16 | 4/4 (51–100) | 4/4 (51–100) | 4/4 (51–100); values 4/4 |" in md  # Wilson 95 % of 4/4: [0.51, 1]
    assert "| a | 1/4 (5–70) |" in md
    assert "`hf-hqq-int2`: QuantizedCache(backend='hqq') needs the package hqq" in md


def test_write_all_writes_markdown_json_and_plots(tmp_path):
    paths = write_all(result(), tmp_path)
    assert json.loads(paths["json"].read_text())["methods"][1]["name"] == "a"
    assert paths["kl_vs_bits"].stat().st_size > 1000 and paths["niah_vs_length"].stat().st_size > 1000


def test_headline_says_what_was_measured_and_puts_bf16_and_ours_first(tmp_path):
    """The first screen names the length, the INT2 share and the needles, one row per method."""
    res = result()
    res["methods"].insert(1, {"name": "oscar", "kind": "x", "description": "ours", "bits": {"1024": 3.6}})
    res["text"]["lengths"]["1024"]["scores"]["oscar"] = {**res["text"]["lengths"]["1024"]["scores"]["a"], "kl": 0.01}
    res["environment"] = {"device": "cpu", "dtype": "torch.float32", "cpu_threads": 1}
    res["timings"] = {"load_s": 12.3, "calibrate_s": 170.0, "methods_s": 20.4, "text_s": 61.0, "niah_s": 1234.5,
                      "wall_s": 1498.6}
    paths = write_all(res, tmp_path)
    text = headline(res, paths).splitlines()
    assert "1 window(s) of 1,024 tokens" in text[1] and "639 of 1,023 positions read INT2 history" in text[1]
    assert "4 per task and length (single needle, multi-key, multi-value) at 1,024 tokens" in text[2]
    # how long the run took, by phase (the main job's 10 minutes)
    assert text[3] == ("- time: 1,499 s in all (model load 12 s, calibration 170 s, peers' setup 20 s, text 61 s, "
                       "needles 1,234 s), 1 torch thread(s)")
    rows = [x for x in text if x.startswith("| ") and not x.startswith("| method")]
    assert [r.split(" | ")[0] for r in rows] == ["| bf16", "| **ours (oscar)**", "| a"]
    assert rows[0].endswith("| 4/4 | 4/4 | 4/4 |") and "| 3.10 | 0.1000 | 10.00 | 0.900 | 1/4 |" in rows[2]
    assert paths["summary"].stat().st_size > 1000 and str(paths["summary"]) in text[-1]


def test_merge_adds_methods_and_refuses_incomparable_runs():
    def res(names, ppl=10.0, windows=1):
        return {"methods": [{"name": n, "bits": {}} for n in names], "command": "x",
                "text": {"lengths": {"1024": {"windows": windows,
                                              "scores": {n: {"ppl": ppl if n == "bf16" else 11.0} for n in names}}}}}

    m = merge(res(["bf16", "a"]), res(["bf16", "b"]))
    assert [x["name"] for x in m["methods"]] == ["bf16", "b", "a"]
    assert set(m["text"]["lengths"]["1024"]["scores"]) == {"bf16", "a", "b"}
    with pytest.raises(ValueError, match="BF16 perplexity differs"):
        merge(res(["bf16", "a"]), res(["bf16", "b"], ppl=10.5))
    with pytest.raises(ValueError, match="text windows at 1024 differ"):
        merge(res(["bf16", "a"]), res(["bf16", "b"], windows=2))


def test_merge_of_two_in_memory_niah_runs_compares_configs_as_written():
    """A run merges its own earlier in-memory part (tuples in its NIAH config), not only a JSON file's."""
    a, b = result(), result()
    for r, name in ((a, "a"), (b, "c")):
        r["niah"]["config"]["lengths"] = (1024,)  # NiahConfig.to_dict() keeps the tuple
        for row in r["niah"]["rows"]:
            row["method"] = "bf16" if row["method"] == "bf16" else name
        r["niah"]["methods"] = ["bf16", name]
    m = merge(a, b)
    assert {r["method"] for r in m["niah"]["rows"]} == {"bf16", "a", "c"}
    b["niah"]["config"]["needles"] = 5
    with pytest.raises(ValueError, match="NIAH configs differ"):
        merge(a, b)


def test_plots_of_none_and_all_of_n_needles(tmp_path):
    """0 of 3 and 10 of 10 (bounds that rounding used to put past the share): every plot is written."""
    rows = [{"method": m, "task": "single", "length": 512, "ok": ok, "index": i}
            for m, n, k in (("bf16", 10, 10), ("oscar", 3, 0)) for i, ok in enumerate([True] * k + [False] * (n - k))]
    res = {"methods": [{"name": n, "description": n, "bits": {"512": b}} for n, b in (("bf16", 16.0), ("oscar", 2.5))],
           "niah": {"config": {"lengths": [512], "tasks": ["single"], "needles": 1, "split": "report"},
                    "summary": summarize(rows), "rows": rows, "methods": ["bf16", "oscar"]}}
    paths = write_all(res, tmp_path)
    assert paths["summary"].stat().st_size > 1000 and paths["niah_vs_length"].stat().st_size > 1000


def test_results_json_is_written_whole_or_not_at_all(tmp_path):
    """A write that fails half way (a file size limit stands in for a full disk) leaves the earlier results.json
    as it was and no partial file."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "results.json").write_text('{"earlier": true}')
    child = textwrap.dedent("""
        import json, resource, signal, sys
        from oscar_export.eval.report import write_all
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        res = {"methods": [{"name": "bf16", "description": "", "bits": {"512": 16.0}}], "padding": "x" * 20000}
        try:
            write_all(res, sys.argv[1])
        except OSError as e:
            print("failed:", e.strerror)
    """)
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert "failed: File too large" in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "results.json").read_text() == '{"earlier": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
