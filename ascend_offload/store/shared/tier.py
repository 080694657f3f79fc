"""The store connector's shared tier, whatever store holds it: block objects published
by every instance that points at the same service (a ``mooncake_master`` or a
Memcache meta service).

How it sits behind the connector (connectors/store/): the scheduler keeps its local
index and every worker rank its host pages, exactly as with the local backend; those
pages are also the only memory the store moves bytes from and to (registered once,
zero-copy). Two clients, both over a :class:`TierClient` (the backend-specific part,
store/shared/mooncake.py and store/shared/memcache.py):

* :class:`RemoteIndex` (scheduler process, no memory): the service is the index of
  the shared tier, so a prefix the local pages lack is looked up there; a block counts
  only when the object of every worker rank is present (each rank publishes its own
  shard).
* :class:`RemotePages` (each worker rank): publishes a block once all its layers are
  in a page (one buffer per layer row) and fetches a block into a page the scheduler
  reserved.

Object of one block on one rank: the block's rows of every layer, concatenated in
model layer order (``kv_layout.layer_order``), so whole-prefix and layerwise engines
of the same model and layout share objects, then a 16-byte trailer: the xxh3_64 of
the object's key (seeded with the trailer version) and the payload hash of the rows
(store/shared/integrity.py: every row's xxh3_64 folded in layer order); key
``<block key>@r<rank>``. A fetch verifies both before the block counts as arrived: an
object whose bytes are not its block's (a put that read pages reused under it, a
transfer gone wrong, an object of another format) is a miss, never an answer, and is
removed from the service where the client can (``TierClient.remove``).

What the check costs is one more read of every byte at publish and at fetch; where the
transfer itself runs at memory speed (Mooncake over TCP on one host copies with
memcpy) that read takes 0.4-0.7 of the transfer's time (docs/store.md, shared tier).
So where the process has a core to spare for it (``PIPELINE_MIN_CPUS``), a call moving
at least ``PIPELINE_MIN_BYTES`` is split in two transfers and the hash overlaps one of
them: a publish hashes a small first part (``1 / LEAD_PARTS`` of the objects), starts
its put and hashes the rest meanwhile; a fetch gets the large first part, then verifies it
while the small last part is fetched. The transfers run on one mover thread (the
library's call releases the GIL) and the hashing stays in the caller's thread: the
other way round, a hashing thread holding the GIL between rows delays the caller's
return from the library by up to the interpreter's switch interval (measured: a 2 ms
put took 3.4 ms beside such a thread). Each transfer is the client's own call, bounded
by its deadline; a part that failed, was not answered or is still in flight ends the
call (the next part is never sent), so at most one part outlives its deadline.

A put or get that outlives the client's deadline (``IN_FLIGHT``, Memcache) may still
read or write the rank's pages inside the library: nothing is copied to protect
them; the pages stay out of use until the call really ended. ``publish`` / ``fetch``
take a caller's token and :meth:`RemotePages.take_ended` returns it once such a call
ended (the connector holds the pages in the scheduler's index until then).

A service that stops answering is a miss, never an error: a call whose codes say the
service did not answer, and that failed fast, is made once more
(:meth:`ServiceHealth.call`: one lost RPC on a loaded host is not an outage, and an
outage would turn every lookup into a miss until the next probe; a call that blocked in
a reconnect is not retried); when the second try fails too, the client logs one warning
and marks the service down; while down nothing on the data path calls the service (a
call then blocks in the library's reconnect), and a background thread probes it every
``retry_interval_s``; its first answer logs that service resumed. Why a thread: the
probe's blocking call releases the GIL, the model thread never waits for it.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Protocol, TypeVar

import numpy as np
import torch
import xxhash

from ascend_offload import device as dev
from ascend_offload.kv_layout import layer_order
from ascend_offload.store.base import StoreError
from ascend_offload.store.shared.integrity import PageHasher

log = logging.getLogger(__name__)
_T = TypeVar("_T")

PROBE_KEY = "ascend-offload:probe"
RETRY_PAUSE_S = 0.05  # between a call the service did not answer and its one retry
# Only a call that failed faster than this is retried: a gone service makes a call
# block in the library's reconnect (~4.3 s for Mooncake), and retrying that would
# double the stall before the outage is declared.
RETRY_IF_FAILED_WITHIN_S = 1.0
#: A put / get whose call outlived its deadline: a transfer may still read / write the pages.
IN_FLIGHT = -(1 << 30)
#: bytes after an object's rows: xxh3_64 of its key (seeded with the version), payload hash
#: (store/shared/integrity.py)
TRAILER_BYTES = 16
TRAILER_VERSION = 2
#: a publish / fetch of at least these bytes overlaps its hash with its transfer (module
#: doc); below, the second library call and the hand-off to the mover thread cost about
#: what the overlap hides (a call's fixed cost on a loopback master: 0.1-0.2 ms)
PIPELINE_MIN_BYTES = 4 << 20
#: CPUs this process may run on from which a call overlaps at all: the hash needs a core
#: beside the transfer's (and the model thread's). Measured on a 2-vCPU VM busy with other
#: work: two threads of GIL-free copies took as long as one after the other, and the
#: two-part publish was 1.2-1.5 ms slower than the one-part one at 16 MiB per call.
PIPELINE_MIN_CPUS = 4
#: the part of a pipelined call whose hash is not hidden (the first put's, the last get's)
#: holds 1 / LEAD_PARTS of its objects: small, yet its transfer outlasts the hash of the rest
#: where the hash runs at about 3x the transfer's rate (loopback memcpy vs one-shot xxh3)
LEAD_PARTS = 4


def trailer_key(shard: str) -> int:
    """The key half of an object's trailer (a version change makes every old object a miss)."""
    return xxhash.xxh3_64_intdigest(shard.encode(), seed=TRAILER_VERSION)


class TierClient(Protocol):
    """What the shared tier needs of a store client; per-object codes, never raising
    for a service that is gone (an adapter turns that into an unreachable code)."""

    #: names the service in log lines ("Mooncake master 10.0.0.1:50051")
    service: str
    #: a put's code for an object the service holds already
    duplicate: int

    def exists(self, keys: Sequence[str]) -> list[int]:
        """1 present, 0 absent, negative: an error code."""

    def unreachable(self, code: int) -> bool:
        """The code says the service did not answer (an outage, not a per-object error)."""

    def put(self, keys: Sequence[str], ptrs: list[list[int]], lens: list[list[int]],
            on_late: Callable[[], None] | None = None) -> list[int]:
        """Object ``keys[i]`` from the concatenated spans ``ptrs[i]``/``lens[i]``: 0 stored;
        :data:`IN_FLIGHT` past the client's deadline (the spans may still be read), and then
        ``on_late`` is called once, from any thread, when that call really ended."""

    def get(self, keys: Sequence[str], ptrs: list[list[int]], lens: list[list[int]],
            on_late: Callable[[], None] | None = None) -> list[int]:
        """Object ``keys[i]`` into the spans: 0 arrived whole, negative an error code;
        :data:`IN_FLIGHT` and ``on_late`` as for :meth:`put` (the spans may still be written)."""

    def remove(self, keys: Sequence[str]) -> None:
        """Drop objects (a fetch found them corrupt); best effort, never raising."""

    def safe_failure(self, code: int) -> bool:
        """After a get failed with ``code`` no transfer can still write its pages."""

    def register(self, ptr: int, nbytes: int) -> int:
        """Register host memory the transfers read from / write into (0 ok)."""

    def unregister(self, ptr: int, nbytes: int) -> None: ...

    def close(self) -> None: ...


def shard_key(block_key: str, rank: int) -> str:
    """The object of ``block_key`` holding worker rank ``rank``'s shard."""
    return f"{block_key}@r{rank}"


class ServiceHealth:
    """Whether this client's service answers; one warning per outage, probed back by a
    daemon thread (see module doc)."""

    def __init__(self, client: TierClient, who: str, retry_interval_s: float) -> None:
        self._client = client
        self.who = who
        self.retry_interval_s = retry_interval_s
        self._lock = threading.Lock()
        self._down = False
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self.outages = 0
        self.retries = 0

    def up(self) -> bool:
        with self._lock:
            return not self._down

    def call(self, op: str, fn: Callable[[], list[int]]) -> tuple[list[int], bool]:
        """``fn()``'s codes and :meth:`check` of them. A call the service did not answer, but
        that failed fast, is made once more first (a lost RPC on a loaded host); one that
        blocked (a reconnect) or is still in flight (a transfer may use its pages) is not."""
        t0 = time.monotonic()
        codes = fn()
        if (any(self._client.unreachable(c) for c in codes) and IN_FLIGHT not in codes
                and time.monotonic() - t0 < RETRY_IF_FAILED_WITHIN_S
                and not self._stop.is_set()):
            self.retries += 1
            time.sleep(RETRY_PAUSE_S)
            codes = fn()
        return codes, self.check(op, codes)

    def check(self, op: str, codes: Sequence[int]) -> bool:
        """True when the service answered the call (per-object codes may be errors)."""
        bad = next((c for c in codes if self._client.unreachable(c)), None)
        if bad is None:
            return True
        with self._lock:
            if self._down or self._stop.is_set():
                return False
            self._down = True
            self.outages += 1
            self._prober = threading.Thread(target=self._probe, name="shared-tier-probe", daemon=True)
            self._prober.start()
        log.warning("%s unreachable from %s (%s returned %d): lookups miss and publishes are "
                    "skipped until it answers again", self._client.service, self.who, op, bad)
        return False

    def _probe(self) -> None:
        while not self._stop.wait(self.retry_interval_s):
            codes = self._client.exists([PROBE_KEY])
            if not any(self._client.unreachable(c) for c in codes):
                # logged before the flip: whoever sees the tier up sees the line too
                log.warning("%s answers %s again: store service resumed", self._client.service, self.who)
                with self._lock:
                    self._down = False
                return

    def close(self) -> None:
        """Stop probing; bounded (a probe in flight returns within the client's RPC timeout)."""
        self._stop.set()
        with self._lock:
            prober = self._prober
        if prober is not None:
            prober.join(timeout=15.0)


class RemoteIndex:
    """The scheduler's view of the shared tier: which leading blocks every rank published."""

    def __init__(self, client: TierClient, world_size: int, retry_interval_s: float) -> None:
        self.world_size = world_size
        self._client = client
        self.health = ServiceHealth(client, "the scheduler", retry_interval_s)
        self.lookups = 0
        self.hit_blocks = 0

    @property
    def service(self) -> str:
        return self._client.service

    def available(self) -> bool:
        return self.health.up()

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        """Leading ``keys`` whose shards of every rank the service has (0 while it is down)."""
        if not keys or not self.health.up():
            return 0
        w = self.world_size
        shards = [shard_key(k, r) for k in keys for r in range(w)]
        codes, answered = self.health.call("exists", lambda: list(self._client.exists(shards)))
        self.lookups += 1
        if len(codes) != len(shards) or not answered:
            return 0
        n = 0
        for i in range(len(keys)):
            if any(c != 1 for c in codes[i * w:(i + 1) * w]):
                break
            n += 1
        self.hit_blocks += n
        return n

    def counters(self) -> dict[str, int]:
        return {"remote_lookups": self.lookups, "remote_hit_blocks": self.hit_blocks,
                "remote_outages": self.health.outages, "remote_retries": self.health.retries}

    def close(self) -> None:
        self.health.close()
        self._client.close()


@dataclasses.dataclass
class TierCounts:
    """A worker rank's publish / fetch totals (monotonic)."""

    published_blocks: int = 0
    publish_duplicates: int = 0  # the service had the object already
    publish_skipped: int = 0  # no space, service down or refused
    fetched_blocks: int = 0
    fetch_failed_blocks: int = 0
    fetch_corrupt_blocks: int = 0  # arrived, but failed verification (a miss)
    late_calls: int = 0  # puts / gets that outlived the client's deadline (pages held)


def default_pipeline_min_bytes() -> float:
    """:data:`PIPELINE_MIN_BYTES` where this process has a core to spare for the hash
    (:data:`PIPELINE_MIN_CPUS`), else infinity: no call overlaps."""
    return PIPELINE_MIN_BYTES if len(os.sched_getaffinity(0)) >= PIPELINE_MIN_CPUS else math.inf


class _LateEnds:
    """The parts of one publish / fetch that outlived their deadline: the call's token
    goes to :meth:`RemotePages.take_ended` once every such part really ended, never
    before (the caller holds all the call's pages under that one token). A part's end
    may be reported before the call has seen its ``IN_FLIGHT`` (the client's deadline
    and the library's return race), hence the count on both sides."""

    def __init__(self, emit: Callable[[], None]) -> None:
        self._emit = emit
        self._lock = threading.Lock()
        self._ended = 0
        self._late: int | None = None  # parts answered IN_FLIGHT, known once the call settled
        self._done = False

    def part_ended(self) -> None:
        """``on_late`` of every part's client call (any thread)."""
        with self._lock:
            self._ended += 1
            ready = self._ready()
        if ready:
            self._emit()

    def settle(self, late_parts: int) -> None:
        """The call returned: ``late_parts`` of its parts answered ``IN_FLIGHT``."""
        with self._lock:
            self._late = late_parts
            ready = self._ready()
        if ready:
            self._emit()

    def _ready(self) -> bool:
        if self._done or not self._late or self._ended < self._late:
            return False
        self._done = True
        return True


class RemotePages:
    """A worker rank's client: moves whole blocks between its page planes and the service.

    ``planes``: layer name -> ``[num_pages, layer_block_bytes]`` host tensor (the rank's
    pages); they are registered with the client here (with a plane of per-page trailers)
    and must outlive this object. On a failed registration the client is closed and
    ``StoreError`` raised. ``pipeline_min_bytes``: calls moving at least this many bytes
    overlap their hash with their transfer (module doc; ``math.inf``: none does); None:
    :func:`default_pipeline_min_bytes`."""

    def __init__(self, client: TierClient, planes: Mapping[str, torch.Tensor], rank: int,
                 retry_interval_s: float, *, pipeline_min_bytes: float | None = None) -> None:
        self._client = client
        self._registered: list[tuple[int, int]] = []
        self._mover: cf.ThreadPoolExecutor | None = None
        self.health = ServiceHealth(client, f"worker rank {rank}", retry_interval_s)
        if not planes:
            self.close()
            raise StoreError("RemotePages needs at least one page plane")
        self.rank = rank
        self.pipeline_min_bytes = (default_pipeline_min_bytes() if pipeline_min_bytes is None
                                   else pipeline_min_bytes)
        self._planes = [planes[name] for name in layer_order(planes)]
        for p in self._planes:
            if p.dim() != 2 or not p.is_contiguous() or not dev.is_host(p):
                self.close()
                raise StoreError("page planes must be contiguous 2-D host tensors")
        self._rows = [p.shape[1] * p.element_size() for p in self._planes]
        self.object_bytes = sum(self._rows)
        self._hasher = PageHasher([p.view(torch.uint8).numpy() for p in self._planes])  # rows as bytes, no copy
        # one trailer per page (key hash, payload hash): the last span of every object
        self._trailers = torch.zeros((self._planes[0].shape[0], TRAILER_BYTES), dtype=torch.uint8)
        self._trailer_words = self._trailers.numpy().view(np.uint64)
        # a page's spans: base address of every plane (and the trailers) + page * its row
        self._bases = np.array([p.data_ptr() for p in (*self._planes, self._trailers)], dtype=np.int64)
        self._strides = np.array([*self._rows, TRAILER_BYTES], dtype=np.int64)
        self._lens = [*self._rows, TRAILER_BYTES]
        for p in (*self._planes, self._trailers):
            nbytes = p.numel() * p.element_size()
            rc = client.register(p.data_ptr(), nbytes)
            if rc != 0:
                self.close()
                raise StoreError(f"{client.service}: registering a {nbytes}-byte page plane failed ({rc})")
            self._registered.append((p.data_ptr(), nbytes))
        self.counts = TierCounts()
        self._ended_lock = threading.Lock()
        self._ended: list[Hashable] = []  # tokens of late calls that ended (any thread)

    @property
    def service(self) -> str:
        return self._client.service

    def _spans(self, pages: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        """Every page's spans (its row of each plane, then its trailer); the length lists
        are one shared list (clients only read them)."""
        ptrs: list[list[int]] = (self._bases + pages[:, None] * self._strides).tolist()
        return ptrs, [self._lens] * len(pages)

    def _trailer_hashes(self, shards: Sequence[str], pages: np.ndarray) -> np.ndarray:
        """``[n, 2]`` uint64: the trailer every object should carry (key hash, payload
        hash of the page's rows as they are now)."""
        out = np.empty((len(pages), 2), dtype=np.uint64)
        out[:, 0] = np.fromiter(map(trailer_key, shards), dtype=np.uint64, count=len(shards))
        out[:, 1] = self._hasher.payload_hashes(pages)
        return out

    def _parts(self, n: int, *, lead_first: bool) -> list[tuple[int, int]]:
        """``[lo, hi)`` object ranges of a call's transfers: one, or two where the call is
        large enough to overlap its hash (the small part first for a publish, last for a
        fetch: the part whose hash nothing hides)."""
        if n < 2 or n * (self.object_bytes + TRAILER_BYTES) < self.pipeline_min_bytes:
            return [(0, n)]
        lead = max(1, n // LEAD_PARTS)
        cut = lead if lead_first else n - lead
        return [(0, cut), (cut, n)]

    def _launch(self, fn: Callable[[], _T], overlap: bool) -> cf.Future[_T]:
        """``fn()`` (a transfer) on the mover thread when the caller overlaps it with a
        hash, else here (a one-part call pays no thread hand-off)."""
        if overlap:
            if self._mover is None:
                self._mover = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shared-tier-mover")
            return self._mover.submit(fn)
        fut: cf.Future[_T] = cf.Future()
        try:
            fut.set_result(fn())
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    def _late(self, token: Hashable) -> Callable[[], None]:
        def ended() -> None:
            with self._ended_lock:
                self._ended.append(token)
        return ended

    def take_ended(self) -> list[Hashable]:
        """Tokens of puts / gets that outlived their deadline and have ended since the last
        call: the pages they named are free to reuse now."""
        with self._ended_lock:
            out, self._ended = self._ended, []
        return out

    def publish(self, keys: Sequence[str], pages: Sequence[int], token: Hashable = None) -> bool:
        """Put block ``keys[i]`` from page ``pages[i]`` (all layers written). A refused put is
        a skipped publish, never an error. False: a put outlived its deadline and may still
        read the pages; they must not be reused until :meth:`take_ended` returns ``token``.
        A large call is two puts, the second part hashed while the first is put."""
        if not keys:
            return True
        c = self.counts
        if not self.health.up():
            c.publish_skipped += len(keys)
            return True
        shards = [shard_key(k, self.rank) for k in keys]
        idx = np.asarray(pages, dtype=np.int64)
        parts = self._parts(len(keys), lead_first=True)
        ends = _LateEnds(self._late(token))
        late_parts = answered = 0
        # a put in flight and its range
        pending: tuple[cf.Future[tuple[list[int], bool]], int, int] | None = None

        def put(lo: int, hi: int) -> tuple[list[int], bool]:
            """The part's codes and whether the service answered them."""
            ptrs, lens = self._spans(idx[lo:hi])
            part = shards[lo:hi]
            return self.health.call(
                "put", lambda: list(self._client.put(part, ptrs, lens, on_late=ends.part_ended)))

        def settle(fut: cf.Future[tuple[list[int], bool]], lo: int, hi: int) -> bool:
            """Count a put's codes; True when the call goes on to its next part."""
            nonlocal late_parts, answered
            codes, reached = fut.result()
            answered += hi - lo
            late = IN_FLIGHT in codes
            if late:
                late_parts += 1
                c.late_calls += 1
                log.warning("%s: a put of %d blocks outlived its deadline on worker rank %d; their pages "
                            "stay out of use until it ends", self._client.service, hi - lo, self.rank)
            if len(codes) != hi - lo:
                c.publish_skipped += hi - lo
                return False
            for code in codes:
                if code == 0:
                    c.published_blocks += 1
                elif code == self._client.duplicate:
                    c.publish_duplicates += 1
                else:
                    c.publish_skipped += 1
            return not late and reached

        try:
            for lo, hi in parts:
                # this part's hash: overlaps the previous part's put
                self._trailer_words[idx[lo:hi]] = self._trailer_hashes(shards[lo:hi], idx[lo:hi])
                if pending is not None:
                    prev, pending = pending, None
                    if not settle(*prev):
                        break
                pending = (self._launch(functools.partial(put, lo, hi), len(parts) > 1), lo, hi)
            if pending is not None:
                prev, pending = pending, None
                settle(*prev)
        finally:
            if pending is not None:  # the hash raised: the put in flight still reads the pages
                cf.wait([pending[0]])
            ends.settle(late_parts)
        c.publish_skipped += len(keys) - answered  # parts never sent
        return not late_parts

    def fetch(self, keys: Sequence[str], pages: Sequence[int], token: Hashable = None) -> tuple[bool, bool]:
        """Get block ``keys[i]`` into page ``pages[i]``: ``(ok, reusable)``. ``ok`` only
        when every block arrived whole and verified; ``reusable`` False when a transfer may
        still be writing the pages (they must not be handed out again; if it is a get past
        its deadline, :meth:`take_ended` returns ``token`` once it ended). A large call is
        two gets, the first part verified while the second is fetched; a part that did not
        arrive whole ends the call (the rest is not fetched: a miss either way)."""
        if not keys:
            return True, True
        c = self.counts
        if not self.health.up():
            c.fetch_failed_blocks += len(keys)
            return False, True
        shards = [shard_key(k, self.rank) for k in keys]
        idx = np.asarray(pages, dtype=np.int64)
        parts = self._parts(len(keys), lead_first=False)
        overlap = len(parts) > 1
        ends = _LateEnds(self._late(token))
        ok = reusable = True
        late_parts = done = 0

        def get(lo: int, hi: int) -> cf.Future[list[int]]:
            ptrs, lens = self._spans(idx[lo:hi])
            part = shards[lo:hi]
            return self._launch(lambda: list(self._client.get(part, ptrs, lens, on_late=ends.part_ended)),
                                overlap)

        pending: cf.Future[list[int]] | None = get(*parts[0])
        try:
            for k, (lo, hi) in enumerate(parts):
                fut, pending = pending, None
                assert fut is not None
                n = hi - lo
                done += n  # counted below, whatever the part's fate
                try:
                    got = fut.result()
                except Exception:  # unknown whether a transfer still runs: the pages stay out of use
                    log.exception("%s: get raised on worker rank %d", self._client.service, self.rank)
                    c.fetch_failed_blocks += n
                    ok = reusable = False
                    break
                self.health.check("get", got)
                if IN_FLIGHT in got:
                    late_parts += 1
                    c.late_calls += 1
                if len(got) != n:
                    log.warning("%s: get answered %d codes for %d blocks on worker rank %d; its pages are "
                                "not reused", self._client.service, len(got), n, self.rank)
                    c.fetch_failed_blocks += n
                    ok = reusable = False
                    break
                bad = [g for g in got if g != 0]
                unsafe = [g for g in bad if not self._client.safe_failure(g)]
                if unsafe:
                    log.warning("%s: get failed with %d on worker rank %d; %d pages are not reused",
                                self._client.service, unsafe[0], self.rank, n)
                    reusable = False
                if bad:
                    c.fetched_blocks += n - len(bad)
                    c.fetch_failed_blocks += len(bad)
                    ok = False
                    break
                if k + 1 < len(parts):
                    pending = get(*parts[k + 1])  # fetched while this part is verified
                corrupt = self._corrupt(shards[lo:hi], idx[lo:hi])
                c.fetched_blocks += n - len(corrupt)
                c.fetch_failed_blocks += len(corrupt)
                ok = ok and not corrupt
        finally:
            if pending is not None:  # verification raised: the get in flight still writes pages
                cf.wait([pending])
            ends.settle(late_parts)
        c.fetch_failed_blocks += len(keys) - done  # parts never fetched
        return ok, reusable

    def _corrupt(self, shards: Sequence[str], pages: np.ndarray) -> list[str]:
        """The fetched objects whose trailer does not match their key and rows (misses;
        removed from the service so no engine keeps fetching them)."""
        wrong = (self._trailer_words[pages] != self._trailer_hashes(shards, pages)).any(axis=1)
        bad = [shards[i] for i in np.flatnonzero(wrong)]
        if bad:
            self.counts.fetch_corrupt_blocks += len(bad)
            log.warning("%s: %d fetched objects failed verification on worker rank %d (first %s); "
                        "a miss, recomputed; removed from the service", self._client.service,
                        len(bad), self.rank, bad[0])
            try:
                self._client.remove(bad)
            except Exception:
                log.exception("%s: removing corrupt objects failed", self._client.service)
        return bad

    def close(self) -> None:
        self.health.close()
        if self._mover is not None:  # idle: every call waits for its transfers
            self._mover.shutdown(wait=False)
            self._mover = None
        for ptr, nbytes in self._registered:
            self._client.unregister(ptr, nbytes)
        self._registered = []
        self._client.close()
