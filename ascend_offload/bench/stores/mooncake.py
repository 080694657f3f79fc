"""The Mooncake Store backend: one KV store shared by every instance that points at
the same ``mooncake_master``, surviving the restart of any of them.

How the contract (store/base.py) maps onto Mooncake's distributed object store:

* **Bytes cross only registered host pages.** A local page pool (``LocalStore``,
  the *staging* pool) is registered with the Mooncake client once; puts read
  objects straight from its pages (``batch_put_from``) and gets write straight into
  them (``batch_get_into``): no intermediate buffer on our side, and over RDMA no
  CPU copy at all.
* **Pending objects never leave this process.** ``allocate`` reserves staging
  pages, ``write`` fills them, ``commit`` is the (batched) put and frees them.
  Mooncake publishes an object only when its put has finished (PutStart ..
  PutEnd), so a reader in any process sees a whole object or none (I3).
* **The master is the index.** ``lookup_prefix`` asks it (``batch_is_exist``),
  ``allocate`` skips keys it already has. Objects another client committed are
  hits here: that is the shared-store property.
* **A pin holds a local copy.** ``pin`` fetches the objects into staging pages
  and keeps them until ``unpin``; reads are local copies, so eviction by the
  master can never pull bytes from under a read. An object the master already
  evicted (``OBJECT_NOT_FOUND``) makes the pin a miss, never an error.
* **A master that disappears is a miss.** An RPC failure (codes -900..-999)
  marks an outage (``store/shared/tier.py: ServiceHealth``): one warning, then lookups and
  pins miss and saves are skipped without asking the master, while a background
  thread probes it every ``retry_interval_s``; its first answer logs that service
  resumed. Why not probe from the data path: while the master is gone every call
  blocks ~4 s in Mooncake's reconnect. The engine keeps serving (it recomputes what
  it would have loaded).

Mooncake's native client logs every failed RPC itself (glog, on stderr);
``GLOG_minloglevel=3`` in the environment silences it. Our own log is one line
per outage and one per recovery.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ascend_offload.bench.stores.staged import StagedStore
from ascend_offload.store.base import Pin, StoreError, WriteHandle
from ascend_offload.store.shared.mooncake import (
    INVALID_PARAMS,
    OBJECT_ALREADY_EXISTS,
    RPC_LAST,
    SAFE_GET_FAILURES,
    MooncakeTierClient,
)
from ascend_offload.store.shared.tier import ServiceHealth

if TYPE_CHECKING:
    from ascend_offload.config import MooncakeStoreConfig

log = logging.getLogger(__name__)


class MooncakeStore(StagedStore):
    """``KVStore`` over ``mooncake.store.MooncakeDistributedStore`` (see module doc).

    ``client`` is for tests that need to reach the raw client; production code builds
    it from the arguments."""

    def __init__(
        self,
        *,
        master_address: str,
        page_bytes: int,
        staging_bytes: int,
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_bytes: int = 1 << 30,
        local_buffer_bytes: int = 64 << 20,
        replica_num: int = 1,
        retry_interval_s: float = 1.0,
    ) -> None:
        if not master_address:
            raise StoreError("the Mooncake backend needs 'master_address' (host:port of mooncake_master)")
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:  # the optional dependency
            raise StoreError(
                f"the Mooncake backend needs the mooncake package ({exc}); "
                "pip install mooncake-transfer-engine-non-cuda (and libibverbs1 librdmacm1 libnuma1)"
            ) from exc
        self.master_address = master_address
        self.retry_interval_s = retry_interval_s
        self._init_staging(staging_bytes, page_bytes)
        self._client: Any = MooncakeDistributedStore()
        rc = self._client.setup(local_hostname, metadata_server, global_segment_bytes,
                                local_buffer_bytes, protocol, device_name, master_address)
        if rc != 0:
            raise StoreError(f"Mooncake store setup against master {master_address} failed ({rc}); "
                             "is mooncake_master running there?")
        rc = self._client.register_buffer(self._base, self._plane.nbytes)
        if rc != 0:
            self._client.close()
            raise StoreError(f"Mooncake register_buffer of the {self._plane.nbytes}-byte staging pool failed ({rc})")
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = replica_num
        self.health = ServiceHealth(MooncakeTierClient(self._client, master_address), "this client",
                                    retry_interval_s)

    @property
    def client(self) -> Any:
        return self._client

    # ------------------------------------------------------------------ master health

    @property
    def outages(self) -> int:
        """Outages seen (each logged once)."""
        return self.health.outages

    def _reachable(self) -> bool:
        return self.health.up()

    def _check(self, op: str, codes: Sequence[int]) -> bool:
        """True when the master answered (per-object codes may still be errors)."""
        return self.health.check(op, codes)

    def is_down(self) -> bool:
        """Whether the master is considered unreachable now."""
        return not self.health.up()

    # ------------------------------------------------------------------ helpers

    def _ptr(self, page: int) -> int:
        return self._base + page * self.page_bytes

    # ------------------------------------------------------------------ writes

    def allocate(self, keys: Sequence[str], sizes: Sequence[int]) -> list[WriteHandle | None] | None:
        uniq = self._checked(keys, sizes)
        if not uniq:
            return []
        if not self._reachable():
            self._skipped(len(uniq))
            return None
        codes = list(self._client.batch_is_exist(uniq))
        if not self._check("batch_is_exist", codes):
            self._skipped(len(uniq))
            return None
        return self._allocate_absent(keys, sizes, {k for k, c in zip(uniq, codes, strict=True) if c == 1})

    def commit(self, handles: Sequence[WriteHandle]) -> None:
        """Put the objects (one batched, zero-copy put) and free their staging pages.
        A put the master refuses (no space, unreachable) is a skipped save, not an error."""
        staged = self._staged(handles)
        if not staged:
            return
        keys = [h.key for h in handles]
        # whole-page objects: their rows in one call (the common case: one block each)
        rows = self._staging.pending_rows(staged)
        try:
            if not self._reachable():
                codes = [RPC_LAST] * len(keys)
            elif rows is not None:
                base, pb = self._base, self.page_bytes
                codes = list(self._client.batch_put_from(
                    keys, [base + r * pb for r in rows[1]], [pb] * len(keys), self._replicate))
                self._check("batch_put_from", codes)
            else:
                pages = [self._staging.pages(s.key) for s in staged]
                spans = [self._page_spans(p, h.size) for p, h in zip(pages, handles, strict=True)]
                codes = list(self._client.batch_put_from_multi_buffers(
                    keys, [s[0] for s in spans], [s[1] for s in spans], self._replicate))
                self._check("batch_put_from_multi_buffers", codes)
        finally:
            self._unpend(handles)
            self._unstage(staged)
        self._count_puts(handles, codes, OBJECT_ALREADY_EXISTS)

    # ------------------------------------------------------------------ reads

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        present: set[str] = set()
        if keys and self._reachable():
            codes = list(self._client.batch_is_exist(list(keys)))
            if self._check("batch_is_exist", codes):
                present = {k for k, c in zip(keys, codes, strict=True) if c == 1}
        with self._lock:
            return self._stats.count_prefix(keys, present.__contains__)

    def pin(self, keys: Sequence[str]) -> Pin | None:
        """Fetch all ``keys`` into staging pages (one batched get) or none: a key the
        master does not have (never stored, evicted, master down) makes it ``None``."""
        keys = list(dict.fromkeys(keys))
        token = next(self._tokens)
        if keys and not self._reachable():
            return None
        prefix = f"r{token}|"
        skeys = [prefix + k for k in keys]
        got = self._stage_alloc(skeys, [self.page_bytes] * len(keys))
        if got is None:  # staging full of pins and pending saves: a miss
            return None
        handles = [h for h in got if h is not None]  # all: the keys are unique to this pin
        rows = self._staging.pending_rows(handles)
        assert rows is not None  # whole pages by construction
        base, pb = self._base, self.page_bytes
        codes = list(self._client.batch_get_into(keys, [base + r * pb for r in rows[1]],
                                                 [pb] * len(keys))) if keys else []
        sizes = dict(zip(skeys, codes, strict=True))
        big = [i for i, c in enumerate(codes) if c == INVALID_PARAMS]
        if big and self._check("batch_get_into", codes):
            handles, ok = self._fetch_large(keys, skeys, handles, big, sizes)
            if not ok:
                return None
        if not self._check("batch_get_into", list(sizes.values())) or any(c <= 0 for c in sizes.values()):
            self._release_failed(handles, sizes)
            return None
        return self._hold(token, keys, skeys, handles, [sizes[k] for k in skeys])

    def _fetch_large(self, keys: list[str], skeys: list[str], handles: list[WriteHandle],
                     big: list[int], sizes: dict[str, int]) -> tuple[list[WriteHandle], bool]:
        """Objects larger than a page: re-stage them at their real size and fetch them
        into their pages with one multi-buffer get."""
        small = {h.key: h for h in handles}
        self._unstage([small.pop(skeys[i]) for i in big])
        real = [self._client.get_size(keys[i]) for i in big]
        if any(r <= 0 for r in real):
            self._check("get_size", real)
            self._unstage(list(small.values()))
            return [], False
        regot = self._stage_alloc([skeys[i] for i in big], real)
        if regot is None:
            self._unstage(list(small.values()))
            return [], False
        spans = [self._page_spans(self._staging.pages(skeys[i]), n) for i, n in zip(big, real, strict=True)]
        got = list(self._client.batch_get_into_multi_buffers(
            [keys[i] for i in big], [s[0] for s in spans], [s[1] for s in spans]))
        for i, n, code in zip(big, real, got, strict=True):
            sizes[skeys[i]] = n if code == n else (code if code < 0 else INVALID_PARAMS)
        return [*small.values(), *(h for h in regot if h is not None)], True

    def _release_failed(self, handles: list[WriteHandle], sizes: dict[str, int]) -> None:
        """Free the staging pages of a failed pin, except where a transfer may still be
        writing into them (see ``SAFE_GET_FAILURES``)."""
        unsafe = [h for h in handles if sizes.get(h.key, 0) < 0 and sizes[h.key] not in SAFE_GET_FAILURES]
        self._release(handles, unsafe, f"Mooncake get failed with {sizes[unsafe[0].key] if unsafe else 0}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.health.close()
        try:
            self._client.unregister_buffer(self._base)
        finally:
            self._client.close()


def mooncake_store_from_config(cfg: MooncakeStoreConfig, object_bytes: int, *, staging_bytes: int = 256 << 20,
                               local_buffer_bytes: int = 64 << 20) -> MooncakeStore:
    """Build the backend from a ``MooncakeStoreConfig``: one staging page per object of
    ``object_bytes``. The staging and transfer-buffer sizes are arguments: they size this
    store's own buffers, which the connector (its tier moves bytes from its local pages)
    has none of, so its config has no keys for them."""
    return MooncakeStore(
        master_address=cfg.master_address,
        page_bytes=object_bytes,
        staging_bytes=staging_bytes,
        local_hostname=cfg.local_hostname,
        metadata_server=cfg.metadata_server,
        protocol=cfg.protocol,
        device_name=cfg.device_name,
        global_segment_bytes=cfg.global_segment_bytes,
        local_buffer_bytes=local_buffer_bytes,
        replica_num=cfg.replica_num,
        retry_interval_s=cfg.retry_interval_s,
    )
