"""``SfaRemoteD2HConnector``'s decode worker: one TP rank's pulls of prefill KV.

Each rank runs a :class:`~ascend_offload.pd.consumer.Consumer` that pulls
every layer straight into the rank's own KV blocks and reports the request
received once every layer is terminal; failed blocks become vLLM load errors
(``kv_load_failure_policy`` recomputes or fails them).

Sparse decode offload (``sparse_offload.enabled``): the engine has no main KV
on the device (``connectors/sparse_decode/kv_cut.py``), so the main KV goes
into the host pool of a :class:`~ascend_offload.connectors.sparse_decode.worker.SparseDecodeWorker`
and each layer's indexer cache into vLLM's device blocks (one wire layer: main
+ indexer). Each request is admitted to the pool when this worker expects it
(prompt + max new tokens, counted beforehand by the scheduler's pool ledger),
attached to a hot-buffer row when vLLM first schedules it, and its rows are
released once vLLM finished it and no read into them is in flight. The
connector facade hands the model's attention this worker's sparse decode
adapter.

Hybrid residency (``sparse_offload.hybrid``): the scheduler places a pulled
request in borrowed device rows when it registers the pull; this worker applies
that placement before it expects the pull, and the consumer then lands the
request's main KV straight in its resident rows (``Consumer.expect_pool(...,
rows=)``: per-token rows inside the indexer caches, already registered with the
transfer engine as part of each wire layer's indexer tensor). Its pool rows are
reserved all the same (a move to the pool never fails).
"""

from __future__ import annotations

import ipaddress
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ascend_offload import device
from ascend_offload.config import ConfigError
from ascend_offload.connectors.remote_d2h.kv_region import KVRegion, paged_views
from ascend_offload.connectors.remote_d2h.metadata import RemoteD2HMetadata
from ascend_offload.connectors.remote_d2h.settings import NAME, Settings
from ascend_offload.pd.layout import RowArea, pool_layer_descs
from ascend_offload.pd.protocol import LayerDesc
from ascend_offload.pd.topology import decode_port
from ascend_offload.sparse.prefix_cache import PrefixHit

if TYPE_CHECKING:
    from ascend_offload.connectors.sparse_decode.settings import SparseDecodeSettings
    from ascend_offload.connectors.sparse_decode.worker import SparseDecodeWorker
    from ascend_offload.pd.consumer import Consumer
    from ascend_offload.sparse.pools import HostKVPool

log = logging.getLogger(__name__)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


#: Request ids remembered as reported, to drop a second outcome (a few minutes of traffic).
MAX_REPORTED = 1 << 16


class DecodeWorker:
    """Decode state of one rank: the consumer, and with sparse offload the pool's worker."""

    def __init__(
        self, settings: Settings, tp_rank: int, *, sparse: SparseDecodeSettings | None = None
    ) -> None:
        self.settings = settings
        self.tp_rank = tp_rank
        self.consumer: Consumer | None = None
        self._sparse_settings = sparse
        self._load_errors: set[int] = set()
        self._cancelled: set[str] = set()  # vLLM finished them before their KV arrived
        # Requests already reported to vLLM (received or stopped), newest last, bounded: a
        # request failed twice (a refused registration and an abort in one step, or an abort
        # racing its last read) yields a second outcome, and vLLM's scheduler asserts on a
        # request it hears of twice or no longer holds (that stopped the engine).
        self._reported: OrderedDict[str, None] = OrderedDict()
        self._recv_failed: set[str] = set()  # refused when expected: reported received (failed)
        # Sparse offload: the pool's worker (the model's adapter), per-request state.
        self.sparse: SparseDecodeWorker | None = None
        self.pool: HostKVPool | None = None
        self._pool_jobs: dict[
            str, tuple[int, ...]
        ] = {}  # loading into the pool -> device load-error set
        self._pool_finished: set[str] = set()  # vLLM finished them while their reads were in flight
        # Hybrid residency: per wire layer, where the resident main-KV rows are (a view over
        # the paired indexer cache); a resident request's main KV lands there
        self.row_areas: list[RowArea] | None = None
        self.landed_resident = 0  # pulls expected into resident rows (not the pool)

    # ------------------------------------------------------------------ startup

    def pool_layers(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        pairs: Sequence[tuple[str, str | None]],
        num_blocks: int,
    ) -> list[LayerDesc]:
        """Sparse offload: the wire destination is the host pool for the main KV and
        vLLM's device blocks for each layer's indexer cache."""
        from ascend_offload.connectors.sparse_decode.worker import SparseDecodeWorker

        assert self._sparse_settings is not None
        if any(idx is None for _, idx in pairs):
            missing = [m for m, idx in pairs if idx is None]
            raise ConfigError(
                f"key 'sparse_offload.enabled'=True: main-KV layers {missing[:4]} have "
                "no indexer cache; nothing would select their rows"
            )
        self.sparse = SparseDecodeWorker(self._sparse_settings, kv_caches, tp_rank=self.tp_rank)
        self.pool = self.sparse.manager.pool
        names = [m for m, _ in pairs]
        if list(self.sparse.decode.layer_names) != names:
            raise ConfigError(
                f"sparse main-KV layers {self.sparse.decode.layer_names} != wire layers {names}"
            )
        indexers = [
            paged_views(kv_caches[idx], num_blocks)[0] for _, idx in pairs if idx is not None
        ]
        if any(device.is_accelerator(t) for t in indexers):
            raise ConfigError(
                "key 'sparse_offload.enabled'=True: the indexer caches are device "
                "memory; pulling them into device blocks needs a transfer engine that "
                "reaches device memory (MemFabric), not staged host reads"
            )
        layers = pool_layer_descs(
            self.pool.kv, self.settings.block_size, indexers, kv_row_bytes=self.pool.row_bytes
        )
        area = self.sparse.manager.area
        if area is not None:
            self.row_areas = resident_row_areas(area.views, layers)
        return layers

    def start(self, region: KVRegion) -> None:
        """Listen for prefill's layers: into ``region`` (vLLM's blocks, or the pool's)."""
        from ascend_offload.pd.consumer import Consumer

        s, cfg = self.settings, self.settings.cfg
        assert s.topology is not None
        extra: dict[str, Any] = {"pool_block_size": s.block_size} if self.pool is not None else {}
        if self.row_areas is not None:
            extra["row_areas"] = self.row_areas
        self.consumer = Consumer(
            engine_id=s.engine_id,
            d_rank=self.tp_rank,
            topology=s.topology,
            transfer=region.engine,
            layers=region.layers,
            host=s.host,
            port=decode_port(s.kv_port, dp_rank=s.dp_rank, d_tp=s.tp_size, tp_rank=self.tp_rank),
            read_timeout_s=cfg.read_timeout_s,
            request_timeout_s=cfg.request_timeout_s,
            read_retries=cfg.read_retries,
            register_memory=False,
            keys=s.keys,
            max_peers=cfg.max_prefill_peers,
            reader_idle_s=cfg.reader_idle_s,
            max_msg_bytes=cfg.max_message_mib << 20,
            **extra,
        )
        if s.keys is None and not _loopback(s.host):
            log.warning(
                "%s: decode rank %d listens on %s without authentication; set "
                "'control_secret_file' on both sides unless this network is trusted",
                NAME,
                self.tp_rank,
                self.consumer.address,
            )
        if self.pool is None:
            log.info(
                "%s: decode rank %d pulls into %d layers, listening on %s",
                NAME,
                self.tp_rank,
                len(region.layers),
                self.consumer.address,
            )
            return
        kv = self.pool.kv
        log.info(
            "%s: decode rank %d pulls main KV of %d layers into a host pool of %d rows x %s %s "
            "(%.2f GiB) and their indexer caches into device blocks, listening on %s",
            NAME,
            self.tp_rank,
            kv.shape[0],
            kv.shape[1],
            tuple(kv.shape[2:]),
            kv.dtype,
            kv.numel() * kv.element_size() / 2**30,
            self.consumer.address,
        )

    # ------------------------------------------------------------------ per step

    def apply(self, meta: RemoteD2HMetadata) -> None:
        """Start, fail and cancel this step's pulls."""
        if self.consumer is None:
            return
        if self.pool is not None and meta.sparse is not None:
            assert self.sparse is not None
            # prefix cache orders first (a keep takes over rows of a request finished below,
            # an eviction frees rows a pull below may need); then vLLM's finishes of last
            # step free their rows before this step admits others
            self.sparse.apply_prefix(meta.sparse)
            for rid in meta.sparse.finished:
                self._finish_pool(rid)
            # the rest of the step's sparse facts before the pulls: hybrid residency's orders
            # place a pulled request in its resident rows (the destination below) and copy
            # moved residents' rows out before any read can land in their blocks again
            self.sparse.apply(meta.sparse)
        for job in meta.recv:
            try:
                if self.pool is not None:
                    assert self.sparse is not None
                    # Admission failure ends the request as a failed outcome (load errors below).
                    self._pool_jobs[job.request_id] = job.block_ids
                    # cached prefix blocks: rows shared, indexer rows loaded now, not pulled
                    shared = (
                        self.sparse.decode.take_prefix(job.request_id, job.prefix)
                        if isinstance(job.prefix, PrefixHit)
                        else []
                    )
                    rows = self._resident_rows(job.request_id, job.prompt_tokens)
                    if (
                        self.consumer.expect_pool(
                            job.request_id,
                            self.pool,
                            prompt_tokens=job.prompt_tokens,
                            max_tokens=job.max_tokens,
                            index_blocks=job.block_ids,
                            shared=shared,
                            rows=rows,
                        )
                        and rows is not None
                    ):
                        self.landed_resident += 1
                else:
                    self.consumer.expect(job.request_id, job.block_ids)
            except ValueError as exc:
                self._pool_jobs.pop(job.request_id, None)
                log.error("%s: cannot receive %s: %s", NAME, job.request_id, exc)
                self._load_errors.update(job.block_ids)
                self._recv_failed.add(job.request_id)
        for rid, reason in meta.fail_recv.items():
            if rid not in meta.cancel_recv:  # a cancel fails it below, once
                self.consumer.fail(rid, reason)
        for rid in meta.cancel_recv:
            self._cancelled.add(rid)
            self.consumer.fail(rid, "request finished on decode before its KV arrived")

    def _resident_rows(self, rid: str, prompt_tokens: int) -> list[int] | None:
        """Hybrid residency: the resident rows of a request placed before its pull (its
        prompt lands there), or ``None`` (it lands in the host pool)."""
        assert self.sparse is not None
        area = self.sparse.manager.area
        if self.row_areas is None or area is None or not area.holds(rid):
            return None
        rows = area.rows(rid)
        if rows.numel() < prompt_tokens:  # the scheduler placed it for its prompt: a bug
            raise ValueError(f"resident with {rows.numel()} rows for a prompt of {prompt_tokens}")
        return rows[:prompt_tokens].tolist()

    def get_finished(
        self, finished_req_ids: set[str], wait_s: float = 0.0
    ) -> tuple[set[str], set[str]]:
        """(cancelled pulls now stopped: blocks may be freed, requests received).

        ``wait_s`` > 0 (a step that computes nothing, ``idle_wait_ms``): when no pull has
        ended yet but some are in flight and vLLM finished nothing, wait up to ``wait_s``
        for one to end. The consumer wakes the wait as the outcome is recorded, so a
        finished pull reaches the scheduler at once instead of at a later polling step,
        and vLLM's empty steps (each a round trip through the engine core and every
        worker) stop spinning while the KV is on its way.
        """
        sending: set[str] = set()
        recving: set[str] = set()
        if self.consumer is not None:
            outcomes = self.consumer.finished()
            if not outcomes and wait_s > 0 and not finished_req_ids and self.consumer.active():
                outcomes = self.consumer.wait_finished(1, wait_s)
            for o in outcomes:
                if o.request_id in self._reported:
                    log.debug("%s: request %s: a second outcome ignored", NAME, o.request_id)
                    continue
                self._reported[o.request_id] = None
                while len(self._reported) > MAX_REPORTED:
                    self._reported.popitem(last=False)
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
                    self._load_errors.update(
                        o.failed_blocks if device_blocks is None else device_blocks
                    )
                    log.warning(
                        "%s: request %s: %d blocks failed to load: %s",
                        NAME,
                        o.request_id,
                        len(o.failed_blocks),
                        "; ".join(o.reasons)[:500],
                    )
            for rid in self._recv_failed - sending - recving:
                if rid not in self._reported:
                    self._reported[rid] = None
                    recving.add(rid)
            self._recv_failed.clear()
        if self.pool is not None:
            for rid in finished_req_ids:
                self._finish_pool(rid)
        return sending, recving

    def _finish_pool(self, rid: str) -> None:
        """vLLM finished ``rid``: free its rows now, or when its reads' outcome arrives."""
        if rid in self._pool_jobs:
            self._pool_finished.add(rid)
        else:
            self._release_pool(rid)

    def _release_pool(self, rid: str) -> None:
        """vLLM finished ``rid`` and no read into its rows is in flight: free them (idempotent)."""
        assert self.pool is not None and self.sparse is not None
        self.sparse.decode.finish(rid)  # hot row and residency, if it was attached
        self.pool.release(rid)

    def totals(self) -> dict[str, int]:
        """Monotonic counters of this rank's pulls (connector metrics)."""
        if self.consumer is None:
            return {}
        st = self.consumer.stats
        return {
            "layers_pulled": st.reads,
            "bytes_pulled": st.bytes_read,
            "read_descriptors": st.descriptors,
            "read_failures": st.failed,
            "read_retries": st.read_retries,
            "rejected_messages": st.rejected,
            "resident_pulls": self.landed_resident,
        }

    def gauges(self) -> dict[str, int]:
        """This rank's receive state (0 when idle): in-flight reads, parked messages,
        requests being received."""
        if self.consumer is None:
            return {}
        return {
            "inflight_reads": self.consumer.inflight(),
            "parked_messages": self.consumer.parked(),
            "active_requests": len(self.consumer.active()),
        }

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        if self.sparse is not None:  # resumed preempted requests whose stash did not load
            out |= self.sparse.take_load_errors()
        return out

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()


def resident_row_areas(views: Sequence[torch.Tensor], layers: Sequence[LayerDesc]) -> list[RowArea]:
    """Hybrid residency's resident rows as the consumer's row areas, one per wire layer.

    Why they need no registration of their own: main-KV layer ``i`` keeps its resident rows
    in indexer layer ``i``'s borrowed blocks (``sparse/hybrid.py``), and each wire layer
    carries that indexer cache as its ``indexer`` tensor, whose whole span the region
    registers. Checked here: the view starts at its wire layer's indexer tensor and ends
    inside it (a layer pairing that differed would land rows in another layer's cache).
    """
    if len(views) != len(layers):
        raise ConfigError(
            f"key 'sparse_offload.hybrid'=True: {len(views)} resident row views for "
            f"{len(layers)} wire layers"
        )
    out = []
    for i, (v, layer) in enumerate(zip(views, layers, strict=True)):
        area = RowArea(v.data_ptr(), v.stride(0) * v.element_size(), v.shape[0])
        idx = layer.indexer
        span_end = (
            idx.base_addr + (idx.num_blocks - 1) * idx.block_stride + idx.block_bytes
            if idx is not None and idx.num_blocks
            else 0
        )
        if idx is None or area.base_addr != idx.base_addr or area.end > span_end:
            raise ConfigError(
                f"key 'sparse_offload.hybrid'=True: wire layer {i}'s resident rows "
                f"[{area.base_addr:#x}, {area.end:#x}) are not its indexer cache's "
                f"blocks ({idx}); accepted: False"
            )
        out.append(area)
    return out
