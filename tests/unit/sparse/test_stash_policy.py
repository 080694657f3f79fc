"""A refused or failed sparse stash must not fail the user's request or the engine.

A worker that could not hold or load an offered stash reports the resumed request's
blocks as load errors. vLLM 0.32 recomputes them only with ``kv_load_failure_policy:
recompute`` (its default ``fail`` fails the request), and raises (an engine failure) on
any block-level load error of a model with several KV cache groups. So the scheduler
side sets the policy at startup, and never offers a stash to a multi-group engine."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from ascend_offload.config import SparseOffloadConfig
from ascend_offload.connectors.sparse_decode.scheduler import SparseDecodeScheduler
from ascend_offload.connectors.sparse_decode.settings import SparseDecodeSettings
from ascend_offload.sparse.preemption import PreemptionBook, PreemptState, StashOrder

BS = 4
MAIN, INDEXER = "model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache"


def _settings(paged: bool = False) -> SparseDecodeSettings:
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=8, index_topk=4,
                              dram_size_per_dp_GB=32 * BS * 12 / 2**30)
    return SparseDecodeSettings(cfg, 4, BS, 64, 2, (MAIN,), 0, 12, 32, paged, ((INDEXER, 0),), 16)


class _Blocks:
    """vLLM's KV cache manager as the scheduler reads it."""

    def __init__(self, groups: int) -> None:
        self.num_kv_cache_groups = groups
        self.ids: dict[str, list[int]] = {}

    def get_block_ids(self, rid: str) -> tuple[list[int], ...]:
        return tuple(list(self.ids.get(rid, [])) for _ in range(self.num_kv_cache_groups))


def _req(rid: str, num_tokens: int) -> Any:
    return SimpleNamespace(request_id=rid, num_tokens=num_tokens, prompt_token_ids=[1] * 9,
                           sampling_params=SimpleNamespace(max_tokens=8))


def _output(scheduled: dict[str, int], *, new: tuple[Any, ...] = (),
            preempted: frozenset[str] = frozenset()) -> Any:
    return SimpleNamespace(
        num_scheduled_tokens=scheduled, finished_req_ids=set(), preempted_req_ids=set(preempted),
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=0,
                                            prompt_token_ids=r.prompt_token_ids,
                                            sampling_params=r.sampling_params) for r in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], resumed_req_ids=set()))


def _preempt_one(groups: int) -> tuple[SparseDecodeScheduler, dict[str, StashOrder]]:
    """A request runs one step, then vLLM preempts it: (scheduler, the step's stash orders)."""
    sched = SparseDecodeScheduler(_settings())
    blocks = _Blocks(groups)
    sched.kv_cache_manager = blocks  # type: ignore[assignment]
    a = _req("a", 9)
    assert sched.admit(a)
    blocks.ids["a"] = [3, 7, 2]
    sched.build_meta(_output({"a": 9}, new=(a,)))
    del blocks.ids["a"]
    meta = sched.build_meta(_output({}, preempted=frozenset({"a"})))
    return sched, meta.preempted


def test_startup_sets_the_load_failure_policy_to_recompute(caplog: pytest.LogCaptureFixture) -> None:
    tc = SimpleNamespace(kv_load_failure_policy="fail")  # vLLM 0.32's default
    with caplog.at_level(logging.WARNING):
        SparseDecodeScheduler(_settings(), tc)
    assert tc.kv_load_failure_policy == "recompute"
    assert any("kv_load_failure_policy" in r.getMessage() for r in caplog.records)


def test_without_a_stash_budget_the_policy_is_left_alone() -> None:
    tc = SimpleNamespace(kv_load_failure_policy="fail")
    SparseDecodeScheduler(_settings(paged=True), tc)  # paged main KV: budget 0, nothing offered
    assert tc.kv_load_failure_policy == "fail"


def test_vllm_reads_the_policy_after_it_created_the_connector() -> None:
    """Why setting it in the connector's constructor takes effect (vLLM 0.32's Scheduler)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    src = inspect.getsource(Scheduler.__init__)
    assert 0 < src.index("create_connector(") < src.index("kv_transfer_config.kv_load_failure_policy")


def test_a_multi_group_engine_is_never_offered_a_stash(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        sched, stashed = _preempt_one(groups=2)
    assert stashed == {"a": StashOrder(0, ())}
    assert sched.preemption.state("a") is PreemptState.LOST
    assert sched.resume_offer(_req("a", 10)) == 0  # recomputed: nothing vLLM could fail on
    assert any("KV cache groups" in r.getMessage() for r in caplog.records)


def test_a_single_group_engine_still_resumes_from_the_stash() -> None:
    sched, stashed = _preempt_one(groups=1)
    assert stashed == {"a": StashOrder(9, ((3, 7, 2),))}
    assert sched.resume_offer(_req("a", 10)) == 9


def test_a_refused_book_loses_every_preemption() -> None:
    book = PreemptionBook(capacity_tokens=10 * BS, block_size=BS)
    book.refuse("test")
    book.scheduled("r", 8, [[1, 2]])
    assert book.preempt("r") == StashOrder(0, ()) and book.state("r") is PreemptState.LOST
