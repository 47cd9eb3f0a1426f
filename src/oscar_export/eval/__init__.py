"""The evaluation (docs/design.md §5): KV-cache methods scored decode-as-deployed against BF16.

One module per concern: ``cache_models`` (one class per cache method, one protocol; transformers'
``QuantizedCache`` replayed in ``hf_quantized``), ``quantizers`` (their INT2 rules, through ``kernels.reference``),
``attention`` (the fake-quantized attention), ``recipes`` (the methods built for one model), ``text`` (PPL, KL,
top-1), ``niah_prompts``, ``niah_scoring`` and ``niah`` (the needle tasks: the prompts, their score, the run),
``deployed`` (the real cache on the GPU), ``report`` (tables, JSON, plots), ``presets`` (what a run measures) and
``driver`` (``oscar-export eval``).
"""
