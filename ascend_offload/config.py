"""Every ``kv_connector_extra_config`` schema, parsed and validated in one place.

Why one module: a bad deployment must fail at engine start with a message that
names the offending key and the values it accepts (invariant I7), and every
connector must read its settings the same way. Key names follow vllm-ascend
where a key exists there, so configs can move between the two.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from ascend_offload.errors import AscendOffloadError


class ConfigError(AscendOffloadError, ValueError):
    """A configuration value is invalid; the message names key and accepted values."""


# The longest wait any deadline key accepts (one day). Why a cap: ``Infinity`` or
# ``1e300`` would pass ``gt=0`` and then overflow in the first contended wait
# (``threading`` turns the timeout into a C ``timespec``).
MAX_TIMEOUT_S = 86400.0

# The largest sparse hot buffer (topk_buffer_size) a residency table holds: the native
# host table packs a slot into 16 bits of an entry; the device table keeps the same limit.
# sparse.residency.MAX_HOT_SIZE at run time (that module imports no pydantic, so the value
# is spelled twice; tests/unit/core/test_config.py checks they agree).
MAX_TOPK_BUFFER_SIZE = 65534


def _timeout(default: float) -> Any:
    """A deadline key: seconds, > 0 and at most :data:`MAX_TIMEOUT_S`."""
    return Field(default, gt=0, le=MAX_TIMEOUT_S)


class _Strict(BaseModel):
    """Unknown keys are errors: a typo must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _nested_schema(annotation: Any) -> type[BaseModel] | None:
    """The schema a field holds (``X`` or ``X | None``), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [
        a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)
    ]
    return models[0] if len(models) == 1 else None


def _innermost(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[type[BaseModel], str]:
    """The schema and key an error location ends in (``debug.fail_loads`` -> the debug block's
    schema and ``fail_loads``), so the message lists what that block accepts."""
    key = str(loc[0]) if loc else ""
    for part in loc[1:]:
        field = model.model_fields.get(key)
        nested = _nested_schema(field.annotation) if field is not None else None
        if nested is None:
            break
        model, key = nested, str(part)
    return model, key


def _accepted(model: type[BaseModel], key: str) -> str:
    """Human description of what ``key`` accepts, from the field annotation."""
    field = model.model_fields.get(key)
    if field is None:
        return "one of the keys: " + ", ".join(sorted(model.model_fields))
    ann = field.annotation
    args = typing.get_args(ann)
    if typing.get_origin(ann) is Literal:
        return "one of: " + ", ".join(repr(a) for a in args)
    literal_args = [a for a in args if typing.get_origin(a) is Literal]
    if literal_args:
        vals = [repr(v) for a in literal_args for v in typing.get_args(a)]
        return (
            "one of: "
            + ", ".join(vals)
            + " (or "
            + " | ".join(
                getattr(a, "__name__", str(a)) for a in args if typing.get_origin(a) is not Literal
            )
            + ")"
        )
    name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
    constraints = ", ".join(str(m) for m in field.metadata)
    return f"{name}" + (f" with {constraints}" if constraints else "")


def parse(model: type[_Strict], raw: Mapping[str, Any] | None, *, where: str) -> Any:
    """Validate ``raw`` against ``model`` or raise :class:`ConfigError`.

    The error lists every problem as ``key=value: reason (accepted: ...)``.
    """
    raw = dict(raw or {})
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "<root>"
            value = err.get("input")
            problems.append(
                f"key '{loc}'={value!r}: {err['msg']} (accepted: {_accepted(*_innermost(model, err['loc']))})"
            )
        raise ConfigError(f"invalid {where}: " + "; ".join(problems)) from None


# --------------------------------------------------------------------------- store


class SsdTierConfig(_Strict):
    """The SSD tier under the host pages (``local.ssd``; docs/store.md "SSD tier"): one
    preallocated file of ``capacity_bytes`` per worker rank in ``path``."""

    # Directory of the tier's files (created if missing); one engine per directory.
    path: str = Field(min_length=1)
    # Bytes of each rank's slot file (fallocated at start); slots of one page + 4 KiB-aligned header.
    capacity_bytes: int = Field(gt=0)
    # Keep the index and the files across restarts (entries verified by their slot headers on read).
    persist: bool = False
    # O_DIRECT: "auto" probes the file system at open (buffered when refused), "on" requires it.
    direct_io: Literal["auto", "on", "off"] = "auto"
    # With persist: the index is rewritten (atomically) at most this often when it changed, also
    # while the engine is idle (a background thread), and at close.
    persist_interval_s: float = Field(5.0, gt=0, le=MAX_TIMEOUT_S)


class LocalStoreConfig(_Strict):
    """The embedded host page pool (``backend: local``)."""

    capacity_bytes: int = Field(1 << 30, gt=0)
    # None: one page per stored object (the connector knows the object size), which
    # lets a batch of objects move with a single indexed copy.
    page_bytes: int | None = Field(None, gt=0)
    # "lru": least recently used first; "arc": scan-resistant adaptive replacement
    # (store/eviction.py, docs/store.md "Eviction")
    eviction: Literal["lru", "arc"] = "lru"
    # Off (None) by default: host pages only.
    ssd: SsdTierConfig | None = None


class MooncakeStoreConfig(_Strict):
    """The shared Mooncake Store (``backend: mooncake``): a ``mooncake_master`` holds
    the index, every client contributes ``global_segment_bytes`` of memory."""

    # host:port of mooncake_master's RPC service (required with backend "mooncake").
    master_address: str = ""
    # The address other clients reach this one's segment on.
    local_hostname: str = "127.0.0.1"
    # "P2PHANDSHAKE" (no metadata service) or an http:// / etcd metadata server URL.
    metadata_server: str = "P2PHANDSHAKE"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""  # RDMA devices (protocol "rdma")
    # Memory this client contributes to the shared pool (objects live in some client's
    # segment and leave with it). 0: none (the objects live in other clients' segments,
    # e.g. a mooncake_client store service); Mooncake refuses segments under 16 MiB.
    global_segment_bytes: int = Field(1 << 30, ge=0)
    replica_num: int = Field(1, ge=1)
    # While the master is unreachable, calls miss/skip and a background thread probes it
    # this often.
    retry_interval_s: float = Field(1.0, gt=0)

    @field_validator("global_segment_bytes")
    @classmethod
    def _segment_size(cls, v: int) -> int:
        if 0 < v < 16 << 20:
            raise ValueError(f"{v}: Mooncake refuses segments under 16 MiB (use 0 for none)")
        return v


# tcp://host:port as the memcache client and meta service take it (store/shared/memcache.py,
# store/services/memcache_meta.py): host name, IPv4 or bracketed IPv6, decimal port.
_TCP_URL = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?):\d{1,5}")


class MemcacheStoreConfig(_Strict):
    """The Ascend pooled store (``backend: memcache``, ``memcache_hybrid``): a Memcache meta
    service holds the index, every client contributes ``dram_size`` / ``hbm_size`` of
    memory. Key names follow memcache's ``mmc-local.conf`` (``ock.mmc.*``)."""

    # tcp://host:port of the meta service (ock.mmc.meta_service_url; required).
    meta_service_url: str = ""
    # tcp://host:port of its config store (ock.mmc.local_service.config_store_url).
    config_store_url: str = "tcp://127.0.0.1:6000"
    # ock.mmc.local_service.protocol: how bytes move between clients' pooled memory.
    protocol: Literal[
        "device_sdma",
        "device_rdma",
        "device_urma",
        "host_rdma",
        "host_tcp",
        "host_shm",
        "host_urma",
    ] = "device_sdma"
    # Pooled memory this client contributes (memcache size strings: "1GB", "512MB", "0").
    dram_size: str = Field("1GB", pattern=r"^\d+(\.\d+)?\s*([KMGTkmgt][Bb]?)?$")
    hbm_size: str = Field("0", pattern=r"^\d+(\.\d+)?\s*([KMGTkmgt][Bb]?)?$")
    world_size: int = Field(256, ge=1)
    replica_num: int = Field(1, ge=1, le=8)
    # A backend call waited for longer is an outage (the client's own wait was 60 s).
    call_timeout_s: float = Field(5.0, gt=0, le=MAX_TIMEOUT_S)
    # While the meta service is unreachable, calls miss/skip without asking for this long.
    retry_interval_s: float = Field(1.0, gt=0)

    @field_validator("meta_service_url", "config_store_url")
    @classmethod
    def _tcp_url(cls, v: str, info: ValidationInfo) -> str:
        # Why here: memcache only parses the URL when the client starts, and then fails
        # with a bare return code; "" is the unset meta service (refused when used).
        if v == "" and info.field_name == "meta_service_url":
            return v
        if not _TCP_URL.fullmatch(v) or not 0 < int(v.rsplit(":", 1)[1]) < 65536:
            raise ValueError(
                "must be tcp://host:port (a host name, IPv4 address or "
                "[IPv6] address, and a port 1-65535)"
            )
        return v


class StoreDebugConfig(_Strict):
    """``debug:`` of ``AscendStoreConnector``: test and fault hooks, off by default. One block
    so the deployment keys stand apart, and in the extra config because that is what reaches
    vLLM's worker processes (the connector hands each value to the class it configures)."""

    # Each layerwise layer save waits this long first: a slow store, to prove the reuse gate
    # holds a slot's next writer until the save read it.
    save_delay_s: float = Field(0.0, ge=0, le=MAX_TIMEOUT_S)
    # The first N layerwise layer loads of each worker fail like a broken store read (their
    # blocks become load errors), to prove a failed read ends cleanly.
    fail_layer_loads: int = Field(0, ge=0)


class StoreConnectorConfig(_Strict):
    """``AscendStoreConnector`` extra config (whole-prefix and layerwise modes)."""

    backend: Literal["local", "mooncake", "memcache"] = "local"
    local: LocalStoreConfig = LocalStoreConfig()
    mooncake: MooncakeStoreConfig = MooncakeStoreConfig()
    memcache: MemcacheStoreConfig = MemcacheStoreConfig()
    use_layerwise: bool = False
    layerwise_num_shared_buffers: int = Field(2, ge=1)
    layerwise_independent_layers: list[int] | Literal["all"] = Field(default_factory=lambda: [0])
    # 2: a load starts a layer earlier wherever a slot is free (B >= 3); with B = 2 the
    # slots allow only 1 anyway (docs/bench-layerwise.md).
    layerwise_prefetch_layers: int = Field(2, ge=0)
    # Deadlines (I5): a wait on a load, save or gate never blocks longer.
    load_timeout_s: float = _timeout(30.0)
    save_timeout_s: float = _timeout(30.0)
    # Only prefixes of at least this many blocks are worth a store round trip.
    min_load_blocks: int = Field(1, ge=1)
    # Shared between instances that may exchange store objects: part of every key.
    model_tag: str = ""
    # Test and fault hooks; all off unless a test sets them.
    debug: StoreDebugConfig = StoreDebugConfig()

    @field_validator("layerwise_independent_layers")
    @classmethod
    def _no_duplicates(cls, v: list[int] | str) -> list[int] | str:
        if isinstance(v, list) and len(set(v)) != len(v):
            raise ValueError(f"duplicate layer indices in {v}")
        return v


def check_store_backend(cfg: StoreConnectorConfig) -> None:
    """Cross-key rules of the store backend (the schema checks keys one by one): backend
    ``mooncake`` names its master; ``local.ssd`` only with backend ``local`` in
    whole-prefix mode. Used at engine start and by ``check-config``."""
    if cfg.backend == "mooncake" and not cfg.mooncake.master_address:
        raise ConfigError(
            "key 'mooncake.master_address' is required with backend 'mooncake' "
            "(host:port of the mooncake_master every instance shares)"
        )
    if cfg.local.ssd is not None and cfg.backend != "local":
        raise ConfigError(
            f"key 'local.ssd' is not supported with backend {cfg.backend!r} (the SSD tier is the "
            "local backend's; the shared tier already holds what the host pages lose)"
        )
    if cfg.local.ssd is not None and cfg.use_layerwise:
        raise ConfigError(
            "key 'local.ssd' is not supported with use_layerwise=True (whole-prefix mode only)"
        )


# --------------------------------------------------------------------------- sparse


class SparseOffloadConfig(_Strict):
    """Decode-side sparse offload (host KV pool + per-layer device hot buffer)."""

    enabled: bool = False
    # At most MAX_TOPK_BUFFER_SIZE (65534).
    topk_buffer_size: int = Field(4096, gt=0)
    dram_size_per_dp_GB: float = Field(128.0, gt=0)
    index_topk: int = Field(2048, gt=0)
    use_native: Literal["auto", "on", "off"] = "auto"
    # Hot-buffer replacement: exact LRU, or ARC (keeps re-selected rows over one-off
    # misses; ahead of LRU when the indexer's focus drifts, level with it on uniform or
    # sink + window selections, a little behind where rows return exactly once).
    residency_policy: Literal["lru", "arc"] = "lru"
    # Where the per-layer resolve runs: "host" (the native table, or its torch twin, on
    # the CPU: the top-k crosses to the host every layer) or "device" (static-shape tensor
    # ops next to the hot buffers: no host synchronization per layer, graph-capturable;
    # exact LRU only; where the device is the host, use_native picks its C++ kernel).
    residency_backend: Literal["host", "device"] = "host"
    # With residency_backend "device" and its tensor ops: torch.compile them
    # (fullgraph, static shapes) into ~40 fused kernels instead of ~190 small ones.
    # "auto": where the platform compiles them well (CUDA: 2.5-2.8x less time per layer
    # in a CUDA graph on an H200); not on the CPU (a compile costs tens of seconds per
    # shape and the C++ kernel runs there) nor on an NPU. "on": always; "off": never.
    # Each new padded batch shape compiles once, at its first step.
    device_compile: Literal["auto", "on", "off"] = "auto"
    # Decode-side prefix caching: finished requests' full blocks this many blocks of
    # block_size tokens, kept in the host pool (rows shared by reference) with a host copy
    # of their indexer rows; a new request with the same leading blocks starts from them.
    # 0: off. Host memory: this many blocks of the indexer caches (the main-KV rows are
    # the pool's, evicted least recently used when a reservation needs them).
    prefix_cache_blocks: int = Field(0, ge=0)
    # Hybrid residency: a request's main KV stays on the device, in blocks borrowed from
    # vLLM's free KV blocks, while vLLM's pool has room (no resolve, no miss copy); under
    # pressure the longest-running resident requests move to the host pool and decode from
    # the hot buffers. Off: every request decodes from the host pool.
    hybrid: bool = False
    # Share of vLLM's KV blocks never borrowed for resident main KV (room for new requests'
    # and growing requests' indexer blocks before anything has to move).
    hybrid_free_fraction: float = Field(0.1, ge=0.0, le=1.0)
    # At most this many requests resident at once (0: no limit but the blocks).
    hybrid_max_resident: int = Field(0, ge=0)

    @field_validator("topk_buffer_size")
    @classmethod
    def _fits_the_table(cls, v: int) -> int:
        # Both residency tables refuse more when they are built (host: the native table
        # and its torch twin; device: the same limit), i.e. at the engine's first step.
        if v > MAX_TOPK_BUFFER_SIZE:
            raise ValueError(
                f"must be <= {MAX_TOPK_BUFFER_SIZE} (the residency tables' limit: "
                "the host table packs a hot-buffer slot into 16 bits)"
            )
        return v

    @field_validator("residency_backend")
    @classmethod
    def _device_is_lru(cls, v: str, info: ValidationInfo) -> str:
        if v == "device" and info.data.get("residency_policy", "lru") != "lru":
            raise ValueError(
                "the device residency implements exact LRU only; use "
                "residency_policy 'lru' with it, or residency_backend 'host'"
            )
        return v

    def check_against(self, *, block_size: int, index_topk: int | None = None) -> None:
        """Cross-field checks that need the model/cache config."""
        topk = index_topk if index_topk is not None else self.index_topk
        if self.topk_buffer_size < topk:
            raise ConfigError(
                f"key 'topk_buffer_size'={self.topk_buffer_size}: must be >= index_topk={topk}"
            )
        if self.topk_buffer_size % block_size:
            raise ConfigError(
                f"key 'topk_buffer_size'={self.topk_buffer_size}: must be a multiple of "
                f"block_size={block_size}"
            )


class SparseDecodeConfig(_Strict):
    """``AscendSparseDecodeConnector`` extra config: sparse decode offload in one engine
    (prefill, then decode from the host pool). The same ``sparse_offload`` block as
    the remote-D2H decode side, so a config moves between the two."""

    sparse_offload: SparseOffloadConfig = SparseOffloadConfig()


# --------------------------------------------------------------------------- P/D


# An injected P/D fault: (kind, layer, only for requests of exactly this many blocks).
Fault = tuple[str, int, "int | None"]


def parse_faults(spec: str) -> list[Fault | None]:
    """Parse a fault-injection spec such as ``"none,invalid:1,drop:2@7"`` (``debug.pd_faults``).

    ``drop:L`` never sends layer L's readiness (decode and producer deadlines
    must end the request); ``invalid:L`` sends it with a wrong main-KV flag
    (decode must answer ``read_failed``); ``none`` leaves a request alone.
    ``@N`` restricts an entry to requests of exactly N blocks; entries without
    it are taken round-robin by the other requests.
    """
    out: list[Fault | None] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part == "none":
            out.append(None)
            continue
        body, _, blocks = part.partition("@")
        kind, _, layer = body.partition(":")
        if (
            kind not in ("drop", "invalid")
            or not layer.isdigit()
            or (blocks and not blocks.isdigit())
        ):
            raise ValueError(
                f"fault spec {part!r} in {spec!r} (accepted: none, drop:<layer>[@<blocks>], "
                "invalid:<layer>[@<blocks>])"
            )
        out.append((kind, int(layer), int(blocks) if blocks else None))
    return out


class RemoteD2HDebugConfig(_Strict):
    """``debug:`` of ``SfaRemoteD2HConnector``: fault hooks, off by default; in the extra config
    because that is what reaches vLLM's worker processes."""

    # Prefill only: P/D protocol faults its producers inject (:func:`parse_faults`), e.g.
    # "drop:2@7" (layer 2 of a 7-block request never announced). None: no faults.
    pd_faults: str | None = None

    @field_validator("pd_faults")
    @classmethod
    def _faults_parse(cls, v: str | None) -> str | None:
        if v is not None:
            parse_faults(v)
        return v


class RemoteD2HConfig(_Strict):
    """``SfaRemoteD2HConnector`` extra config (prefill producer / decode consumer)."""

    transfer_backend: Literal["mooncake", "memfabric"] = "mooncake"
    use_layerwise: bool = True
    # MemFabric (transfer_backend "memfabric"): the data-op type; prefill and decode must
    # use the same one (decode advertises it in its registration, prefill checks it).
    memfabric_transfer_protocol: Literal["sdma", "device_rdma", "device_urma"] = "sdma"
    # The NIC MemFabric's device RDMA/URMA binds (e.g. "tcp://10.0.0.2:7001"); empty: its default.
    memfabric_nic: str = ""
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_device_name: str = ""
    # IP this instance advertises to its peers; empty = vLLM's get_ip() / VLLM_HOST_IP.
    host: str = ""
    # Deadlines (I5).
    read_timeout_s: float = _timeout(30.0)
    ack_timeout_s: float = _timeout(30.0)
    request_timeout_s: float = _timeout(120.0)
    registration_timeout_s: float = _timeout(30.0)
    registration_retries: int = Field(5, ge=0)
    # Prefill, early dispatch: how long a request waits for its decode's registration
    # (the claim's long-poll and retries); the proxy's own register deadline normally
    # ends such a request first.
    claim_timeout_s: float = _timeout(600.0)
    # Prefill, early dispatch: a step that follows one that scheduled nothing may block up
    # to this long (once, woken the moment the claim ends) for a held request's claim, so
    # the request runs in that step instead of the next and vLLM does not spin empty steps
    # polling the claims. A request arriving meanwhile waits at most this long. 0: no wait.
    claim_wait_ms: float = Field(10.0, ge=0, le=100)
    # Prefill, early dispatch: schedule the request at once and let each worker claim its
    # decode's registration while it computes, publishing the layers already written the
    # moment it arrives (the forward starts before the decode registered). False: hold the
    # request unscheduled until the scheduler claimed it. Layer sharing on the prefill
    # (AscendMultiConnector) always holds: a shared buffer must be published before reuse.
    claim_in_worker: bool = True
    read_retries: int = Field(1, ge=0)
    # Decode: in a step that computes nothing while pulls are in flight, the worker waits
    # up to this long for a pull to end (woken the moment one does) instead of returning
    # at once; vLLM would otherwise run ~1000 empty steps a second only to poll for the
    # KV, taking CPU from the prefill and the request path. 0: poll every step.
    idle_wait_ms: float = Field(2.0, ge=0, le=50)
    # Control plane (decode's ZMQ ROUTER). A file holding a shared secret: peers without it
    # cannot connect (CURVE keys derived from it); empty = no authentication (loopback/trusted net).
    control_secret_file: str = ""
    # Bounds on what peers can make decode hold: prefill metadata entries and reader threads
    # (idle ones retired after reader_idle_s), and the largest control message accepted.
    max_prefill_peers: int = Field(256, ge=1, le=65536)
    reader_idle_s: float = Field(60.0, gt=0, le=86400)
    max_message_mib: int = Field(64, ge=1, le=4096)
    # Unequal TP: the prefill TP size as seen by decode (None = same as decode).
    prefill_tp_size: int | None = Field(None, ge=1)
    sparse_offload: SparseOffloadConfig = SparseOffloadConfig()
    # Fault hooks; all off unless a test sets them.
    debug: RemoteD2HDebugConfig = RemoteD2HDebugConfig()


# --------------------------------------------------------------------------- multi


class ChildConnector(_Strict):
    """One child of ``AscendMultiConnector``: a vLLM ``KVTransferConfig`` dict. Keys
    beyond these (``kv_port``, ``kv_load_failure_policy``, ...) go to vLLM, which
    validates them when it builds the child."""

    model_config = ConfigDict(extra="allow")

    kv_connector: str
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_role: str | None = None


class MultiConnectorConfig(_Strict):
    """``AscendMultiConnector``: prefill pairs the RD2H producer with the store."""

    connectors: list[ChildConnector] = Field(min_length=1)


SCHEMAS: dict[str, type[_Strict]] = {
    "AscendStoreConnector": StoreConnectorConfig,
    "SfaRemoteD2HConnector": RemoteD2HConfig,
    "AscendMultiConnector": MultiConnectorConfig,
    "AscendSparseDecodeConnector": SparseDecodeConfig,
}


def parse_extra_config(connector: str, raw: Mapping[str, Any] | None) -> Any:
    """Parse the extra config of one of our connectors by its registered name."""
    try:
        model = SCHEMAS[connector]
    except KeyError:
        raise ConfigError(
            f"unknown connector {connector!r} (accepted: {', '.join(SCHEMAS)})"
        ) from None
    return parse(model, raw, where=f"kv_connector_extra_config of {connector}")
