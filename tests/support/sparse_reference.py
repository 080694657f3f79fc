"""A small reference sparse-attention decoder (plain torch, float32).

MLA-like: every token of every layer has one latent main-KV row (``latent``
wide); an indexer scores all past tokens of the request and picks the top-k;
attention runs over exactly those rows. The decoder drives a KV backend the way
an attention backend would drive the offload manager, so one model can run

* :class:`FullKV` — the whole main-KV history on the "device" (parity baseline);
* :class:`OffloadKV` — :class:`~ascend_offload.sparse.manager.SparseOffloadManager`
  with the history in the host pool and only hot buffers on the device.

Both must give bit-identical logits: the same rows reach attention in the same
order, and the arithmetic around them is the same.

The prompt is not attended during "prefill" (each prompt token runs the MLP
path only): prefill belongs to the prefill node; what matters here is that both
backends receive the same prompt KV and indexer keys, the offload one written
straight into the host pool as the remote-D2H consumer does. :func:`prefill_kv`
is that prefill on its own (what a prefill node would publish), and
:class:`PulledKV` decodes from prompt rows a consumer already pulled into the pool.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch

from ascend_offload.sparse.manager import SparseOffloadManager, StepEntry


@dataclasses.dataclass(frozen=True)
class RefConfig:
    vocab: int = 97
    hidden: int = 32
    latent: int = 16
    index_dim: int = 8
    num_layers: int = 4
    topk: int = 64
    seed: int = 0
    init_scale: float = 0.5


class RefWeights:
    """Random float32 weights, deterministic in ``seed``."""

    def __init__(self, cfg: RefConfig) -> None:
        g = torch.Generator().manual_seed(cfg.seed)

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * (cfg.init_scale / math.sqrt(shape[0]))

        d, c, di = cfg.hidden, cfg.latent, cfg.index_dim
        self.embed = torch.randn(cfg.vocab, d, generator=g)
        self.w_kv = [rnd(d, c) for _ in range(cfg.num_layers)]
        self.w_q = [rnd(d, c) for _ in range(cfg.num_layers)]
        self.w_ik = [rnd(d, di) for _ in range(cfg.num_layers)]
        self.w_iq = [rnd(d, di) for _ in range(cfg.num_layers)]
        self.w_o = [rnd(c, d) for _ in range(cfg.num_layers)]
        self.w_ff = [rnd(d, d) for _ in range(cfg.num_layers)]
        self.unembed = rnd(d, cfg.vocab)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class KVBackend(Protocol):
    def add(self, req_id: str, max_tokens: int) -> None: ...
    def remove(self, req_id: str) -> None: ...
    def write_prompt(self, layer: int, req_id: str, kv: torch.Tensor) -> None: ...
    def begin_step(self, entries: list[StepEntry]) -> None: ...
    def offload_new(self, layer: int, kv: torch.Tensor, positions: torch.Tensor) -> None: ...
    def select(self, layer: int, topk: torch.Tensor) -> torch.Tensor: ...
    def end_step(self) -> None: ...


class FullKV:
    """Every request's whole main-KV history per layer on the device."""

    def __init__(self, num_layers: int, latent: int) -> None:
        self.num_layers, self.latent = num_layers, latent
        self.kv: dict[str, list[torch.Tensor]] = {}
        self._batch: list[str] = []

    def add(self, req_id: str, max_tokens: int) -> None:
        self.kv[req_id] = [torch.zeros(max_tokens, self.latent) for _ in range(self.num_layers)]

    def remove(self, req_id: str) -> None:
        del self.kv[req_id]

    def write_prompt(self, layer: int, req_id: str, kv: torch.Tensor) -> None:
        self.kv[req_id][layer][: kv.shape[0]] = kv

    def begin_step(self, entries: list[StepEntry]) -> None:
        self._batch = [e.req_id for e in entries]

    def offload_new(self, layer: int, kv: torch.Tensor, positions: torch.Tensor) -> None:
        for row, (b, p) in zip(kv, positions.tolist(), strict=True):
            self.kv[self._batch[b]][layer][p] = row

    def select(self, layer: int, topk: torch.Tensor) -> torch.Tensor:
        rows = [self.kv[r][layer].index_select(0, topk[b].clamp(min=0))
                for b, r in enumerate(self._batch)]
        return torch.stack(rows)

    def end_step(self) -> None:
        return None


class OffloadKV:
    """The sparse offload manager: host pool + hot buffers + residency."""

    def __init__(self, manager: SparseOffloadManager) -> None:
        self.mgr = manager

    def add(self, req_id: str, max_tokens: int) -> None:
        self.mgr.admit(req_id, max_tokens)

    def remove(self, req_id: str) -> None:
        self.mgr.finish(req_id)

    def write_prompt(self, layer: int, req_id: str, kv: torch.Tensor) -> None:
        self.mgr.pool.write_rows(layer, req_id, 0, kv)

    def begin_step(self, entries: list[StepEntry]) -> None:
        self.mgr.begin_step(entries)

    def offload_new(self, layer: int, kv: torch.Tensor, positions: torch.Tensor) -> None:
        self.mgr.offload_new_kv(layer, kv, positions)

    def select(self, layer: int, topk: torch.Tensor) -> torch.Tensor:
        slots = self.mgr.onload_topk(layer, topk)
        hot = self.mgr.hot_buffer(layer)
        return hot.index_select(0, slots.clamp(min=0).flatten().long()).view(
            *slots.shape, hot.shape[-1])

    def end_step(self) -> None:
        self.mgr.end_step()


class PulledKV(OffloadKV):
    """Offload backend whose prompt KV was pulled into the host pool by the
    remote-D2H consumer (``Consumer.expect_pool``): requests are attached, not
    admitted, and the locally computed prompt KV is *not* written, so decoding
    reads exactly the bytes the transfer delivered."""

    def add(self, req_id: str, max_tokens: int) -> None:
        self.mgr.attach(req_id, max_tokens)

    def write_prompt(self, layer: int, req_id: str, kv: torch.Tensor) -> None:
        return None


@dataclasses.dataclass
class _Req:
    tokens: list[int]
    index_keys: list[torch.Tensor]  # per layer [max_tokens, index_dim] (device side)
    max_tokens: int


def prefill_kv(cfg: RefConfig, w: RefWeights, prompt: list[int]
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """The prefill node's part: per layer the prompt's main-KV rows ``[len, latent]``
    and indexer keys ``[len, index_dim]``, and the first generated token."""
    x = w.embed[torch.tensor(prompt)]
    kv, keys = [], []
    for layer in range(cfg.num_layers):
        h = _norm(x)
        kv.append(h @ w.w_kv[layer])
        keys.append(h @ w.w_ik[layer])
        x = x + torch.tanh(_norm(x) @ w.w_ff[layer])
    # Prefill also yields the first generated token; decode starts at its position.
    return kv, keys, int((_norm(x[-1]) @ w.unembed).argmax())


class RefDecoder:
    """Greedy decoding of several requests joining and leaving between steps."""

    def __init__(self, cfg: RefConfig, weights: RefWeights, backend: KVBackend) -> None:
        self.cfg, self.w, self.kv = cfg, weights, backend
        self.reqs: dict[str, _Req] = {}

    def add_request(self, req_id: str, prompt: list[int], max_new_tokens: int) -> None:
        cfg = self.cfg
        max_tokens = len(prompt) + max_new_tokens
        self.kv.add(req_id, max_tokens)
        kv, index_keys, first = prefill_kv(cfg, self.w, prompt)
        keys = [torch.zeros(max_tokens, cfg.index_dim) for _ in range(cfg.num_layers)]
        for layer in range(cfg.num_layers):
            self.kv.write_prompt(layer, req_id, kv[layer])
            keys[layer][: len(prompt)] = index_keys[layer]
        self.reqs[req_id] = _Req([*prompt, first], keys, max_tokens)

    def finish(self, req_id: str) -> list[int]:
        self.kv.remove(req_id)
        return self.reqs.pop(req_id).tokens

    def step(self, req_ids: list[str]) -> torch.Tensor:
        """One decode step for ``req_ids``: returns ``[B, vocab]`` logits and
        appends the greedy tokens."""
        cfg, w = self.cfg, self.w
        reqs = [self.reqs[r] for r in req_ids]
        pos = [len(r.tokens) - 1 for r in reqs]  # the position whose KV this step adds
        lens = [p + 1 for p in pos]
        for r, n in zip(reqs, lens, strict=True):
            if n > r.max_tokens:
                raise ValueError("request ran past its max_new_tokens")
        self.kv.begin_step([StepEntry(rid, n, n) for rid, n in zip(req_ids, lens, strict=True)])
        positions = torch.tensor([[b, p] for b, p in enumerate(pos)], dtype=torch.int64)
        K = cfg.topk
        x = w.embed[torch.tensor([r.tokens[-1] for r in reqs])]
        for layer in range(cfg.num_layers):
            h = _norm(x)
            self.kv.offload_new(layer, h @ w.w_kv[layer], positions)
            ik = h @ w.w_ik[layer]
            iq = h @ w.w_iq[layer]
            q = h @ w.w_q[layer]
            topk = torch.full((len(reqs), K), -1, dtype=torch.int64)
            for b, r in enumerate(reqs):
                r.index_keys[layer][pos[b]] = ik[b]
                scores = r.index_keys[layer][: lens[b]] @ iq[b]
                k = min(K, lens[b])
                topk[b, :k] = torch.topk(scores, k).indices
            sel = self.kv.select(layer, topk)  # [B, K, latent]
            valid = topk >= 0
            sel = sel * valid.unsqueeze(-1).to(sel.dtype)
            att = torch.einsum("bkc,bc->bk", sel, q) / math.sqrt(cfg.latent)
            att = att.masked_fill(~valid, float("-inf")).softmax(-1)
            o = torch.einsum("bk,bkc->bc", att, sel)
            x = x + o @ w.w_o[layer]
            x = x + torch.tanh(_norm(x) @ w.w_ff[layer])
        self.kv.end_step()
        logits = _norm(x) @ w.unembed
        for r, t in zip(reqs, logits.argmax(-1).tolist(), strict=True):
            r.tokens.append(t)
        return logits
