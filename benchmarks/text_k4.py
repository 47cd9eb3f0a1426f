"""Text KL / PPL of ours and the issue-17 4-bit-key configs, fake-quantized decode-as-deployed (fp32 model).

    python benchmarks/text_k4.py 8192 [ARTIFACT] [OUT.json]    # one 8K window of the evaluation text; 2K/4K prefixes

The layer sets are the ones EVALUATION.md's report-split table names (k4-mass-*: the dev-split diagnosis;
k4-kl-3: oscar_export/eval/sensitivity.py on calibration text). About 40 min on a 2-core CPU.
"""
import json, sys, time, torch
from oscar_export.models import load_model
from oscar_export.calibration.artifact import load_artifact
from oscar_export.eval.recipes import ours_method
from oscar_export.eval.levers import variant
from oscar_export.eval.cache_models import BF16Cache
from oscar_export.eval.text import text_windows, final_hidden, score_prefixes, max_positions, TextScore
L = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
t0 = time.time()
model, tok = load_model(dtype=torch.float32, device="cpu")
ART = sys.argv[2] if len(sys.argv) > 2 else "art"
OUT = sys.argv[3] if len(sys.argv) > 3 else f"text_k4_{L}.json"
ours = ours_method(load_artifact(ART, model.config), name="ours")
k4 = lambda name, layers: variant(ours, name, units=tuple((i, -1, "k", 4) for i in layers))
methods = [BF16Cache("bf16", "BF16"), ours,
           k4("k4-mass-3", [6,7,8,14,15,16,17,18,19,20,21,22,23,24,28]),
           k4("k4-kl-3", [1,2,3,4,5,6,7,8,9,10,17,18,20,23,28]),
           k4("k4-mass-2.75", [7,8,14,17,18,21,23])]
w = text_windows(tok, L, 1, max_positions=max_positions(model))[0]
lengths = [x for x in (2048, 4096, 8192) if x <= L]
head = model.get_output_embeddings()
ref = final_hidden(model, w, methods[0])
pos = torch.arange(w.numel() - 1)
out = {}
for m in methods[1:]:
    got = final_hidden(model, w, m)
    part = score_prefixes(lambda a, b: head(ref[a:b]), lambda a, b: head(got[a:b]), w, m.reads_quantized(pos), lengths)
    out[m.name] = {str(k): v.summary() for k, v in part.items()}
    out[m.name]["page_bits"] = m.page_bits() if hasattr(m, "page_bits") else 2.5
    print(m.name, {k: (round(v["kl"], 4), round(v["dppl_pct"], 2)) for k, v in out[m.name].items() if k != "page_bits"}, f"{time.time()-t0:.0f}s", flush=True)
    json.dump(out, open(OUT, "w"), indent=1)
