"""A small model run the way AutoDeploy runs it, on the stand-ins (autodeploy_standins.py), against the reference.

:class:`TinyModel` is a decoder of ``L`` attention layers (random projections, no RoPE: the op takes whatever
post-RoPE ``q, k, v`` the model makes) whose attention is AutoDeploy's source op ``auto_deploy::torch_attention``
(``bsnd``). :class:`Runner` traces it (``torch.fx.symbolic_trace`` + fake values, as export leaves the graph),
runs the stand-in ``insert_cached_attention`` with the ``"oscar"`` descriptor, allocates the declared resources
and then runs steps as AutoDeploy's runtime does: ``nest_sequences`` (pages from a free list in shuffled order,
as a block manager hands them out), then the graph (``prepare_metadata`` once, the cached op per layer).

:class:`Reference` is the same model on each sequence alone, its attention the adapter's reference cache ops
driven directly (``plugins/trtllm/reference_ops.py`` ``TorchCacheOps`` over a ``PagedKV`` and ``PageBook`` of its
own): the prompt attends at full precision and is written, a later prompt chunk attends through
``chunk_attention`` and is written, each decode step is ``decode_step`` + ``decode``.
"""

from __future__ import annotations

import math
import random

import torch

from oscar_export.kernels.layout import PagedKV
from oscar_export.kernels.pages import PageBook
from oscar_export.plugins.trtllm.attention import PAGES_PER_SPLIT

import autodeploy_standins as ads

HIDDEN, VOCAB = 32, 50


def linear(x, w):
    """``x @ w`` as a product and a sum: each row's result does not depend on the other rows (a BLAS matmul's
    does, by a rounding, through its blocking), so a sequence's rows are the same bits alone or in any batch."""
    return (x.unsqueeze(-1) * w).sum(-2)


class TinyModel(torch.nn.Module):
    """``input_ids [b, s]`` -> hidden states ``[b, s, HIDDEN]``, ``L`` attention layers with residuals."""

    def __init__(self, num_layers: int, heads: int, kv_heads: int, head_dim: int, scale: float, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.h, self.hkv, self.d, self.scale = heads, kv_heads, head_dim, scale
        width = (heads + 2 * kv_heads) * head_dim
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(HIDDEN, width, generator=g) * HIDDEN ** -0.5)
                                        for _ in range(num_layers))
        self.o = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(heads * head_dim, HIDDEN, generator=g) * 0.1)
                                        for _ in range(num_layers))

    def forward(self, input_ids):
        b, s = input_ids.shape[0], input_ids.shape[1]
        x = torch.nn.functional.embedding(input_ids, self.emb)
        hd, kd = self.h * self.d, self.hkv * self.d
        for i in range(len(self.w)):
            qkv = linear(x, self.w[i]).to(torch.bfloat16)
            q = qkv[..., :hd].reshape(b, s, self.h, self.d)
            k = qkv[..., hd : hd + kd].reshape(b, s, self.hkv, self.d)
            v = qkv[..., hd + kd :].reshape(b, s, self.hkv, self.d)
            o = self.attend(q, k, v, i)
            x = x + linear(o.float().reshape(b, s, hd), self.o[i])
        return x

    def attend(self, q, k, v, layer: int):
        return torch.ops.auto_deploy.torch_attention(q, k, v, None, 0.0, True, self.scale, None, None, None, "bsnd")


class Reference(TinyModel):
    """One sequence through the reference cache ops (see the module doc); ``step(tokens)`` -> ``[n, HIDDEN]``."""

    def __init__(self, model: TinyModel, deployment, ops, max_len: int):
        super().__init__(len(model.w), model.h, model.hkv, model.d, model.scale)
        self.device = model.emb.device
        self.to(self.device).load_state_dict(model.state_dict())
        self.dep, self.ops = deployment, ops
        self.book = PageBook(deployment.layout, 1, max_len, self.device)
        self.states = [PagedKV.allocate(lay, 1, self.book.num_pool_pages, self.book.max_pages, self.device)
                       for lay in deployment.layer_layouts]
        self.length = 0

    def step(self, tokens: list[int]) -> torch.Tensor:
        self.book.begin(len(tokens))
        out = self(torch.tensor([tokens], device=self.device))[0]
        self.book.commit(len(tokens))
        self.length += len(tokens)
        return out

    def attend(self, q, k, v, layer: int):
        t, ops = self.dep.transform(layer, self.device), self.ops[layer]
        state = self.book.state_view(self.states[layer], self.book.committed)
        qi, ki, vi = (x[0].transpose(0, 1) for x in (q, k, v))  # [H, n, D], [H_kv, n, D]
        k_s = t.transform_keys(ki[None])[0].to(torch.bfloat16)
        v_s = t.transform_values(vi[None])[0].to(torch.bfloat16)
        if self.length == 0:
            o = torch.nn.functional.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=True,
                                                                 scale=self.scale, enable_gqa=True)[0]
            ops.write(state, 0, 0, k_s, v_s, t)
            return o.transpose(0, 1)[None]
        if q.shape[1] > 1:  # a later prompt chunk: over the cache as stored, then written
            o = t.restore_output(ops.chunk_attention(state, qi, k_s, v_s, t)[None])[0]
            ops.write(state, 0, self.length, k_s, v_s, t)
            return o.transpose(0, 1)[None].to(q.dtype)
        status = torch.zeros(1, dtype=torch.int32, device=self.device)
        q_s = ops.decode_step(state, k_s.transpose(0, 1), v_s.transpose(0, 1), status, t, qi.transpose(0, 1))
        step_state = self.book.state_view(self.states[layer], self.book.in_step)
        ob = ops.decode(q_s, step_state, t, PAGES_PER_SPLIT)
        return t.restore_output(ob[:, :, None].float()).squeeze(2)[None].to(q.dtype)  # [1, 1, H, D]


class Capture(torch.fx.Interpreter):
    """Runs the graph, keeping ``(layer, q, k, v, output)`` of each cached-attention call."""

    def __init__(self, gm, seen: list) -> None:
        super().__init__(gm)
        self.seen = seen

    def call_function(self, target, args, kwargs):
        out = super().call_function(target, args, kwargs)
        if target is torch.ops.oscar_ad.cached_attention.default:
            self.seen.append((args[-2], *(a.clone() for a in args[:3]), out.clone()))
        return out


class Seq:
    """A request: its slot, cached length and AutoDeploy pages."""

    def __init__(self, slot: int) -> None:
        self.slot, self.pos, self.pages = slot, 0, []


class Runner:
    """The transformed graph and its cache interface; :meth:`step` runs one forward."""

    def __init__(self, model, up, max_batch: int, max_seq_len: int, page_size: int, num_blocks: int, seed=0):
        device = model.emb.device
        self.cm = ads.CachedSequenceInterface(ads.SequenceInfo(max_seq_len, max_batch, page_size, device=device))
        self.gm = torch.fx.symbolic_trace(model)
        ads.fake_propagate(self.gm, torch.zeros(2, 4, dtype=torch.int, device=device))
        self.replaced = ads.insert_cached_attention(self.gm, self.cm, up.AttentionRegistry.get("oscar"))
        self.cm.initialize_resources(num_blocks)
        self.page_size = page_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def cache(self, name: str, layer: int) -> torch.Tensor:
        return self.cm.caches[f"{name}_{layer}"]

    def step(self, rows: list[tuple[Seq, list[int]]], batch_info=None, seen=None) -> list[torch.Tensor]:
        """``rows``: ``(seq, tokens)``, context rows first. Returns each row's hidden states ``[n, HIDDEN]``.
        ``seen``: a list that gets ``(layer, q, k, v, output)`` of every cached-attention call."""
        for seq, toks in rows:
            while len(seq.pages) < math.ceil((seq.pos + len(toks)) / self.page_size):
                seq.pages.append(self.free.pop())
        self.cm.info.nest_sequences([toks for _, toks in rows], [s.pos for s, _ in rows],
                                    [p for s, _ in rows for p in s.pages], [len(s.pages) for s, _ in rows],
                                    [s.slot for s, _ in rows], batch_info)
        named = self.cm.named_args
        if seen is None:
            out = self.gm(**named)
        else:
            args = [named[n.target] for n in self.gm.graph.nodes if n.op == "placeholder"]
            out = Capture(self.gm, seen).run(*args)
        out = out.reshape(-1, out.shape[-1])
        res, off = [], 0
        for seq, toks in rows:
            res.append(out[off : off + len(toks)])
            off += len(toks)
            seq.pos += len(toks)
        return res

    def finish(self, seq: Seq) -> None:
        self.free.extend(seq.pages)
        seq.pages = []
