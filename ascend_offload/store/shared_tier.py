"""The store connector's shared tier, whatever store holds it: block objects published
by every instance that points at the same service (a ``mooncake_master`` or a
Memcache meta service).

How it sits behind the connector (connectors/store/): the scheduler keeps its local
index and every worker rank its host pages, exactly as with the local backend; those
pages are also the only memory the store moves bytes from and to (registered once,
zero-copy). Two clients, both over a :class:`TierClient` (the backend-specific part,
store/mooncake_tier.py and store/memcache_tier.py):

* :class:`RemoteIndex` (scheduler process, no memory): the service is the index of
  the shared tier, so a prefix the local pages lack is looked up there; a block counts
  only when the object of every worker rank is present (each rank publishes its own
  shard).
* :class:`RemotePages` (each worker rank): publishes a block once all its layers are
  in a page (one buffer per layer row) and fetches a block into a page the scheduler
  reserved.

Object of one block on one rank: the block's rows of every layer, concatenated in
model layer order (``kv_layout.layer_order``), so whole-prefix and layerwise engines
of the same model and layout share objects; key ``<block key>@r<rank>``.

A service that stops answering is a miss, never an error: the first failed call
logs one warning per client and marks it down; while down nothing on the data path
calls the service (a call then blocks in the library's reconnect), and a background
thread probes it every ``retry_interval_s``; its first answer logs that service
resumed. Why a thread: the probe's blocking call releases the GIL, the model thread
never waits for it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from ascend_offload.kv_layout import layer_order
from ascend_offload.store.base import StoreError

log = logging.getLogger(__name__)

PROBE_KEY = "ascend-offload:probe"
#: A get whose call outlived its deadline: a transfer may still write the pages.
IN_FLIGHT = -(1 << 30)


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

    def put(self, keys: Sequence[str], ptrs: list[list[int]], lens: list[list[int]]) -> list[int]:
        """Object ``keys[i]`` from the concatenated spans ``ptrs[i]``/``lens[i]``: 0 stored."""

    def get(self, keys: Sequence[str], ptrs: list[list[int]], lens: list[list[int]]) -> list[int]:
        """Object ``keys[i]`` into the spans: 0 arrived whole, negative an error code."""

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

    def up(self) -> bool:
        with self._lock:
            return not self._down

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
        codes = self._client.exists(shards)
        self.lookups += 1
        if len(codes) != len(shards) or not self.health.check("exists", codes):
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
                "remote_outages": self.health.outages}

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


class RemotePages:
    """A worker rank's client: moves whole blocks between its page planes and the service.

    ``planes``: layer name -> ``[num_pages, layer_block_bytes]`` host tensor (the rank's
    pages); they are registered with the client here and must outlive this object.
    On a failed registration the client is closed and ``StoreError`` raised."""

    def __init__(self, client: TierClient, planes: Mapping[str, torch.Tensor], rank: int,
                 retry_interval_s: float) -> None:
        self._client = client
        self._registered: list[tuple[int, int]] = []
        self.health = ServiceHealth(client, f"worker rank {rank}", retry_interval_s)
        if not planes:
            self.close()
            raise StoreError("RemotePages needs at least one page plane")
        self.rank = rank
        self._planes = [planes[name] for name in layer_order(planes)]
        for p in self._planes:
            if p.dim() != 2 or not p.is_contiguous() or p.device.type != "cpu":
                self.close()
                raise StoreError("page planes must be contiguous 2-D host tensors")
        self._rows = [p.shape[1] * p.element_size() for p in self._planes]
        self.object_bytes = sum(self._rows)
        for p in self._planes:
            nbytes = p.numel() * p.element_size()
            rc = client.register(p.data_ptr(), nbytes)
            if rc != 0:
                self.close()
                raise StoreError(f"{client.service}: registering a {nbytes}-byte page plane failed ({rc})")
            self._registered.append((p.data_ptr(), nbytes))
        self.counts = TierCounts()

    @property
    def service(self) -> str:
        return self._client.service

    def _spans(self, pages: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        ptrs = [[p.data_ptr() + page * n for p, n in zip(self._planes, self._rows, strict=True)]
                for page in pages]
        return ptrs, [list(self._rows) for _ in pages]

    def publish(self, keys: Sequence[str], pages: Sequence[int]) -> None:
        """Put block ``keys[i]`` from page ``pages[i]`` (all layers written). A refused
        put is a skipped publish, never an error."""
        if not keys:
            return
        c = self.counts
        if not self.health.up():
            c.publish_skipped += len(keys)
            return
        ptrs, lens = self._spans(pages)
        codes = self._client.put([shard_key(k, self.rank) for k in keys], ptrs, lens)
        self.health.check("put", codes)
        if len(codes) != len(keys):
            c.publish_skipped += len(keys)
            return
        for code in codes:
            if code == 0:
                c.published_blocks += 1
            elif code == self._client.duplicate:
                c.publish_duplicates += 1
            else:
                c.publish_skipped += 1

    def fetch(self, keys: Sequence[str], pages: Sequence[int]) -> tuple[bool, bool]:
        """Get block ``keys[i]`` into page ``pages[i]``: ``(ok, reusable)``. ``ok`` only
        when every block arrived whole; ``reusable`` False when a transfer may still be
        writing the pages (they must not be handed out again)."""
        if not keys:
            return True, True
        if not self.health.up():
            self.counts.fetch_failed_blocks += len(keys)
            return False, True
        ptrs, lens = self._spans(pages)
        try:
            got = list(self._client.get([shard_key(k, self.rank) for k in keys], ptrs, lens))
        except Exception:  # unknown whether a transfer still runs: the pages stay out of use
            log.exception("%s: get raised on worker rank %d", self._client.service, self.rank)
            self.counts.fetch_failed_blocks += len(keys)
            return False, False
        self.health.check("get", got)
        if len(got) != len(keys):
            log.warning("%s: get answered %d codes for %d blocks on worker rank %d; its pages are "
                        "not reused", self._client.service, len(got), len(keys), self.rank)
            self.counts.fetch_failed_blocks += len(keys)
            return False, False
        bad = [g for g in got if g != 0]
        self.counts.fetched_blocks += len(got) - len(bad)
        self.counts.fetch_failed_blocks += len(bad)
        unsafe = [g for g in bad if not self._client.safe_failure(g)]
        if unsafe:
            log.warning("%s: get failed with %d on worker rank %d; %d pages are not reused",
                        self._client.service, unsafe[0], self.rank, len(keys))
        return not bad, not unsafe

    def close(self) -> None:
        self.health.close()
        for ptr, nbytes in self._registered:
            self._client.unregister(ptr, nbytes)
        self._registered = []
        self._client.close()
