"""One deployment directory as the TensorRT-LLM host sees it, checked at startup (before any request).

``OscarDeployment(checkpoint, bundle, arch)`` reads the exported checkpoint's ``config.json`` (its ``oscar``
section and artifact) and the kernel bundle's manifest, and raises one clear error for each bad input:

* a model family the adapter does not serve (``SUPPORTED_FAMILIES``) -> ``NotImplementedError``;
* a checkpoint that is not an OSCAR export, or whose artifact is not ``values_prerotated`` -> ``ValueError``;
* a bundle built for another layout / head count / softmax scale than the checkpoint's ``oscar`` section, or
  without the kernels of a key width its layers use (``key_bits``) -> ``BundleError``;
* a bundle without binaries for the GPU it must run on -> ``BundleError``;
* ``max_seq_len`` / ``max_batch_size`` beyond the block table or the reserved INT2 pages
  (:meth:`OscarDeployment.check_limits`) -> ``ValueError``.

No TensorRT-LLM and no GPU needed: tested in tests/plugins/test_trtllm_deployment.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from oscar_export.calibration.families import FAMILIES, family_for_config_dict

#: HF ``model_type`` -> (registered architecture, upstream module, upstream model class) of the families the
#: adapter serves, from the model-family table (``Family.trtllm``). The exported checkpoint served by
#: TensorRT-LLM names the architecture in config.json.
SUPPORTED_FAMILIES = {mt: (f"Oscar{fam.trtllm[1]}", *fam.trtllm) for mt, fam in FAMILIES.items() if fam.trtllm}
#: the serving kernels a deployment needs from its bundle (``kernels/aot/bundle.py`` names, without the tag).
REQUIRED_KERNELS = ("decode_split", "decode_merge", "quant_pack_k", "quant_pack_v", "decode_append")


#: ``trtllm-serve --extra_llm_api_options`` of a deployment (``oscar-export build`` writes it, ``{page_size}`` filled).
EXTRA_LLM_API_OPTIONS = """\
# trtllm-serve --extra_llm_api_options for the OSCAR cache (written into the deployment by `oscar-export build`,
# with tokens_per_block set to the artifact's page size). NOT EXECUTED: TensorRT-LLM could not be installed where
# this was written. Every feature the adapter was not run under inside TensorRT-LLM is off; see README.md there.
# overlap scheduler: designed safe (demotion on the device, inside the forward), replayed in the contract tests
disable_overlap_scheduler: true
# CUDA graphs: the decode step is written to be captured (tests/gpu/test_trtllm_gpu.py); the graph runner and
# its batch padding inside TensorRT-LLM were not run
cuda_graph_config: null
# a later prompt chunk has no AOT kernel yet (the adapter raises NotImplementedError on the GPU path)
enable_chunked_prefill: false
kv_cache_config:
  enable_block_reuse: false      # reused prefix blocks would hold BF16 data the OSCAR cache never wrote
  tokens_per_block: {page_size}  # C++ block = INT2 page; the cache manager refuses any other value at startup
"""


def extra_llm_api_options(layout) -> str:
    return EXTRA_LLM_API_OPTIONS.replace("{page_size}", str(layout.page_size))


def family_of(config: dict[str, Any]) -> tuple[str, str, str]:
    mt = config.get("model_type")
    if mt not in SUPPORTED_FAMILIES:
        raise NotImplementedError(
            f"model family {mt!r} is not served by the OSCAR TensorRT-LLM adapter (supported: "
            f"{sorted(SUPPORTED_FAMILIES)})"
        )
    return SUPPORTED_FAMILIES[mt]


def trtllm_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of the checkpoint TensorRT-LLM serves: ``architectures`` names the OSCAR model class
    (so ``register_auto_model`` selects it); the original names are kept in ``oscar_base_architectures``."""
    arch = family_of(config)[0]
    return {**config, "architectures": [arch], "oscar_base_architectures": config.get("architectures")}


class OscarDeployment:
    """The artifact (``values_prerotated``), layout, model shape and verified bundle of one deployment.

    Args:
        checkpoint: the exported checkpoint directory (``deploy/checkpoint``).
        bundle: the kernel bundle directory (``deploy/kernels``).
        arch: the GPU target the bundle must have (``"sm_90"``); None: the current CUDA device's, if any.
    """

    def __init__(self, checkpoint: str | Path, bundle: str | Path, arch: str | None = None) -> None:
        from oscar_export.calibration.artifact import load_artifact
        from oscar_export.checkpoint import artifact_path, read_config_json, read_export
        from oscar_export.kernels.aot.bundle import layout_tag
        from oscar_export.kernels.aot.manifest import BundleError, read_manifest

        checkpoint = Path(checkpoint)
        section = read_export(checkpoint)  # the oscar section as `oscar-export export` wrote it, or ValueError
        self.config = read_config_json(checkpoint)
        self.family = family_of(self.config)
        self.artifact = load_artifact(artifact_path(checkpoint, section))
        if not all(t.values_prerotated for t in self.artifact.transforms):
            raise ValueError(f"{checkpoint}: the artifact is not values_prerotated; serve an exported checkpoint")
        self.layout = self.artifact.layout
        #: each layer's layout (the artifact's ``key_bits``: 4-bit key pages in some layers); windows, page size
        #: and therefore the page book are the same in every layer
        self.layer_layouts = tuple(self.artifact.layer_layout(i) for i in range(self.artifact.num_layers))
        if "layout" in section and not self.layout.matches_dict(section["layout"]):
            raise ValueError(f"{checkpoint}: the oscar section's layout does not match its artifact's")
        self.num_layers = self.artifact.num_layers
        #: the attention facts of the checkpoint (the family table: heads, head_dim, the model's softmax scale)
        self.facts = family_for_config_dict(self.config)
        if self.facts.sliding_layers:
            raise NotImplementedError(f"{checkpoint}: sliding-window layers ({len(self.facts.sliding_layers)}) are "
                                      "not served by the OSCAR TensorRT-LLM adapter")
        self.num_heads = self.facts.num_heads
        self.sm_scale = self.facts.scaling
        self.manifest = read_manifest(bundle)
        want = {"key": self.layout.key.packing, "value": self.layout.value.packing}
        if self.manifest.packing != want:
            raise BundleError(f"{bundle}: kernels built for page packing {self.manifest.packing}, the checkpoint's "
                              f"layout has {want}")
        names = {e.name for e in self.manifest.entries}
        for lay in dict.fromkeys(self.layer_layouts):  # each key width the layers use, in layer order
            tag = layout_tag(lay, self.num_heads)
            missing = [k for k in REQUIRED_KERNELS if f"{k}_{tag}" not in names]
            if missing:
                have = sorted({n.split("_h", 1)[1] for n in names if "_h" in n})
                raise BundleError(
                    f"{bundle}: no {missing} kernels for this checkpoint's oscar section (layout tag h{tag[1:]}, "
                    f"{lay.key.bits}-bit keys); the bundle was built for {['h' + h for h in have]}: rebuild it "
                    "with `oscar-export build`"
                )
            split = self.manifest.entries[[e.name for e in self.manifest.entries].index(f"decode_split_{tag}")]
            baked = split.spec.constexpr_dict["SM_SCALE"]
            if not math.isclose(baked, self.sm_scale, rel_tol=1e-6):
                raise BundleError(f"{bundle}: compiled for softmax scale {baked}, the checkpoint's is {self.sm_scale}")
        if arch is None:
            arch = _current_arch()
        if arch is not None and arch not in self.manifest.archs():
            raise BundleError(
                f"{bundle}: built for {self.manifest.archs()}, this GPU is {arch}: rebuild with --arch {arch}")
        self.arch = arch
        self._ops: dict = {}
        self._transforms: dict[Any, list] = {}

    def check_limits(self, max_batch: int, max_seq_len: int, max_pages: int, pool_pages: int) -> None:
        """Raise unless ``max_batch`` sequences of ``max_seq_len`` tokens fit the block table and the pool."""
        lay = self.layout
        need = lay.pages_for(max_seq_len)
        if need > max_pages:
            raise ValueError(f"max_seq_len {max_seq_len} needs {need} INT2 pages per sequence; the block table "
                             f"holds {max_pages} (tokens_per_block {lay.page_size})")
        if max_batch * need > pool_pages:
            raise ValueError(f"max_batch_size {max_batch} x max_seq_len {max_seq_len} needs {max_batch * need} INT2 "
                             f"pages; {pool_pages} are reserved (kv_cache_config.max_tokens / {lay.page_size})")

    def transform(self, layer: int, device):
        key = str(device)
        if key not in self._transforms:
            self._transforms[key] = [t.to(device) for t in self.artifact.transforms]
        return self._transforms[key][layer]

    def ops(self, layout):  # pragma: no cover - needs a GPU and cuda-python
        """The bundle's cache ops of ``layout`` (one of :attr:`layer_layouts`), loaded once per layout."""
        if layout not in self._ops:
            from .device import AotCacheOps

            self._ops[layout] = AotCacheOps(self.manifest, layout, self.num_heads)
        return self._ops[layout]


def _current_arch() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{10 * major + minor}"


__all__ = ["EXTRA_LLM_API_OPTIONS", "REQUIRED_KERNELS", "SUPPORTED_FAMILIES", "OscarDeployment",
           "extra_llm_api_options", "family_of", "trtllm_config"]
