"""Generate with the OSCAR 2-bit KV cache on the embedded SmolLM2-135M-Instruct, beside the BF16 cache.

    python examples/generate.py                      # identity transforms (no calibration needed)
    python examples/generate.py runs/smollm2         # with a calibrated artifact directory
"""

import sys
from pydoc_data.topics import topics

import torch

from oscar_export.models import load_model
from oscar_export.plugins.hf import cache_kwargs, enable_oscar

artifact = sys.argv[1] if len(sys.argv) > 1 else None
model, tok = load_model("default")  # fp32 on the CPU; pass dtype=torch.bfloat16, device="cuda" on a GPU
ids = tok(topics["with"], return_tensors="pt").input_ids  # 824 tokens: the history reaches the INT2 pages

with torch.no_grad():
    bf16 = model.generate(ids, max_new_tokens=48, do_sample=False)

with enable_oscar(model, artifact=artifact) as oscar, torch.no_grad():
    cache = oscar.make_cache(batch_size=1, max_length=ids.shape[1] + 48)
    int2 = model.generate(ids, max_new_tokens=48, do_sample=False, **cache_kwargs(model, cache))

n = ids.shape[1]
print("BF16 :", tok.decode(bf16[0, n:], skip_special_tokens=True))
print("OSCAR:", tok.decode(int2[0, n:], skip_special_tokens=True))
print(f"KV bytes: {cache.kv_bytes():,} (OSCAR) vs {cache.bf16_bytes():,} (BF16)")
