"""Calibrate a model: capture, targets, rotation candidates, clip fit, codebook -> :class:`OscarArtifact`.

Per layer and (by default) per KV head, for keys and values separately:

1. targets from the streamed statistics (``covariance.LayerStats``): ``C_Q`` for keys, the weighted value
   second moment for values;
2. each rotation candidate (``rotation.py`` kinds, optionally with the whitening scaling ``d``) gets its
   clip ratios fitted on the held-out rows (``clipping.fit_clip`` over ``objective.LayerObjective``,
   the exact reference quantizer with the real row format);
3. ``rotation="auto"`` keeps, per head, the candidate with the lowest held-out error; a fixed kind keeps it;
4. value clips move one grid step milder than that fit (``clipping.VALUE_CLIP_STEPS``: what the text KL preferred);
5. a Lloyd-Max codebook is fitted and kept where it lowers the error (``codebook="auto"``);
6. with ``key_bits_budget``, the layers whose held-out key attention error 4-bit keys reduce most get 4-bit
   keys within that page-bit budget (``key_bits.py``); every layer's key clips are chosen again per head against
   that attention error, at the width it gets (``key_bits.fit_key_clip``).

The statistics recorded in the artifact give, per layer, the error of the result next to identity
(no clip), Hadamard + global clip and the research recipe (shared ``U·H``, global clips), all on the same held-out
rows.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from oscar_export.kernels.layout import KVCacheLayout, RowFormat
from oscar_export.kernels.transform import LayerTransform

from .artifact import OscarArtifact, model_fingerprint
from .capture import Collector, run_batches
from .clipping import GLOBAL_CLIP, VALUE_CLIP_STEPS, clip_grid, fit_clip, milder
from .codebook import lloyd_levels, normalized_positions, uniform_levels
from .config import CalibrationConfig
from .covariance import LayerStats, shared_target
from .data import load_sources, token_sequences
from .families import family_for
from .key_bits import check_budget, choose_key_bits, set_key_clips
from .objective import LayerObjective
from .rotation import rotation, whitening_scale

#: rotation candidates tried by ``rotation="auto"``: (kind, whitening scale), per side and key granularity.
#: Per-channel keys are scale-invariant per channel (no whitening); on SmolLM2 values never kept identity.
AUTO_CANDIDATES = {
    ("k", "token"): (("hadamard", False), ("oscar", False), ("eig", True), ("identity", False)),
    ("k", "channel"): (("identity", False), ("hadamard", False), ("eig", False)),
    ("v", "token"): (("hadamard", False), ("oscar", False), ("eig", True)),
}


# ---- one side (K or V) of one layer ---------------------------------------------------------------------


@dataclass
class SideFit:
    """The chosen transform of one side: fp64 ``rotation [H, D, D]``, ``scale, mean [H, D]``, fp32 ``clip [H]``,
    ``levels [H, 4]``, its held-out ``error [H]`` and the per-head candidate names; ``baselines`` name -> [H]."""

    rotation: torch.Tensor
    scale: torch.Tensor
    mean: torch.Tensor
    clip: torch.Tensor
    levels: torch.Tensor
    error: torch.Tensor
    chosen: list[str]
    baselines: dict[str, torch.Tensor] = field(default_factory=dict)


def _power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def _candidates(cfg: CalibrationConfig, side: str, granularity: str, head_dim: int) -> list[tuple[str, bool]]:
    """Candidates to try. Fallback: without a power-of-two head_dim, ``auto`` drops the Hadamard kinds."""
    if cfg.rotation == "auto":
        cands = list(AUTO_CANDIDATES[(side, granularity)])
        if not _power_of_two(head_dim):
            cands = [c for c in cands if c[0] not in ("hadamard", "oscar")] or [("eig", False), ("identity", False)]
        return cands
    return [(cfg.rotation, cfg.scale == "whiten")]


def fit_side(
    side: str, target: torch.Tensor, second: torch.Tensor, mean: torch.Tensor, error_fn: Callable, pages: Callable,
    fmt: RowFormat, group: int, cfg: CalibrationConfig, seed: int, screen_fn: Callable | None = None,
    local: bool = False,
) -> SideFit:
    """Fit one side of one layer.

    Args:
        side: ``"k"`` or ``"v"``.
        target: ``[H, D, D]`` rotation target (already shared across heads if ``per_head`` is off).
        second: ``[H, D, D]`` second moment of the stored rows (for the whitening scale).
        mean: ``[H, D]`` mean of the rows in the model basis.
        error_fn: ``(R, d, mu, [clip [H], ...], levels) -> error [len, H]`` on held-out rows.
        pages: ``(R, d, mu) -> [N, H, P, D]`` held-out pages in the stored basis (codebook fitting).
        fmt: the side's row format; group: its quantization group length (for the clip grid).
        screen_fn: a cheaper estimate of ``error_fn`` (same call) that ranks each clip grid, whose best ratios
            ``error_fn`` then measures (``clipping.fit_clip``); None measures the whole grid, or with ``local`` a
            descent along it (``clipping.fit_clip``).
    """
    h, d = target.shape[0], target.shape[-1]
    uni = uniform_levels(h)
    use_mean = cfg.key_mean if side == "k" else cfg.value_mean
    grid = clip_grid(group)
    best: SideFit | None = None
    zero = torch.zeros(h, d, dtype=torch.float64)

    def evaluate(r, s, mu, name) -> SideFit:
        fn = lambda cs: error_fn(r, s, mu, cs, uni)  # noqa: E731
        if cfg.clip == "fitted":
            est = None if screen_fn is None else lambda cs: screen_fn(r, s, mu, cs, uni)  # noqa: E731
            fit = fit_clip(fn, h, grid, per_head=cfg.per_head, screen_fn=est, local=local)
            clip, err = fit.clip, fit.error
        else:
            clip = torch.full((h,), GLOBAL_CLIP[side] if cfg.clip == "global" else 1.0)
            err = fn([clip])[0].double()
        return SideFit(r, s, mu, clip, uni.clone(), err, [name] * h)

    def merge(best: SideFit | None, cand: SideFit) -> SideFit:
        if best is None:
            return cand
        take = cand.error < best.error if cfg.per_head else torch.full((h,), bool(cand.error.sum() < best.error.sum()))
        for f in ("rotation", "scale", "mean", "clip", "error"):
            old = getattr(best, f)
            setattr(best, f, torch.where(take.view(-1, *[1] * (old.dim() - 1)), getattr(cand, f), old))
        best.chosen = [n if t else c for t, n, c in zip(take.tolist(), cand.chosen, best.chosen)]
        return best

    for kind, scaled in _candidates(cfg, side, fmt.granularity, d):
        r = rotation(kind, target, fmt.group_size, seed)
        s = whitening_scale(second, r) if scaled else torch.ones(h, d, dtype=torch.float64)
        mu = (torch.einsum("hd,hde->he", mean.double(), r) * s) if use_mean else zero
        best = merge(best, evaluate(r, s, mu, kind + ("+whiten" if scaled else "")))
    assert best is not None
    if use_mean and cfg.rotation == "auto":
        # The mean is exact but only worth keeping where it shrinks the quantized range: measure without it.
        nomean = evaluate(best.rotation, best.scale, zero, "")
        nomean.chosen = [c + "/no-mean" for c in best.chosen]
        best = merge(best, nomean)
    if side == "v" and cfg.clip == "fitted" and VALUE_CLIP_STEPS:
        # the value clips a step milder than the held-out fit (clipping.VALUE_CLIP_STEPS), their error measured
        best.clip = milder(best.clip, grid, VALUE_CLIP_STEPS)
        best.error = error_fn(best.rotation, best.scale, best.mean, [best.clip], best.levels)[0].double()
    if cfg.codebook != "off":
        lv = lloyd_levels(normalized_positions(pages(best.rotation, best.scale, best.mean), fmt, best.clip))
        err = error_fn(best.rotation, best.scale, best.mean, [best.clip], lv)[0].double()
        keep = torch.ones(h, dtype=torch.bool) if cfg.codebook == "on" else err < 0.99 * best.error
        best.levels = torch.where(keep[:, None], lv, best.levels)
        best.error = torch.where(keep, err, best.error)
    return best


def baselines(side: str, target_shared: torch.Tensor, mean: torch.Tensor, error_fn: Callable, fmt: RowFormat,
              seed: int) -> dict[str, torch.Tensor]:
    """Held-out errors ``[H]`` of identity (no clip), Hadamard + global clip and the research recipe.

    All with the layout being calibrated (so with channel keys "research" is the recipe's shared ``U·H`` and
    global clips applied to channel-granular keys, not the recipe's per-token keys).
    """
    h, d = target_shared.shape[0], target_shared.shape[-1]
    one, zero, uni = torch.ones(h, d, dtype=torch.float64), torch.zeros(h, d, dtype=torch.float64), uniform_levels(h)
    g = torch.full((h,), GLOBAL_CLIP[side])
    out = {}
    for name, kind, clip in (("identity", "identity", torch.ones(h)), ("hadamard+clip", "hadamard", g),
                             ("research", "oscar", g)):
        if kind in ("hadamard", "oscar") and not _power_of_two(d):
            continue  # no Hadamard of this size: those baselines do not exist
        r = rotation(kind, target_shared, fmt.group_size, seed)
        out[name] = error_fn(r, one, zero, [clip], uni)[0].double()
    return out


# ---- the whole model ---------------------------------------------------------------------------------------


def capture(model, tokenizer, cfg: CalibrationConfig, progress: Callable[[int], None] | None = None) -> Collector:
    """Run the calibration text through ``model``: statistics from all but the held-out sequences."""
    col = Collector.for_model(model, skip=cfg.sink, weightings=(cfg.value_weighting,))  # the family table
    text = load_sources(list(cfg.data), model, tokenizer)
    seqs = token_sequences(text, tokenizer, cfg.seq_len, cfg.num_sequences, cfg.seed)  # [S, T]
    col.mode = "heldout"
    run_batches(model, col, seqs[: cfg.heldout].split(cfg.batch_size), progress)
    col.mode = "stats"
    run_batches(model, col, seqs[cfg.heldout :].split(cfg.batch_size), progress)
    return col


def fit_layer(i: int, stats: LayerStats, obj: LayerObjective, layout: KVCacheLayout,
              cfg: CalibrationConfig) -> tuple[SideFit, SideFit]:
    """Keys and values of layer ``i``."""
    def share(t):
        return t if cfg.per_head else shared_target(t)

    def pages_fn(x):
        def f(r, s, mu):
            xs = torch.matmul(x, r.unsqueeze(0)) * s[None, :, None] - mu[None, :, None]  # [N, H, Tq, D]
            n, h, tq, d = xs.shape
            pages = xs.float().reshape(n, h, tq // layout.page_size, layout.page_size, d)
            return pages.transpose(1, 2).reshape(-1, h, layout.page_size, d)
        return f

    kfmt, vfmt = layout.key, layout.value
    kgroup = layout.page_size if kfmt.granularity == "channel" else kfmt.group_size
    kerr = lambda r, s, mu, cs, lv: obj.key_errors(r, s, mu, cs, lv, kfmt)  # noqa: E731
    verr = lambda r, s, mu, cs, lv: obj.value_errors(r, s, mu, cs, lv, vfmt)  # noqa: E731
    vscreen = lambda r, s, mu, cs, lv: obj.value_errors(r, s, mu, cs, lv, vfmt, screen=True)  # noqa: E731
    c_q = stats.key_target()
    # keys: a descent along each clip grid (on SmolLM2 the key error had one minimum along it in 359 of 360 heads x
    # candidates, and the descent found the grid's best in all 360); values: a screen (objective.py)
    k_fit = fit_side("k", share(c_q), share(stats.key_second(cfg.key_mean)), stats.key_mean(), kerr, pages_fn(obj.k),
                     kfmt, kgroup, cfg, cfg.seed + i, local=True)
    k_fit.baselines = baselines("k", shared_target(c_q), stats.key_mean(), kerr, kfmt, cfg.seed + i)
    v_t = stats.value_target(cfg.value_weighting)
    v_fit = fit_side("v", share(v_t), share(stats.value_target("plain", cfg.value_mean)), stats.value_mean(), verr,
                     pages_fn(obj.v), vfmt, vfmt.group_size, cfg, cfg.seed + i, vscreen if obj.count_screen else None)
    v_fit.baselines = baselines("v", shared_target(v_t), stats.value_mean(), verr, vfmt, cfg.seed + i)
    return k_fit, v_fit


def layer_summary(k: SideFit, v: SideFit, obj: LayerObjective) -> dict[str, Any]:
    """JSON statistics of one layer: errors (absolute and relative to the signal) and the choices."""
    def side(f: SideFit, scale: torch.Tensor) -> dict[str, Any]:
        e = float(f.error.sum())

        def ratio(name: str) -> float | None:
            b = f.baselines.get(name)
            return None if b is None else e / max(float(b.sum()), 1e-300)

        return {
            "error": e, "relative_error": e / max(float(scale.sum()), 1e-300),
            "baselines": {n: float(b.sum()) for n, b in f.baselines.items()},
            "vs_identity": ratio("identity"), "vs_hadamard": ratio("hadamard+clip"), "vs_research": ratio("research"),
            "clip": f.clip.tolist(), "rotation": f.chosen,
            "codebook": [lv != [0.0, 1.0, 2.0, 3.0] for lv in f.levels.tolist()],
        }
    return {"k": side(k, obj.key_scale()), "v": side(v, obj.value_scale())}


def _fit_all(col: Collector, layout: KVCacheLayout, cfg: CalibrationConfig, num_layers: int, on_layer,
             workers: int = 1) -> tuple[list, list]:
    """``(k_fit, v_fit)`` per layer, None for the sliding-window layers (identity transforms, see :func:`calibrate`).

    ``workers`` layers are fitted at once, each in its own thread (the caller sets torch's threads: one each);
    ``on_layer`` is called in layer order. Each layer's fit is independent, so the result does not depend on
    ``workers``."""
    def one(i: int) -> tuple[tuple[SideFit, SideFit] | None, dict[str, Any]]:
        if i in col.sliding_layers:
            return None, {"sliding": True}
        st = col.stats[i]
        if st is None:
            raise ValueError(f"capture: layer {i} was never called through the attention interface")
        obj = LayerObjective.build(col.heldout_layer(i), cfg.sink, cfg.page_size, cfg.objective_window)
        k_fit, v_fit = fit_layer(i, st.to("cpu"), obj, layout, cfg)  # fitting runs on the CPU
        return (k_fit, v_fit), layer_summary(k_fit, v_fit, obj)

    fits, per_layer = [], []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for i, (fit, summary) in enumerate(pool.map(one, range(num_layers))):
            fits.append(fit)
            per_layer.append(summary)
            if on_layer is not None and fit is not None:
                on_layer(i, summary)
    return fits, per_layer


def calibrate(
    model, tokenizer, cfg: CalibrationConfig, progress: Callable[[int], None] | None = None,
    on_layer: Callable[[int, dict], None] | None = None, fit_threads: int | None = None,
    on_key_bits: Callable[[int], None] | None = None,
) -> OscarArtifact:
    """Calibrate ``model`` (any HF causal LM whose attention goes through ``AttentionInterface``).

    ``progress(tokens)`` follows capture, ``on_layer(i, summary)`` the fit of each layer, ``on_key_bits(1)`` the
    key-width measurement of each layer (with ``key_bits_budget``).

    ``fit_threads``: CPU threads of the fit and the key-width measurement (None: torch's thread count, every core
    by default). Each thread fits whole layers on one torch thread (layers are independent), torch's own count
    restored afterwards: no thread waits on another inside an op, so a busy machine costs no extra CPU (two torch
    threads per op cost a loaded 2-core machine 2.6x the CPU of one: benchmarks/RESULTS-calibrate.md).
    """
    t0, c0 = time.perf_counter(), time.process_time()
    facts = family_for(model)  # refuses unsupported architectures and features before any capture
    fp = model_fingerprint(model)
    h, d = facts.num_kv_heads, facts.head_dim
    if cfg.key_bits_budget is not None:
        check_budget(cfg.key_bits_budget, cfg.layout(h, d))  # before the capture's minutes
    col = capture(model, tokenizer, cfg, progress)
    t_capture, c_capture = time.perf_counter() - t0, time.process_time() - c0
    layout = cfg.layout(h, d)
    threads = torch.get_num_threads()
    workers = fit_threads or threads
    torch.set_num_threads(1)
    try:
        fits, per_layer = _fit_all(col, layout, cfg, facts.num_layers, on_layer, workers)
    finally:
        torch.set_num_threads(threads)
    t_fit, c_fit = time.perf_counter() - t0 - t_capture, time.process_time() - c0 - c_capture
    uniform = uniform_levels(h)
    fitted = [f for f in fits if f is not None]
    layout = cfg.layout(h, d, codebook_k=any(not torch.equal(k.levels, uniform) for k, _ in fitted),
                        codebook_v=any(not torch.equal(v.levels, uniform) for _, v in fitted))
    # sliding-window layers (the family table's, e.g. Gemma 3's local layers) keep their window in BF16 and
    # are never quantized: identity transforms, so export folds nothing into them
    transforms = [
        LayerTransform.identity(h, d) if f is None else LayerTransform(
            k_rotation=f[0].rotation.float(), v_rotation=f[1].rotation.float(), k_scale=f[0].scale.float(),
            v_scale=f[1].scale.float(), k_mean=f[0].mean.float(), v_mean=f[1].mean.float(),
            k_clip=f[0].clip.float(), v_clip=f[1].clip.float(), k_levels=f[0].levels.float().contiguous(),
            v_levels=f[1].levels.float().contiguous(),
        )
        for f in fits
    ]
    key_bits: tuple[int, ...] = ()
    extra = {}
    t_bits, c_bits = time.perf_counter(), time.process_time()
    if cfg.key_bits_budget is not None:
        torch.set_num_threads(1)
        try:
            key_bits, extra["key_bits"] = choose_key_bits(col.heldout_layer, transforms, layout, cfg.key_bits_budget,
                                                          cfg.key_bits_metric, skip=col.sliding_layers,
                                                          progress=on_key_bits, workers=workers,
                                                          per_head=cfg.per_head)
        finally:
            torch.set_num_threads(threads)
        transforms = set_key_clips(transforms, key_bits, extra["key_bits"])
    stats = {
        "tokens_statistics": int(sum(s.tokens for s in col.stats if s is not None) // max(len(fitted), 1)),
        "heldout_sequences": cfg.heldout,
        "objective_window": cfg.objective_window,
        "seconds_capture": round(t_capture, 2),
        "seconds_fit": round(t_fit, 2),
        "seconds_key_bits": round(time.perf_counter() - t_bits, 2),
        "seconds_total": round(time.perf_counter() - t0, 2),
        # the process's CPU seconds (all threads) of the same phases: what they cost on a busy machine
        "cpu_seconds": {"capture": round(c_capture, 1), "fit": round(c_fit, 1),
                        "key_bits": round(time.process_time() - c_bits, 1)},
        "layers": per_layer,
        **extra,
    }
    return OscarArtifact(layout, transforms, fp, {"method": "oscar-calibrate", **cfg.to_dict()}, stats, key_bits)


__all__ = ["AUTO_CANDIDATES", "SideFit", "calibrate", "capture", "fit_layer", "fit_side"]
