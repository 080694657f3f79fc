"""The shared tier's master-health rules without a master (store/shared/mooncake.py): a
client that fails or raises is an outage logged once, the data path stops calling
it, and the background probe brings it back. The real-master tests are in
tests/integration/test_store_mooncake_tier.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from ascend_offload.store.shared.mooncake import RPC_LAST, RemoteIndex

CFG = SimpleNamespace(master_address="127.0.0.1:1", retry_interval_s=0.01)


class Client:
    """Answers ``batch_is_exist`` like MooncakeDistributedStore (1 present, 0 absent), or
    fails the way a gone master does (an RPC code, or raising)."""

    def __init__(self, present: set[str]) -> None:
        self.present = present
        self.mode = "up"
        self.data_path_calls = 0  # from the test's (the scheduler's) thread, not the prober
        self.answered = threading.Event()

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        if threading.current_thread() is threading.main_thread():
            self.data_path_calls += 1
        if self.mode == "raise":
            raise RuntimeError("client broken")
        if self.mode == "down":
            return [RPC_LAST] * len(keys)
        self.answered.set()
        return [1 if k in self.present else 0 for k in keys]

    def close(self) -> None:
        pass


@pytest.mark.parametrize("failure", ["down", "raise"])
def test_outage_is_a_miss_logged_once_then_probed_back(failure: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ascend_offload.store.shared.mooncake")
    client = Client({"a@r0", "a@r1", "b@r0"})
    index = RemoteIndex(CFG, world_size=2, client=client)
    try:
        assert index.lookup_prefix(["a", "b"]) == 1  # b lacks rank 1's shard
        client.mode = failure
        assert index.lookup_prefix(["a"]) == 0
        calls = client.data_path_calls
        for _ in range(10):
            assert index.lookup_prefix(["a"]) == 0
        assert client.data_path_calls == calls  # while down only the prober asks the master
        lines = [r for r in caplog.records if "unreachable from the scheduler" in r.getMessage()]
        assert len(lines) == 1 and index.health.outages == 1
        client.answered.clear()
        client.mode = "up"
        assert client.answered.wait(10), "the prober never asked again"
        for _ in range(1000):  # the prober flips the state right after its answer
            if index.available():
                break
            threading.Event().wait(0.01)
        assert index.available()
        assert index.lookup_prefix(["a"]) == 1
        assert [r for r in caplog.records if "store service resumed" in r.getMessage()]
    finally:
        index.close()


def test_one_unanswered_call_is_retried_not_an_outage(caplog: pytest.LogCaptureFixture) -> None:
    """A single RPC the master did not answer (a loaded host) is made once more: the lookup
    answers, no outage is declared, nothing is logged; two in a row are an outage."""
    caplog.set_level(logging.WARNING, logger="ascend_offload.store.shared.mooncake")

    class Blips(Client):
        def __init__(self, present: set[str]) -> None:
            super().__init__(present)
            self.fail_next = 0

        def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
            if self.fail_next:
                self.fail_next -= 1
                self.data_path_calls += 1
                return [RPC_LAST] * len(keys)
            return super().batch_is_exist(keys)

    client = Blips({"a@r0", "a@r1"})
    index = RemoteIndex(CFG, world_size=2, client=client)
    try:
        client.fail_next = 1
        assert index.lookup_prefix(["a"]) == 1
        assert client.data_path_calls == 2 and index.health.retries == 1
        assert index.health.outages == 0 and index.available()
        assert index.counters()["remote_retries"] == 1
        client.fail_next = 2
        assert index.lookup_prefix(["a"]) == 0
        assert index.health.outages == 1 and index.health.retries == 2
        assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1
    finally:
        index.close()


def test_a_call_that_blocked_is_an_outage_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure that took the library's reconnect time is not retried (that would double
    the stall): the outage is declared after one call."""
    from ascend_offload.store.shared import tier

    monkeypatch.setattr(tier, "RETRY_IF_FAILED_WITHIN_S", 0.0)  # every failure counts as slow
    client = Client({"a@r0"})
    index = RemoteIndex(CFG, world_size=1, client=client)
    try:
        client.mode = "down"
        assert index.lookup_prefix(["a"]) == 0
        assert client.data_path_calls == 1 and index.health.retries == 0
        assert index.health.outages == 1
    finally:
        index.close()
