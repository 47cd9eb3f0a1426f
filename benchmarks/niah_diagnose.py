"""Where needle retrieval breaks under our INT2 cache, and what each candidate lever buys (issue 17).

    python benchmarks/niah_diagnose.py /tmp/smol.gguf --artifact art/ --out $OUT/diag --budget-s 330
    python benchmarks/niah_diagnose.py tiny-random --tiny --out /tmp/diag          # CPU, seconds: every code path
    python benchmarks/niah_diagnose.py default --artifact art/ --tiny --out /tmp/diag  # the embedded model, CPU

The ``dev`` NIAH split (phases 1-5; never tune on ``report``, which only phase 6 reads), every method fake-quantized decode-as-deployed from one
full-precision prefill (``oscar_export.eval.niah.run_niah``), the model in fp32, every cached row rounded to BF16.
Phases, each written to ``--out`` (``diagnose.json``, ``diagnose.md``) as soon as it ends:

1. ``layers``  (first task, first length): BF16, ours, ours with every layer's K (V) at BF16, and ours with one
   layer's K, then one layer's V, kept at BF16 (``2 L`` configs); attention mass on the needle's value tokens.
2. ``levers``  each lever alone and combined (``oscar_export.eval.levers``): 4-bit pages for the layers/sides
   phase 1 ranks worst, at most ``--page-bits`` (3.0) bits per element over the pages; BF16 anchor rows per page
   (by quantization error or key norm, 1-4 per page, K and/or V, optionally kept out of the page statistics);
   value groups of 32 (16); combinations at the same budget; over-budget points reported with their bits.
3. ``heads``   one (layer, KV head)'s K or V at BF16, for the ``--worst`` layers per side of phase 1.
4. ``tasks``   the other tasks (``--tasks``, e.g. multikey) at the first length: BF16, ours and the best levers.
5. ``long``    the first task at the other lengths (``--lengths``, e.g. 8192): BF16, ours and the best levers.
6. ``report``  the candidates on the ``report`` split, every task and length: BF16, ours, every K page 4-bit, the
   4-bit key layer sets named by ``--k4 NAME=L1,L2,..`` (chosen from the dev phases) and those
   ``oscar_export.eval.sensitivity`` allocates from calibration text alone (``--sens-budgets``, ``--sens-metrics``).

Methods of a phase go through ``run_niah`` in chunks whose decode-time rows fit ``--mem-gib`` (estimate below);
before each chunk the time of the last one predicts whether ``--budget-s`` still allows it, else the phase stops
and says so. Bits per element are reported at 8K and 32K (windows included) and over the pages alone.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from oscar_export.calibration.key_bits import parse_layers
from oscar_export.eval.cache_models import BF16Cache, CacheModel, PagedInt2
from oscar_export.eval.levers import PageVariant, variant
from oscar_export.eval.niah import NiahConfig, build_prompts, numbers, run_niah

GIB = 1 << 30
PHASES = ("layers", "levers", "heads", "tasks", "long", "report")


# ---- the toy setup (CPU tests) ------------------------------------------------------------------------------


class DigitTokenizer:
    """ids = characters mod 96; decode maps every id to one digit (any answer is a number)."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        return type("E", (), {"input_ids": [ord(c) % 96 for c in text]})()

    def decode(self, ids):
        return "".join(chr(48 + int(i) % 10) for i in ids)


def tiny_random_setup():
    """A random 2-layer Llama (4 query heads, 2 KV heads, D 64), the digit tokenizer, and ours as random
    per-head transforms on a small layout (sink 16, window 32, pages of 16, channel keys)."""
    import transformers

    from oscar_export.kernels.layout import KVCacheLayout
    from oscar_export.kernels.transform import LayerTransform

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    lay = KVCacheLayout.default(2, 64, "channel", sink=16, window=32, page_size=16)

    def transform():
        rot = lambda: torch.linalg.qr(torch.randn(2, 64, 64, generator=g, dtype=torch.float64))[0].float()  # noqa: E731
        lv = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(2, 4).contiguous()
        return LayerTransform(k_rotation=rot(), v_rotation=rot(), k_scale=0.5 + torch.rand(2, 64, generator=g),
                              v_scale=0.5 + torch.rand(2, 64, generator=g),
                              k_mean=0.1 * torch.randn(2, 64, generator=g),
                              v_mean=0.1 * torch.randn(2, 64, generator=g), k_clip=torch.tensor([0.95, 1.0]),
                              v_clip=torch.tensor([0.9, 0.97]), k_levels=lv, v_levels=lv.clone())

    ours = PagedInt2("ours", "random transforms (toy)", layout=lay, transforms=(transform(), transform()))
    lines = [[i % 96 for i in range(j, j + 12)] for j in range(60)]
    return model, DigitTokenizer(), ours, lines


# ---- what a phase measures ----------------------------------------------------------------------------------


@dataclass
class Budget:
    seconds: float
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, predicted_s: float) -> bool:
        return self.elapsed() + predicted_s <= self.seconds


def decode_bytes(m: CacheModel, layers: int, kv_heads: int, head_dim: int, fold: int, length: int) -> int:
    """Bytes the decode keeps per method (attention.py's per-layer rows: stored K/V float32 of the prompt and
    answer, plus the dequantized page rows of a quantizing method)."""
    per = 2 if (not m.quantize or isinstance(m, BF16Cache)) else 4
    return layers * per * fold * kv_heads * (length + 64) * head_dim * 4


def leading_digits(answer: str, value: str) -> int:
    """Digits of ``value`` the answer's first number gets right from the start (0 if it starts otherwise)."""
    done, open_run = numbers(answer)
    got = (done + [open_run])[0] if (done or open_run) else ""
    if not answer.lstrip().startswith(got):
        return 0
    n = 0
    for a, b in zip(got, value):
        if a != b:
            break
        n += 1
    return n


def score(rows: list[dict], n_layers: int) -> dict:
    """Per method: needles ok / n, leading digits, per-layer needle mass (mean over heads, and max head)."""
    out: dict = {}
    for r in rows:
        s = out.setdefault(r["method"], {"ok": 0, "n": 0, "digits": 0, "_mass": [], "failed": []})
        s["ok"] += int(r["ok"])
        s["n"] += 1
        s["digits"] += leading_digits(r["answer"], r["values"][0])
        if not r["ok"]:
            s["failed"].append({"index": r["index"], "depth": r["depth"], "value": r["values"],
                                "answer": r["answer"]})
        if r.get("needle_mass") is not None:
            s["_mass"].append(torch.tensor(r["needle_mass"]))  # [L, H]
    for s in out.values():
        ms = s.pop("_mass")
        if ms:
            m = torch.stack(ms)  # [prompts, L, H]
            s["mass_layer"] = [round(x, 5) for x in m.mean(2).mean(0).tolist()]
            s["mass_layer_maxhead"] = [round(x, 5) for x in m.amax(2).mean(0).tolist()]
            s["mass_mean"] = round(float(m.mean()), 5)
        else:
            s["mass_layer"] = s["mass_layer_maxhead"] = None
            s["mass_mean"] = None
    return out


def bits(m: CacheModel) -> dict:
    d = {"bits_8k": round(m.bits_per_element(8192), 4), "bits_32k": round(m.bits_per_element(32768), 4)}
    if isinstance(m, PageVariant):
        d["page_bits"] = round(m.page_bits(), 4)
    elif isinstance(m, PagedInt2):
        d["page_bits"] = round(m.layout.int2_bits_per_element(), 4)
    return d


class Diagnosis:
    """The run: model, prompts, results so far, and the writer (results after every phase)."""

    def __init__(self, model, tok, ours: PagedInt2, args, lines=None, log=print):
        self.model, self.tok, self.ours, self.args, self.log = model, tok, ours, args, log
        c = model.config
        self.n_layers = c.num_hidden_layers
        self.kv_heads = ours.layout.num_kv_heads
        self.head_dim = ours.layout.head_dim
        self.lines = lines
        self.budget = Budget(args.budget_s)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.result = {"command": args.command, "split": "dev", "needles": args.needles, "lengths": args.lengths,
                       "tasks": args.tasks, "page_bits_budget": args.page_bits, "phases": {}, "methods": {},
                       "ours": ours.name, "environment": environment()}
        self.chunk_s_per_method: float | None = None

    # -- running ------------------------------------------------------------------------------------------------
    def prompts(self, task: str, length: int, split: str = "dev"):
        cfg = NiahConfig(lengths=(length,), needles=self.args.needles, tasks=(task,), split=split,
                         digits=self.args.digits, values=self.args.values)
        return cfg, build_prompts(self.tok, cfg, self.lines)

    def run_phase(self, name: str, methods: list[CacheModel], task: str, length: int, split: str = "dev") -> dict:
        """Every method on the (task, length) prompts of ``split``, chunked to fit memory and the time budget."""
        cfg, prompts = self.prompts(task, length, split)
        fold = max(1, min(len(prompts), self.args.max_tokens // max(1, len(prompts[0].ids))))
        phase = {"task": task, "length": length, "split": split, "prompts": len(prompts), "fold": fold,
                 "configs": {}, "complete": False, "skipped": []}
        self.result["phases"][name] = phase
        for m in methods:
            self.result["methods"][m.name] = {**m.summary(), **bits(m)}
        pending = list(methods)
        t0 = time.perf_counter()
        while pending:
            chunk, mem = [], 0
            for m in pending:
                b = decode_bytes(m, self.n_layers, self.kv_heads, self.head_dim, fold, length)
                if chunk and mem + b > self.args.mem_gib * GIB:
                    break
                chunk.append(m)
                mem += b
            if self.chunk_s_per_method is not None:
                groups = math.ceil(len(prompts) / fold)
                predicted = self.chunk_s_per_method * len(chunk) * groups * (length / 4096)
                if not self.budget.allows(predicted):
                    phase["skipped"] = [m.name for m in pending]
                    phase["stopped"] = f"budget: {self.budget.elapsed():.0f} s used, next chunk ~{predicted:.0f} s"
                    self.log(f"{name}: stopping ({phase['stopped']}); {len(pending)} configs not run")
                    break
            t = time.perf_counter()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            rows = run_niah(self.model, self.tok, chunk, prompts, cfg, batch=fold, max_tokens=self.args.max_tokens,
                            needle_mass=True)
            dt = time.perf_counter() - t
            groups = math.ceil(len(prompts) / fold)
            self.chunk_s_per_method = dt / (len(chunk) * groups * (length / 4096))
            peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None
            phase.setdefault("chunks", []).append({"methods": len(chunk), "s": round(dt, 1),
                                                   "est_gib": round(mem / GIB, 1),
                                                   "peak_gib": None if peak is None else round(peak, 1)})
            for mname, s in score(rows, self.n_layers).items():
                phase["configs"][mname] = s
            phase.setdefault("rows", []).extend(
                {k: r[k] for k in ("method", "index", "depth", "values", "answer", "ok")} for r in rows)
            pending = pending[len(chunk):]
            self.log(f"{name}: {len(chunk)} configs in {dt:.1f} s (est {mem / GIB:.1f} GiB"
                     f"{'' if peak is None else f', peak {peak:.1f} GiB'}); {len(pending)} left")
        phase["complete"] = not pending
        phase["s"] = round(time.perf_counter() - t0, 1)
        self.write()
        return phase

    # -- the configs ------------------------------------------------------------------------------------------------
    def swap(self, name: str, units, desc: str) -> PageVariant:
        return variant(self.ours, name, desc, units=tuple(units))

    def layer_configs(self) -> list[CacheModel]:
        L = self.n_layers
        ms = [BF16Cache("bf16", "BF16 cache"), self.ours,
              self.swap("K16-all", [(i, -1, "k", 16) for i in range(L)], "every layer's K pages BF16"),
              self.swap("V16-all", [(i, -1, "v", 16) for i in range(L)], "every layer's V pages BF16")]
        for side in "kv":
            ms += [self.swap(f"{side.upper()}16-L{i}", [(i, -1, side, 16)], f"layer {i}'s {side.upper()} pages BF16")
                   for i in range(L)]
        return ms

    def ranking(self, side: str) -> list[int]:
        """Layers by what keeping their ``side`` at BF16 bought in phase 1 (needles, then leading digits),
        best first; layers not measured are left out."""
        cfgs = self.result["phases"].get("layers", {}).get("configs", {})
        base = cfgs.get(self.ours.name)
        if base is None:
            return []
        got = [(c["ok"] - base["ok"], c["digits"] - base["digits"], -i, i)
               for i in range(self.n_layers) if (c := cfgs.get(f"{side.upper()}16-L{i}")) is not None]
        return [i for *_, i in sorted(got, reverse=True)]

    def head_configs(self) -> list[CacheModel]:
        ms = []
        for side in "kv":
            for i in self.ranking(side)[: self.args.worst]:
                ms += [self.swap(f"{side.upper()}16-L{i}h{h}", [(i, h, side, 16)],
                                 f"layer {i} KV head {h}: {side.upper()} pages BF16") for h in range(self.kv_heads)]
        return ms

    def allocation(self, budget_bits: float, **options) -> tuple[tuple, float]:
        """4-bit (layer, side) units in phase-1 order (interleaving K and V rankings by gain) while the page bits
        stay within ``budget_bits`` for a variant with ``options``."""
        cfgs = self.result["phases"].get("layers", {}).get("configs", {})
        base = cfgs.get(self.ours.name)
        if base is None:
            return (), 0.0
        cand = sorted(((c["ok"] - base["ok"], c["digits"] - base["digits"], side, i)
                       for side in "kv" for i in range(self.n_layers)
                       if (c := cfgs.get(f"{side.upper()}16-L{i}")) is not None),
                      key=lambda x: (-x[0], -x[1], x[2], x[3]))
        units: list = []
        bits_now = variant(self.ours, "probe", **options).page_bits()
        for *_, side, i in cand:
            trial = units + [(i, -1, side, 4)]
            b = variant(self.ours, "probe", units=tuple(trial), **options).page_bits()
            if b > budget_bits + 1e-9:
                break
            units, bits_now = trial, b
        return tuple(units), bits_now

    def lever_configs(self) -> list[CacheModel]:
        L, pb = self.n_layers, self.args.page_bits
        base_bits = self.ours.layout.int2_bits_per_element()
        half = base_bits + (pb - base_bits) / 2
        ms: list[CacheModel] = [BF16Cache("bf16", "BF16 cache"), self.ours]
        v = lambda name, desc, **o: variant(self.ours, name, desc, **o)  # noqa: E731
        alloc, b = self.allocation(pb)
        if alloc:
            ms.append(v("4b-alloc", f"4-bit pages for the {len(alloc)} (layer, side) phase 1 ranks worst "
                        f"({b:.3f} page bits)", units=alloc))
            ms.append(v("4b-alloc-clip", "as 4b-alloc, 4-bit groups clipped at the 2-bit clip ratios",
                        units=alloc, wide_clip=True))
        ms += [v("4b-K-all", "every K page 4-bit (over budget: reference point)",
                 units=tuple((i, -1, "k", 4) for i in range(L))),
               v("4b-V-all", "every V page 4-bit (over budget: reference point)",
                 units=tuple((i, -1, "v", 4) for i in range(L)))]
        for n, sides in ((1, "kv"), (2, "kv"), (2, "k"), (2, "v"), (4, "v"), (4, "kv")):
            ms.append(v(f"anc-err{n}-{sides}",
                        f"{n} BF16 anchor rows per page and head ({sides}), by quantization error",
                        anchors=n, anchor_sides=sides))
        ms += [v("anc-err2-kv-excl", "as anc-err2-kv, anchors kept out of the page statistics", anchors=2,
                 anchor_exclude=True),
               v("anc-norm2-kv", "2 BF16 anchor rows per page and head (kv), by key norm", anchors=2,
                 anchor_score="keynorm"),
               v("anc-norm2-kv-excl", "as anc-norm2-kv, anchors kept out of the page statistics", anchors=2,
                 anchor_score="keynorm", anchor_exclude=True),
               v("vg32", "values in groups of 32", value_group=32),
               v("vg16", "values in groups of 16", value_group=16)]
        # combinations at the budget: the cheap levers first, 4-bit pages for what is left
        alloc_h, bh = self.allocation(half)
        if alloc_h:
            ms.append(v("4b-half+anc-err1-kv", f"4-bit pages for {len(alloc_h)} (layer, side) + 1 error anchor/page",
                        units=alloc_h, anchors=1))
            ms.append(v("4b-half+vg32", f"4-bit pages for {len(alloc_h)} (layer, side) + values in groups of 32",
                        units=alloc_h, value_group=32))
        ms.append(v("vg32+anc-err1-kv", "values in groups of 32 + 1 error anchor per page", value_group=32, anchors=1))
        ms.append(v("vg32+anc-err1-kv-excl", "as vg32+anc-err1-kv, anchors out of the statistics", value_group=32,
                    anchors=1, anchor_exclude=True))
        alloc_q, bq = self.allocation(pb, anchors=1, value_group=32)
        ms.append(v("4b+vg32+anc-err1-kv", f"4-bit pages for {len(alloc_q)} (layer, side) + values in groups of 32 "
                    "+ 1 error anchor per page", units=alloc_q, anchors=1, value_group=32))
        return ms

    def best_levers(self, k: int) -> list[CacheModel]:
        """The ``k`` lever configs of phase 3 with the most needles (within the page-bit budget), then digits."""
        ph = self.result["phases"].get("levers", {}).get("configs", {})
        built = {m.name: m for m in self._levers}
        within = lambda n: (isinstance(built.get(n), PageVariant)  # noqa: E731
                            and built[n].page_bits() <= self.args.page_bits + 1e-9)
        ok = [(c["ok"], c["digits"], n) for n, c in ph.items() if within(n)]
        return [built[n] for *_, n in sorted(ok, reverse=True)[:k]]

    def report_configs(self) -> list[CacheModel]:
        """Phase ``report``: BF16, ours, every K page 4-bit, the layer sets ``--k4`` names (chosen on the dev
        split) and the allocations of ``oscar_export.eval.sensitivity`` on calibration text (no needles)."""
        from oscar_export.eval import sensitivity

        L = self.n_layers
        ms: list[CacheModel] = [BF16Cache("bf16", "BF16 cache"), self.ours,
                                variant(self.ours, "K4-all", "every K page 4-bit",
                                        units=tuple((i, -1, "k", 4) for i in range(L)))]
        for spec in self.args.k4:
            name, _, layers = spec.partition("=")
            chosen = parse_layers(layers)
            ms.append(variant(self.ours, name, f"4-bit K pages in layers {chosen} (chosen on the dev split)",
                              units=tuple((i, -1, "k", 4) for i in chosen)))
        if self.args.sens_budgets:
            t = time.perf_counter()
            ids = sensitivity.calibration_windows(self.tok, self.args.sens_len, self.args.sens_seqs)
            col = sensitivity.capture(self.model, ids)
            errors = sensitivity.layer_errors(col, self.ours, queries=self.args.sens_queries)
            sens = {"tokens": [int(x) for x in ids.shape], "queries": self.args.sens_queries,
                    "errors": {str(b): e for b, e in errors.items()}, "allocations": {}}
            for metric in self.args.sens_metrics:
                for budget in self.args.sens_budgets:
                    m, chosen = sensitivity.allocate(self.ours, errors, budget, metric=metric)
                    sens["allocations"][m.name] = chosen
                    if chosen:  # an empty allocation is ours again
                        ms.append(m)
            sens["s"] = round(time.perf_counter() - t, 1)
            self.result["sensitivity"] = sens
            self.log(f"sensitivity on calibration text: {sens['allocations']} ({sens['s']} s)")
        return ms

    # -- the run ----------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        task, length = self.args.tasks[0], self.args.lengths[0]
        want = set(self.args.phases)
        if "layers" in want:
            self.log(f"phase layers: {task} @ {length}")
            self.run_phase("layers", self.layer_configs(), task, length)
        self._levers = self.lever_configs()
        if "levers" in want:
            self.log(f"phase levers: {len(self._levers)} configs")
            self.run_phase("levers", self._levers, task, length)
        heads = self.head_configs() if "heads" in want else []
        if heads:
            self.log(f"phase heads: {len(heads)} configs")
            self.run_phase("heads", heads, task, length)
        top = [BF16Cache("bf16", "BF16 cache"), self.ours] + self.best_levers(self.args.top)
        for t in self.args.tasks[1:] if "tasks" in want else []:
            self.log(f"phase tasks: {t} @ {length}")
            self.run_phase(f"tasks-{t}", top, t, length)
        for L in self.args.lengths[1:] if "long" in want else []:
            self.log(f"phase long: {task} @ {L}")
            self.run_phase(f"long-{L}", top, task, L)
        if "report" in want:  # the candidates on the report split: every task and length
            cands = self.report_configs()
            for t in self.args.tasks:
                for L in self.args.lengths:
                    self.log(f"phase report: {t} @ {L}, {len(cands)} configs")
                    self.run_phase(f"report-{t}-{L}", cands, t, L, split="report")
        self.result["wall_s"] = round(self.budget.elapsed(), 1)
        self.write()
        return self.result

    def write(self) -> None:
        (self.out / "diagnose.json").write_text(json.dumps(self.result, indent=1))
        (self.out / "diagnose.md").write_text(markdown(self.result))


def markdown(res: dict) -> str:
    lines = [f"# NIAH diagnosis ({res['needles']} needles per phase; dev split unless a phase says report)", "",
             f"Command: `{res['command']}`", f"Environment: {res['environment']}", ""]
    meth = res["methods"]
    for name, ph in res["phases"].items():
        state = "complete" if ph["complete"] else "INCOMPLETE: " + ph.get("stopped", "")
        lines += [f"## {name}: {ph['task']} @ {ph['length']} tokens, {ph.get('split', 'dev')} split "
                  f"({ph['prompts']} prompts, {state}, "
                  f"{ph.get('s', '?')} s)", "",
                  "| config | ok / n | leading digits | page bits | bits @8K | bits @32K | needle mass (mean) |",
                  "|---|---|---|---|---|---|---|"]
        for m, c in ph["configs"].items():
            b = meth.get(m, {})
            mass = "-" if c["mass_mean"] is None else f"{c['mass_mean']:.4f}"
            lines.append(f"| {m} | {c['ok']} / {c['n']} | {c['digits']} | {b.get('page_bits', '-')} | "
                         f"{b.get('bits_8k', '-')} | {b.get('bits_32k', '-')} | {mass} |")
        if ph.get("skipped"):
            lines.append(f"\nNot run (budget): {', '.join(ph['skipped'])}")
        lines.append("")
    lines += report_summary(res)
    lay = res["phases"].get("layers", {}).get("configs", {})
    if "bf16" in lay and lay["bf16"]["mass_layer"]:
        ours = res.get("ours")
        if ours in lay and lay[ours]["mass_layer"]:
            lines += ["## Attention mass on the needle's value tokens per layer (answer decode steps)", "",
                      f"| layer | bf16 mean head | {ours} mean head | bf16 max head | {ours} max head |",
                      "|---|---|---|---|---|"]
            for i, (a, b, c, d) in enumerate(zip(lay["bf16"]["mass_layer"], lay[ours]["mass_layer"],
                                                 lay["bf16"]["mass_layer_maxhead"], lay[ours]["mass_layer_maxhead"])):
                lines.append(f"| {i} | {a:.4f} | {b:.4f} | {c:.4f} | {d:.4f} |")
            lines.append("")
    return "\n".join(lines)


def report_summary(res: dict) -> list[str]:
    """The report phases side by side (needles correct per task and length, and in total), then the
    calibration-text sensitivity per layer and what it allocated."""
    rep = {n: p for n, p in res["phases"].items() if n.startswith("report-")}
    out: list[str] = []
    if rep:
        names = list(next(iter(rep.values()))["configs"])
        cols = list(rep)
        out += ["## Report split, all phases: needles correct (of the phase's prompts)", "",
                "| config | page bits | bits @8K | bits @32K | " + " | ".join(c[len("report-"):] for c in cols)
                + " | total |", "|---" * (len(cols) + 5) + "|"]
        for m in names:
            got = [rep[c]["configs"].get(m) for c in cols]
            tot = sum(g["ok"] for g in got if g), sum(g["n"] for g in got if g)
            b = res["methods"].get(m, {})
            out.append(f"| {m} | {b.get('page_bits', '-')} | {b.get('bits_8k', '-')} | {b.get('bits_32k', '-')} | "
                       + " | ".join("-" if g is None else f"{g['ok']}/{g['n']}" for g in got)
                       + f" | {tot[0]}/{tot[1]} |")
        out.append("")
    sens = res.get("sensitivity")
    if sens:
        out += [f"## Key attention error per layer on calibration text ({sens['tokens'][0]} windows of "
                f"{sens['tokens'][1]} tokens, last {sens['queries']} queries)", "",
                "| layer | KL, 2-bit K | KL, 4-bit K | top-row shift, 2-bit K | top-row shift, 4-bit K |",
                "|---|---|---|---|---|"]
        e2, e4 = sens["errors"]["2"], sens["errors"]["4"]
        for i, (a, b) in enumerate(zip(e2, e4)):
            out.append(f"| {i} | {a['kl']:.4f} | {b['kl']:.4f} | {a['top']:.4f} | {b['top']:.4f} |")
        out += [""] + [f"- `{n}`: layers {layers}" for n, layers in sens["allocations"].items()] + [""]
    return out


def environment() -> dict:
    import platform

    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def load(args, device):
    """``(model, tokenizer, ours, haystack lines)`` for ``args.model``: ``tiny-random``, ``default`` (the
    embedded SmolLM2) or a GGUF path."""
    if args.model == "tiny-random":
        model, tok, ours, lines = tiny_random_setup()
        return model.to(device), tok, ours.to(device), lines
    if args.artifact is None:
        raise SystemExit("niah_diagnose: --artifact is required with a real model (oscar-export calibrate)")
    if args.model == "default":
        from oscar_export.models import load_model

        model, tok = load_model(dtype=torch.float32, device=str(device))
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from eval_gpu import load_gguf

        model, tok = load_gguf(args.model, device)
    from oscar_export.calibration.artifact import load_artifact
    from oscar_export.eval.recipes import ours_method

    ours = ours_method(load_artifact(args.artifact, model.config), name="ours").to(device)
    return model, tok, ours, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("model", help="GGUF path, 'default' (embedded SmolLM2) or 'tiny-random' (toy, CPU tests)")
    ap.add_argument("--artifact", default=None, help="calibrated artifact directory (ours)")
    ap.add_argument("--out", default="niah_diagnose_out", help="output directory")
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop phases gracefully after this many seconds")
    ap.add_argument("--tasks", default="single,multikey", help="first: the diagnosis task; the rest: phase 4")
    ap.add_argument("--lengths", default="4096,8192", help="first: the diagnosis length; the rest: phase 5")
    ap.add_argument("--needles", type=int, default=20)
    ap.add_argument("--digits", type=int, default=7)
    ap.add_argument("--values", type=int, default=4, help="values per key (multivalue)")
    ap.add_argument("--worst", type=int, default=3, help="layers per side whose KV heads are swapped one by one")
    ap.add_argument("--top", type=int, default=4, help="levers carried to phases 4 and 5")
    ap.add_argument("--page-bits", type=float, default=3.0, help="budget: bits per element over the pages")
    ap.add_argument("--mem-gib", type=float, default=70.0, help="decode rows per chunk of methods (estimate)")
    ap.add_argument("--max-tokens", type=int, default=81920, help="prompt tokens decoded together")
    ap.add_argument("--phases", default=",".join(PHASES[:-1]),
                    help=f"subset of {','.join(PHASES)} (in that order; default: all but report)")
    ap.add_argument("--k4", action="append", default=[], metavar="NAME=L1,L2,..",
                    help="report phase: a config with 4-bit K pages in these layers (repeatable)")
    ap.add_argument("--sens-budgets", default="2.75,3.0", help="report phase: page-bit budgets of the calibration-"
                    "text allocations (empty: none)")
    ap.add_argument("--sens-metrics", default="kl,top", help="report phase: sensitivity metrics (kl, top)")
    ap.add_argument("--sens-len", type=int, default=2048, help="calibration window length (tokens)")
    ap.add_argument("--sens-seqs", type=int, default=2, help="calibration windows")
    ap.add_argument("--sens-queries", type=int, default=64, help="last positions of a window used as queries")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--tiny", action="store_true", help="toy sizes: 1 needle, 512 tokens, 3 digits, one value")
    args = ap.parse_args(argv)
    args.command = "python benchmarks/niah_diagnose.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    args.sens_budgets = [float(x) for x in args.sens_budgets.split(",") if x.strip()]
    args.sens_metrics = [m.strip() for m in args.sens_metrics.split(",") if m.strip()]
    if not args.tasks or any(p not in PHASES for p in args.phases):
        print(f"niah_diagnose: --phases: expected a subset of {','.join(PHASES)}, got {args.phases}; "
              f"--tasks: at least one", file=sys.stderr)
        return 2
    if args.tiny:
        args.needles, args.lengths, args.digits = 1, [512], min(args.digits, 3)
        args.values = 1
        args.worst, args.top = min(args.worst, 1), min(args.top, 2)
        args.sens_len, args.sens_queries = 256, 32
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("niah_diagnose: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)  # noqa: E731
    model, tok, ours, lines = load(args, device)
    log(f"model {args.model} on {device}; ours page bits {ours.layout.int2_bits_per_element():.3f}")
    res = Diagnosis(model, tok, ours, args, lines, log).run()
    print(markdown(res))
    log(f"done; {Path(args.out) / 'diagnose.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
