"""A preempted request asks the tier behind the host pages again when it resumes: its
blocks may have gone to the SSD tier (or the shared tier) and left the host pages while
it was out, and recomputing them would waste what the tier holds.

Driven through the connector's ``PrefixScheduler`` with plain stand-ins for vLLM's
request and scheduler-output fields, and through ``PrefixJobs`` over a fake shared tier."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ascend_offload.store.book.prefix_jobs import PrefixJobs
from ascend_offload.store.local import LocalStore
from ascend_offload.store.shared.remote_fetch import RemoteFetches
from tests.support.scheduler_inputs import request as _new_request
from tests.support.scheduler_inputs import step as _step

PAGE = 64
BS = 4



def _request(rid: str, n_tokens: int) -> SimpleNamespace:
    return _new_request(rid, n_tokens, BS)

def _scheduler(tmp_path: Path) -> tuple[Any, dict[str, list[int]]]:
    from ascend_offload.config import parse_extra_config
    from ascend_offload.connectors.store.scheduler import PrefixScheduler
    from ascend_offload.connectors.store.settings import NAME, StoreSettings

    cfg = parse_extra_config(NAME, {"local": {"capacity_bytes": 16 * PAGE, "ssd": {
        "path": str(tmp_path / "ssd"), "capacity_bytes": 32 * 4096}}})
    settings = StoreSettings(cfg=cfg, block_size=BS, hash_ratio=1, object_bytes=PAGE, page_bytes=PAGE,
                             num_pages=16, world_size=1, fingerprint="fp", engine_id="e")
    tables: dict[str, list[int]] = {}
    return PrefixScheduler(settings, lambda rid: tables[rid]), tables





def _report(sched: Any, meta: Any) -> None:
    """Every rank (one) did what the step's metadata asked: copies, spills, promotes."""
    from vllm.v1.outputs import KVConnectorOutput

    from ascend_offload.connectors.store.metadata import StoreWorkerMetadata

    wm = StoreWorkerMetadata(done=Counter({j.job_id: 1 for j in (*meta.loads, *meta.saves)}),
                             ssd_spilled=Counter({j.job_id: 1 for j in meta.ssd_spills}),
                             ssd_promoted=Counter({(j.job_id, len(j.keys)): 1 for j in meta.ssd_promotes}),
                             epoch=meta.epoch)
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=wm))


def test_a_resumed_request_promotes_its_blocks_from_the_ssd_tier(tmp_path: Path) -> None:
    sched, tables = _scheduler(tmp_path)
    try:
        req = _request("r", 17)  # 4 full blocks + 1 token
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # the tier has nothing yet
        tables["r"] = [10, 11, 12, 13, 14]
        sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (tables["r"],)), 0)
        step1 = sched.build_connector_meta(_step(new=[("r", 0, 16)]))
        _report(sched, step1)  # saved: committed in the host index
        step2 = sched.build_connector_meta(_step(cached=[("r", 16, 1)]))
        assert [len(j.keys) for j in step2.ssd_spills] == [4]
        _report(sched, step2)  # spilled: ready on the tier
        keys = sched._keys(req, 4)
        assert sched.ssd.ssd.lookup_prefix(keys) == 4
        # other traffic pushes the blocks out of the host pages, then vLLM preempts r
        assert sched.index.discard(keys) == 4
        req.num_preemptions, req.num_computed_tokens = 1, 0
        sched.build_connector_meta(_step(preempted={"r"}))
        # the resumption asks the SSD tier again: a promote starts, the request waits
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        step4 = sched.build_connector_meta(_step())
        assert [len(j.keys) for j in step4.ssd_promotes] == [4]
        _report(sched, step4)
        assert sched.get_num_new_matched_tokens(req, 0) == (16, False)
    finally:
        sched.close()


class _Tier:
    """A shared tier that holds every key it was given."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.lookups = 0

    def available(self) -> bool:
        return True

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        self.lookups += 1
        n = 0
        for k in keys:
            if k not in self.held:
                break
            n += 1
        return n


def test_a_resumed_request_fetches_from_the_shared_tier_again() -> None:
    index = LocalStore(8 * PAGE, PAGE, with_data=False)
    tier = _Tier()
    fetches = RemoteFetches(index, tier, page_bytes=PAGE, world_size=1, timeout_s=5.0)
    book = PrefixJobs(index, block_size=BS, page_bytes=PAGE, world_size=1, min_load_blocks=1, remote=fetches)
    keys = [f"k{i}" for i in range(3)]
    assert book.lookup("r", 0, 3, lambda n: keys[:n]) == 0  # asked once: the tier has nothing
    tier.held.update(keys)  # another engine published them meanwhile
    assert book.lookup("r", 0, 3, lambda n: keys[:n]) == 0  # same admission: not asked again
    book.preempted("r")  # vLLM preempted it: its next admission asks again
    assert book.lookup("r", 0, 3, lambda n: keys[:n]) is None
    (job,) = fetches.take_jobs()
    fetches.report({job.job_id: 1}, {}, {})
    assert book.lookup("r", 0, 3, lambda n: keys[:n]) == 3 * BS
