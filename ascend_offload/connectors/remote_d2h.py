"""``SfaRemoteD2HConnector``: vLLM adapter of the P/D pull (``ascend_offload.pd``).

Decode (``kv_consumer``) — scheduler side: a request carrying
``do_remote_prefill`` + ``metaserver`` is reported as an asynchronous external
load of its whole prompt; once decode's blocks are allocated, the scheduler
registers its endpoint and destination blocks with the proxy metaserver (in the
background, retries + deadline) and tells its workers to expect the request.
Worker side: each TP rank runs a :class:`~ascend_offload.pd.consumer.Consumer`
that pulls every layer straight into the rank's own KV blocks (sparse decode
offload off, so any model works) and reports the request received once every
layer is terminal; failed blocks become vLLM load errors
(``kv_load_failure_policy`` recomputes or fails them).

Prefill (``kv_producer``) — scheduler side: requests carrying
``do_remote_decode`` are tracked; in the step where a request's prompt
finishes computing, its blocks and decode target go to the workers. Worker
side: after each attention layer (``save_kv_layer``) the rank's
:class:`~ascend_offload.pd.producer.Producer` publishes that layer to decode;
blocks are freed only after decode answered for every layer or the ack
deadline passed (``request_finished`` delays the free).

Sparse decode offload (``sparse_offload.enabled``, decode only): the main KV
goes straight into the host KV pool instead of device blocks. Each request is
admitted to the pool when its workers expect it (prompt + max new tokens;
exhaustion fails that request as load errors, never an overwrite), the whole
prompt is pulled (local prefix hits live in device blocks, not the pool), and
the rows are released once vLLM finished the request and no read into them is
in flight. vLLM has no sparse-attention backend that decodes from the pool, so
this mode requires an explicit attention-backend hook
(``ASCEND_OFFLOAD_SPARSE_ATTENTION_HOOK``, see docs/sparse.md "Integration seam").
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ascend_offload import device
from ascend_offload.config import ConfigError, RemoteD2HConfig, parse_extra_config
from ascend_offload.pd.layout import extents, layer_desc, pool_layer_descs
from ascend_offload.pd.protocol import LayerDesc
from ascend_offload.pd.registration import Registrar
from ascend_offload.pd.topology import Topology, TopologyError, decode_port

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from ascend_offload.pd.consumer import Consumer
    from ascend_offload.pd.producer import Producer
    from ascend_offload.sparse.pools import HostKVPool
    from ascend_offload.transfer.base import TransferEngine

log = logging.getLogger(__name__)

NAME = "SfaRemoteD2HConnector"
# Test-only fault injection on the prefill side, e.g. "none,invalid:1,drop:2"
# (see ascend_offload.pd.producer.parse_faults). Unset in production.
FAULTS_ENV = "ASCEND_OFFLOAD_PD_FAULTS"
# Keys decode registers with the metaserver (and prefill then receives).
# "<module>:<callable>" of the attention-backend hook that decodes from the host pool
# (required with sparse_offload.enabled on decode; see load_sparse_hook).
SPARSE_HOOK_ENV = "ASCEND_OFFLOAD_SPARSE_ATTENTION_HOOK"
REMOTE_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_tp_size", "remote_dp_rank",
               "remote_request_id", "remote_block_ids", "remote_block_offset")


# ----------------------------------------------------------------------------- metadata


@dataclasses.dataclass(frozen=True)
class RecvJob:
    request_id: str
    block_ids: tuple[int, ...]  # decode device blocks loaded externally (the load-error set)
    # Sparse offload only: the whole prompt goes to the host pool, reserved for max_tokens.
    prompt_tokens: int = 0
    max_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class SendJob:
    request_id: str  # prefill's own id
    remote_request_id: str  # decode's id: the name on the wire
    block_ids: tuple[int, ...]  # prefill blocks, aligned with decode's block list
    host: str
    kv_port: int
    d_tp: int
    dp_rank: int


@dataclasses.dataclass
class RemoteD2HMetadata(KVConnectorMetadata):
    recv: list[RecvJob] = dataclasses.field(default_factory=list)
    fail_recv: dict[str, str] = dataclasses.field(default_factory=dict)
    cancel_recv: list[str] = dataclasses.field(default_factory=list)
    send: list[SendJob] = dataclasses.field(default_factory=list)


# ----------------------------------------------------------------------------- helpers


def block_views(t: torch.Tensor, block_dim: int) -> list[torch.Tensor]:
    """Split a paged KV tensor into tensors indexed by block on dim 0, each block contiguous.

    ``(2, num_blocks, ...)`` (K and V halves) gives two views; ``(num_blocks, ...)``
    one. Dimensions before the block dimension, and after it while a block is
    not contiguous, are unrolled.
    """
    if block_dim > 0:
        return [v for i in range(t.shape[0]) for v in block_views(t[i], block_dim - 1)]
    if t.shape[0] == 0 or t[0].is_contiguous():
        return [t]
    if t.dim() < 2:
        raise ValueError(f"KV tensor shape={tuple(t.shape)} stride={t.stride()}: blocks not contiguous")
    return [v for j in range(t.shape[1]) for v in block_views(t[:, j], 0)]


def find_block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The dimension indexing blocks: prefer dim 1 of a (2, num_blocks, ...) K/V stack."""
    if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return 1
    for i, n in enumerate(t.shape):
        if n == num_blocks:
            return i
    raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV tensor {tuple(t.shape)}")


def layer_order(names: list[str]) -> list[str]:
    """Attention layers in model order (both nodes must agree on layer indices)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return sorted(names, key=lambda n: (extract_layer_index(n), n))


def _wire_logging() -> None:
    """Let ``ascend_offload.*`` loggers print through vLLM's handlers (vLLM configures only its own)."""
    ours = logging.getLogger("ascend_offload")
    if ours.handlers:
        return
    for h in logging.getLogger("vllm").handlers:
        ours.addHandler(h)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def check_sparse_role(cfg: RemoteD2HConfig, *, is_producer: bool, is_consumer: bool) -> None:
    """Sparse offload is decode-only; refuse it anywhere else at startup (I7)."""
    if not cfg.sparse_offload.enabled:
        return
    if is_producer:
        raise ConfigError(
            "key 'sparse_offload.enabled'=True on a kv_producer (prefill): sparse offload is a "
            "decode-side feature (accepted here: False; set it in the kv_consumer's config)")
    if not is_consumer:
        raise ConfigError("key 'sparse_offload.enabled'=True needs kv_role 'kv_consumer' (accepted: False)")


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


def pool_row_shape(layers: dict[str, torch.Tensor], num_blocks: int, block_size: int
                   ) -> tuple[tuple[int, ...], torch.dtype]:
    """Per-token main-KV row shape shared by every layer (MLA: one latent row per token).

    The host pool holds one row per token and layer; a K/V pair or layers of
    different widths cannot be pooled, which is a startup error naming both.
    """
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    first = ""
    for name, t in layers.items():
        views = block_views(t, find_block_dim(t, num_blocks))
        if len(views) != 1 or views[0].dim() < 2 or views[0].shape[1] != block_size:
            raise ConfigError(
                f"key 'sparse_offload.enabled'=True: KV cache of {name} {tuple(t.shape)} is not one "
                f"[num_blocks, block_size={block_size}, ...] tensor (MLA); the host pool holds one "
                "main-KV row per token")
        row, dt = tuple(views[0].shape[2:]), views[0].dtype
        if shape is None:
            shape, dtype, first = row, dt, name
        elif (row, dt) != (shape, dtype):
            raise ConfigError(
                f"key 'sparse_offload.enabled'=True: KV row of {name} is {row} {dt}, of {first} "
                f"{shape} {dtype}; one host pool needs the same row in every layer")
    if shape is None or dtype is None:
        raise ConfigError("key 'sparse_offload.enabled'=True: no KV cache layers registered")
    return shape, dtype


def _host_ip(configured: str = "") -> str:
    """The advertised endpoint IP: the ``host`` key when set, else vLLM's choice."""
    if configured:
        return configured
    from vllm.utils.network_utils import get_ip

    return get_ip()


# ----------------------------------------------------------------------------- connector


class SfaRemoteD2HConnector(KVConnectorBase_V1):
    """P/D pull connector; see the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _wire_logging()
        tc = vllm_config.kv_transfer_config
        self.cfg: RemoteD2HConfig = parse_extra_config(NAME, tc.kv_connector_extra_config)
        check_sparse_role(self.cfg, is_producer=bool(tc.is_kv_producer), is_consumer=bool(tc.is_kv_consumer))
        self.sparse = self.cfg.sparse_offload.enabled
        self._sparse_hook = load_sparse_hook(os.environ.get(SPARSE_HOOK_ENV)) if self.sparse else None
        if self.cfg.transfer_backend != "mooncake":
            raise ConfigError(f"key 'transfer_backend'={self.cfg.transfer_backend!r}: needs the Ascend "
                              "driver, not available here (accepted: 'mooncake')")
        self.is_producer = bool(tc.is_kv_producer)
        self.is_consumer = bool(tc.is_kv_consumer)
        self.engine_id = str(tc.engine_id)
        self.kv_port = int(tc.kv_port)
        self.block_size = vllm_config.cache_config.block_size
        pc = vllm_config.parallel_config
        self.tp_size = pc.tensor_parallel_size
        self.dp_rank = getattr(pc, "data_parallel_rank", 0) or 0
        if self.is_consumer:
            p_tp = self.cfg.prefill_tp_size or self.tp_size
            try:
                self.topology = Topology(p_tp, self.tp_size)
            except TopologyError as exc:
                raise ConfigError(f"key 'prefill_tp_size'={p_tp}: {exc}") from None
            if self.topology.ratio > 1 and not vllm_config.model_config.use_mla:
                raise ConfigError(
                    f"key 'prefill_tp_size'={p_tp} with decode tp={self.tp_size}: a prefill TP larger "
                    "than decode's needs replicated (MLA) KV; this model shards KV by head "
                    f"(accepted: {self.tp_size})"
                )
        self.host = _host_ip(self.cfg.host)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer must run between layers

    # ======================================================================= scheduler

    def _init_scheduler(self) -> None:
        self._registrar = Registrar(timeout_s=self.cfg.registration_timeout_s,
                                    retries=self.cfg.registration_retries) if self.is_consumer else None
        self._recv_new: list[RecvJob] = []
        self._recv_fail: dict[str, str] = {}
        self._recv_cancel: list[str] = []
        self._recving: set[str] = set()
        self._send_pending: dict[str, Request] = {}
        self._send_new: list[SendJob] = []
        self._sending: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if self.is_consumer and params and params.get("do_remote_prefill"):
            count = request.num_prompt_tokens - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        if self.is_consumer and params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False  # one transfer per request
            if num_external_tokens <= 0:
                return
            mgr = getattr(self, "_kv_cache_manager", None)
            all_blocks = list(mgr.get_block_ids(rid)[0]) if mgr is not None else list(blocks.get_block_ids()[0])
            # request.num_computed_tokens is not set yet here; local prefix hits are
            # whatever get_num_new_matched_tokens did not claim (whole blocks).
            first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
            n = math.ceil(request.num_prompt_tokens / self.block_size) - first
            dst = tuple(all_blocks[first:first + n])  # loaded externally: the load-error set
            wire_first, wire_dst = first, dst
            if self.sparse:
                # The host pool needs the whole prompt: local prefix hits are device blocks, not pool rows.
                wire_first, wire_dst = 0, tuple(all_blocks[:first + n])
                self._recv_new.append(RecvJob(rid, dst, request.num_prompt_tokens,
                                              request.num_prompt_tokens + request.max_tokens))
            else:
                self._recv_new.append(RecvJob(rid, dst))
            self._recving.add(rid)
            url, prid = params.get("metaserver"), params.get("proxy_request_id")
            if len(dst) != n:
                self._recv_fail[rid] = f"decode allocated {len(dst)} blocks, the prompt needs {n}"
            elif not url or not prid:
                self._recv_fail[rid] = "kv_transfer_params lacks 'metaserver' or 'proxy_request_id'"
            else:
                assert self._registrar is not None
                self._registrar.submit(rid, url, prid, {
                    "remote_engine_id": self.engine_id, "remote_host": self.host, "remote_port": self.kv_port,
                    "remote_tp_size": self.tp_size, "remote_dp_rank": self.dp_rank,
                    "remote_request_id": rid, "remote_block_ids": list(wire_dst),
                    "remote_block_offset": wire_first,
                })
        elif self.is_producer and params.get("do_remote_decode"):
            missing = [k for k in ("remote_host", "remote_port", "remote_request_id", "remote_block_ids")
                       if k not in params]
            if missing:
                log.error("%s: request %s has do_remote_decode but lacks %s; decode will not get its KV",
                          NAME, rid, missing)
                return
            self._send_pending[rid] = request

    def _send_job(self, request: Request) -> SendJob | None:
        params = request.kv_transfer_params or {}
        mgr = getattr(self, "_kv_cache_manager", None)
        if mgr is None:
            log.error("%s: no KV cache manager bound; cannot send %s", NAME, request.request_id)
            return None
        mine = list(mgr.get_block_ids(request.request_id)[0])
        offset = int(params.get("remote_block_offset", 0))
        want = len(params["remote_block_ids"])
        src = mine[offset:offset + want]
        if len(src) != want:
            log.error("%s: request %s has %d prefill blocks from offset %d; decode expects %d",
                      NAME, request.request_id, len(mine), offset, want)
            return None
        return SendJob(request.request_id, str(params["remote_request_id"]), tuple(src),
                       str(params["remote_host"]), int(params["remote_port"]),
                       int(params.get("remote_tp_size", 1)), int(params.get("remote_dp_rank", 0)))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RemoteD2HMetadata(recv=self._recv_new, cancel_recv=self._recv_cancel)
        self._recv_new, self._recv_cancel = [], []
        if self._registrar is not None:
            for rid, err in self._registrar.poll().items():
                if err is not None and rid in self._recving:
                    log.error("%s: request %s: %s", NAME, rid, err)
                    self._recv_fail[rid] = str(err)
        meta.fail_recv, self._recv_fail = self._recv_fail, {}
        scheduled = scheduler_output.num_scheduled_tokens
        for rid, req in list(self._send_pending.items()):
            n = scheduled.get(rid, 0)
            if n and req.num_computed_tokens + n >= req.num_prompt_tokens:
                del self._send_pending[rid]
                job = self._send_job(req)
                if job is not None:
                    log.debug("%s: %s prefill completes this step; %d blocks -> decode %s:%d as %s", NAME,
                              rid, len(job.block_ids), job.host, job.kv_port, job.remote_request_id)
                    meta.send.append(job)
                    self._sending.add(rid)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._send_pending.pop(rid, None)
        if rid in self._recving:
            # Still pulling into these blocks: they must not be reused before the
            # consumer stops; the worker reports the request "sent" when it has.
            self._recv_cancel.append(rid)
            return True, None
        if rid in self._sending:
            return True, None  # decode still reads these blocks
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_recving or ():
            self._recving.discard(rid)
        for rid in connector_output.finished_sending or ():
            self._sending.discard(rid)
            self._recving.discard(rid)

    # ======================================================================= worker

    def _init_worker(self) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.tp_rank = get_tensor_model_parallel_rank()
        self._engine: TransferEngine | None = None
        self._consumer: Consumer | None = None
        self._producers: dict[int, Producer] = {}
        self._layers: list[LayerDesc] = []
        self._layer_index: dict[str, int] = {}
        self._registered: list[int] = []
        self._load_errors: set[int] = set()
        self._cancelled: set[str] = set()
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._cancel_done: set[str] = set()
        self._step_sends: dict[int, list[str]] = {}
        self._by_remote: dict[tuple[int, str], str] = {}  # (decode tp, decode id) -> our id
        self._own: dict[str, tuple[int, str]] = {}  # our id -> (decode tp, decode id)
        self._send_layers: dict[str, int] = {}
        self._send_done: set[str] = set()
        self._seen_finished: set[str] = set()
        self._prepared: RemoteD2HMetadata | None = None
        # Sparse offload (decode): the host pool, the backend hook's object, per-request state.
        self._pool: HostKVPool | None = None
        self._hook_obj: Any = None
        self._pool_jobs: dict[str, tuple[int, ...]] = {}  # loading into the pool -> device load-error set
        self._pool_finished: set[str] = set()  # vLLM finished them while their reads were in flight
        # Layer sharing on this prefill (AscendMultiConnector): decode reads hold the slot.
        self._gate: Any = None
        self._gate_pipeline: Any = None
        self._gate_tokens: dict[str, tuple[int, dict[int, Any]]] = {}  # layer -> (slot, d_tp -> token)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        names = layer_order(list(kv_caches))
        self._layer_index = {n: i for i, n in enumerate(names)}
        if self.sparse:
            self._register_pool(kv_caches, names, num_blocks)
            return
        for name in names:
            t = kv_caches[name]
            if t.device.type != "cpu":
                raise ConfigError(f"{NAME}: KV cache of {name} is on {t.device}; the Mooncake backend here "
                                  "reads host memory (device memory needs the Ascend backend)")
            self._layers.append(layer_desc(block_views(t, find_block_dim(t, num_blocks))))
        self._open_engine()
        if self.is_consumer:
            self._consumer = self._make_consumer()
            log.info("%s: decode rank %d pulls into %d layers, listening on %s", NAME, self.tp_rank,
                     len(self._layers), self._consumer.address)

    def _open_engine(self) -> None:
        """The transfer engine, with every extent of ``self._layers`` registered."""
        from ascend_offload.transfer.base import create_engine

        self._engine = create_engine("mooncake", host=self.host, protocol=self.cfg.mooncake_protocol,
                                     device_name=self.cfg.mooncake_device_name,
                                     timeout_s=self.cfg.read_timeout_s)
        for addr, length in extents(self._layers):
            self._engine.register(addr, length)
            self._registered.append(addr)

    def _make_consumer(self, **extra: Any) -> Consumer:
        """This decode rank's consumer over ``self._layers`` (memory already registered)."""
        from ascend_offload.pd.consumer import Consumer

        port = decode_port(self.kv_port, dp_rank=self.dp_rank, d_tp=self.tp_size, tp_rank=self.tp_rank)
        return Consumer(
            engine_id=self.engine_id, d_rank=self.tp_rank, topology=self.topology, transfer=self._engine,
            layers=self._layers, host=self.host, port=port, read_timeout_s=self.cfg.read_timeout_s,
            request_timeout_s=self.cfg.request_timeout_s, read_retries=self.cfg.read_retries,
            register_memory=False, **extra,
        )

    def _register_pool(self, kv_caches: dict[str, torch.Tensor], names: list[str], num_blocks: int) -> None:
        """Sparse offload, decode: the consumer's destination is the host KV pool (main KV only).

        Every registered KV tensor must hold one row per token (MLA); an
        indexer cache registered as its own layer cannot be pooled and fails
        here (the core supports a device-side indexer, ``Consumer.expect_pool``
        ``index_blocks``; this adapter does not separate it yet).
        """
        from ascend_offload.sparse.pools import HostKVPool, pool_rows_from_config

        row_shape, dtype = pool_row_shape({n: kv_caches[n] for n in names}, num_blocks, self.block_size)
        rows = pool_rows_from_config(self.cfg.sparse_offload, num_layers=len(names), row_shape=row_shape,
                                     dtype=dtype, block_size=self.block_size)
        # One private pool per TP rank: MLA main KV is replicated, each rank's consumer fills its own.
        self._pool = HostKVPool(len(names), rows, row_shape, dtype, self.block_size)
        row_bytes = math.prod(row_shape) * torch.empty(0, dtype=dtype).element_size()
        self._layers = pool_layer_descs(self._pool.kv, self.block_size, kv_row_bytes=row_bytes)
        self._open_engine()
        self._consumer = self._make_consumer(pool_block_size=self.block_size)
        assert self._sparse_hook is not None
        self._hook_obj = self._sparse_hook(pool=self._pool, layer_names=names, vllm_config=self._vllm_config)
        log.info("%s: decode rank %d pulls main KV of %d layers into a host pool of %d rows x %s %s "
                 "(%.2f GiB), listening on %s", NAME, self.tp_rank, len(names), rows, row_shape, dtype,
                 self._pool.kv.numel() * self._pool.kv.element_size() / 2**30, self._consumer.address)

    def _release_pool(self, rid: str) -> None:
        """vLLM finished ``rid`` and no read into its rows is in flight: free them (idempotent)."""
        assert self._pool is not None
        done = getattr(self._hook_obj, "request_finished", None)
        if done is not None:
            try:
                done(rid)
            except Exception:  # the backend's bookkeeping must not leak our rows
                log.exception("%s: sparse hook request_finished(%s) failed", NAME, rid)
        self._pool.release(rid)

    def _producer(self, d_tp: int) -> Producer:
        prod = self._producers.get(d_tp)
        if prod is None:
            from ascend_offload.pd.producer import Producer, gate_listener

            assert self._engine is not None
            prod = Producer(engine_id=self.engine_id, p_rank=self.tp_rank, topology=Topology(self.tp_size, d_tp),
                            transfer=self._engine, layers=self._layers, ack_timeout_s=self.cfg.ack_timeout_s,
                            request_timeout_s=self.cfg.request_timeout_s, register_memory=False,
                            faults=os.environ.get(FAULTS_ENV) or None,
                            listener=gate_listener(self._gate) if self._gate is not None else None)
            self._producers[d_tp] = prod
        return prod

    def attach_reuse_gate(self, pipeline: Any) -> None:
        """Layer sharing on this prefill: the physical slot of a layer is reused by a later
        layer within the same forward, so decode's reads of it must hold the slot.

        ``pipeline`` is the store connector's layerwise pipeline. In its ``save_layer``
        (before the slot is handed on) one gate consumer is registered per decode TP
        size this step sends to; the layer is published on that gate slot with the
        token as tag, and the producer releases the token when every read of it
        answered or the ack deadline passed (``gate_listener``). Called by
        ``AscendMultiConnector``; needs ``use_layerwise`` (publish per layer).
        """
        from ascend_offload.pd.producer import gate_listener

        if not self.cfg.use_layerwise:
            raise ConfigError(f"{NAME}: key 'use_layerwise'=False with layer sharing on this prefill: the "
                              "slot of a layer is reused within the forward, so each layer must be "
                              "published as soon as it is written (accepted: True)")
        self._gate = pipeline.gate
        self._gate_pipeline = pipeline
        # Our tokens are released by the ack deadline at the latest; a writer waiting for
        # the slot must not give up (and fail the forward) before that.
        pipeline.gate.outwait(self.cfg.ack_timeout_s)
        for prod in self._producers.values():
            prod.listener = gate_listener(self._gate)
        pipeline.add_save_listener(self._on_slot_saved)

    def _on_slot_saved(self, layer: str, gate_slot: int, generation: int) -> None:
        """Save listener (runs inside the pipeline's ``save_layer``): hold the slot for decode."""
        self._prepare()
        if not self._step_sends:
            return
        for name in self._gate_pipeline.members_of(layer):
            tokens = {d_tp: self._gate.add_consumer(gate_slot, generation, f"rd2h d_tp={d_tp} {name}")
                      for d_tp in self._step_sends}
            self._gate_tokens[name] = (gate_slot, tokens)

    def _release_gate_tokens(self) -> None:
        """Tokens of layers that were never published (no save_kv_layer came): free the slots."""
        for _, tokens in self._gate_tokens.values():
            for tok in tokens.values():
                self._gate.release_consumer(tok, None)
        self._gate_tokens.clear()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._prepare()

    def _prepare(self) -> None:
        """Apply this step's metadata once, from whichever hook runs first.

        vLLM (0.32) calls ``start_load_kv`` *after* the forward for async
        connectors, but the producer must know this step's requests before the
        first ``save_kv_layer``.
        """
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RemoteD2HMetadata)
        if meta is self._prepared:
            return
        self._prepared = meta
        if meta.recv or meta.send or meta.fail_recv or meta.cancel_recv:
            log.debug("%s: step metadata %s", NAME, meta)
        if self._consumer is not None:
            for job in meta.recv:
                try:
                    if self._pool is not None:
                        # Admission failure ends the request as a failed outcome (load errors below).
                        self._pool_jobs[job.request_id] = job.block_ids
                        self._consumer.expect_pool(job.request_id, self._pool, prompt_tokens=job.prompt_tokens,
                                                   max_tokens=job.max_tokens)
                    else:
                        self._consumer.expect(job.request_id, job.block_ids)
                except ValueError as exc:
                    self._pool_jobs.pop(job.request_id, None)
                    log.error("%s: cannot receive %s: %s", NAME, job.request_id, exc)
                    self._load_errors.update(job.block_ids)
                    self._recv_failed.add(job.request_id)
            for rid, reason in meta.fail_recv.items():
                self._consumer.fail(rid, reason)
            for rid in meta.cancel_recv:
                self._cancelled.add(rid)
                self._consumer.fail(rid, "request finished on decode before its KV arrived")
        self._step_sends = defaultdict(list)
        for job in meta.send:
            try:
                prod = self._producer(job.d_tp)
                from ascend_offload.pd.producer import DecodeTarget

                prod.add_request(job.remote_request_id, job.block_ids,
                                 DecodeTarget(job.host, job.kv_port, job.d_tp, job.dp_rank))
            except (ValueError, TopologyError) as exc:
                log.error("%s: cannot send %s to decode: %s", NAME, job.request_id, exc)
                self._send_done.add(job.request_id)
                continue
            self._by_remote[(job.d_tp, job.remote_request_id)] = job.request_id
            self._own[job.request_id] = (job.d_tp, job.remote_request_id)
            self._step_sends[job.d_tp].append(job.remote_request_id)
        if not self._step_sends:
            self._step_sends = {}

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous (a request runs only after all its layers
        # arrived); this hook only makes sure the step's metadata is applied.
        self._prepare()

    def _publish(self, layer: int, name: str | None = None) -> None:
        device.synchronize()  # the layer's KV must be in memory before decode may read it
        held = self._gate_tokens.pop(name, None) if name is not None else None
        if self._gate is not None and held is None:
            log.error("%s: layer %r has no reuse-gate token (store connector not saving it?); "
                      "published on a private slot", NAME, name)
        for d_tp, rids in self._step_sends.items():
            if held is not None and d_tp in held[1]:
                self._producers[d_tp].publish_layer(layer, slot=held[0], tag=held[1].pop(d_tp),
                                                    request_ids=rids)
            else:
                self._producers[d_tp].publish_layer(layer, unique_slot=True, request_ids=rids)
        if held is not None:
            for tok in held[1].values():  # a decode TP size with nothing to send this layer
                self._gate.release_consumer(tok, None)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._prepare()
        if self._step_sends and self.cfg.use_layerwise:
            idx = self._layer_index.get(layer_name)
            if idx is None:
                log.error("%s: unknown layer %r; not published", NAME, layer_name)
                return
            self._publish(idx, layer_name)

    def wait_for_save(self) -> None:
        self._prepare()
        if self._step_sends and not self.cfg.use_layerwise:
            for i in range(len(self._layers)):
                self._publish(i)
        if self._gate_tokens:
            self._release_gate_tokens()
        self._step_sends = {}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        if self._consumer is not None:
            for o in self._consumer.finished():
                device_blocks = self._pool_jobs.pop(o.request_id, None)
                if self._pool is not None and o.request_id in self._pool_finished | self._cancelled:
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
        if self._pool is not None:
            for rid in finished_req_ids:
                if rid in self._pool_jobs:
                    self._pool_finished.add(rid)  # released when its outcome arrives
                else:
                    self._release_pool(rid)
        # Prefill: a request's blocks are freed once vLLM finished it *and* decode
        # answered every published layer (or the ack deadline passed).
        mine = {rid for rid in finished_req_ids if rid in self._own or rid in self._send_done}
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
        if ready:
            self._send_done -= ready
            self._seen_finished -= ready
            sending |= ready
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if getattr(self, "_consumer", None) is not None:
            self._consumer.close()
        for prod in getattr(self, "_producers", {}).values():
            prod.close()
        eng = getattr(self, "_engine", None)
        if eng is not None:
            for addr in self._registered:
                eng.unregister(addr)
            eng.close()
        if getattr(self, "_registrar", None) is not None:
            self._registrar.close()
