"""``AscendMultiConnector``: a prefill that shares layer buffers *and* serves P/D pulls.

vLLM's ``MultiConnector`` already runs several connectors side by side (loads
from the first that has tokens, saves to all, request completion counted
across them). What it cannot know is that with layer sharing
(``AscendStoreConnector`` with ``use_layerwise``) the physical buffer of layer
*i* is rewritten by layer *i + B* within the same forward, while the remote-D2H
producer (``SfaRemoteD2HConnector``) lets decode read layer *i* from that very
buffer. This class adds exactly that: the producer's decode reads become
consumers of the slot in the store pipeline's reuse gate, so the slot's next
writer waits until decode answered (or the ack deadline passed); see
``SfaRemoteD2HConnector.attach_reuse_gate``.

Children run in a canonical order, whatever their order in ``connectors``
(:func:`canonical_order`): the slot-release provider (the layer-sharing store,
whose ``save_kv_layer`` registers decode's reads before the slot is handed on)
first, then the others in config order. Exactly one child loads a request's
external tokens (:func:`choose_loader`): the one that offers the most, ties to a
child that must deliver (P/D consumer) over a cache, then config order; the
others are told 0 tokens and drop their offers. A lookup asks a P/D producer first
(:func:`lookup_order`): while it holds an early-dispatched request back (None), the
other children are not asked, so no store pins a prefix or starts a fetch for it.

Rules checked at start-up (a wrong combination fails naming the key):
* vLLM runs with ``--disable-hybrid-kv-cache-manager`` (vLLM switches the
  hybrid manager off by itself only for the name ``MultiConnector``);
* at most one layer-sharing store and one producer;
* the producer publishes per layer (``use_layerwise``).
Without layer sharing it behaves like ``MultiConnector`` apart from the load
choice and the worker-side order above.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from ascend_offload.config import ConfigError, parse_extra_config
from ascend_offload.connectors.remote_d2h import SfaRemoteD2HConnector
from ascend_offload.connectors.store import AscendStoreConnector
from ascend_offload.pd.slot_sharing import SharedStepPipeline

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

NAME = "AscendMultiConnector"


def sharing_pair(stores: list[int], producers: list[int], publishes_per_layer: list[bool]
                 ) -> tuple[int, int] | None:
    """(store child, producer child) whose layer buffers and decode reads must share
    the reuse gate, or None; any order in the config. ``stores``: indices of
    layer-sharing store children; ``producers``: indices of P/D producer children;
    ``publishes_per_layer``: per child, whether it publishes each layer as soon as it
    is written."""
    if not stores or not producers:
        return None
    if len(stores) > 1 or len(producers) > 1:
        raise ConfigError(f"{NAME}: key 'connectors': at most one layer-sharing AscendStoreConnector and "
                          f"one SfaRemoteD2HConnector producer (got {len(stores)} and {len(producers)})")
    s, p = stores[0], producers[0]
    if not publishes_per_layer[p]:
        raise ConfigError(
            f"{NAME}: key 'connectors[{p}].kv_connector_extra_config.use_layerwise'=False with layer "
            "sharing: each layer must be published as soon as it is written (accepted: True)")
    return s, p


def canonical_order(releases_slots: Sequence[bool]) -> list[int]:
    """Config indices in the order the children are invoked: slot-release providers
    first (their ``save_kv_layer`` must register a layer's readers before any sibling
    publishes it), the rest in config order. Same on scheduler and workers, so the
    per-child metadata lines up."""
    return sorted(range(len(releases_slots)), key=lambda i: (not releases_slots[i], i))


def choose_loader(offers: Sequence[int], must_deliver: Sequence[bool]) -> int | None:
    """The one child that loads a request's external tokens: the largest offer; ties go
    to a child that must deliver (a P/D consumer: the prefill holds the request's KV for
    it) before a cache, then to the first in ``offers``. None when nobody offers.
    Why not "first that offers" (vLLM's ``MultiConnector``): that would make the result
    depend on the config order, and a cache's shorter prefix would win over a P/D pull
    of the whole prompt."""
    best: int | None = None
    for i, n in enumerate(offers):
        if n <= 0:
            continue
        if best is None or (n, must_deliver[i]) > (offers[best], must_deliver[best]):
            best = i
    return best


def lookup_order(defers: Sequence[bool]) -> list[int]:
    """Invocation indices in the order a request's lookup asks the children: those that
    may defer a request (``defers``: a P/D producer holds an early-dispatched request back
    until its decode's registration is claimed) first, the rest in invocation order.
    Why: a child answering None ends the lookup (vLLM asks again next step), and a
    store's lookup pins the prefix it offers and may start a shared-tier fetch, which a
    None from a child asked after it would leave behind for a request not scheduled.
    The deferring children's lookups hold nothing."""
    return sorted(range(len(defers)), key=lambda i: not defers[i])


class AscendMultiConnector(MultiConnector):
    """``MultiConnector`` plus the reuse-gate wiring between layer sharing and P/D reads."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        tc = vllm_config.kv_transfer_config
        assert tc is not None
        parse_extra_config(NAME, tc.kv_connector_extra_config)  # schema errors name the key
        if not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager and \
                not MultiConnector.all_children_support_hma(tc):
            # vLLM auto-disables the hybrid KV cache manager only for the name
            # "MultiConnector"; for ours it must be switched off explicitly.
            raise ConfigError(
                f"{NAME}: its child connectors do not support the hybrid KV cache manager; start "
                "vLLM with --disable-hybrid-kv-cache-manager (key 'disable_hybrid_kv_cache_manager'"
                "=True)")
        # vLLM types kv_cache_config as required but stores it as given (None: no cache yet)
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        # Pairing on config indices (errors name connectors[i] as written), then the
        # canonical invocation order.
        stores = [i for i, c in enumerate(self._connectors)
                  if isinstance(c, AscendStoreConnector) and c.layerwise]
        producers = [i for i, c in enumerate(self._connectors)
                     if isinstance(c, SfaRemoteD2HConnector) and c.is_producer]
        self._store: AscendStoreConnector | None = None
        self._rd2h: SfaRemoteD2HConnector | None = None
        pair = sharing_pair(stores, producers, [
            isinstance(c, SfaRemoteD2HConnector) and c.cfg.use_layerwise for c in self._connectors])
        if pair is not None:
            store, rd2h = self._connectors[pair[0]], self._connectors[pair[1]]
            assert isinstance(store, AscendStoreConnector) and isinstance(rd2h, SfaRemoteD2HConnector)
            self._store, self._rd2h = store, rd2h
            rd2h.hold_early_requests()
        #: the config index of each child, in invocation order
        self.config_index = canonical_order([i in stores for i in range(len(self._connectors))])
        self._connectors = [self._connectors[i] for i in self.config_index]
        self._ktc_kv_transfer_config = [self._ktc_kv_transfer_config[i] for i in self.config_index]
        #: invocation indices in the order a request's lookup asks them (lookup_order)
        self.lookup_order = lookup_order([isinstance(c, SfaRemoteD2HConnector) and c.is_producer
                                          for c in self._connectors])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Ask every child; exactly one (:func:`choose_loader`) is assigned the load."""
        self._requests_to_connector.pop(request.request_id, None)
        offers: list[tuple[int, bool]] = [(0, False)] * len(self._connectors)
        for i in self.lookup_order:
            toks, load_async = self._connectors[i].get_num_new_matched_tokens(request, num_computed_tokens)
            if toks is None:  # a child still looking up: ask again later, the rest unasked
                return None, False
            offers[i] = (toks, load_async)
        # ties in config order, not invocation order
        by_config = sorted(range(len(offers)), key=lambda i: self.config_index[i])
        pick = choose_loader([offers[i][0] for i in by_config],
                             [self._connectors[i].requires_kv_delivery for i in by_config])
        if pick is None:
            return 0, False
        chosen = by_config[pick]
        self._requests_to_connector[request.request_id] = chosen
        return offers[chosen]

    def request_finished(self, request: Request, blocks: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's aggregation, except that a key a later child (in invocation order) returns
        again is dropped from its params instead of failing the request: two store
        children both report ``ascend_store`` (their per-request counts)."""
        seen: set[str] = set()

        def finish(c: Any) -> tuple[bool, dict[str, Any] | None]:
            async_save, params = c.request_finished(request, blocks)
            if params:
                params = {k: v for k, v in params.items() if k not in seen}
                seen.update(params)
            return async_save, params or None

        return self._aggregate_request_finished(request, finish)

    @property
    def shares_slots_with_pd(self) -> bool:
        return self._store is not None and self._rd2h is not None

    def _shared_pipeline(self) -> SharedStepPipeline | None:
        """The store's layerwise pipeline when its buffers are shared with P/D reads."""
        if self._store is None or self._rd2h is None:
            return None
        return self._store.pipeline

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        pipe = self._shared_pipeline()
        if pipe is not None and self._rd2h is not None:
            self._rd2h.attach_reuse_gate(pipe)
            # The next layer's slot is taken only after the producer published this
            # layer (see save_kv_layer): otherwise it would wait for its own publish.
            pipe.defer_next_ready = True
            log.info("%s: decode reads of each layer hold its physical buffer (%d layers on %d buffers)",
                     NAME, pipe.plan.num_logical, pipe.plan.num_physical)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Children in canonical order (store: save + hold the slot for decode; producer:
        publish), then the next layer's slot is made ready, which may wait for decode's reads."""
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        pipe = self._shared_pipeline()
        if pipe is not None and pipe.defer_next_ready and pipe.in_step:
            pipe.ready_next(layer_name)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer must run between layers (both children need it)
