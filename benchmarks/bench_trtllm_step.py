"""The TensorRT-LLM adapter's attention layer on a GPU: one layer's forward (``OscarAttention.forward`` over the
cache manager, the AOT bundle's kernels through the driver API), without TensorRT-LLM (minimal bases of the two
upstream classes: what the adapter uses of them), Llama-3-8B heads (32 / 8 x 128), the default layout.

Rows (median of CUDA-event timings, ms per layer forward):

* ``prefill batched``: N prompts in one forward (the adapter's context path: padded attention groups, one planned
  write); ``prefill one per forward``: the same prompts, one forward each (the launches a per-request loop makes);
* ``decode``: G generation rows among S sequence slots at length L (the kernels run over the G scheduled rows).

    python3 benchmarks/bench_trtllm_step.py --json /tmp/trtllm_step.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from types import SimpleNamespace

import torch

HEADS, KV, D = 32, 8, 128


class KVCacheManagerBase:  # what the adapter uses of upstream's KVCacheManager
    def __init__(self, kv_cache_config, kv_cache_type, *, max_seq_len, tokens_per_block, max_batch_size, **kw):
        self.max_blocks_per_seq = math.ceil(max_seq_len / tokens_per_block)
        self._blocks = max_batch_size * self.max_blocks_per_seq

    def get_max_resource_count(self):
        return self._blocks


class AttentionBackendBase:  # what the adapter uses of upstream's AttentionBackend
    def __init__(self, layer_idx, num_heads, head_dim, num_kv_heads=None, quant_config=None, **kwargs):
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
        self.num_kv_heads = num_kv_heads or num_heads


def aot_ops(lay, tmp):
    from oscar_export.kernels.aot import bundle as b
    from oscar_export.kernels.aot.compile import build_bundle
    from oscar_export.kernels.aot.manifest import read_manifest
    from oscar_export.plugins.trtllm.device import AotCacheOps

    tag = b.layout_tag(lay, HEADS)
    specs = [b.decode_split_spec(lay, HEADS, D**-0.5, tag), b.decode_merge_spec(lay, tag),
             *b.decode_step_specs(lay, HEADS, tag), b.quant_pack_spec(lay, lay.key, "k", False, tag),
             b.quant_pack_spec(lay, lay.value, "v", False, tag)]
    major, minor = torch.cuda.get_device_capability()
    out = build_bundle(specs, f"{tmp}/bundle", archs=[f"sm_{10 * major + minor}"], ptx_version=None)
    return AotCacheOps(read_manifest(out), lay, HEADS)


def setup(ops, lay, slots: int, max_seq: int, dev="cuda"):
    """A manager of ``slots`` sequence slots (random windows, shuffled block ids) and one attention layer."""
    from oscar_export.kernels.transform import LayerTransform
    from oscar_export.plugins.trtllm.attention import make_attention_class
    from oscar_export.plugins.trtllm.cache import make_cache_manager_class

    t = LayerTransform.identity(KV, D, k_clip=0.97, v_clip=0.95).to(dev)
    dep = SimpleNamespace(sm_scale=D**-0.5, layout=lay, layer_layouts=(lay,), num_layers=1,
                          transform=lambda i, d: t, check_limits=lambda *a: None)
    cls = make_cache_manager_class(SimpleNamespace(KVCacheManager=KVCacheManagerBase), dep, lambda layout: ops)
    mgr = cls(SimpleNamespace(max_tokens=None), "SELF", num_layers=1, num_kv_heads=KV, head_dim=D,
              tokens_per_block=lay.page_size, max_seq_len=max_seq, max_batch_size=slots,
              mapping=SimpleNamespace(world_size=1))
    st = mgr.layers[0]
    for f in ("sink_k", "sink_v", "recent_k", "recent_v"):
        getattr(st, f).normal_()
    st.k_codes.random_(0, 256), st.v_codes.random_(0, 256)
    st.k_params.uniform_(0, 0.1), st.v_params.uniform_(0, 0.1)
    ids = torch.randperm(st.k_codes.shape[0])[: slots * mgr.book.max_pages].view(slots, -1).to(torch.int32)
    for s in range(slots):
        mgr.book.assign(s, ids[s])
        mgr.slots[s] = s  # request id s in slot s
    layer = make_attention_class(SimpleNamespace(AttentionBackend=AttentionBackendBase), dep)(0, HEADS, D, KV)
    return mgr, layer


def forward(mgr, layer, lens: list[int], cached: list[int], contexts: int, rids: list[int], dev="cuda"):
    n = sum(lens)
    q = torch.randn(n, HEADS * D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(n, KV * D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    mgr._write_step_slots([mgr.slots[r] for r in rids])
    md = SimpleNamespace(kv_cache_manager=mgr, num_contexts=contexts, num_seqs=len(lens), request_ids=rids,
                         seq_lens=torch.tensor(lens, dtype=torch.int32),
                         kv_cache_params=SimpleNamespace(num_cached_tokens_per_seq=cached))
    return lambda: layer.forward(q, k, v, md)


def set_lengths(mgr, length: int) -> None:
    mgr.book.seq_len.fill_(length)
    mgr.book.seq_len[-1] = 0  # the scratch slot
    mgr.book.commit(0)


def timed(fns, reset, reps: int = 10) -> float:
    """Median ms of running every function in ``fns`` once (``reset`` before each rep, untimed)."""
    times = []
    for _ in range(reps + 2):
        reset()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for f in fns:
            f()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="")
    args = p.parse_args()
    from oscar_export.bench import env_line
    from oscar_export.kernels.layout import KVCacheLayout

    lay = KVCacheLayout.default(KV, D, "channel")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ops = aot_ops(lay, tmp)
        for prompts in ([1024] * 16, [2048, 1536, 1024, 768, 512, 256, 128, 64]):
            mgr, layer = setup(ops, lay, len(prompts), 4096)
            rids = list(range(len(prompts)))
            batched = forward(mgr, layer, prompts, [0] * len(prompts), len(prompts), rids)
            single = [forward(mgr, layer, [n], [0], 1, [r]) for n, r in zip(prompts, rids)]
            reset = lambda m=mgr: set_lengths(m, 0)  # noqa: E731
            what = f"{len(prompts)} prompts, {sum(prompts)} tokens"
            rows.append({"row": "prefill batched", "what": what, "ms": timed([batched], reset)})
            rows.append({"row": "prefill one per forward", "what": what, "ms": timed(single, reset)})
        for slots, g, length in ((64, 8, 32768), (64, 64, 32768)):
            mgr, layer = setup(ops, lay, slots, length + 64)
            step = forward(mgr, layer, [1] * g, [length] * g, 0, list(range(g)))
            ms = timed([step], lambda m=mgr, n=length: set_lengths(m, n))
            rows.append({"row": "decode", "what": f"{g} of {slots} slots at {length}", "ms": ms})
    env = env_line()
    print(env)
    for r in rows:
        print(f"{r['row']:26s} {r['what']:36s} {r['ms']:8.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
