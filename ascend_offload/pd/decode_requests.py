"""Decode scheduler bookkeeping of remote prefills, free of vLLM.

A request that asks for a remote prefill is reported as an asynchronous
external load of its whole prompt; once its blocks are allocated the decode
registers its endpoint and destination blocks with the proxy metaserver (in the
background, see :class:`~ascend_offload.pd.registration.Registrar`) and tells
its workers to expect it. This class decides all of that from plain values, so
the vLLM adapter only translates vLLM's objects and the rules are unit-tested
without an engine.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from ascend_offload.pd.registration import DecodeRegistration, Registrar

log = logging.getLogger(__name__)


class CachedBlocks(Protocol):
    """The prompt's leading blocks a decode-side cache serves instead of the pull
    (:class:`~ascend_offload.sparse.prefix_cache.PrefixHit`; duck-typed so ``pd`` does not
    import ``sparse``)."""

    @property
    def device_blocks(self) -> tuple[int, ...]: ...


@dataclasses.dataclass(frozen=True)
class RecvJob:
    """One request a decode worker starts pulling this step."""

    request_id: str
    block_ids: tuple[int, ...]  # decode device blocks loaded externally (the load-error set)
    # Sparse offload only: the whole prompt goes to the host pool, reserved for max_tokens.
    prompt_tokens: int = 0
    max_tokens: int = 0
    # Sparse offload with the decode-side prefix cache: the prompt's leading blocks served
    # from cached entries (not pulled: the wire starts after them)
    prefix: CachedBlocks | None = None


@dataclasses.dataclass(frozen=True)
class DecodeEndpoint:
    """Where prefill reaches this decode instance (rank ports follow ``topology.decode_port``)."""

    engine_id: str
    host: str
    kv_port: int
    tp_size: int
    dp_rank: int
    transfer_protocol: str = ""  # ``backend/protocol`` advertised to prefill (transfer.base)


@dataclasses.dataclass
class DecodeStep:
    """What decode's workers hear in one scheduler step."""

    recv: list[RecvJob] = dataclasses.field(default_factory=list)
    fail: dict[str, str] = dataclasses.field(default_factory=dict)  # request -> why it cannot load
    cancel: list[str] = dataclasses.field(default_factory=list)  # finished before its KV arrived


class DecodeRequest(Protocol):
    """The fields of a scheduler request this bookkeeping reads (vLLM's ``Request`` has them)."""

    @property
    def request_id(self) -> str: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """The proxy asked this decode to pull the prompt's KV from a prefill."""
    return bool(params and params.get("do_remote_prefill"))


class DecodeRequests:
    """Requests whose prompt KV this decode pulls: registration, expected loads, cancels."""

    def __init__(self, endpoint: DecodeEndpoint, *, block_size: int, sparse: bool,
                 registrar: Registrar,
                 reservation: Callable[[int, int], int] | None = None) -> None:
        """``reservation(prompt_tokens, max_tokens)``: the pool positions a sparse request
        reserves, as the scheduler's pool ledger counts them (default: their sum)."""
        self.endpoint = endpoint
        self.block_size = block_size
        self.sparse = sparse  # pool destination: the whole prompt is pulled (see after_alloc)
        self.reservation = reservation if reservation is not None else operator.add
        self.registrar = registrar
        self._new: list[RecvJob] = []
        self._fail: dict[str, str] = {}
        self._cancel: list[str] = []
        self._recving: set[str] = set()

    @property
    def receiving(self) -> frozenset[str]:
        """Requests whose workers may still write into their blocks."""
        return frozenset(self._recving)

    def num_new_matched_tokens(self, request: DecodeRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Everything past the local prefix hits is an asynchronous external load."""
        if wants_remote_prefill(request.kv_transfer_params):
            count = request.num_prompt_tokens - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def after_alloc(self, request: DecodeRequest, block_ids: Sequence[int], num_external_tokens: int,
                    cached: Callable[[Sequence[int]], CachedBlocks | None] | None = None) -> None:
        """Blocks are allocated: register with the metaserver and expect the request.

        ``block_ids``: all of the request's blocks (local prefix hits first).
        ``cached(block_ids)``: sparse offload's decode-side prefix cache, the prompt's
        leading blocks it serves (their device blocks), or ``None``; those are not pulled.
        """
        params = request.kv_transfer_params
        if params is None or not wants_remote_prefill(params):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        # Local prefix hits are whatever num_new_matched_tokens did not claim (whole blocks).
        first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        n = math.ceil(request.num_prompt_tokens / self.block_size) - first
        dst = tuple(block_ids[first:first + n])  # loaded externally: the load-error set
        wire_first, wire_dst = first, dst
        if self.sparse:
            # The host pool needs the whole prompt: local prefix hits are device blocks, not pool
            # rows; the blocks the pool's own prefix cache serves are not pulled.
            hit = cached(block_ids) if cached is not None else None
            skip = 0 if hit is None else len(hit.device_blocks)
            wire_first, wire_dst = skip, tuple(block_ids[skip:first + n])
            reserve = self.reservation(request.num_prompt_tokens, request.max_tokens)
            self._new.append(RecvJob(rid, dst, request.num_prompt_tokens, reserve, hit))
        else:
            self._new.append(RecvJob(rid, dst))
        self._recving.add(rid)
        url, prid = params.get("metaserver"), params.get("proxy_request_id")
        if len(dst) != n:
            self._fail[rid] = f"decode allocated {len(dst)} blocks, the prompt needs {n}"
        elif not url or not prid:
            self._fail[rid] = "kv_transfer_params lacks 'metaserver' or 'proxy_request_id'"
        else:
            ep = self.endpoint
            self.registrar.submit(rid, str(url), str(prid), DecodeRegistration(
                remote_engine_id=ep.engine_id, remote_host=ep.host, remote_port=ep.kv_port,
                remote_tp_size=ep.tp_size, remote_dp_rank=ep.dp_rank, remote_request_id=rid,
                remote_block_ids=list(wire_dst), remote_block_offset=wire_first,
                transfer_protocol=ep.transfer_protocol),
                registration_token=params.get("registration_token"))

    def take_step(self) -> DecodeStep:
        """This step's new loads, failures (refused or late registrations) and cancels."""
        step = DecodeStep(recv=self._new, cancel=self._cancel)
        self._new, self._cancel = [], []
        for rid, err in self.registrar.poll().items():
            if err is not None and rid in self._recving:
                log.error("remote-d2h: request %s: %s", rid, err)
                self._fail[rid] = str(err)
        step.fail, self._fail = self._fail, {}
        return step

    def request_finished(self, request_id: str) -> bool:
        """vLLM finished the request; True: its blocks must wait (a pull may still write them).

        The worker stops the pull and reports the request "sent" once it has.
        """
        if request_id in self._recving:
            self._cancel.append(request_id)
            return True
        return False

    def workers_done(self, request_ids: Iterable[str]) -> None:
        """Workers reported these requests received, or stopped after a cancel."""
        self._recving.difference_update(request_ids)

    def close(self) -> None:
        self.registrar.close()
