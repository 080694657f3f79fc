"""``SfaRemoteD2HConnector``'s decode worker: one TP rank's pulls of prefill KV.

Each rank runs a :class:`~ascend_offload.pd.consumer.Consumer` that pulls
every layer straight into the rank's own KV blocks and reports the request
received once every layer is terminal; failed blocks become vLLM load errors
(``kv_load_failure_policy`` recomputes or fails them).

Sparse decode offload (``sparse_offload.enabled``): the main KV goes into a
host KV pool instead. Each request is admitted to the pool when this worker
expects it (prompt + max new tokens; exhaustion fails that request as load
errors, never an overwrite), and its rows are released once vLLM finished the
request and no read into them is in flight. vLLM has no sparse-attention
backend that decodes from the pool, so this mode requires an explicit
attention-backend hook (``ASCEND_OFFLOAD_SPARSE_ATTENTION_HOOK``, see
docs/sparse.md "Integration seam").
"""

from __future__ import annotations

import importlib
import ipaddress
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ascend_offload.config import ConfigError
from ascend_offload.connectors.remote_d2h.kv_region import KVRegion
from ascend_offload.connectors.remote_d2h.metadata import RemoteD2HMetadata
from ascend_offload.connectors.remote_d2h.settings import NAME, Settings
from ascend_offload.pd.layout import pool_layer_descs, pool_row_shape
from ascend_offload.pd.protocol import LayerDesc
from ascend_offload.pd.topology import decode_port

if TYPE_CHECKING:
    from ascend_offload.pd.consumer import Consumer
    from ascend_offload.sparse.pools import HostKVPool

log = logging.getLogger(__name__)

# "<module>:<callable>" of the attention-backend hook that decodes from the host pool
# (required with sparse_offload.enabled on decode; see load_sparse_hook).
SPARSE_HOOK_ENV = "ASCEND_OFFLOAD_SPARSE_ATTENTION_HOOK"

SparseHook = Callable[..., Any]


def load_sparse_hook(spec: str | None) -> SparseHook:
    """Resolve the attention-backend hook ``"<module>:<callable>"`` (startup error if unusable).

    Why required: with sparse offload on, the prompt KV lands in the host
    pool, not in vLLM's KV blocks; only a sparse-attention backend that drives
    :class:`~ascend_offload.sparse.manager.SparseOffloadManager` over that pool
    can decode correctly. vLLM (CPU here) has none, so without a hook decoding
    would silently read empty blocks: refused instead.
    """
    if not spec:
        raise ConfigError(
            "key 'sparse_offload.enabled'=True on decode: the prompt KV goes to the host pool and "
            "only a sparse-attention backend that decodes from it can use it; vLLM provides none. "
            f"Set {SPARSE_HOOK_ENV}=<module>:<factory> (docs/sparse.md 'Integration seam') or set "
            "'sparse_offload.enabled' to False")
    mod, _, attr = spec.partition(":")
    try:
        hook = getattr(importlib.import_module(mod), attr) if attr else None
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{SPARSE_HOOK_ENV}={spec!r}: cannot load it ({exc})") from None
    if not callable(hook):
        raise ConfigError(f"{SPARSE_HOOK_ENV}={spec!r}: expected '<module>:<callable>'")
    return hook


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def sparse_hook_from_env() -> SparseHook:
    """The hook named by :data:`SPARSE_HOOK_ENV` (checked in every role, so a scheduler fails too)."""
    return load_sparse_hook(os.environ.get(SPARSE_HOOK_ENV))


class DecodeWorker:
    """Decode state of one rank: the consumer, and with sparse offload the pool and its hook."""

    def __init__(self, settings: Settings, tp_rank: int, *, sparse_hook: SparseHook | None = None,
                 vllm_config: Any = None) -> None:
        self.settings = settings
        self.tp_rank = tp_rank
        self.consumer: Consumer | None = None
        self._sparse_hook = sparse_hook
        self._vllm_config = vllm_config  # handed to the sparse hook
        self._load_errors: set[int] = set()
        self._cancelled: set[str] = set()  # vLLM finished them before their KV arrived
        self._recv_failed: set[str] = set()  # refused when expected: reported received (failed)
        # Sparse offload: the host pool, the backend hook's object, per-request state.
        self.pool: HostKVPool | None = None
        self._hook_obj: Any = None
        self._pool_names: list[str] = []
        self._pool_jobs: dict[str, tuple[int, ...]] = {}  # loading into the pool -> device load-error set
        self._pool_finished: set[str] = set()  # vLLM finished them while their reads were in flight

    # ------------------------------------------------------------------ startup

    def pool_layers(self, kv_caches: Mapping[str, torch.Tensor], names: Sequence[str],
                    num_blocks: int) -> list[LayerDesc]:
        """Sparse offload: build the host KV pool (main KV only); its layouts are the destination.

        Every registered KV tensor must hold one row per token (MLA); an
        indexer cache registered as its own layer cannot be pooled and fails
        here (the core supports a device-side indexer, ``Consumer.expect_pool``
        ``index_blocks``; this adapter does not separate it yet).
        """
        from ascend_offload.sparse.pools import HostKVPool, pool_rows_from_config

        block_size = self.settings.block_size
        row_shape, dtype = pool_row_shape({n: kv_caches[n] for n in names}, num_blocks, block_size)
        rows = pool_rows_from_config(self.settings.cfg.sparse_offload, num_layers=len(names),
                                     row_shape=row_shape, dtype=dtype, block_size=block_size)
        # One private pool per TP rank: MLA main KV is replicated, each rank's consumer fills its own.
        self.pool = HostKVPool(len(names), rows, row_shape, dtype, block_size)
        self._pool_names = list(names)
        row_bytes = math.prod(row_shape) * torch.empty(0, dtype=dtype).element_size()
        return pool_layer_descs(self.pool.kv, block_size, kv_row_bytes=row_bytes)

    def start(self, region: KVRegion) -> None:
        """Listen for prefill's layers: into ``region`` (vLLM's blocks, or the pool's)."""
        from ascend_offload.pd.consumer import Consumer

        s, cfg = self.settings, self.settings.cfg
        assert s.topology is not None
        extra: dict[str, Any] = {"pool_block_size": s.block_size} if self.pool is not None else {}
        self.consumer = Consumer(
            engine_id=s.engine_id, d_rank=self.tp_rank, topology=s.topology, transfer=region.engine,
            layers=region.layers, host=s.host,
            port=decode_port(s.kv_port, dp_rank=s.dp_rank, d_tp=s.tp_size, tp_rank=self.tp_rank),
            read_timeout_s=cfg.read_timeout_s, request_timeout_s=cfg.request_timeout_s,
            read_retries=cfg.read_retries, register_memory=False, keys=s.keys,
            max_peers=cfg.max_prefill_peers, reader_idle_s=cfg.reader_idle_s,
            max_msg_bytes=cfg.max_message_mib << 20, **extra,
        )
        if s.keys is None and not _loopback(s.host):
            log.warning("%s: decode rank %d listens on %s without authentication; set "
                        "'control_secret_file' on both sides unless this network is trusted",
                        NAME, self.tp_rank, self.consumer.address)
        if self.pool is None:
            log.info("%s: decode rank %d pulls into %d layers, listening on %s", NAME, self.tp_rank,
                     len(region.layers), self.consumer.address)
            return
        assert self._sparse_hook is not None
        self._hook_obj = self._sparse_hook(pool=self.pool, layer_names=self._pool_names,
                                           vllm_config=self._vllm_config)
        kv = self.pool.kv
        log.info("%s: decode rank %d pulls main KV of %d layers into a host pool of %d rows x %s %s "
                 "(%.2f GiB), listening on %s", NAME, self.tp_rank, len(self._pool_names), kv.shape[1],
                 tuple(kv.shape[2:]), kv.dtype, kv.numel() * kv.element_size() / 2**30,
                 self.consumer.address)

    # ------------------------------------------------------------------ per step

    def apply(self, meta: RemoteD2HMetadata) -> None:
        """Start, fail and cancel this step's pulls."""
        if self.consumer is None:
            return
        for job in meta.recv:
            try:
                if self.pool is not None:
                    # Admission failure ends the request as a failed outcome (load errors below).
                    self._pool_jobs[job.request_id] = job.block_ids
                    self.consumer.expect_pool(job.request_id, self.pool, prompt_tokens=job.prompt_tokens,
                                              max_tokens=job.max_tokens)
                else:
                    self.consumer.expect(job.request_id, job.block_ids)
            except ValueError as exc:
                self._pool_jobs.pop(job.request_id, None)
                log.error("%s: cannot receive %s: %s", NAME, job.request_id, exc)
                self._load_errors.update(job.block_ids)
                self._recv_failed.add(job.request_id)
        for rid, reason in meta.fail_recv.items():
            self.consumer.fail(rid, reason)
        for rid in meta.cancel_recv:
            self._cancelled.add(rid)
            self.consumer.fail(rid, "request finished on decode before its KV arrived")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(cancelled pulls now stopped: blocks may be freed, requests received)."""
        sending: set[str] = set()
        recving: set[str] = set()
        if self.consumer is not None:
            for o in self.consumer.finished():
                device_blocks = self._pool_jobs.pop(o.request_id, None)
                if self.pool is not None and o.request_id in self._pool_finished | self._cancelled:
                    self._pool_finished.discard(o.request_id)
                    self._release_pool(o.request_id)  # finished earlier; its last read is over now
                if o.request_id in self._cancelled:
                    self._cancelled.discard(o.request_id)
                    sending.add(o.request_id)  # blocks may be freed now
                    continue
                recving.add(o.request_id)
                if not o.ok:
                    # Pool destination: failed_blocks are pool blocks; vLLM must hear of its own
                    # device blocks, and a partial pool prompt is unusable, so all of them fail.
                    self._load_errors.update(o.failed_blocks if device_blocks is None else device_blocks)
                    log.warning("%s: request %s: %d blocks failed to load: %s", NAME, o.request_id,
                                len(o.failed_blocks), "; ".join(o.reasons)[:500])
            recving |= self._recv_failed
            self._recv_failed.clear()
        if self.pool is not None:
            for rid in finished_req_ids:
                if rid in self._pool_jobs:
                    self._pool_finished.add(rid)  # released when its outcome arrives
                else:
                    self._release_pool(rid)
        return sending, recving

    def _release_pool(self, rid: str) -> None:
        """vLLM finished ``rid`` and no read into its rows is in flight: free them (idempotent)."""
        assert self.pool is not None
        done = getattr(self._hook_obj, "request_finished", None)
        if done is not None:
            try:
                done(rid)
            except Exception:  # the backend's bookkeeping must not leak our rows
                log.exception("%s: sparse hook request_finished(%s) failed", NAME, rid)
        self.pool.release(rid)

    def totals(self) -> dict[str, int]:
        """Monotonic counters of this rank's pulls (connector metrics)."""
        if self.consumer is None:
            return {}
        st = self.consumer.stats
        return {"layers_pulled": st.reads, "bytes_pulled": st.bytes_read, "read_descriptors": st.descriptors,
                "read_failures": st.failed, "read_retries": st.read_retries, "rejected_messages": st.rejected}

    def gauges(self) -> dict[str, int]:
        """This rank's receive state (0 when idle): in-flight reads, parked messages,
        requests being received."""
        if self.consumer is None:
            return {}
        return {"inflight_reads": self.consumer.inflight(), "parked_messages": self.consumer.parked(),
                "active_requests": len(self.consumer.active())}

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
