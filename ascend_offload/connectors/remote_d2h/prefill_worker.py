"""``SfaRemoteD2HConnector``'s prefill worker: one TP rank publishing its KV to decode.

After each attention layer (``save_kv_layer``) the rank's
:class:`~ascend_offload.pd.producer.Producer` (one per decode TP size) publishes
that layer to the decode ranks that read it; a request's blocks are freed only
after decode answered for every layer or the ack deadline passed (the
scheduler's ``request_finished`` delays the free until this worker says so).

A request computed before its decode registered (early dispatch, ``claim_in_worker``)
arrives as a late send: this rank claims the registration while it computes and
publishes the layers already written the moment it arrives, from the claims' thread
(:mod:`ascend_offload.pd.late_sends`); the producers and the request maps are shared
with that thread under one lock.

With layer sharing (``AscendMultiConnector``) a layer's physical buffer is
reused within the forward, so decode's reads hold the buffer's reuse-gate slot
(:meth:`PrefillWorker.attach_reuse_gate`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ascend_offload import device
from ascend_offload.config import ConfigError
from ascend_offload.connectors.remote_d2h.kv_region import KVRegion
from ascend_offload.connectors.remote_d2h.metadata import RemoteD2HMetadata
from ascend_offload.connectors.remote_d2h.settings import NAME, Settings
from ascend_offload.pd._loop import HANDOFF_S
from ascend_offload.pd.late_sends import LateSends
from ascend_offload.pd.prefill_requests import SendJob
from ascend_offload.pd.slot_sharing import ReadGate, SlotSharing
from ascend_offload.pd.topology import Topology, TopologyError
from ascend_offload.transfer.base import transfer_protocol

if TYPE_CHECKING:
    from ascend_offload.pd.producer import Producer, SlotRelease

log = logging.getLogger(__name__)


class PrefillWorker:
    """Prefill state of one rank: producers, this step's sends, requests in flight, the gate."""

    def __init__(self, settings: Settings, tp_rank: int, *, prepare: Callable[[], None]) -> None:
        self.settings = settings
        self.tp_rank = tp_rank
        # Applies the step's metadata (the connector's, once per step): a save listener may
        # run before any other hook of the step.
        self._prepare = prepare
        self._region: KVRegion | None = None
        self._layer_index: dict[str, int] = {}
        # Producers and the request maps below: also written by the claims' thread (late sends).
        self._lock = threading.Lock()
        self._producers: dict[int, Producer] = {}  # decode TP size -> producer
        self._step_sends: dict[int, list[str]] = {}  # decode TP size -> decode ids sent this step
        self._step_late: list[str] = []  # our ids of this step's late sends
        self._step_blocks: list[int] = []  # blocks of this step's sends (staged KV: copied out per layer)
        self._by_remote: dict[tuple[int, str], str] = {}  # (decode tp, decode id) -> our id
        self._own: dict[str, tuple[int, str]] = {}  # our id -> (decode tp, decode id)
        self._send_done: set[str] = set()
        self._seen_finished: set[str] = set()
        # Layer sharing on this prefill (AscendMultiConnector): decode reads hold the slot.
        self._gate: ReadGate | None = None
        self._gate_pipeline: SlotSharing | None = None
        self._gate_tokens: dict[str, tuple[int, dict[int, Any]]] = {}  # layer -> (slot, d_tp -> token)
        self.gate_holds = 0
        self.gate_hold_failures = 0
        self.withheld_layers = 0  # layers not published after a failed store load of their step
        cfg = settings.cfg
        self._late = LateSends(start=self._start_late, publish=self._publish_late,
                               transfer_protocol=transfer_protocol(cfg), claim_timeout_s=cfg.claim_timeout_s)

    def start(self, region: KVRegion, names: Sequence[str]) -> None:
        """Publish from ``region``; ``names`` in model order give the layer indices on the wire."""
        self._region = region
        self._layer_index = {n: i for i, n in enumerate(names)}

    def _producer(self, d_tp: int) -> Producer:
        """The producer for decode TP size ``d_tp``, built on first use (callers hold
        ``_lock``: the claims' thread may build one too)."""
        prod = self._producers.get(d_tp)
        if prod is None:
            from ascend_offload.pd.producer import Producer

            assert self._region is not None
            cfg = self.settings.cfg
            prod = Producer(engine_id=self.settings.engine_id, p_rank=self.tp_rank,
                            topology=Topology(self.settings.tp_size, d_tp), transfer=self._region.engine,
                            layers=self._region.layers, ack_timeout_s=cfg.ack_timeout_s,
                            request_timeout_s=cfg.request_timeout_s, register_memory=False,
                            keys=self.settings.keys, faults=cfg.debug.pd_faults,
                            listener=self._gate_listener() if self._gate is not None else None)
            self._producers[d_tp] = prod
        return prod

    # ------------------------------------------------------------------ layer sharing

    def attach_reuse_gate(self, pipeline: SlotSharing) -> None:
        """Layer sharing on this prefill: the physical slot of a layer is reused by a later
        layer within the same forward, so decode's reads of it must hold the slot.

        ``pipeline`` is the store connector's layerwise pipeline. In its ``save_layer``
        (before the slot is handed on) one gate consumer is registered per decode TP
        size this step sends to; the layer is published on that gate slot with the
        token as tag, and the producer releases the token when every read of it
        answered or the ack deadline passed (``gate_listener``). Called by
        ``AscendMultiConnector``; needs ``use_layerwise`` (publish per layer).
        """

        cfg = self.settings.cfg
        if not cfg.use_layerwise:
            raise ConfigError(f"{NAME}: key 'use_layerwise'=False with layer sharing on this prefill: the "
                              "slot of a layer is reused within the forward, so each layer must be "
                              "published as soon as it is written (accepted: True)")
        gate = pipeline.gate
        self._gate = gate
        self._gate_pipeline = pipeline
        # Our tokens are released by the ack deadline at the latest; a writer waiting for
        # the slot must not give up (and fail the forward) before that.
        gate.outwait(cfg.ack_timeout_s)
        for prod in self._producers.values():
            prod.listener = self._gate_listener()
        pipeline.add_save_listener(self._on_slot_saved)

    def _gate_listener(self) -> Callable[[SlotRelease], None]:
        """The producer's slot listener: release the gate token, counting failed holds."""
        from ascend_offload.pd.producer import gate_listener

        assert self._gate is not None
        release = gate_listener(self._gate)

        def on_release(r: SlotRelease) -> None:
            if r.tag is not None and not r.ok:
                self.gate_hold_failures += 1
            release(r)

        return on_release

    def _on_slot_saved(self, layer: str, gate_slot: int, generation: int) -> None:
        """Save listener (runs inside the pipeline's ``save_layer``): hold the slot for decode."""
        self._prepare()
        if not self._step_sends:
            return
        assert self._gate is not None and self._gate_pipeline is not None
        for name in self._gate_pipeline.members_of(layer):
            if name not in self._layer_index:
                # an indexer cache: it travels in its main layer's wire layer, whose token
                # holds the shared gate slot (a token of its own would never be released
                # before the end of the step, stalling the slot's next layer)
                continue
            tokens = {d_tp: self._gate.add_consumer(gate_slot, generation, f"rd2h d_tp={d_tp} {name}")
                      for d_tp in self._step_sends}
            self._gate_tokens[name] = (gate_slot, tokens)
            self.gate_holds += len(tokens)

    def _release_gate_tokens(self) -> None:
        """Tokens of layers that were never published (no save_kv_layer came): free the slots."""
        for held in self._gate_tokens.values():
            self._release(held)
        self._gate_tokens.clear()

    # ------------------------------------------------------------------ per step

    def apply(self, meta: RemoteD2HMetadata) -> None:
        """Hand this step's send jobs to the producers (before the first layer is saved), and
        start claiming the registrations of its late sends."""
        step: defaultdict[int, list[str]] = defaultdict(list)
        blocks: set[int] = set()
        for job in meta.send:
            if not self._add_send(job):
                with self._lock:
                    self._send_done.add(job.request_id)
                continue
            step[job.d_tp].append(job.remote_request_id)
            blocks.update(job.block_ids)
        late: list[str] = []
        for lj in meta.late_send:
            if self._gate is not None:  # the scheduler holds such requests with layer sharing
                log.error("%s: request %s computed before its decode registered, with layer sharing on "
                          "this prefill; not sent (decode recomputes)", NAME, lj.request_id)
                with self._lock:
                    self._send_done.add(lj.request_id)
                continue
            self._late.add(lj)
            late.append(lj.request_id)
            blocks.update(lj.block_ids)
        self._step_sends = dict(step)
        self._step_late = late
        self._step_blocks = sorted(blocks)

    def _add_send(self, job: SendJob) -> bool:
        """Announce ``job`` to its producer and map its ids; False (logged) if it cannot be served."""
        from ascend_offload.pd.producer import DecodeTarget

        key = (job.d_tp, job.remote_request_id)
        with self._lock:
            self._by_remote[key] = job.request_id
            self._own[job.request_id] = key
            try:
                self._producer(job.d_tp).add_request(
                    job.remote_request_id, job.block_ids, DecodeTarget(job.host, job.kv_port, job.d_tp, job.dp_rank))
            except (ValueError, TopologyError) as exc:
                log.error("%s: cannot send %s to decode: %s", NAME, job.request_id, exc)
                del self._by_remote[key], self._own[job.request_id]
                return False
        return True

    def _start_late(self, job: SendJob, layers: Sequence[int]) -> bool:
        """A late send's registration arrived (claims' thread): announce it, publish ``layers``."""
        if not self._add_send(job):
            return False
        for layer in layers:
            self._publish_late(job, layer)
        return True

    def _publish_late(self, job: SendJob, layer: int) -> None:
        self._producers[job.d_tp].publish_layer(layer, unique_slot=True, request_ids=[job.remote_request_id])

    def _publish(self, layer: int, name: str | None = None) -> None:
        failed = self._failed_requests(name)
        held = self._gate_tokens.pop(name, None) if name is not None else None
        if failed is None:  # published for no request: the slot is freed now
            self._release(held)
            return
        device.synchronize()  # the layer's KV must be in memory before decode may read it
        if self._region is not None:  # device KV behind a host-only engine: copy the blocks out
            self._region.stage_out(layer, self._step_blocks)
        if self._step_late:
            self._late.written(layer, self._step_late)
            if self._late.waiting:
                # The claims' thread may hold an answer, waiting for the GIL (and, pinned
                # with this thread, for the CPU): step aside so it publishes now, not at
                # the interpreter's switch interval.
                time.sleep(HANDOFF_S)
        if self._gate is not None and held is None:
            log.error("%s: layer %r has no reuse-gate token (store connector not saving it?); "
                      "published on a private slot", NAME, name)
        for d_tp, rids in self._step_sends.items():
            if failed:  # those requests' KV of this layer is wrong: decode never reads it
                rids = [r for r in rids if self._by_remote.get((d_tp, r)) not in failed]
                if not rids:
                    continue  # its gate token (if any) is released below
            if held is not None and d_tp in held[1]:
                self._producers[d_tp].publish_layer(layer, slot=held[0], tag=held[1].pop(d_tp),
                                                    request_ids=rids)
            else:
                self._producers[d_tp].publish_layer(layer, unique_slot=True, request_ids=rids)
        self._release(held)  # decode TP sizes with nothing to read of this layer

    def _release(self, held: tuple[int, dict[int, Any]] | None) -> None:
        """Release the gate tokens left in ``held`` (no read of them will be answered)."""
        if held is None:
            return
        assert self._gate is not None
        for tok in held[1].values():
            self._gate.release_consumer(tok, None)

    def _failed_requests(self, name: str | None) -> frozenset[str] | None:
        """The step's requests (vLLM ids) whose store load failed at ``name`` or before
        (layer sharing): their KV of it was computed over a buffer the load never filled.
        Decode never reads it: it gives such a request up at its deadline and recomputes,
        or reads it after the prefill's own recompute publishes it. None: every request.
        Counted and logged (once at warning) as a withheld layer."""
        pipe = self._gate_pipeline
        if pipe is None or name is None:
            return frozenset()
        failed = pipe.failed_requests_at_or_before(name)
        if failed is None or failed:
            self.withheld_layers += 1
            (log.warning if self.withheld_layers == 1 else log.debug)(
                "%s: layer %s not published for %s: a store load of this step failed before "
                "it (decode recomputes what it lacks)", NAME, name,
                "any request" if failed is None else f"{len(failed)} request(s)")
        return failed

    def save_kv_layer(self, layer_name: str) -> None:
        """Publish ``layer_name`` as soon as it is written (``use_layerwise``)."""
        if (self._step_sends or self._step_late) and self.settings.cfg.use_layerwise:
            idx = self._layer_index.get(layer_name)
            if idx is None:
                log.error("%s: unknown layer %r; not published", NAME, layer_name)
                return
            self._publish(idx, layer_name)

    def wait_for_save(self) -> None:
        """End of the forward: publish every layer now unless published per layer."""
        if (self._step_sends or self._step_late) and not self.settings.cfg.use_layerwise:
            assert self._region is not None
            for i in range(len(self._region.layers)):
                self._publish(i)
        if self._gate_tokens:
            self._release_gate_tokens()
        if self._step_late:
            self._late.end_step(self._step_late)
        self._step_sends = {}
        self._step_late = []
        self._step_blocks = []

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks may be freed: vLLM finished them *and* decode answered every
        published layer (or the ack deadline passed). A late send whose registration has not
        arrived yet is held until its claim ends."""
        failed = self._late.take_failed()
        # Asked before the maps: a late send leaves ``_late`` only after it is mapped.
        late = {rid for rid in finished_req_ids if rid in self._late}
        with self._lock:
            self._send_done |= failed
            mine = late | {rid for rid in finished_req_ids if rid in self._own or rid in self._send_done}
            self._seen_finished |= mine
            for rid in mine:
                key = self._own.get(rid)
                if key is not None:
                    self._producers[key[0]].abort_request(key[1])  # no-op unless layers were never published
            for d_tp, prod in self._producers.items():
                for o in prod.finished():
                    own = self._by_remote.pop((d_tp, o.request_id), None)
                    if own is None:
                        continue
                    self._own.pop(own, None)
                    self._send_done.add(own)
                    if not o.ok:
                        log.warning("%s: decode did not read layers %s of %s", NAME, o.failed_layers, own)
            ready = self._send_done & self._seen_finished
            self._send_done -= ready
            self._seen_finished -= ready
        return ready

    def totals(self) -> dict[str, int]:
        """Monotonic counters of this rank's publishing (connector metrics)."""
        out = {"layers_published": 0, "acks": 0, "acks_late": 0, "ack_timeouts": 0, "failed_answers": 0,
               "send_errors": 0, "rejected_messages": 0,
               "gate_holds": self.gate_holds, "gate_hold_failures": self.gate_hold_failures,
               "late_claims": self._late.claimed, "late_claim_failures": self._late.failures}
        for prod in list(self._producers.values()):
            st = prod.stats
            for key, value in (("layers_published", st.published_items), ("acks", st.acked),
                               ("acks_late", st.stale), ("ack_timeouts", st.timed_out),
                               ("failed_answers", st.failed), ("send_errors", st.send_errors),
                               ("rejected_messages", st.rejected)):
                out[key] += value
        return out

    def gauges(self) -> dict[str, int]:
        """Published slot uses still waiting for decode's answers or their deadline (0 when idle)."""
        return {"pending_slot_uses": sum(len(p.pending_slots()) for p in list(self._producers.values())),
                "late_sends_waiting": self._late.waiting}

    def close(self) -> None:
        self._late.close()
        for prod in list(self._producers.values()):
            prod.close()
