"""The Memcache backend (``memcache_hybrid``): the Ascend pooled KV store, shared by every
instance that points at the same meta service, surviving the restart of any of them.

How the contract (store/base.py) maps onto Memcache's ``DistributedObjectStore``:

* **Bytes cross only registered host pages.** A local page pool (``LocalStore``, the
  *staging* pool) is registered with the client once (``register_buffer``); puts
  read objects from its pages (``batch_put_from``, direction H2G) and gets write into
  them (``batch_get_into``, G2H); objects spanning several pages use the ``_layers``
  variants (one buffer list per key). No other buffer on our side.
* **Pending objects never leave this process.** ``allocate`` reserves staging pages,
  ``write`` fills them, ``commit`` is the batched put and frees them. Memcache
  publishes an object when its put finished (alloc, copy, write-finish inside the
  client), so a reader anywhere sees a whole object or none (I3).
* **The meta service is the index.** ``lookup_prefix`` asks it (``batch_is_exist``),
  ``allocate`` skips keys it already holds, objects another instance committed are
  hits here.
* **A pin holds a local copy.** ``pin`` asks the sizes (``batch_get_key_info``) and
  fetches the objects into staging pages, kept until ``unpin``: eviction by the meta
  service can never pull bytes from under a read. A key the service no longer holds
  (evicted between lookup and pin, or in between the two calls) makes the pin a miss.
* **A meta service that disappears is a miss.** Link errors (``-3004`` timeout,
  ``-3014`` link not found, ``-3017..-3019`` not connected) and calls that outlive
  ``call_timeout_s`` mark an outage: one warning, then for ``retry_interval_s``
  lookups and pins miss and saves are skipped without asking; the next call probes
  again, and the first answer logs that service resumed.

Why a deadline of our own: measured with memcache_hybrid 1.3.0 on loopback, the first
call after the meta service died blocked 60 s whatever ``client_timeout_seconds``
said (later calls failed at once with ``-3014``). Backend calls therefore run on a
small pool of threads and the caller waits at most ``call_timeout_s``; a call that
overran keeps its thread until the library returns, and staging pages it may still
write into are quarantined, never reused. While every thread is held by an overrun
call, calls are not even submitted (a miss / skipped save at once).

Direction codes are ``memfabric_hybrid.bm.BmCopyType`` values (H2G = 3, G2H = 2),
asserted against the installed wheel in tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ascend_offload.bench.stores.staged import StagedStore
from ascend_offload.store.base import Pin, StoreError, WriteHandle
from ascend_offload.store.shared import deadline_calls
from ascend_offload.store.shared.deadline_calls import DeadlineCalls
from ascend_offload.store.shared.memcache import (
    G2H,
    H2G,
    MAX_BATCH,
    MMC_DUPLICATED_OBJECT,
    MMC_ERROR,
    NOT_SENT_CODE,
    OUTAGE_CODES,
    SAFE_GET_FAILURES,
    TIMED_OUT,
    data_call,
    real_client,
    replicate_config,
)

if TYPE_CHECKING:
    from ascend_offload.config import MemcacheStoreConfig

log = logging.getLogger(__name__)

_NOT_SENT = object()


class MemcacheStore(StagedStore):
    """``KVStore`` over ``memcache_hybrid.DistributedObjectStore`` (see module doc).

    ``client``: an initialized client (tests pass a fake of the same API); production
    code builds it with :func:`real_client` (``memcache_store_from_config``)."""

    def __init__(self, client: Any, *, page_bytes: int, staging_bytes: int, replica_num: int = 1,
                 retry_interval_s: float = 1.0, call_timeout_s: float = 5.0, call_threads: int = 2,
                 name: str = "Memcache meta service") -> None:
        if call_timeout_s <= 0 or call_threads < 1:
            raise StoreError(f"call_timeout_s={call_timeout_s} and call_threads={call_threads} must be > 0")
        self.name = name
        self.retry_interval_s = retry_interval_s
        self.call_timeout_s = call_timeout_s
        self._client = client
        self._init_staging(staging_bytes, page_bytes)
        rc = client.register_buffer(self._base, self._plane.nbytes)
        if rc != 0:
            raise StoreError(f"Memcache register_buffer of the {self._plane.nbytes}-byte staging pool failed ({rc})")
        self._replicate = replicate_config(replica_num)
        self._calls = DeadlineCalls(call_timeout_s, call_threads, "memcache-call")
        self._down = False
        self._retry_at = 0.0
        self.outages = 0

    @property
    def client(self) -> Any:
        return self._client

    # ------------------------------------------------------------------ service health

    def _reachable(self) -> bool:
        with self._lock:
            return not self._down or time.monotonic() >= self._retry_at

    def _outage(self, op: str, code: int) -> None:
        with self._lock:
            self._retry_at = time.monotonic() + self.retry_interval_s
            if self._down:
                return
            self._down = True
            self.outages += 1
        log.warning("%s unreachable (%s returned %d): loads miss and saves are skipped until it "
                    "answers again", self.name, op, code)

    def _answered(self) -> None:
        with self._lock:
            if not self._down:
                return
            self._down = False
        log.warning("%s answers again: store service resumed", self.name)

    @property
    def down(self) -> bool:
        with self._lock:
            return self._down

    def _call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a call thread, waited for at most ``call_timeout_s``: its result,
        None when it overran (an outage; it may still run), or ``_NOT_SENT`` when no thread
        is free of an overrun call (nothing was submitted)."""
        got = self._calls.call(fn, *args)
        if got is deadline_calls.NOT_SENT:
            self._outage(op, TIMED_OUT)
            return _NOT_SENT
        if got is deadline_calls.OVERRAN:
            self._outage(op, TIMED_OUT)
            return None
        return got

    def _codes(self, op: str, got: Any, n: int) -> list[int]:
        """Per-key codes of a batch call (an overrun call: ``TIMED_OUT`` for every key, one
        never sent: ``NOT_SENT_CODE``); records an outage or a recovery."""
        if got is None or got is _NOT_SENT:  # _call already recorded the outage
            return [TIMED_OUT if got is None else NOT_SENT_CODE] * n
        codes = [int(c) for c in got]
        if len(codes) != n:  # the client refused the batch as a whole (empty, too large)
            log.warning("%s: %s answered %d codes for %d keys", self.name, op, len(codes), n)
            return [MMC_ERROR] * n
        bad = next((c for c in codes if c in OUTAGE_CODES), None)
        if bad is not None:
            self._outage(op, bad)
        else:
            self._answered()
        return codes

    def _batched(self, op: str, fn: Callable[..., Any], n: int,
                 args: Callable[[int, int], list[Any]]) -> list[int]:
        """Per-key codes of ``fn`` over ``n`` keys in calls of at most ``MAX_BATCH``
        (``args(lo, hi)``: the call's arguments for keys ``lo:hi``); once the service
        is found down, the rest are not sent."""
        out: list[int] = []
        for lo in range(0, n, MAX_BATCH):
            hi = min(n, lo + MAX_BATCH)
            if lo and not self._reachable():
                out.extend([NOT_SENT_CODE] * (n - lo))
                break
            out.extend(self._codes(op, self._call(op, fn, *args(lo, hi)), hi - lo))
        return out

    def _exists(self, keys: list[str]) -> list[int]:
        return self._batched("batch_is_exist", self._client.batch_is_exist, len(keys),
                             lambda lo, hi: [keys[lo:hi]])

    # ------------------------------------------------------------------ staging

    def _spans(self, skey: str, size: int) -> tuple[list[int], list[int]]:
        return self._page_spans(self._staging.pages(skey), size)

    def _transfer(self, op: str, keys: list[str], spans: list[tuple[list[int], list[int]]],
                  direct: int) -> list[int]:
        """One batched put or get over staging spans: single-span objects in one call,
        multi-page objects in one ``_layers`` call. Per-key codes, in ``keys`` order."""
        codes = [0] * len(keys)
        single = [i for i, s in enumerate(spans) if len(s[0]) == 1]
        multi = [i for i, s in enumerate(spans) if len(s[0]) != 1]
        c = self._client
        put = op == "put"
        for group, layers in ((single, False), (multi, True)):
            if not group:
                continue
            name, fn = data_call(c, put=put, layers=layers)

            def args(lo: int, hi: int, group: list[int] = group, layers: bool = layers) -> list[Any]:
                part = group[lo:hi]
                ptrs = [spans[i][0] if layers else spans[i][0][0] for i in part]
                lens = [spans[i][1] if layers else spans[i][1][0] for i in part]
                out: list[Any] = [[keys[i] for i in part], ptrs, lens, direct]
                return [*out, self._replicate] if put else out

            for i, code in zip(group, self._batched(name, fn, len(group), args), strict=True):
                codes[i] = code
        return codes

    # ------------------------------------------------------------------ writes

    def allocate(self, keys: Sequence[str], sizes: Sequence[int]) -> list[WriteHandle | None] | None:
        uniq = self._checked(keys, sizes)
        if not uniq:
            return []
        codes = self._exists(uniq) if self._reachable() else None
        if codes is None or any(c in OUTAGE_CODES for c in codes):
            self._skipped(len(uniq))
            return None
        return self._allocate_absent(keys, sizes, {k for k, c in zip(uniq, codes, strict=True) if c == 1})

    def commit(self, handles: Sequence[WriteHandle]) -> None:
        """Put the objects (batched, from the staging pages) and free their pages. A put
        the service refuses (no space, unreachable) is a skipped save, not an error."""
        staged = self._staged(handles)
        if not staged:
            return
        keys = [h.key for h in handles]
        unsafe: list[WriteHandle] = []
        try:
            if self._reachable():
                spans = [self._spans(s.key, h.size) for s, h in zip(staged, handles, strict=True)]
                codes = self._transfer("put", keys, spans, H2G)
            else:
                codes = [min(OUTAGE_CODES)] * len(keys)
            # a put that overran may still read the pages: they are not reused
            unsafe = [s for s, c in zip(staged, codes, strict=True) if c == TIMED_OUT]
        finally:
            self._unpend(handles)
            self._release(staged, unsafe, f"{self.name}: a put outlived its deadline")
        self._count_puts(handles, codes, MMC_DUPLICATED_OBJECT)

    # ------------------------------------------------------------------ reads

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        present: set[str] = set()
        if keys and self._reachable():
            codes = self._exists(list(keys))
            present = {k for k, c in zip(keys, codes, strict=True) if c == 1}
        with self._lock:
            return self._stats.count_prefix(keys, present.__contains__)

    def pin(self, keys: Sequence[str]) -> Pin | None:
        """Fetch all ``keys`` into staging pages or none: a key the service does not hold
        (never stored, evicted, service down) makes it ``None``."""
        keys = list(dict.fromkeys(keys))
        token = next(self._tokens)
        if not keys:
            return Pin(keys=(), token=token)
        if not self._reachable():
            return None
        sizes: list[int] = []
        for lo in range(0, len(keys), MAX_BATCH):
            part = keys[lo:lo + MAX_BATCH]
            infos = self._call("batch_get_key_info", self._client.batch_get_key_info, part)
            if infos is None or infos is _NOT_SENT or len(infos) != len(part):  # no answer: a miss
                return None
            sizes.extend(int(i.size()) for i in infos)
        if any(s <= 0 for s in sizes):  # not held
            return None
        prefix = f"r{token}|"
        skeys = [prefix + k for k in keys]
        got = self._stage_alloc(skeys, sizes)
        if got is None:  # staging full of pins and pending saves: a miss
            return None
        handles = [h for h in got if h is not None]
        spans = [self._spans(s, n) for s, n in zip(skeys, sizes, strict=True)]
        codes = self._transfer("get", keys, spans, G2H)
        if any(c != 0 for c in codes):
            unsafe = [h for h, c in zip(handles, codes, strict=True) if c != 0 and c not in SAFE_GET_FAILURES]
            self._release(handles, unsafe, f"{self.name}: a get failed mid-way or outlived its deadline")
            return None
        return self._hold(token, keys, skeys, handles, sizes)

    def close(self) -> None:
        """Unregister the staging pool and close the client; never waits on an overrun call."""
        if self._closed:
            return
        self._closed = True
        self._calls.shutdown()
        if self._calls.overrun:  # the library still runs a call; closing under it could free its pages
            log.warning("%s: closing with a call past its deadline still running; the client is "
                        "left open", self.name)
            return
        try:
            self._client.unregister_buffer(self._base, self._plane.nbytes)
        finally:
            self._client.close()


def memcache_store_from_config(cfg: MemcacheStoreConfig, object_bytes: int, *, staging_bytes: int = 256 << 20,
                               device_id: int = 0, client: Any = None) -> MemcacheStore:
    """Build the backend from a ``MemcacheStoreConfig``: one staging page per object of
    ``object_bytes``, ``staging_bytes`` of them (this store's own pages; the connector's tier
    moves bytes from its local pages, so its config has no key for them). ``client``
    replaces the real client (tests)."""
    if client is None:
        if not cfg.meta_service_url:
            raise StoreError("the Memcache backend needs 'memcache.meta_service_url' "
                             "(tcp://host:port of the meta service)")
        client = real_client(meta_service_url=cfg.meta_service_url, config_store_url=cfg.config_store_url,
                             protocol=cfg.protocol, dram_size=cfg.dram_size, hbm_size=cfg.hbm_size,
                             device_id=device_id, world_size=cfg.world_size,
                             client_timeout_s=max(1, round(cfg.call_timeout_s)))
    return MemcacheStore(client, page_bytes=object_bytes, staging_bytes=staging_bytes,
                         replica_num=cfg.replica_num, retry_interval_s=cfg.retry_interval_s,
                         call_timeout_s=cfg.call_timeout_s)
