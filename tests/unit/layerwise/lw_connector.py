"""A minimal layerwise store connector for the engine tests of the layerwise core.

Why it exists: it proves, on a real vLLM CPU engine, that the layout hook's
aliasing plus :class:`LayerwisePipeline` driven from vLLM's per-layer hooks give
the same tokens as vLLM alone - before the production ``AscendStoreConnector``
wires the same pipeline. It is selected with ``kv_connector_module_path`` and
is named ``AscendStoreConnector`` so the layout hook recognizes it. It assumes
the scheduler and the (single) worker share a process (vLLM's uni executor on
CPU), so one in-process store serves both; no preemption handling.

Keys: a full block is stored under its vLLM block hash (shareable between
requests), a partial block under ``request/index/fill`` (immutable objects).
Counters are kept in module globals (``_STATS``, ``_LAST``) for the in-process engine check,
and written to the JSON file named by ``ASCEND_OFFLOAD_LW_STATS`` when that is set.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ascend_offload.config import parse_extra_config
from ascend_offload.layerwise.layout import plan_for_engine
from ascend_offload.layerwise.pipeline import LayerwisePipeline, StepBuilder, StepIO
from tests.unit.layerwise.dict_store import DictStore

_STORE = DictStore()
_STATS: dict[str, Any] = {"hit_tokens": 0, "scheduler_pid": None, "worker_pid": None}
_LAST: dict[str, Any] = {}  # the worker pipeline's and gate's counters after the latest step


@dataclasses.dataclass
class _Meta(KVConnectorMetadata):
    io: StepIO


class AscendStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.cfg = parse_extra_config("AscendStoreConnector", extra)
        self.bs = vllm_config.cache_config.block_size
        self.steps = StepBuilder(self.bs, partial_prefix=f"partial-{os.getpid()}")
        self._requests: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}
        self.pipe: LayerwisePipeline | None = None
        if role == KVConnectorRole.WORKER:
            _STATS["worker_pid"] = os.getpid()
            plan = plan_for_engine(vllm_config, kv_cache_config)
            assert plan is not None
            self.pipe = LayerwisePipeline(
                plan, _STORE,
                prefetch_layers=self.cfg.layerwise_prefetch_layers,
                load_timeout_s=self.cfg.load_timeout_s,
                save_timeout_s=self.cfg.save_timeout_s,
                save_delay_s=self.cfg.debug_save_delay_s,
            )
            _STATS["physical_buffers"] = plan.num_physical
        else:
            _STATS["scheduler_pid"] = os.getpid()

    # ---------------------------------------------------------------- scheduler

    def _hash_key(self, request: Any, i: int) -> str:
        return "h:" + bytes(request.block_hashes[i]).hex()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        n_full = min(len(request.block_hashes), (request.num_prompt_tokens - 1) // self.bs)
        keys = [self._hash_key(request, i) for i in range(n_full)]
        assert self.pipe is None
        layers = _STATS.get("layers") or []
        hit = min((_STORE.lookup_prefix([f"{k}|{ly}" for k in keys]) for ly in layers), default=0)
        return max(0, hit * self.bs - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._pending[request.request_id] = (request, num_external_tokens // self.bs)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        # start_load_kv must run before the forward (vLLM defers it otherwise): the
        # pipeline owns and fills layer 0's slot there.
        scheduler_output.has_sync_kv_loads = True
        steps = self.steps
        for new in scheduler_output.scheduled_new_reqs:
            request, hits = self._pending.pop(new.req_id)
            self._requests[new.req_id] = request
            steps.begin(new.req_id, new.block_ids[0],
                        [self._hash_key(request, i) for i in range(hits)])
            _STATS["hit_tokens"] += hits * self.bs
            steps.schedule(new.req_id, new.num_computed_tokens,
                           scheduler_output.num_scheduled_tokens[new.req_id],
                           self._full_key(request))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            assert rid not in cached.resumed_req_ids, "test connector: no preemption support"
            if cached.new_block_ids[i] is not None:
                steps.add_blocks(rid, cached.new_block_ids[i][0])
            steps.schedule(rid, cached.num_computed_tokens[i],
                           scheduler_output.num_scheduled_tokens[rid],
                           self._full_key(self._requests[rid]))
        for rid in scheduler_output.finished_req_ids:
            steps.end(rid)
            self._requests.pop(rid, None)
        return _Meta(steps.build())

    def _full_key(self, request: Any) -> Any:
        def key(i: int) -> str | None:
            return self._hash_key(request, i) if i < len(request.block_hashes) else None

        return key

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        self.steps.end(request.request_id)
        self._requests.pop(request.request_id, None)
        return False, None

    # ---------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.pipe is not None
        self.pipe.register_kv_caches(kv_caches)
        _STATS["layers"] = list(self.pipe.plan.layers)
        _STATS["aliased"] = self.pipe.aliased

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.pipe is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, _Meta)
            self.pipe.start_step(meta.io)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.pipe is not None:
            self.pipe.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self.pipe is not None:
            self.pipe.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.pipe is None or not self.pipe.in_step:
            return
        self.pipe.finish_step()
        self._record()

    def _record(self) -> None:
        assert self.pipe is not None
        _LAST.update(pipeline=self.pipe.stats().as_dict(), gate=self.pipe.gate.stats().as_dict())
        path = os.environ.get("ASCEND_OFFLOAD_LW_STATS")
        if path:  # the engine core runs in a child process: hand the counters over by file
            with open(path + ".tmp", "w") as f:
                json.dump(dict(_STATS, **_LAST), f)
            os.replace(path + ".tmp", path)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.pipe.take_load_errors() if self.pipe is not None else set()

    def shutdown(self) -> None:
        if self.pipe is not None:
            self.pipe.close()
            self._record()
