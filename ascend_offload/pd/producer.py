"""Prefill side of the P/D pull: publish layer readiness, collect acks per slot use.

After each layer's KV is in place the engine calls :meth:`Producer.publish_layer`;
the producer sends one ``read_ready_batch`` to every decode rank that needs
that layer and starts a deadline for the physical slot's current use. The
slot's use ends when every decode rank answered (``read_done`` /
``read_failed``) or the deadline passed — whichever first — and the listener
(the layerwise reuse gate) hears about it exactly once. Each use carries a
fresh generation id, so an answer arriving after the deadline is counted as
*stale* and never mistaken for a read of the slot's new contents. A decode
that never answers therefore costs one deadline, never a hung prefill.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import zmq

from ascend_offload.config import Fault, parse_faults
from ascend_offload.errors import AscendOffloadError
from ascend_offload.pd import protocol as P
from ascend_offload.pd._loop import IoLoop
from ascend_offload.pd.auth import ControlKeys, secure_client
from ascend_offload.pd.layout import block_capacity, extents, out_of_range
from ascend_offload.pd.slot_sharing import ReadGate
from ascend_offload.pd.topology import Topology, decode_port
from ascend_offload.transfer.base import TransferEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeTarget:
    """Where a request's KV is pulled from us: the decode instance's ZMQ base port and TP."""

    host: str
    kv_port: int
    d_tp: int
    dp_rank: int = 0


@dataclass(frozen=True)
class SlotRelease:
    """One use of a physical slot ended: every reader answered or the deadline passed."""

    slot: int
    generation: int
    layer: int
    ok: bool
    # (request_id, failure code) for each read that did not complete.
    failures: tuple[tuple[str, str], ...] = ()
    # Whatever the caller passed to publish_layer (e.g. the reuse gate's consumer token).
    tag: object = None


@dataclass(frozen=True)
class SendOutcome:
    """A request whose every layer reached a terminal state on its decode rank."""

    request_id: str
    ok: bool
    failed_layers: tuple[int, ...] = ()


SlotListener = Callable[[SlotRelease], None]


@dataclass
class ProducerStats:
    published_items: int = 0
    acked: int = 0
    failed: int = 0
    timed_out: int = 0
    stale: int = 0
    rejected: int = 0
    send_errors: int = 0
    sockets_closed: int = 0


@dataclass
class _Request:
    request_id: str
    src_blocks: list[int]
    target: DecodeTarget
    num_layers: int
    d_rank: int
    endpoint: tuple[str, int]
    deadline: float = float("inf")
    terminal: dict[int, bool] = field(default_factory=dict)  # layer -> ok
    published: set[int] = field(default_factory=set)
    fault: Fault | None = None


@dataclass
class _SlotUse:
    slot: int
    generation: int
    layer: int
    deadline: float
    pending: set[str]
    failures: list[tuple[str, str]] = field(default_factory=list)
    tag: object = None


class Producer:
    """One prefill TP rank's publisher. Thread-safe; sockets live on its I/O thread."""

    def __init__(
        self,
        *,
        engine_id: str,
        p_rank: int,
        topology: Topology,
        transfer: TransferEngine,
        layers: Sequence[P.LayerDesc],
        ack_timeout_s: float = 30.0,
        listener: SlotListener | None = None,
        request_timeout_s: float | None = None,
        faults: str | None = None,
        register_memory: bool = True,
        keys: ControlKeys | None = None,
        idle_socket_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``keys``: authenticate to decodes that require the shared secret (:mod:`~ascend_offload.pd.auth`).
        ``idle_socket_s``: a decode endpoint no request uses for this long loses its socket."""
        if ack_timeout_s <= 0:
            raise ValueError(f"ack_timeout_s={ack_timeout_s}: must be > 0")
        topology.member_of(p_rank)  # validates p_rank
        self.engine_id = engine_id
        self.p_rank = p_rank
        self.topology = topology
        self.transfer = transfer
        self.layers = list(layers)
        self.ack_timeout_s = ack_timeout_s
        self.listener = listener
        # Layers never published (prefill failed mid-request) must not pin the request forever.
        self.request_timeout_s = request_timeout_s
        # Fault injection for tests (the connector's ``debug.pd_faults``, parsed by
        # config.parse_faults); requests take the specs round-robin.
        self._faults = parse_faults(faults) if faults else []
        self._fault_seq = 0
        self.stats = ProducerStats()
        self._clock = clock
        self._registered: list[int] = []
        if register_memory:
            for addr, length in extents(self.layers):
                transfer.register(addr, length)
                self._registered.append(addr)
        self._meta = P.encode(P.MfMeta(
            version=P.PROTOCOL_VERSION, engine_id=engine_id, p_rank=p_rank, p_tp=topology.p_tp,
            endpoint=transfer.endpoint, layers=self.layers,
        ))
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._gen: dict[int, int] = defaultdict(int)
        self._uses: dict[int, _SlotUse] = {}  # slot -> current (pending) use
        self._unique_slots = itertools.count(1 << 40)  # far above any physical slot index
        # (endpoint, message, (request_id, slot, generation) of each item in it)
        self._outbox: list[tuple[tuple[str, int], bytes, list[tuple[str, int, int]]]] = []
        self._finished: list[SendOutcome] = []
        self._releases: list[SlotRelease] = []
        self._need_meta: set[tuple[str, int]] = set()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._socks: dict[tuple[str, int], zmq.Socket] = {}
        self._sock_ep: dict[zmq.Socket, tuple[str, int]] = {}
        self._sock_used: dict[tuple[str, int], float] = {}
        self._keys = keys
        self.idle_socket_s = idle_socket_s
        self._loop = IoLoop(f"pd-producer-{p_rank}", self._tick, self._next_wait)
        self._loop.start()

    # ------------------------------------------------------------ caller API

    def add_request(self, request_id: str, src_blocks: Sequence[int], target: DecodeTarget,
                    num_layers: int | None = None) -> None:
        """Announce a request whose layers will be published; validates the decode topology."""
        if target.d_tp != self.topology.d_tp:
            raise ValueError(
                f"request {request_id!r}: decode tp={target.d_tp} but this producer was built for "
                f"prefill tp={self.topology.p_tp}, decode tp={self.topology.d_tp}"
            )
        n = len(self.layers) if num_layers is None else num_layers
        if not 0 < n <= len(self.layers):
            raise ValueError(f"request {request_id!r}: num_layers={n} outside 1..{len(self.layers)}")
        d_rank = self.topology.d_rank_of(self.p_rank)
        port = decode_port(target.kv_port, dp_rank=target.dp_rank, d_tp=target.d_tp, tp_rank=d_rank)
        blocks = [int(b) for b in src_blocks]
        cap = block_capacity(self.layers[:n])
        bad = out_of_range(blocks, cap)
        if bad:
            raise ValueError(f"request {request_id!r}: source blocks {bad[:8]} outside 0..{cap - 1}")
        if not request_id or len(request_id) > P.MAX_NAME:
            # Decode would reject the whole batch carrying it, failing other requests with it.
            raise ValueError(f"request id of {len(request_id)} characters (accepted: 1..{P.MAX_NAME})")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} already added")
            deadline = (self._clock() + self.request_timeout_s) if self.request_timeout_s else float("inf")
            fault = None
            if self._faults:
                fault, turn = _pick_fault(self._faults, self._fault_seq, len(blocks))
                self._fault_seq += int(turn)
            self._requests[request_id] = _Request(request_id, blocks, target, n, d_rank, (target.host, port),
                                                  deadline, fault=fault)

    def publish_layer(self, layer: int, *, slot: int | None = None,
                      request_ids: Iterable[str] | None = None, tag: object = None,
                      unique_slot: bool = False) -> int:
        """Layer ``layer`` is written for these requests (default: all that need it).

        ``slot`` is the physical buffer holding it (default: the layer index,
        i.e. no sharing); ``tag`` comes back in the :class:`SlotRelease`.
        ``unique_slot`` names a one-off slot instead (buffers owned per request,
        as in plain vLLM paging: nothing is reused until the request is freed),
        so concurrent publishes of one layer never fence each other and no
        per-slot state outlives the use. Returns the slot-use generation. If
        nothing reads it, the slot is released at once (the listener runs
        before this returns).
        """
        if unique_slot:
            slot = next(self._unique_slots)
        slot = layer if slot is None else slot
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"layer={layer} outside 0..{len(self.layers) - 1}")
        with self._lock:
            prev = self._uses.pop(slot, None)
            if prev is not None:
                # The gate should have prevented this; fence the old use loudly.
                log.error("slot %d reused (layer %d) while generation %d still had %d readers; "
                          "failing them", slot, layer, prev.generation, len(prev.pending))
                self._expire(prev, "superseded")
            if unique_slot:
                gen = 1  # one use only: a late answer finds no pending use and counts as stale
            else:
                self._gen[slot] += 1
                gen = self._gen[slot]
            ids = list(self._requests) if request_ids is None else list(request_ids)
            per_ep: dict[tuple[str, int], list[P.ReadReady]] = defaultdict(list)
            pending: set[str] = set()
            first = False  # some request's first layer: its decode is idle until this arrives
            for rid in ids:
                req = self._requests.get(rid)
                if req is None or layer >= req.num_layers or layer in req.terminal:
                    continue
                lo, hi = self.topology.index_range(self.p_rank, len(req.src_blocks))
                main = self.topology.sends_main(self.p_rank)
                pending.add(rid)
                first = first or not req.published
                req.published.add(layer)
                if req.fault is not None and req.fault[1] == layer:
                    log.warning("fault injection: %s layer %d of request %r", req.fault[0], layer, rid)
                    if req.fault[0] == "drop":
                        continue
                    main = not main  # "invalid": decode must reject it
                per_ep[req.endpoint].append(P.ReadReady(
                    request_id=rid, layer=layer, slot=slot, generation=gen, src_blocks=req.src_blocks,
                    main=main, index_lo=lo, index_hi=hi,
                ))
            use = _SlotUse(slot, gen, layer, self._clock() + self.ack_timeout_s, pending, tag=tag)
            budget_ms = max(1, int(self.ack_timeout_s * 500))  # half: see ReadReadyBatch
            for ep, items in per_ep.items():
                msg = P.ReadReadyBatch(version=P.PROTOCOL_VERSION, engine_id=self.engine_id,
                                       p_rank=self.p_rank, read_budget_ms=budget_ms, items=items)
                self._outbox.append((ep, P.encode(msg), [(it.request_id, slot, gen) for it in items]))
                self.stats.published_items += len(items)
            if pending:
                self._uses[slot] = use
            else:
                self._release(use)
        # A request's first layer goes out now, not after the caller's next blocking call:
        # its decode has nothing to read until then (later layers queue behind a read).
        self._loop.wake(hand_off=first and bool(per_ep))
        self._deliver()
        return gen

    def abort_request(self, request_id: str) -> None:
        """Layers not yet published never will be (prefill aborted): they fail now.

        Published layers keep waiting for their answers (or deadline): decode
        may still be reading those blocks, so the request finishes only then.
        """
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                return
            for layer in range(req.num_layers):
                if layer not in req.published:
                    req.terminal.setdefault(layer, False)
            self._maybe_finish(req)
        self._deliver()

    def finished(self) -> list[SendOutcome]:
        """Drain requests that reached a terminal state on every layer."""
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def sockets(self) -> list[tuple[str, int]]:
        """Decode endpoints with an open socket (bounded: failed and idle ones are closed)."""
        with self._lock:
            return sorted(self._socks)

    def pending_slots(self) -> dict[int, int]:
        """slot -> generation still waiting for readers."""
        with self._lock:
            return {s: u.generation for s, u in self._uses.items()}

    def close(self) -> None:
        self._loop.stop()
        for s in self._socks.values():
            s.close(linger=0)
        self._socks.clear()
        for addr in self._registered:
            try:
                self.transfer.unregister(addr)
            except Exception:  # closing: nothing left to protect
                log.debug("unregister %#x failed", addr, exc_info=True)
        self._registered.clear()

    # ------------------------------------------------------------ state (under lock)

    def _release(self, use: _SlotUse) -> None:
        self._releases.append(SlotRelease(use.slot, use.generation, use.layer, not use.failures,
                                          tuple(use.failures), use.tag))

    def _expire(self, use: _SlotUse, code: str) -> None:
        for rid in sorted(use.pending):
            use.failures.append((rid, code))
            self._mark(rid, use.layer, False)
        if code == "timeout":
            self.stats.timed_out += len(use.pending)
        use.pending.clear()
        self._release(use)

    def _mark(self, rid: str, layer: int, ok: bool) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        req.terminal[layer] = req.terminal.get(layer, True) and ok
        self._maybe_finish(req)

    def _maybe_finish(self, req: _Request) -> None:
        if len(req.terminal) >= req.num_layers and req.request_id in self._requests:
            del self._requests[req.request_id]
            failed = tuple(sorted(layer for layer, ok in req.terminal.items() if not ok))
            self._finished.append(SendOutcome(req.request_id, not failed, failed))

    def _on_answer(self, msg: P.ReadDone | P.ReadFailed, ep: tuple[str, int]) -> None:
        if msg.p_rank != self.p_rank:
            self.stats.rejected += 1
            log.warning("answer for prefill rank %d arrived at rank %d; dropped", msg.p_rank, self.p_rank)
            return
        use = self._uses.get(msg.slot)
        if use is None or use.generation != msg.generation or msg.request_id not in use.pending:
            self.stats.stale += 1
            log.warning("stale %s for request %r layer %d slot %d generation %d (current %s); ignored",
                        type(msg).__name__, msg.request_id, msg.layer, msg.slot, msg.generation,
                        use.generation if use else "none")
            return
        use.pending.discard(msg.request_id)
        ok = isinstance(msg, P.ReadDone)
        if isinstance(msg, P.ReadDone):
            self.stats.acked += 1
        else:
            self.stats.failed += 1
            use.failures.append((msg.request_id, msg.code))
            log.warning("decode rank %d failed to read request %r layer %d: %s %s",
                        msg.d_rank, msg.request_id, msg.layer, msg.code, msg.reason)
            if msg.code == P.FAIL_NO_META:
                self._need_meta.add(ep)
        self._mark(msg.request_id, msg.layer, ok)
        if not use.pending:
            del self._uses[msg.slot]
            self._release(use)

    def _send_failed(self, items: list[tuple[str, int, int]], code: str) -> None:
        """Items that never left: they fail now instead of waiting for the ack deadline."""
        for rid, slot, gen in items:
            use = self._uses.get(slot)
            if use is None or use.generation != gen or rid not in use.pending:
                continue
            use.pending.discard(rid)
            use.failures.append((rid, code))
            self._mark(rid, use.layer, False)
            if not use.pending:
                del self._uses[slot]
                self._release(use)

    def _deliver(self) -> None:
        """Run listener callbacks outside the lock (the gate may call back into us)."""
        with self._lock:
            rel, self._releases = self._releases, []
        if self.listener is not None:
            for r in rel:
                try:
                    self.listener(r)
                except Exception:
                    log.exception("slot listener failed for slot %d generation %d", r.slot, r.generation)

    # ------------------------------------------------------------ I/O thread

    def _next_wait(self) -> float:
        with self._lock:
            ds = [u.deadline for u in self._uses.values()]
            ds += [r.deadline for r in self._requests.values() if r.deadline != float("inf")]
        return max(0.0, min(ds) - self._clock()) if ds else 0.2

    def _sock(self, ep: tuple[str, int]) -> zmq.Socket:
        """The socket to decode endpoint ``ep``, connected on first use (raises ``zmq.ZMQError``)."""
        s = self._socks.get(ep)
        if s is None:
            s = self._ctx.socket(zmq.DEALER)
            try:
                # A fresh, unguessable identity per connection: decode's ROUTER drops a
                # connection whose identity it still holds (no handover without keys), so a
                # reconnect right after an idle close would otherwise be silently refused.
                s.setsockopt(zmq.IDENTITY, f"{self.engine_id}/{self.p_rank}/{secrets.token_hex(8)}".encode())
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 10000)
                s.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # answers are small; a bigger one is not decode's
                secure_client(s, self._keys)
                host = f"[{ep[0]}]" if ":" in ep[0] else ep[0]
                s.connect(f"tcp://{host}:{ep[1]}")
            except zmq.ZMQError:
                s.close(linger=0)
                raise
            with self._lock:
                self._socks[ep] = s
                self._need_meta.add(ep)
            self._sock_ep[s] = ep
            self._loop.add(s)
        return s

    def _drop_sock(self, ep: tuple[str, int]) -> None:
        """Close and forget the socket to ``ep`` (a later send reconnects and resends mf_meta)."""
        with self._lock:
            s = self._socks.pop(ep, None)
            self._need_meta.discard(ep)
            self._sock_used.pop(ep, None)
        if s is not None:
            self._loop.remove(s)
            self._sock_ep.pop(s, None)
            s.close(linger=0)
            self.stats.sockets_closed += 1

    def _send_out(self, outbox: list[tuple[tuple[str, int], bytes, list[tuple[str, int, int]]]]) -> None:
        """Send each message; a failing endpoint loses only its own messages."""
        broken: set[tuple[str, int]] = set()
        for ep, data, items in outbox:
            code = "send_error"
            try:
                if ep in broken:
                    raise zmq.ZMQError(msg="endpoint failed earlier in this pass")
                s = self._sock(ep)
                if ep in self._need_meta:
                    s.send(self._meta, zmq.NOBLOCK)
                    with self._lock:
                        self._need_meta.discard(ep)
                s.send(data, zmq.NOBLOCK)
                self._sock_used[ep] = self._clock()
                continue
            except zmq.Again:
                code = "queue_full"  # decode is not draining
                log.error("send queue to decode %s:%d full; %d readiness items failed", ep[0], ep[1], len(items))
            except zmq.ZMQError as exc:
                if ep not in broken:
                    log.error("decode %s:%d unreachable (%s); %d readiness items failed, socket closed",
                              ep[0], ep[1], exc, len(items))
                broken.add(ep)
                self._drop_sock(ep)
            with self._lock:
                self.stats.send_errors += 1
                self._send_failed(items, code)

    def _prune_idle(self, now: float) -> None:
        """Close sockets to endpoints no live request uses and that sent nothing for a while."""
        with self._lock:
            live = {r.endpoint for r in self._requests.values()}
            idle = [ep for ep in self._socks if ep not in live
                    and now - self._sock_used.get(ep, now) >= self.idle_socket_s]
        for ep in idle:
            self._drop_sock(ep)

    def _tick(self, ready: list[zmq.Socket]) -> None:
        with self._lock:
            outbox, self._outbox = self._outbox, []
        self._send_out(outbox)
        for s in ready:
            if s not in self._sock_ep:
                continue  # closed in this pass
            while True:
                try:
                    data = s.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = P.decode(data, expect=P.TO_PREFILL)
                except P.ProtocolError as exc:
                    with self._lock:
                        self.stats.rejected += 1
                    log.warning("rejected message from decode %s: %s", self._sock_ep.get(s), exc)
                    continue
                with self._lock:
                    self._on_answer(msg, self._sock_ep[s])  # type: ignore[arg-type]
        now = self._clock()
        self._prune_idle(now)
        with self._lock:
            for slot, use in list(self._uses.items()):
                if use.deadline <= now:
                    del self._uses[slot]
                    log.error("slot %d generation %d (layer %d): %d decode reads unanswered after %.1fs",
                              slot, use.generation, use.layer, len(use.pending), self.ack_timeout_s)
                    self._expire(use, "timeout")
            for req in list(self._requests.values()):
                if req.deadline <= now:
                    # Published layers stay bounded by their ack deadline (decode may be reading).
                    missing = [layer for layer in range(req.num_layers)
                               if layer not in req.terminal and layer not in req.published]
                    if missing:
                        log.error("request %r: layers %s never published within %.1fs; failing them",
                                  req.request_id, missing, self.request_timeout_s)
                    for layer in missing:
                        req.terminal[layer] = False
                    req.deadline = float("inf")
                    self._maybe_finish(req)
        self._deliver()


def _pick_fault(faults: list[Fault | None], seq: int, num_blocks: int) -> tuple[Fault | None, bool]:
    """The fault for a new request, and whether it consumed a round-robin turn."""
    for f in faults:
        if f is not None and f[2] == num_blocks:
            return f, False
    rr = [f for f in faults if f is None or f[2] is None]
    return (rr[seq % len(rr)], True) if rr else (None, False)


def stats_dict(stats: ProducerStats) -> dict[str, int]:
    return dataclasses.asdict(stats)


class ReadFailedError(AscendOffloadError, RuntimeError):
    """Decode did not (provably) read a slot's contents; carried to the reuse gate."""


def gate_listener(gate: ReadGate) -> SlotListener:
    """Listener that releases the layerwise reuse gate's consumer token passed as ``tag``.

    Usage: ``tok = gate.add_consumer(slot, gen, "rd2h")`` after the layer's
    write, then ``producer.publish_layer(layer, slot=slot, tag=tok)``. The slot
    reopens once every decode read answered or the ack deadline passed.
    """

    def on_release(r: SlotRelease) -> None:
        if r.tag is None:
            return
        err = None if r.ok else ReadFailedError(
            f"slot {r.slot} layer {r.layer}: " + ", ".join(f"{rid}: {code}" for rid, code in r.failures))
        gate.release_consumer(r.tag, error=err)

    return on_release
