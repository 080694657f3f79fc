"""The store connector's shared tier on Mooncake Store: block objects published by
every instance that points at the same ``mooncake_master``.

How it sits behind the connector (connectors/store/): the scheduler keeps its
local index and every worker rank its host pages, exactly as with the local
backend; those pages are also the only memory Mooncake moves bytes from and to
(registered once, zero-copy). Two clients:

* :class:`RemoteIndex` (scheduler process, no segment): the master is the index of
  the shared tier, so a prefix the local pages lack is looked up there
  (``batch_is_exist``); a block counts only when the object of every worker rank
  is present (each rank publishes its own shard).
* :class:`RemotePages` (each worker rank): publishes a block once all its layers
  are in a page (``batch_put_from_multi_buffers``, one buffer per layer row) and
  fetches a block into a page the scheduler reserved
  (``batch_get_into_multi_buffers``).

Object of one block on one rank: the block's rows of every layer, concatenated in
model layer order (``kv_layout.layer_order``), so whole-prefix and layerwise
engines of the same model and layout share objects; key ``<block key>@r<rank>``.

A master that stops answering is a miss, never an error: the first RPC failure
logs one warning per client and marks it down; while down nothing on the data
path calls the master (a call then blocks ~4 s in Mooncake's reconnect), and a
background thread probes it every ``retry_interval_s``; its first answer logs that
service resumed. Why a thread: the probe's blocking call releases the GIL, the
model thread never waits for it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ascend_offload.kv_layout import layer_order
from ascend_offload.store.base import StoreError

log = logging.getLogger(__name__)

#: Mooncake ``ErrorCode`` values told apart here (mooncake-store types.h).
NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
RPC_FIRST, RPC_LAST = -999, -900  # RPC_FAIL, RPC_TIMEOUT, heartbeat errors: master unreachable
# Get failures returned before any byte moved (or after all did): the pages are safe
# to reuse. After any other failure a transfer may still write them.
SAFE_GET_FAILURES = frozenset({NO_AVAILABLE_HANDLE, -600, OBJECT_NOT_FOUND, -703, -707,
                               *range(RPC_FIRST, RPC_LAST + 1)})
_PROBE_KEY = "ascend-offload:probe"


def _rpc_failure(code: int) -> bool:
    return RPC_FIRST <= code <= RPC_LAST


def _call(fn: Any, *args: Any, n: int) -> list[int]:
    """A batch call's per-object codes; a call that raises (a closed or broken client)
    answers like an unreachable master for all ``n`` objects, never into the engine."""
    try:
        return list(fn(*args))
    except Exception:
        log.exception("Mooncake %s raised; treated as an unreachable master", getattr(fn, "__name__", fn))
        return [RPC_LAST] * n


def shard_key(block_key: str, rank: int) -> str:
    """The object of ``block_key`` holding worker rank ``rank``'s shard."""
    return f"{block_key}@r{rank}"


def connect(cfg: Any, *, global_segment_bytes: int, deadline_s: float | None = None) -> Any:
    """A ``MooncakeDistributedStore`` client set up from a ``MooncakeStoreConfig``.
    ``global_segment_bytes`` 0 contributes no memory to the pool. No local transfer
    buffer: every byte moves from or to registered pages. ``deadline_s`` bounds every
    transfer of this process (Mooncake's transport timeouts, read at setup): a peer
    that stops answering fails a put or get then, instead of blocking the model
    thread (measured: 30 s without, 2.0 s with a 2 s deadline, peer SIGSTOPped)."""
    if deadline_s is not None:
        from ascend_offload.transfer.mooncake import apply_read_deadline

        apply_read_deadline(deadline_s)
    if not cfg.master_address:
        raise StoreError("the Mooncake backend needs 'mooncake.master_address' (host:port of mooncake_master)")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise StoreError(
            f"the Mooncake backend needs the mooncake package ({exc}); "
            "pip install mooncake-transfer-engine-non-cuda (and libibverbs1 librdmacm1 libnuma1)"
        ) from exc
    client = MooncakeDistributedStore()
    rc = client.setup(cfg.local_hostname, cfg.metadata_server, global_segment_bytes, 0,
                      cfg.protocol, cfg.device_name, cfg.master_address)
    if rc != 0:
        raise StoreError(f"Mooncake store setup against master {cfg.master_address} failed ({rc}); "
                         "is mooncake_master running there?")
    return client


class MasterHealth:
    """Whether this client's master answers; one warning per outage, probed back by a
    daemon thread (see module doc)."""

    def __init__(self, client: Any, address: str, who: str, retry_interval_s: float) -> None:
        self._client = client
        self.address = address
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
        """True when the master answered the call (per-object codes may be errors)."""
        bad = next((c for c in codes if _rpc_failure(c)), None)
        if bad is None:
            return True
        with self._lock:
            if self._down or self._stop.is_set():
                return False
            self._down = True
            self.outages += 1
            self._prober = threading.Thread(target=self._probe, name="mooncake-probe", daemon=True)
            self._prober.start()
        log.warning("Mooncake master %s unreachable from %s (%s returned %d): lookups miss and "
                    "publishes are skipped until it answers again", self.address, self.who, op, bad)
        return False

    def _probe(self) -> None:
        while not self._stop.wait(self.retry_interval_s):
            codes = _call(self._client.batch_is_exist, [_PROBE_KEY], n=1)
            if not any(_rpc_failure(c) for c in codes):
                with self._lock:
                    self._down = False
                log.warning("Mooncake master %s answers %s again: store service resumed",
                            self.address, self.who)
                return

    def close(self) -> None:
        """Stop probing; bounded (a probe in flight returns within Mooncake's RPC timeout)."""
        self._stop.set()
        with self._lock:
            prober = self._prober
        if prober is not None:
            prober.join(timeout=15.0)


class RemoteIndex:
    """The scheduler's view of the shared tier: which leading blocks every rank published."""

    def __init__(self, cfg: Any, world_size: int, *, client: Any = None) -> None:
        self.world_size = world_size
        self._client = client if client is not None else connect(cfg, global_segment_bytes=0)
        self.health = MasterHealth(self._client, cfg.master_address, "the scheduler",
                                   cfg.retry_interval_s)
        self.lookups = 0
        self.hit_blocks = 0

    def available(self) -> bool:
        return self.health.up()

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        """Leading ``keys`` whose shards of every rank the master has (0 while it is down)."""
        if not keys or not self.health.up():
            return 0
        w = self.world_size
        shards = [shard_key(k, r) for k in keys for r in range(w)]
        codes = _call(self._client.batch_is_exist, shards, n=len(shards))
        self.lookups += 1
        if not self.health.check("batch_is_exist", codes):
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
    publish_duplicates: int = 0  # the master had the object already
    publish_skipped: int = 0  # no space, master down or refused
    fetched_blocks: int = 0
    fetch_failed_blocks: int = 0


class RemotePages:
    """A worker rank's client: moves whole blocks between its page planes and the master.

    ``planes``: layer name -> ``[num_pages, layer_block_bytes]`` host tensor (the rank's
    pages); they are registered with Mooncake here and must outlive this object."""

    def __init__(self, cfg: Any, planes: Mapping[str, torch.Tensor], rank: int, *,
                 client: Any = None, deadline_s: float | None = None) -> None:
        if not planes:
            raise StoreError("RemotePages needs at least one page plane")
        self.rank = rank
        self._planes = [planes[name] for name in layer_order(planes)]
        for p in self._planes:
            if p.dim() != 2 or not p.is_contiguous() or p.device.type != "cpu":
                raise StoreError("page planes must be contiguous 2-D host tensors")
        self._rows = [p.shape[1] * p.element_size() for p in self._planes]
        self.object_bytes = sum(self._rows)
        self._client = client if client is not None else connect(
            cfg, global_segment_bytes=cfg.global_segment_bytes, deadline_s=deadline_s)
        self._registered: list[int] = []
        for p in self._planes:
            rc = self._client.register_buffer(p.data_ptr(), p.numel() * p.element_size())
            if rc != 0:
                self.close()
                raise StoreError(f"Mooncake register_buffer of a {p.numel()}-byte page plane failed ({rc})")
            self._registered.append(p.data_ptr())
        self.health = MasterHealth(self._client, cfg.master_address, f"worker rank {rank}",
                                   cfg.retry_interval_s)
        self.replica_num = int(getattr(cfg, "replica_num", 1))
        self.counts = TierCounts()

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
        from mooncake.store import ReplicateConfig

        rep = ReplicateConfig()
        rep.replica_num = self.replica_num
        ptrs, lens = self._spans(pages)
        codes = _call(self._client.batch_put_from_multi_buffers,
                      [shard_key(k, self.rank) for k in keys], ptrs, lens, rep, n=len(keys))
        self.health.check("batch_put_from_multi_buffers", codes)
        for code in codes:
            if code == 0:
                c.published_blocks += 1
            elif code == OBJECT_ALREADY_EXISTS:
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
            got = list(self._client.batch_get_into_multi_buffers(
                [shard_key(k, self.rank) for k in keys], ptrs, lens))
        except Exception:  # unknown whether a transfer still runs: the pages stay out of use
            log.exception("Mooncake batch_get_into_multi_buffers raised on worker rank %d", self.rank)
            self.counts.fetch_failed_blocks += len(keys)
            return False, False
        self.health.check("batch_get_into_multi_buffers", got)
        bad = [g for g in got if g != self.object_bytes]
        self.counts.fetched_blocks += len(got) - len(bad)
        self.counts.fetch_failed_blocks += len(bad)
        unsafe = [g for g in bad if g < 0 and g not in SAFE_GET_FAILURES]
        if unsafe:
            log.warning("Mooncake get failed with %d on worker rank %d; %d pages are not reused",
                        unsafe[0], self.rank, len(keys))
        return not bad, not unsafe

    def close(self) -> None:
        if getattr(self, "health", None) is not None:
            self.health.close()
        for ptr in self._registered:
            self._client.unregister_buffer(ptr)
        self._registered = []
        self._client.close()
