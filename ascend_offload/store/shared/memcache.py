"""The shared tier of the store connector (store/shared/tier.py) on Memcache
(``memcache_hybrid``): block objects published by every instance that points at the
same meta service.

What is Memcache-specific, behind :class:`~ascend_offload.store.shared.tier.TierClient`
(:class:`MemcacheTierClient`):

* existence lookups are ``batch_is_exist`` (1 present, 0 absent); the scheduler's
  client is metadata-only (``init(device_id, init_bm=False)``: no Ascend driver, no
  memory contributed), a rank's client has the data path on;
* a rank registers its page planes (``register_buffer``), publishes with
  ``batch_put_from`` (direction H2G) and fetches with ``batch_get_into`` (G2H) when
  the KV has one layer plane, and with the ``_layers`` variants (one buffer per layer
  row of the block) otherwise; batches of at most ``MAX_BATCH`` keys (the client
  refuses larger ones);
* the meta service's link codes (``OUTAGE_CODES``) are an unreachable service; so is
  a call that outlived ``call_timeout_s`` (the library's own first call after the
  service died waited 60 s): calls run through :class:`DeadlineCalls`, and a put or get
  that overran reports ``IN_FLIGHT``: the library may still read (put) or write (get)
  its pages, so they stay out of use until the call really ended (``on_late``).

This module is the one place that knows Memcache's client: its error and direction
codes (``BmCopyType`` H2G = 3, G2H = 2, asserted against the installed wheel in tests),
its set-up (:func:`real_client`, :func:`metadata_client`) and its batched data calls;
bench/stores/memcache.py builds on them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ascend_offload.store.base import StoreError
from ascend_offload.store.shared import tier as shared_tier
from ascend_offload.store.shared.deadline_calls import NOT_SENT, OVERRAN, DeadlineCalls
from ascend_offload.store.shared.tier import IN_FLIGHT

if TYPE_CHECKING:
    from ascend_offload.config import MemcacheStoreConfig

log = logging.getLogger(__name__)

H2G, G2H = 3, 2  # BmCopyType: host DRAM -> global pool, global pool -> host DRAM
MMC_DUPLICATED_OBJECT = -3006
# The client cannot reach the meta service (MmcErrorCode): an outage, not a miss.
OUTAGE_CODES = frozenset({-3004, -3014, -3017, -3018, -3019})
# Get failures after which no transfer can still be writing into our pages.
SAFE_GET_FAILURES = frozenset({-3007, -3102, -1, *OUTAGE_CODES})
TIMED_OUT = -3004  # our own deadline passed: reported like the library's MMC_TIMEOUT
NOT_SENT_CODE = -3017  # MMC "not connected": reported for calls never submitted (nothing moved)
MMC_ERROR = -1
# Keys per client call: the client refuses larger batches up front (MAX_BATCH_OP_COUNT).
MAX_BATCH = 1024


def data_call(client: Any, *, put: bool, layers: bool) -> tuple[str, Callable[..., Any]]:
    """The client's batched put (H2G) or get (G2H) and its name: ``batch_put_from`` /
    ``batch_get_into`` take one buffer per key, their ``_layers`` variants a list each."""
    name = ("batch_put_from" if put else "batch_get_into") + ("_layers" if layers else "")
    return name, getattr(client, name)


def replicate_config(replica_num: int) -> Any:
    """A ``memcache_hybrid.ReplicateConfig`` of ``replica_num`` copies; None without the
    wheel (a fake client: its default is used)."""
    try:
        from memcache_hybrid import ReplicateConfig
    except ImportError:
        return None
    rc = ReplicateConfig()
    rc.replicaNum = replica_num
    return rc


def real_client(*, meta_service_url: str, config_store_url: str, protocol: str, dram_size: str,
                hbm_size: str, device_id: int, world_size: int, client_timeout_s: int,
                log_level: str = "warn") -> Any:
    """A set-up, initialized ``memcache_hybrid.DistributedObjectStore`` (data path on:
    needs the Ascend driver)."""
    try:
        from memcache_hybrid import DistributedObjectStore, LocalConfig
    except ImportError as exc:
        raise StoreError(f"the Memcache backend needs memcache_hybrid ({exc}); "
                         "pip install 'ascend-offload[ascend]'") from exc
    conf = LocalConfig()
    conf.meta_service_url = meta_service_url
    conf.config_store_url = config_store_url
    conf.protocol = protocol
    conf.dram_size = dram_size
    conf.hbm_size = hbm_size
    conf.world_size = world_size
    conf.client_timeout_seconds = client_timeout_s
    conf.log_level = log_level
    client = DistributedObjectStore()
    rc = client.setup(conf)
    if rc == 0:
        rc = client.init(device_id, True)
    if rc != 0:
        raise StoreError(f"Memcache client setup/init against {meta_service_url} failed ({rc}); "
                         "is the meta service running and the Ascend driver loaded?")
    return client


def metadata_client(meta_service_url: str, config_store_url: str, *, log_level: str = "error") -> Any:
    """A ``DistributedObjectStore`` on the metadata path only (``init_bm=False``): it
    answers existence and size lookups without the Ascend driver. Its data calls and
    ``register_buffer`` are not usable (the latter crashed the process in 1.3.0)."""
    from memcache_hybrid import DistributedObjectStore, LocalConfig

    conf = LocalConfig()
    conf.meta_service_url = meta_service_url
    conf.config_store_url = config_store_url
    conf.protocol = "host_tcp"
    conf.log_level = log_level
    client = DistributedObjectStore()
    rc = client.setup(conf)
    if rc == 0:
        rc = client.init(0, False)
    if rc != 0:
        raise RuntimeError(f"Memcache metadata client against {meta_service_url} failed ({rc})")
    return client


class MemcacheTierClient:
    """A ``memcache_hybrid.DistributedObjectStore`` as the shared tier's ``TierClient``.

    ``client``: set up and initialized (tests pass a fake of the same API);
    ``replicate``: a ``memcache_hybrid.ReplicateConfig`` for puts, or None (default)."""

    duplicate = MMC_DUPLICATED_OBJECT

    def __init__(self, client: Any, meta_service_url: str, *, call_timeout_s: float = 5.0,
                 call_threads: int = 2, replicate: Any = None) -> None:
        self.client = client
        self.service = f"Memcache meta service {meta_service_url}"
        self._calls = DeadlineCalls(call_timeout_s, call_threads, "memcache-tier")
        self._replicate = replicate

    def _batched(self, op: str, fn: Callable[..., Any], n: int, args: Callable[[int, int], list[Any]],
                 *, getting: bool = False, moving: bool = False,
                 on_late: Callable[[], None] | None = None) -> list[int]:
        """Per-key codes of ``fn`` over ``n`` keys in calls of at most ``MAX_BATCH``;
        after an unreachable answer the rest are not sent, so at most one call overruns:
        ``moving`` (a put or get) reports its keys ``IN_FLIGHT`` and ``on_late`` is called
        once it really ended."""
        out: list[int] = []
        for lo in range(0, n, MAX_BATCH):
            hi = min(n, lo + MAX_BATCH)
            if out and any(self.unreachable(c) for c in out):
                out.extend([NOT_SENT_CODE] * (n - lo))
                break
            try:
                got = self._calls.call(fn, *args(lo, hi), on_late=on_late if moving else None)
            except Exception:
                if getting:
                    raise  # a get that raised may still run: the caller keeps its pages
                log.exception("Memcache %s raised; treated as an unreachable meta service", op)
                out.extend([TIMED_OUT] * (hi - lo))
                continue
            if got is OVERRAN:
                out.extend([IN_FLIGHT if moving else TIMED_OUT] * (hi - lo))
            elif got is NOT_SENT:
                out.extend([NOT_SENT_CODE] * (hi - lo))
            else:
                codes = [int(c) for c in got]
                if len(codes) != hi - lo:  # the client refused the batch as a whole
                    log.warning("Memcache %s answered %d codes for %d keys", op, len(codes), hi - lo)
                    codes = [IN_FLIGHT if getting else MMC_ERROR] * (hi - lo)
                out.extend(codes)
        return out

    def exists(self, keys: Sequence[str]) -> list[int]:
        keys = list(keys)
        return self._batched("batch_is_exist", self.client.batch_is_exist, len(keys),
                             lambda lo, hi: [keys[lo:hi]])

    @staticmethod
    def unreachable(code: int) -> bool:
        return code in OUTAGE_CODES or code == IN_FLIGHT

    def _move(self, put: bool, keys: Sequence[str], ptrs: list[list[int]], lens: list[list[int]],
              on_late: Callable[[], None] | None) -> list[int]:
        keys = list(keys)
        single = all(len(p) == 1 for p in ptrs)
        name, fn = data_call(self.client, put=put, layers=not single)

        def args(lo: int, hi: int) -> list[Any]:
            p = [x[0] for x in ptrs[lo:hi]] if single else ptrs[lo:hi]
            n = [x[0] for x in lens[lo:hi]] if single else lens[lo:hi]
            if put:
                return [keys[lo:hi], p, n, H2G, self._replicate]
            return [keys[lo:hi], p, n, G2H]

        return self._batched(name, fn, len(keys), args, getting=not put, moving=True, on_late=on_late)

    def put(self, keys: Sequence[str], ptrs: list[list[int]], lens: list[list[int]],
            on_late: Callable[[], None] | None = None) -> list[int]:
        return self._move(True, keys, ptrs, lens, on_late)

    def get(self, keys: Sequence[str], ptrs: list[list[int]], lens: list[list[int]],
            on_late: Callable[[], None] | None = None) -> list[int]:
        return self._move(False, keys, ptrs, lens, on_late)

    def remove(self, keys: Sequence[str]) -> None:
        """Drop objects that failed verification (``remove_batch``, deadline-bounded)."""
        keys = list(keys)
        self._batched("remove_batch", self.client.remove_batch, len(keys), lambda lo, hi: [keys[lo:hi]])

    @staticmethod
    def safe_failure(code: int) -> bool:
        return code in SAFE_GET_FAILURES

    def register(self, ptr: int, nbytes: int) -> int:
        return int(self.client.register_buffer(ptr, nbytes))

    def unregister(self, ptr: int, nbytes: int) -> None:
        self.client.unregister_buffer(ptr, nbytes)

    def close(self) -> None:
        """Close the client, unless a call past its deadline still runs in it (closing
        under it could free memory it writes): then it is left open, logged."""
        self._calls.shutdown()
        if self._calls.overrun:
            log.warning("%s: closing with a call past its deadline still running; the client is "
                        "left open", self.service)
            return
        self.client.close()


def _tier(cfg: MemcacheStoreConfig, client: Any) -> MemcacheTierClient:
    return MemcacheTierClient(client, cfg.meta_service_url, call_timeout_s=cfg.call_timeout_s,
                              replicate=replicate_config(cfg.replica_num))


class RemoteIndex(shared_tier.RemoteIndex):
    """The shared tier's scheduler view on a Memcache meta service (``cfg``: a
    ``MemcacheStoreConfig``); its client is metadata-only unless ``client`` is given."""

    def __init__(self, cfg: MemcacheStoreConfig, world_size: int, *, client: Any = None) -> None:
        if client is None:
            client = _metadata_client(cfg)
        super().__init__(_tier(cfg, client), world_size, cfg.retry_interval_s)


class RemotePages(shared_tier.RemotePages):
    """A worker rank's shared-tier client on Memcache (data path: needs the Ascend
    driver; ``device_id``: the rank's accelerator, whose HBM ``hbm_size`` contributes)."""

    def __init__(self, cfg: MemcacheStoreConfig, planes: Mapping[str, torch.Tensor], rank: int, *,
                 device_id: int = 0, client: Any = None) -> None:
        if client is None:
            client = real_client(meta_service_url=_url(cfg), config_store_url=cfg.config_store_url,
                                 protocol=cfg.protocol, dram_size=cfg.dram_size, hbm_size=cfg.hbm_size,
                                 device_id=device_id, world_size=cfg.world_size,
                                 client_timeout_s=max(1, round(cfg.call_timeout_s)))
        super().__init__(_tier(cfg, client), planes, rank, cfg.retry_interval_s)


def _url(cfg: MemcacheStoreConfig) -> str:
    if not cfg.meta_service_url:
        raise StoreError("the Memcache backend needs 'memcache.meta_service_url' "
                         "(tcp://host:port of the meta service)")
    return str(cfg.meta_service_url)


def _metadata_client(cfg: MemcacheStoreConfig) -> Any:
    try:
        return metadata_client(_url(cfg), cfg.config_store_url)
    except ImportError as exc:
        raise StoreError(f"the Memcache backend needs memcache_hybrid ({exc}); "
                         "pip install 'ascend-offload[ascend]'") from exc
    except RuntimeError as exc:
        raise StoreError(f"{exc}; is the meta service running?") from exc
