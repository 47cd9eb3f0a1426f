"""Generate text with the OSCAR INT2 KV cache, printed beside the BF16-cache (DynamicCache) output.

Runs the model twice on the same prompt with greedy decoding: once with transformers' DynamicCache (the
full-precision reference, "BF16") and once with the OSCAR cache (sink and recent windows at the model's
dtype, INT2 pages in between), then prints both texts, how many leading tokens agree, and the KV-cache
bytes of both, computed from the cache layout.
"""

from __future__ import annotations

import argparse
import time

EPILOG = """examples:
  oscar-export generate --prompt "Explain the Python assert statement." --max-new-tokens 64
  oscar-export generate --model default --artifact runs/smollm2 --prompt-topic assignment --max-new-tokens 128
"""


#: prompt used when neither --prompt nor --prompt-topic is given (703 SmolLM2 tokens).
DEFAULT_TOPIC = "class"
#: the most --max-new-tokens accepted before the model loads (the model's own length and memory decide after).
MAX_NEW_TOKENS = 1 << 20


def check_fits(config, n_prompt: int, max_new_tokens: int, dtype, device: str) -> None:
    """Refuse, before anything is allocated, a length the model cannot encode or whose KV cache cannot fit.

    The estimate is a full cache at the model dtype (what the reference run keeps; the OSCAR cache is
    smaller), ``L * T * 2 * H_kv * D`` elements.
    """
    import torch

    from oscar_export.calibration.families import family_for
    from oscar_export.plugins.hf.cache_size import available_bytes

    from .cli import UserError

    c = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    length = n_prompt + max_new_tokens
    max_pos = getattr(c, "max_position_embeddings", None)
    if isinstance(max_pos, int) and length > max_pos:
        raise UserError(f"--max-new-tokens: {n_prompt} prompt + {max_new_tokens} new tokens exceed the model's "
                        f"max_position_embeddings {max_pos}")
    f = family_for(c)
    hkv, d = f.num_kv_heads, f.head_dim
    layers = int(c.num_hidden_layers)
    need = layers * length * 2 * hkv * d * torch.empty((), dtype=dtype).element_size()
    free = available_bytes(device)
    if need > free:
        raise UserError(f"--max-new-tokens: a KV cache of {length} tokens needs {need:,} bytes at {dtype} ({layers} "
                        f"layers, {hkv} KV heads x head_dim {d}, K and V); {free:,} bytes available on {device}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (embedded SmolLM2-135M-Instruct) or a local HF model dir")
    p.add_argument("--artifact", default=None, help="OSCAR artifact directory (default: identity transforms)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text")
    src.add_argument(
        "--prompt-topic", default=None,
        help=f"use a section of Python's documentation (pydoc_data.topics) as the prompt (default {DEFAULT_TOPIC!r})",
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--backend", default="torch", help="cache ops backend: torch | torch.compile | triton")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--skip-bf16", action="store_true",
                   help="only run the OSCAR cache (skip the full-precision DynamicCache run: BF16 on CUDA, fp32 on "
                        "the CPU)")


def _prompt_text(args: argparse.Namespace) -> str:
    from .cli import UserError

    if args.prompt_topic is not None:
        from pydoc_data.topics import topics

        if args.prompt_topic not in topics:
            some = ", ".join(sorted(topics)[:8])
            raise UserError(f"--prompt-topic: unknown topic {args.prompt_topic!r}; e.g. {some}")
        return topics[args.prompt_topic]
    if args.prompt is None:  # ~700 tokens: long enough that the history reaches the INT2 pages
        from pydoc_data.topics import topics

        return topics[DEFAULT_TOPIC]
    return args.prompt


class _Progress:
    """A ``generate`` streamer that shows a tqdm bar of generated tokens."""

    def __init__(self, total: int, desc: str) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc=desc, unit="tok", leave=False)
        self._first = True

    def put(self, value) -> None:
        if self._first:  # the first call carries the prompt
            self._first = False
            return
        self._bar.update(1)

    def end(self) -> None:
        self._bar.close()


#: the longest a model's chat template may take to render the prompt (a hostile one looped for minutes).
CHAT_TEMPLATE_SECONDS = 10


def render_chat(tok, text: str) -> str:
    """``text`` as the user turn of the tokenizer's chat template (jinja2's sandbox, as transformers renders it),
    stopped with one ``TimeoutError`` if the template runs past :data:`CHAT_TEMPLATE_SECONDS` (main thread)."""
    import signal
    import threading

    def render() -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    if threading.current_thread() is not threading.main_thread():
        return render()

    def expired(signum, frame):
        raise TimeoutError(f"--chat: the model's chat template ran past {CHAT_TEMPLATE_SECONDS} s; refusing it "
                           f"(run without --chat, or fix the template)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(CHAT_TEMPLATE_SECONDS)
    try:
        return render()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check_options(args: argparse.Namespace) -> str:
    """The device to run on, once the options that need no model are checked (before it loads): the device
    exists, the backend is known and runs there, the prompt is not empty."""
    import torch

    from .cli import UserError, check_device

    device = check_device(args.device, "--device") if args.device else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.backend == "triton" and not device.startswith("cuda"):
        raise UserError(f"--backend triton: the Triton kernels run on a CUDA GPU (BF16 windows), not on {device}; "
                        f"use --backend torch here")
    if args.prompt == "" and not args.chat:
        raise UserError("--prompt: empty; give some text (or --prompt-topic)")
    from oscar_export.plugins.hf.ops import BACKENDS  # (imports transformers: after the checks that need nothing)

    if args.backend not in BACKENDS:
        raise UserError(f"--backend: expected one of {sorted(BACKENDS)}, got {args.backend!r}")
    return device


def run(args: argparse.Namespace) -> int:
    from .cli import UserError, check_int

    check_int(args.max_new_tokens, "--max-new-tokens", 1, MAX_NEW_TOKENS)
    device = check_options(args)  # before the imports of transformers (seconds) and the model load (minutes)

    import torch

    from oscar_export.models import load_model
    from oscar_export.threads import cpu_run_threads

    artifact = None
    if args.artifact is not None:  # verified in full before the model loads
        from oscar_export.calibration.artifact import load_artifact

        artifact = load_artifact(args.artifact)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    text = _prompt_text(args)
    model, tok = load_model(args.model, dtype=dtype, device=device)
    if args.chat and getattr(tok, "chat_template", None):
        text = render_chat(tok, text)
    ids = tok(text, return_tensors="pt").input_ids.to(device)
    n_prompt = ids.shape[1]
    if n_prompt == 0:
        raise UserError(f"--prompt: {text!r:.80} is no tokens at all; give some text")
    check_fits(model.config, n_prompt, args.max_new_tokens, dtype, device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    dname = DTYPE_NAMES.get(str(dtype), str(dtype).removeprefix("torch."))
    with cpu_run_threads(device) as threads:
        print(f"model: {args.model}  prompt: {n_prompt} tokens  device: {device}  dtype: {dname}"
              + (f"  threads: {threads}" if device == "cpu" else ""))
        return _generate(args, model, tok, artifact, ids, gen, dname)


def _generate(args: argparse.Namespace, model, tok, artifact, ids, gen: dict, dname: str) -> int:
    """Both runs and the report, once the model is loaded and the prompt checked (see :func:`run`)."""
    import torch

    from oscar_export.plugins.hf import cache_kwargs, enable_oscar

    n_prompt = ids.shape[1]

    ref = None
    if not args.skip_bf16:
        t0 = time.perf_counter()
        with torch.no_grad():
            ref = model.generate(ids, streamer=_Progress(args.max_new_tokens, f"{dname:5s}"), **gen)[0, n_prompt:]
        print(f"{dname} cache: {len(ref)} tokens in {time.perf_counter() - t0:.1f} s")

    with enable_oscar(model, artifact=artifact, backend=args.backend) as oscar:
        short = too_short(oscar.layout, n_prompt, args.max_new_tokens)
        if short:
            print(f"note: {short}")
        cache = oscar.make_cache(1, n_prompt + args.max_new_tokens)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids, streamer=_Progress(args.max_new_tokens, "oscar"), **gen, **cache_kwargs(model, cache)
            )[0, n_prompt:]
        print(f"oscar cache: {len(out)} tokens in {time.perf_counter() - t0:.1f} s")
    layout, n_layers = oscar.layout, oscar.shape.num_layers
    layouts = [cache.layer_layout(i) for i in range(n_layers)]  # each layer's key width (an artifact's key_bits)

    if ref is not None:
        print(f"\n=== {dname.upper()} cache (DynamicCache) ===")
        print(tok.decode(ref, skip_special_tokens=True))
    wide = artifact is not None and any(b != layout.key.bits for b in getattr(artifact, "key_bits", ()))
    print(f"\n=== OSCAR cache ({'INT2 / 4-bit-key' if wide else 'INT2'} pages, {dname} windows) ===")
    print(tok.decode(out, skip_special_tokens=True))
    if ref is not None:
        n = min(len(ref), len(out))
        same = int((ref[:n] == out[:n]).sum())
        diff = (ref[:n] != out[:n]).nonzero()
        first = int(diff[0]) if len(diff) else n
        print(f"\ntoken agreement: {same}/{n}, identical for the first {first} tokens")

    length = n_prompt + len(out)
    short = too_short(layout, n_prompt, len(out))
    if short:
        print(f"\n{short}")
        return 0
    oscar_bytes = sum(lay.sequence_bytes(length) for lay in layouts)
    bf16_bytes = n_layers * length * layout.bf16_token_bytes()
    sink, pages, recent = layout.split(length)
    print(
        f"KV cache at {length} tokens, {n_layers} layers, as deployed (BF16 windows): BF16 {bf16_bytes:,} bytes, "
        f"OSCAR {oscar_bytes:,} bytes ({oscar_bytes / bf16_bytes:.1%}; saved {bf16_bytes - oscar_bytes:,} bytes; sink "
        f"{sink} + INT2 {pages} pages x {layout.page_size} + recent {recent} tokens; "
        f"{16 * oscar_bytes / bf16_bytes:.2f} bits/element)"
    )
    return 0


#: short names of the dtypes a run may use, for its labels
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def too_short(layout, n_prompt: int, n_new: int) -> str | None:
    """None when ``n_prompt + n_new`` tokens reach the INT2 pages of ``layout``; else the sentence that says they
    never do (every token stays in the full-precision windows, so both caches hold the same values)."""
    length = n_prompt + n_new
    if layout.split(length)[1] > 0:
        return None
    need = layout.sink + layout.recent_capacity + 1  # the first length with a page
    return (f"{length} tokens ({n_prompt} prompt + {n_new} new) never reach the INT2 pages: the first "
            f"{need - 1} stay in the full-precision windows (sink {layout.sink} + recent window {layout.window} + one "
            f"page of {layout.page_size}), so OSCAR holds the same values as a plain cache and saves nothing here; "
            f"give at least {need} tokens (e.g. --prompt-topic {DEFAULT_TOPIC}, 703 tokens with SmolLM2)")
