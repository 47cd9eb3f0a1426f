"""Replays of TensorRT-LLM's startup and executor loops over the OSCAR adapter, checked against the reference.

:class:`Driver` starts the served model the way ``create_py_executor`` does, on the stand-ins of
``trtllm_standins/``: the model from ``AutoModelForCausalLM.from_config`` (a frozen ``ModelConfig`` with the
stock ``TRTLLM`` backend configured), the KV cache manager class from ``get_kv_cache_manager_cls`` inside
``KvCacheCreator``, and with ``estimate=True`` the KV-cache estimation: a manager built for the estimation, its
dummy context requests (``max_num_tokens`` tokens, one generated token each) run through the plain loop, the
budget from ``get_cache_size_per_token``, teardown (``shutdown``) and the rebuild. Every forward goes through
each layer's ``Attention.forward`` with the packed ``q|k|v`` rows (the fused-QKV input shape) before RoPE, so
whatever the layer wired at construction (RoPE, QKV split) is what reaches the backend. Loops:

* ``plain``   -- ``_executor_loop``: prepare_resources(N), forward(N), update_resources(N), free finished;
* ``overlap`` -- ``_executor_loop_overlap``: prepare_resources(N+1) and forward(N+1) run before
  update_resources(N) and before the requests finished in N are freed (which therefore take one more step);
* ``graph``   -- CUDA graphs: warmup and capture on dummy requests (``add_dummy_requests``), then every
  generation batch is padded to the captured size with upstream's padding request
  (``CUDA_GRAPH_DUMMY_REQUEST_ID``, made after ``prepare_resources``; no padding when ``add_dummy_requests``
  returns ``None``) and "replayed": the forward runs with the capture-time metadata and host-side checks off
  (``attention._capturing`` is True), so anything the adapter decided on the host at capture time is what the
  replay uses, as in a real graph.

After every step each live request's cache (lengths, BF16 windows, the INT2 pages its block-table row names)
is compared with a cache written step by step by ``kernels/reference.append_tokens`` from the same (rotated)
rows, and every generated row's attention output with ``reference.decode_attention`` / ``chunk_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from oscar_export.kernels import reference
from oscar_export.kernels.layout import PagedKV

from trtllm_standins import (
    CUDA_GRAPH_DUMMY_REQUEST_ID,
    KvCacheConfig,
    KVCacheParams,
    Mapping,
    ModelConfig,
    ScheduledRequests,
    rope,
    torch_bytes,
)

#: request ids of the estimation's dummy context requests (the executor numbers them like any request)
ESTIMATION_IDS = 10**7


@dataclass
class Req:
    rid: int
    prompt: int
    new: int
    chunk: int = 0  # 0: the whole prompt in one context step
    req: object = None
    written: int = 0  # tokens in the cache
    generated: int = 0
    done: bool = False
    ref: list = field(default_factory=list)  # per layer: a batch-of-one reference PagedKV
    rows: list = field(default_factory=list)  # block-table rows the request was given (for reuse checks)
    nan_at: int = -1  # the token at this position carries a NaN in its keys (layer 0, KV head 1)
    poisoned: bool = False  # its NaN token was fed: the cache must stay at the last finite token
    skipped: int = 0  # tokens fed since (the executor counts them; the cache must not hold them)
    failed: str = ""  # why the cache failed the request alone (it then ends; nothing of it is checked)
    failed_step: int = -1

    @property
    def fed(self) -> int:
        """Tokens the executor has fed (its position): the cache's plus the ones it must not hold."""
        return self.written + self.skipped


def rows_for(rid: int, pos: int, n: int, layer: int, heads: int, kv: int, d: int):
    """Deterministic q ``[n, H*D]``, k, v ``[n, H_kv*D]`` (before RoPE) for tokens ``pos .. pos+n-1``."""
    out = []
    for p in range(pos, pos + n):
        g = torch.Generator().manual_seed((rid * 100003 + p) * 31 + layer)
        out.append(torch.randn(heads * d + 2 * kv * d, generator=g).bfloat16().float())
    x = torch.stack(out)
    return x[:, : heads * d], x[:, heads * d : heads * d + kv * d], x[:, heads * d + kv * d :]


class Driver:
    def __init__(self, ns, dep, max_batch: int, max_seq_len: int, pretrained, estimate: bool = False,
                 max_num_tokens: int | None = None, available_bytes: int = 1 << 34, streams=None,
                 execution_stream=None, chunked_prefill: bool = False) -> None:
        self.ns, self.dep, self.lay = ns, dep, dep.layout
        c = pretrained
        self.heads, self.kv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.theta = float(getattr(c, "rope_theta", 10000.0))
        self.max_batch = max_batch
        self.steps = 0
        self.checked_outputs = 0
        self.model_config = ModelConfig(pretrained_config=pretrained, max_num_tokens=max_num_tokens or max_seq_len)
        self.model = ns.modeling_auto.AutoModelForCausalLM.from_config(self.model_config)
        self.backends = [m.attn for m in self.model.layers]
        self.kv_config = KvCacheConfig(enable_block_reuse=False)  # as the deployment's extra_llm_api_options.yaml
        self.chunked_prefill = chunked_prefill  # the executor's enable_chunked_prefill (runtime_features)
        #: ``trtllm_streams.SimulatedStreams`` (or None): the forward on ``execution_stream``, the rest on the
        #: current stream, as upstream's executor issues them
        self.streams, self.execution_stream = streams, execution_stream
        self.creator = ns.util.KvCacheCreator(
            model=self.model, mapping=Mapping(), max_num_tokens=self.model_config.max_num_tokens,
            tokens_per_block=self.lay.page_size, max_seq_len=max_seq_len, max_batch_size=max_batch,
            kv_cache_config=self.kv_config, execution_stream=execution_stream)
        resources: dict = {}
        #: the estimation's manager (the engine's metadata keeps pointing at it until the next forward)
        self.estimation_mgr = None
        self.estimated = estimate and self.creator.try_prepare_estimation()
        #: the stand-in device: what is in use before the KV cache (the model) plus ``available_bytes``
        self.total_gpu_memory = torch_bytes() + available_bytes if self.estimated else None
        self.creator.build_managers(resources, estimating_kv_cache=self.estimated)
        if self.estimated:
            self.mgr = self.estimation_mgr = self._built(resources)
            dummies = [Req(ESTIMATION_IDS + i, n, 1) for i, n in enumerate(self.creator.dummy_requests)]
            self.creator.configure_kv_cache_capacity(SimpleNamespace(
                run_dummy_requests=lambda: self.run_plain(dummies), kv_cache_manager=self.mgr,
                total_gpu_memory=self.total_gpu_memory))
            self.creator.teardown_managers(resources)
            self.creator.build_managers(resources)
        self.mgr = self._built(resources)

    def _built(self, resources):
        """The manager just built, given the simulated streams in place of the device's."""
        mgr = resources["kv_cache_manager"]
        if self.streams is not None:
            mgr.streams = self.streams
            book = mgr.book
            self.streams.watch(step_slots=mgr.step_slots, slot_rid=mgr.slot_rid, block_table=book.block_table,
                               seq_len=book.seq_len, committed_sink_len=book.committed.sink_len,
                               committed_num_pages=book.committed.num_pages,
                               committed_recent_len=book.committed.recent_len)
        return mgr

    def on_execution_stream(self, what: str):
        """The forward's stream (upstream: ``torch.cuda.stream(execution_stream)``); a no-op without streams."""
        import contextlib

        if self.streams is None:
            return contextlib.nullcontext()
        self.streams.where = what
        return self.streams.stream("execution")

    def synchronize(self) -> None:
        """The executor's host synchronisation once a step (its sampler waits for the step's tokens)."""
        if self.streams is not None:
            self.streams.synchronize()

    # ---- one forward over a batch ------------------------------------------------------------------------
    def metadata(self, ctx: list[Req], gen: list, padded: int = 0):
        lens = [r.chunk or r.prompt for r in ctx]
        lens = [min(n, r.prompt - r.fed) for n, r in zip(lens, ctx)] + [1] * (len(gen) + padded)
        ids = [r.rid for r in ctx] + [r.rid if isinstance(r, Req) else r.py_request_id for r in gen]
        cached = [r.fed for r in ctx] + [r.fed if isinstance(r, Req) else 0 for r in gen]
        # the engine's metadata class is the configured backend's (TRTLLM: TrtllmAttentionMetadata), prepared
        # every step against the manager before the forward
        metadata_cls = self.ns.utils.get_attention_backend(self.model_config.attn_backend).Metadata
        md = metadata_cls(
            max_num_requests=self.max_batch + padded + len(ctx) + len(gen), kv_cache_manager=self.mgr,
            seq_lens=torch.tensor(lens, dtype=torch.int32), num_contexts=len(ctx), request_ids=ids,
            prompt_lens=[r.prompt if isinstance(r, Req) else r.prompt_len for r in list(ctx) + list(gen)],
            kv_cache_params=KVCacheParams(num_cached_tokens_per_seq=cached + [0] * padded),
            runtime_features=self.ns.interface.AttentionRuntimeFeatures(chunked_prefill=self.chunked_prefill))
        md.prepare()
        return md

    def rotated(self, q, k, pos: int):
        """q, k as the layer's RoPE leaves them (bf16 in, bf16 out) at positions ``pos ..``."""
        p = torch.arange(pos, pos + q.shape[0])
        return rope(q.bfloat16(), p, self.d, self.theta), rope(k.bfloat16(), p, self.d, self.theta)

    def forward(self, ctx: list[Req], gen: list, metadata=None, check: bool = True):
        """Run every layer's ``Attention.forward`` on the packed rows; ``gen`` may hold dummy requests (padding).
        Checks outputs of real rows against the reference."""
        md = metadata if metadata is not None else self.metadata(ctx, gen)
        lens = md.seq_lens.tolist()
        real = list(ctx) + [r for r in gen if isinstance(r, Req)]
        for layer, module in enumerate(self.model.layers):
            packed, pos_ids, qs, ks, vs = [], [], [], [], []
            for i, r in enumerate(list(ctx) + list(gen)):
                n = lens[i] if i < len(lens) else 1
                if isinstance(r, Req):
                    pos = r.fed  # the executor's position
                    q, k, v = rows_for(r.rid, pos, n, layer, self.heads, self.kv, self.d)
                    if pos <= r.nan_at < pos + n and layer == 0:
                        k[r.nan_at - pos, self.d + 3] = float("nan")
                else:  # a dummy request: garbage the adapter must not store
                    pos = 0
                    widths = (self.heads * self.d, self.kv * self.d, self.kv * self.d)
                    q, k, v = (torch.full((n, w), 7.0) for w in widths)
                packed.append(torch.cat([q, k, v], -1))
                pos_ids.append(torch.arange(pos, pos + n))
                qr, kr = self.rotated(q, k, pos)
                qs.append(qr), ks.append(kr), vs.append(v.bfloat16())
            with self.on_execution_stream(f"step {self.steps} layer {layer}"):
                out = module(torch.cat(pos_ids)[None], torch.cat(packed).bfloat16(), md)
            if check:
                q, k, v = (torch.cat(x) for x in (qs, ks, vs))
                self._check_outputs(layer, ctx, gen, lens, q, k, v, out)
        self.synchronize()
        for r in real:
            self._advance_reference(r, lens[(list(ctx) + list(gen)).index(r)])
        self.steps += 1

    # ---- the reference ---------------------------------------------------------------------------------------
    def _ref_state(self, r: Req, layer: int):
        while len(r.ref) <= layer:
            st = PagedKV.allocate(self.dep.layer_layouts[len(r.ref)], 1, 8, 8, dtype=torch.bfloat16)
            st.next_page = 0  # the reference's own allocator
            r.ref.append(st)
        return r.ref[layer]

    def _stored(self, layer: int, k, v):
        t = self.dep.transform(layer, "cpu")
        n = k.shape[0]
        ks = t.transform_keys(k.float().view(n, self.kv, self.d).transpose(0, 1)[None])[0].bfloat16()
        vs = t.transform_values(v.float().view(n, self.kv, self.d).transpose(0, 1)[None])[0].bfloat16()
        return t, ks, vs

    def _check_outputs(self, layer, ctx, gen, lens, q, k, v, out):
        off = 0
        for i, r in enumerate(list(ctx) + list(gen)):
            n = lens[i] if i < len(lens) else 1
            poisoned = isinstance(r, Req) and (r.poisoned or r.failed or r.written <= r.nan_at < r.written + n)
            if isinstance(r, Req) and i < len(ctx) and r.written == 0 and not poisoned:  # a first chunk
                # causal attention over the prompt's own tokens, at full precision
                qi, ki, vi = (x[off : off + n].view(n, -1, self.d).transpose(0, 1)[None] for x in (q, k, v))
                want = torch.nn.functional.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=self.dep.sm_scale, enable_gqa=True)[0].transpose(0, 1)
                where = f"step {self.steps} request {r.rid} layer {layer}"
                # a padded group's attention blocks its sums differently: one bf16 rounding step at most
                err = (out[off : off + n].float() - want.reshape(n, -1).float()).abs().max().item()
                assert err <= 2**-7 * want.abs().max().item(), f"{where}: prompt output off by {err}"
                self.checked_outputs += 1
            elif isinstance(r, Req) and (i >= len(ctx) or r.written > 0) and not poisoned:  # gen rows, later chunks
                t, ks, vs = self._stored(layer, k[off : off + n], v[off : off + n])
                st = self._ref_state(r, layer)
                qi = q[off : off + n].float().view(n, self.heads, self.d).transpose(0, 1)[None]  # [1, H, n, D]
                lay = self.dep.layer_layouts[layer]
                if i >= len(ctx):
                    trial = _clone_state(st)
                    self._append(trial, layer, t, ks, vs)
                    want = reference.decode_attention(t.transform_queries(qi).squeeze(2), trial, lay, t.k_levels,
                                                      t.v_levels, self.dep.sm_scale)[:, :, None]
                else:
                    want = reference.chunk_attention(t.transform_queries(qi), ks[None], vs[None], st, lay,
                                                     t.k_levels, t.v_levels, self.dep.sm_scale)
                want = t.restore_output(want)[0].transpose(0, 1).reshape(n, self.heads * self.d)
                got = out[off : off + n].float()
                err = (got - want.bfloat16().float()).abs().max().item()
                where = f"step {self.steps} request {r.rid} layer {layer}"
                assert err <= 1e-2 * (1 + want.abs().max().item()), f"{where}: output off by {err}"
                self.checked_outputs += 1
            off += n

    def _append(self, st, layer, t, ks, vs):
        def alloc():
            st.next_page += 1
            return st.next_page - 1
        reference.append_tokens(st, 0, ks, vs, self.dep.layer_layouts[layer], t, alloc)

    def _advance_reference(self, r: Req, n: int) -> None:
        if r.failed:
            return
        if r.poisoned or r.written <= r.nan_at < r.written + n:  # the cache must not take it, nor later tokens
            r.poisoned = True
            r.skipped += n
            return
        for layer in range(len(self.backends)):
            q, k, v = rows_for(r.rid, r.written, n, layer, self.heads, self.kv, self.d)
            _, k = self.rotated(q, k, r.written)
            t, ks, vs = self._stored(layer, k, v.bfloat16())
            self._append(self._ref_state(r, layer), layer, t, ks, vs)
        r.written += n

    def check_cache(self, reqs) -> None:
        """Every live request's stored cache equals the reference's, in every layer."""
        for r in reqs:
            if r.done or r.failed or r.written == 0:  # finished, failed, or not admitted yet
                continue
            slot = self.mgr.slot_of(r.rid)
            for layer, st in enumerate(self.mgr.layers):
                ref = r.ref[layer]
                got = [int(st.sink_len[slot]), int(st.num_pages[slot]), int(st.recent_len[slot])]
                want = [int(ref.sink_len[0]), int(ref.num_pages[0]), int(ref.recent_len[0])]
                where = f"step {self.steps} request {r.rid} (slot {slot}, {r.written} tokens) layer {layer}"
                assert got == want == list(self.lay.split(r.written)), f"{where}: lengths {got}, reference {want}"
                sl, npg, rl = want
                ring = self.lay.recent_slot(torch.arange(npg * self.lay.page_size, npg * self.lay.page_size + rl))
                assert torch.equal(st.sink_k[slot, :, :sl], ref.sink_k[0, :, :sl]), f"{where}: sink keys differ"
                assert torch.equal(st.sink_v[slot, :, :sl], ref.sink_v[0, :, :sl]), f"{where}: sink values differ"
                assert torch.equal(st.recent_k[slot][:, ring], ref.recent_k[0][:, ring]), f"{where}: recent keys differ"
                assert torch.equal(st.recent_v[slot][:, ring], ref.recent_v[0][:, ring]), (
                    f"{where}: recent values differ")
                row = self.mgr.rows[slot]
                assert st.block_table[slot, :npg].tolist() == row[:npg], f"{where}: block table is not the C++ row"
                for i in range(npg):
                    a, b = int(st.block_table[slot, i]), int(ref.block_table[0, i])
                    for name in ("k_codes", "k_params", "v_codes", "v_params"):
                        assert torch.equal(getattr(st, name)[a], getattr(ref, name)[b]), f"{where}: page {i} {name}"

    # ---- the loops ---------------------------------------------------------------------------------------
    def _llm_request(self, r: Req):
        if r.req is None:
            r.req = self.ns.llm_request.LlmRequest(request_id=r.rid, max_new_tokens=r.new, input_tokens=[1] * r.prompt)
            if r.chunk:
                r.req.context_chunk_size = r.chunk
        r.req.context_current_position = min(r.fed, r.prompt)
        return r.req

    def schedule(self, reqs: list[Req]) -> tuple[list[Req], list[Req]]:
        live = [r for r in reqs if not r.done and not r.failed][: self.max_batch]
        ctx = [r for r in live if r.fed < r.prompt]
        gen = [r for r in live if r.fed >= r.prompt]
        return ctx, gen

    def batch(self, ctx, gen) -> ScheduledRequests:
        b = ScheduledRequests([self._llm_request(r) for r in ctx], [self._llm_request(r) for r in gen])
        for r in ctx + gen:
            if r.rid in self.mgr.slots:
                r.rows.append(list(self.mgr.rows.get(self.mgr.slot_of(r.rid), [])))
        return b

    def finish(self, r: Req) -> None:
        r.done = True
        r.ref = []  # a finished request's reference cache is never read again
        self.mgr.free_resources(r.req)

    def prepare(self, b, ctx, gen) -> None:
        """``prepare_resources``; a request the cache failed alone ends (upstream: ``GENERATION_COMPLETE``)."""
        self.mgr.prepare_resources(b)
        complete = self.ns.llm_request.LlmRequestState.GENERATION_COMPLETE
        for r in list(ctx) + list(gen):
            if r.req.state == complete and not r.failed:
                r.failed, r.failed_step = self.mgr.failed[r.rid], self.steps

    def _progress(self, ctx, gen) -> list[Req]:
        for r in gen:
            r.generated += 1
        return [r for r in gen if r.generated >= r.new or r.failed] + [r for r in ctx if r.failed]

    def run_plain(self, reqs: list[Req]) -> None:
        while any(not r.done for r in reqs):
            ctx, gen = self.schedule(reqs)
            b = self.batch(ctx, gen)
            self.prepare(b, ctx, gen)
            self.forward(ctx, gen)
            self.mgr.update_resources(b)
            self.check_cache(reqs)
            for r in self._progress(ctx, gen):
                self.finish(r)

    def run_overlap(self, reqs: list[Req]) -> None:
        prev = None
        while any(not r.done for r in reqs) or prev is not None:
            ctx, gen = self.schedule(reqs)
            b = None
            if ctx or gen:
                b = self.batch(ctx, gen)
                self.prepare(b, ctx, gen)
                self.forward(ctx, gen)  # forward(N+1) before update_resources(N)
                self.check_cache(reqs)
            if prev is not None:
                pb, pctx, pgen = prev
                self.mgr.update_resources(pb)
                for r in self._progress(pctx, pgen):
                    if not r.done:
                        self.finish(r)
            prev = (b, ctx, gen) if b is not None else None

    def warmup_and_capture(self, batch_size: int, monkeypatch) -> object:
        """CUDA-graph warmup (eager) and capture on dummy generation requests; returns the captured metadata."""
        from oscar_export.plugins.trtllm import attention

        ids = list(range(10**6, 10**6 + batch_size))
        dummies = self.mgr.add_dummy_requests(ids, token_nums=[self.lay.page_size + 1] * batch_size, is_gen=True)
        md = self.metadata([], dummies)
        self.forward([], dummies, md, check=False)  # warmup
        with monkeypatch.context() as m:
            m.setattr(attention, "_capturing", lambda: True)
            self.forward([], dummies, md, check=False)  # capture
        for d in dummies:
            self.mgr.free_resources(d)
        return md

    def run_graph(self, reqs: list[Req], batch_size: int, monkeypatch) -> None:
        from oscar_export.plugins.trtllm import attention

        captured = self.warmup_and_capture(batch_size, monkeypatch)
        pad = None  # TensorRT-LLM's padding request, made on the first batch that needs it
        while any(not r.done for r in reqs):
            ctx, gen = self.schedule(reqs)
            b = self.batch(ctx, gen)
            self.prepare(b, ctx, gen)
            if ctx or len(gen) > batch_size:
                self.forward(ctx, gen)  # context steps run eagerly
            else:
                if pad is None and len(gen) < batch_size:
                    made = self.mgr.add_dummy_requests([CUDA_GRAPH_DUMMY_REQUEST_ID], is_gen=True)
                    pad = made[0] if made else None  # None: no free block, so no padding (runs eagerly)
                if pad is None and len(gen) < batch_size:
                    self.forward(ctx, gen)
                else:
                    padded = list(gen) + [pad] * (batch_size - len(gen))  # padded after prepare_resources
                    with monkeypatch.context() as m:
                        m.setattr(attention, "_capturing", lambda: True)
                        self.forward([], padded, captured)  # "replay": capture-time metadata
            self.mgr.update_resources(b)
            self.check_cache(reqs)
            for r in self._progress(ctx, gen):
                self.finish(r)
        if pad is not None:
            self.mgr.free_resources(pad)


def _clone_state(st):
    from dataclasses import fields

    c = type(st)(**{f.name: getattr(st, f.name).clone() for f in fields(st)})
    c.next_page = st.next_page
    return c
