"""Calibration of a model larger than one GPU: wall time and peak memory per GPU, and a 1-GPU vs all-GPU check.

UNTESTED ON GPUs: the two GPU modes below have never been run (no multi-GPU machine was lent while this was
written); only ``--tiny --device cpu`` has run (its CPU smoke mode). Treat the first GPU run as the test of this
script, and report what it prints, not what this docstring expects.

Modes:

* default — a random-weight Llama of the given shape (default: the Llama-3-70B shape, 80 layers, hidden 8192,
  64 query / 8 KV heads of 128, MLP 28672, vocab 128256: about 141 GB in BF16) built directly on the visible
  GPUs with accelerate (empty weights, the device map ``from_pretrained(device_map="auto")`` would choose,
  random init on each GPU: nothing is read from disk), then calibrated through accelerate's hooks on every
  visible GPU (``oscar-export calibrate --device-map auto`` does the same from a checkpoint). Writes the
  build / capture / fit times, the weights and peak memory torch allocated on each GPU, and the layers per
  device to ``--out`` (JSON). Random weights: mechanics and cost only, never accuracy.
* ``--small`` — a small model (``--layers`` etc. default to a 1B-like shape) calibrated on one GPU, then the
  same weights with their layers split evenly over all visible GPUs; the two artifacts' tensors must agree
  within 1e-6 relative (max |a - b| / max |a| per tensor). Exit code 1 if they do not.
* ``--tiny --device cpu`` — both flows at toy size on the CPU in seconds: the empty-weights build and the
  device-mapped calibration over two "devices" (both the CPU, accelerate hooks on every layer), and the
  plain vs split comparison. The smoke test of this script.

Capture runs on the GPUs (each layer's float64 statistics on its own device); fitting runs on the CPU with
``--fit-threads`` threads (``seconds_fit`` in the JSON), as in ``oscar-export calibrate``.

    python benchmarks/calibrate_tp.py --out calibrate_tp_70b.json            # every visible GPU, 70B shape
    python benchmarks/calibrate_tp.py --small --out calibrate_tp_small.json  # 1 GPU vs all GPUs
    python benchmarks/calibrate_tp.py --tiny --device cpu --out /tmp/tp.json # CPU smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from oscar_export.bench import ByteTokenizer, git_commit

SHAPES = {  # layers, hidden, heads, kv_heads, head_dim, intermediate, vocab
    "70b": (80, 8192, 64, 8, 128, 28672, 128256),
    "small": (16, 2048, 32, 8, 64, 8192, 32000),
    "tiny": (4, 64, 4, 2, 16, 128, 256),
}
#: the calibration of --tiny (seconds on the CPU); the other modes use CalibrationConfig's defaults and --tokens.
TINY_CALIBRATION = dict(tokens=8 * 96, seq_len=96, heldout=2, batch_size=3, sink=16, window=32, page_size=16)
RTOL = 1e-6


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(num_hidden_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate, vocab_size=self.vocab, max_position_embeddings=8192,
                           tie_word_embeddings=False)


# ---- building the model where it will run -------------------------------------------------------------------


def split_layers(num_layers: int, devices: list[str]) -> dict[str, str]:
    """A device map with the decoder layers split evenly over ``devices`` (embeddings first, head last)."""
    n = len(devices)
    dm = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    dm.update({f"model.layers.{i}": devices[i * n // num_layers] for i in range(num_layers)})
    dm.update({"model.norm": devices[-1], "lm_head": devices[-1]})
    return dm


def auto_device_map(model, dtype: torch.dtype) -> dict[str, str | int]:
    """The map ``from_pretrained(device_map="auto")`` computes: balanced over the visible GPUs, whole layers."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    no_split = list(model._no_split_modules or [])
    mem = get_balanced_memory(model, dtype=dtype, no_split_module_classes=no_split)
    return infer_auto_device_map(model, max_memory=mem, no_split_module_classes=no_split, dtype=dtype)


def device_of(device_map: dict, name: str) -> str:
    """The device of parameter ``name``: its longest module prefix in ``device_map``."""
    best = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
    d = device_map[best]
    return f"cuda:{d}" if isinstance(d, int) else d


def empty_model(shape: Shape):
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    with init_empty_weights():  # parameters on the meta device; buffers (RoPE inv_freq) real, on the CPU
        return LlamaForCausalLM(shape.config()).eval()


@torch.no_grad()
def materialize(model, device_map: dict, dtype: torch.dtype, seed: int, generate_on_device: bool, hooks: bool = True):
    """Random weights, each parameter created on its own device, then accelerate's hooks attached (``hooks=False``:
    none, for a map of one device).

    Norm weights are ones, everything else ``N(0, initializer_range)``. ``generate_on_device=False`` draws them
    on the CPU first (same numbers for any placement: the --small / --tiny comparisons need that).
    """
    from accelerate import dispatch_model
    from accelerate.utils import set_module_tensor_to_device

    std = model.config.initializer_range
    for i, (name, p) in enumerate(list(model.named_parameters())):
        dev = device_of(device_map, name)
        if name.endswith("norm.weight"):
            value = torch.ones(p.shape, dtype=dtype, device=dev)
        else:
            gen_dev = dev if generate_on_device else "cpu"
            g = torch.Generator(gen_dev).manual_seed(seed + i)
            value = torch.empty(p.shape, dtype=dtype, device=gen_dev).normal_(0.0, std, generator=g).to(dev)
        set_module_tensor_to_device(model, name, dev, value=value, dtype=dtype)  # else cast to the meta fp32
    first = device_of(device_map, "model.embed_tokens")
    if not hooks:
        return model.to(first)  # one device, no accelerate hooks: the plain path (buffers such as RoPE moved too)
    return dispatch_model(model, device_map, main_device=first, force_hooks=True)


# ---- measuring ---------------------------------------------------------------------------------------------


def cuda_devices(devices: list[str]) -> list[int]:
    return sorted({torch.device(d).index or 0 for d in devices if str(d).startswith("cuda")})


def weights_per_device(model) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in model.parameters():
        out[str(p.device)] = out.get(str(p.device), 0) + p.numel() * p.element_size()
    return out


def calibrate_timed(model, shape: Shape, cfg, fit_threads: int) -> tuple[object, dict]:
    """``(artifact, measurements)``: wall time, the pipeline's capture / fit split, peak memory per GPU."""
    from oscar_export.calibrate import gpu_peak_memory
    from oscar_export.calibration.pipeline import calibrate

    for i in cuda_devices([str(p.device) for p in model.parameters()]):
        torch.cuda.reset_peak_memory_stats(i)
    t0 = time.perf_counter()
    art = calibrate(model, ByteTokenizer(shape.vocab), cfg, fit_threads=fit_threads)
    seconds = time.perf_counter() - t0
    return art, {"seconds_calibrate": round(seconds, 2), "seconds_capture": art.stats["seconds_capture"],
                 "seconds_fit": art.stats["seconds_fit"], "tokens": cfg.tokens, "seq_len": cfg.seq_len,
                 "peak_bytes_per_gpu": gpu_peak_memory()}


def compare(a, b, rtol: float = RTOL) -> list[dict]:
    """Per tensor of two artifacts: max |a - b| / max |a| (``ok`` when within ``rtol``)."""
    ta, tb = a.tensors(), b.tensors()
    if ta.keys() != tb.keys():
        raise ValueError(f"the artifacts hold different tensors: {sorted(ta.keys() ^ tb.keys())[:4]}")
    rows = []
    for k in ta:
        x, y = ta[k].double(), tb[k].double()
        rel = (x - y).abs().max().item() / max(x.abs().max().item(), 1e-30)
        rows.append({"tensor": k, "rel": rel, "ok": rel <= rtol})
    return rows


def environment(devices: list[str]) -> dict:
    import transformers

    sha = git_commit(Path(__file__).parent) or "?"
    gpus = [torch.cuda.get_device_name(i) for i in cuda_devices(devices)]
    return {"git": sha, "torch": torch.__version__, "transformers": transformers.__version__, "gpus": gpus,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def layers_per_device(device_map: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for k, d in device_map.items():
        if k.startswith("model.layers."):
            out[device_of(device_map, k)] = out.get(device_of(device_map, k), 0) + 1
    return out


# ---- the modes -----------------------------------------------------------------------------------------------


def run_large(shape: Shape, devices: list[str], dtype: torch.dtype, cfg, a) -> dict:
    """Build on every device, calibrate through the hooks, measure."""
    t0 = time.perf_counter()
    model = empty_model(shape)
    dm = auto_device_map(model, dtype) if a.device == "cuda" else split_layers(shape.layers, devices)
    model = materialize(model, dm, dtype, a.seed, generate_on_device=a.device == "cuda")
    build = time.perf_counter() - t0
    weights = weights_per_device(model)
    art, m = calibrate_timed(model, shape, cfg, a.fit_threads)
    return {"seconds_build": round(build, 2), "weights_bytes_per_device": weights,
            "layers_per_device": layers_per_device(dm), "num_layers_calibrated": art.num_layers, **m}


def run_compare(shape: Shape, devices: list[str], dtype: torch.dtype, cfg, a) -> dict:
    """The same weights on one device, then split over ``devices``: the artifacts must agree."""
    one = {k: devices[0] for k in split_layers(shape.layers, devices[:1])}
    split = split_layers(shape.layers, devices)
    base = empty_model(shape)
    plain = materialize(copy.deepcopy(base), one, dtype, a.seed, False, hooks=False)
    art1, m1 = calibrate_timed(plain, shape, cfg, a.fit_threads)
    del plain
    art2, m2 = calibrate_timed(materialize(base, split, dtype, a.seed, False), shape, cfg, a.fit_threads)
    rows = compare(art1, art2)
    worst = max(rows, key=lambda r: r["rel"])
    return {"one_device": m1, "all_devices": {**m2, "layers_per_device": layers_per_device(split)},
            "rtol": RTOL, "tensors_compared": len(rows), "tensors_outside_rtol": [r for r in rows if not r["ok"]],
            "worst": worst}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[-3:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--small", action="store_true", help="1 GPU vs all GPUs on a small model (tensors compared)")
    mode.add_argument("--tiny", action="store_true", help="toy size, both flows (the CPU smoke test)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default="calibrate_tp.json", help="JSON file to write")
    for name, i in (("layers", 0), ("hidden", 1), ("heads", 2), ("kv-heads", 3), ("head-dim", 4),
                    ("intermediate", 5), ("vocab", 6)):
        p.add_argument(f"--{name}", type=int, default=None, help=f"model shape (default: 70B {SHAPES['70b'][i]})")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default bfloat16 (float32 --tiny)")
    p.add_argument("--tokens", type=int, default=None, help="calibration tokens (default: the CLI's)")
    p.add_argument("--fit-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    from oscar_export.calibration.config import CalibrationConfig

    mode_name = "tiny" if a.tiny else "small" if a.small else "70b"
    given = [getattr(a, f) for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")]
    shape = Shape(*(g if g is not None else d for g, d in zip(given, SHAPES[mode_name])))
    if a.device == "cuda":
        if not torch.cuda.is_available():
            print("calibrate_tp: no CUDA device (use --tiny --device cpu for the CPU smoke test)", file=sys.stderr)
            return 2
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    else:
        if not a.tiny:
            print("calibrate_tp: --device cpu runs --tiny only (a large model on the CPU takes hours)", file=sys.stderr)
            return 2
        devices = ["cpu", "cpu"]  # two "devices": the device-mapped path with hooks on every layer
    dtype = getattr(torch, a.dtype or ("float32" if a.tiny else "bfloat16"))
    cfg = CalibrationConfig(**TINY_CALIBRATION) if a.tiny else CalibrationConfig()
    if a.tokens is not None:
        cfg = replace(cfg, tokens=a.tokens)

    result = {"mode": mode_name, "shape": asdict(shape), "dtype": str(dtype).removeprefix("torch."),
              "devices": devices, "calibration": cfg.to_dict(), **environment(devices)}
    ok = True
    if not a.small:
        result["build_and_calibrate"] = run_large(shape, devices, dtype, cfg, a)
    if a.small or a.tiny:
        if len(set(devices)) < 2 and a.device == "cuda":
            print("calibrate_tp: --small needs at least 2 GPUs to compare against", file=sys.stderr)
            return 2
        result["one_vs_all"] = run_compare(shape, devices, dtype, cfg, a)
        ok = not result["one_vs_all"]["tensors_outside_rtol"]
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("calibration",)}, indent=1))
    if not ok:
        print(f"calibrate_tp: artifacts differ beyond {RTOL:g} relative: {result['one_vs_all']['worst']}",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
