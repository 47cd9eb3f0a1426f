"""``benchmarks/niah_diagnose.py`` end to end at toy size on the CPU: every phase runs, the JSON and the
markdown have one entry per config with needles, bits and needle mass, and the time budget stops phases
gracefully (saying which configs were not run)."""

from __future__ import annotations

import json

from helpers import load_benchmark_script


def _script():
    return load_benchmark_script("niah_diagnose")


def test_diagnosis_runs_every_phase_and_writes_its_tables(tmp_path):
    nd = _script()
    assert nd.main(["tiny-random", "--tiny", "--out", str(tmp_path), "--tasks", "multivalue,single",
                    "--page-bits", "5.3"]) == 0
    res = json.loads((tmp_path / "diagnose.json").read_text())
    assert res["split"] == "dev"
    ph = res["phases"]
    assert list(ph) == ["layers", "levers", "heads", "tasks-single"], list(ph)
    layers = ph["layers"]["configs"]
    assert set(layers) == {"bf16", "ours", "K16-all", "V16-all", "K16-L0", "K16-L1", "V16-L0", "V16-L1"}
    assert len(ph["heads"]["configs"]) == 2 * 1 * 2  # --worst 1 layer per side, 2 KV heads
    assert {"4b-alloc", "anc-err1-kv", "anc-norm2-kv", "vg32", "4b+vg32+anc-err1-kv"} <= set(ph["levers"]["configs"])
    for p in ph.values():
        assert p["complete"] and not p["skipped"]
        for name, c in p["configs"].items():
            assert c["n"] == p["prompts"] == 1 and 0 <= c["ok"] <= 1, (name, c)
            assert len(c["mass_layer"]) == 2 and c["mass_mean"] is not None or p["task"] == "single", (name, c)
            b = res["methods"][name]
            assert b["bits_8k"] > 0 and b["bits_32k"] > 0, b
    alloc = res["methods"]["4b-alloc"]
    assert alloc["page_bits"] <= 5.3 and alloc["units"], alloc
    assert len(ph["tasks-single"]["configs"]) == 2 + 2  # bf16, ours and --top 2 levers within the budget
    md = (tmp_path / "diagnose.md").read_text()
    assert "## layers: multivalue @ 512" in md and "| K16-L1 |" in md and "Attention mass" in md


def test_diagnosis_stops_phases_when_the_budget_is_spent(tmp_path):
    nd = _script()
    assert nd.main(["tiny-random", "--tiny", "--out", str(tmp_path), "--tasks", "single", "--budget-s", "0"]) == 0
    res = json.loads((tmp_path / "diagnose.json").read_text())
    assert res["phases"]["layers"]["complete"]  # the first chunk always runs (it times the rest)
    later = [p for n, p in res["phases"].items() if n != "layers"]
    assert later and all(not p["complete"] and p["skipped"] and "budget" in p["stopped"] for p in later)
    assert "INCOMPLETE" in (tmp_path / "diagnose.md").read_text()


def test_report_phase_reads_the_report_split_with_the_named_and_allocated_configs(tmp_path):
    nd = _script()
    assert nd.main(["tiny-random", "--tiny", "--out", str(tmp_path), "--phases", "report", "--tasks",
                    "single,multivalue", "--k4", "devset=1", "--sens-budgets", "3.0,3.75"]) == 0
    res = json.loads((tmp_path / "diagnose.json").read_text())
    assert list(res["phases"]) == ["report-single-512", "report-multivalue-512"]
    for p in res["phases"].values():
        assert p["split"] == "report" and p["complete"]
        assert list(p["configs"])[:4] == ["bf16", "ours", "K4-all", "devset"]
    alloc = res["sensitivity"]["allocations"]
    assert alloc["k4-kl-3"] == [] and len(alloc["k4-kl-3.75"]) == 1  # toy base 3.25: one 4-bit K layer fits
    assert "k4-kl-3.75" in res["phases"]["report-single-512"]["configs"]
    assert "k4-kl-3" not in res["phases"]["report-single-512"]["configs"]
    md = (tmp_path / "diagnose.md").read_text()
    assert "## Report split, all phases" in md and "| devset | 3.75 |" in md and "KL, 2-bit K" in md
