"""What ``SfaRemoteD2HConnector``'s scheduler tells its workers each step."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ascend_offload.connectors.sparse_decode.scheduler import SparseDecodeMetadata
from ascend_offload.pd.decode_requests import RecvJob
from ascend_offload.pd.prefill_requests import LateSendJob, SendJob

__all__ = ["LateSendJob", "RecvJob", "RemoteD2HMetadata", "SendJob"]


@dataclasses.dataclass
class RemoteD2HMetadata(KVConnectorMetadata):
    """Decode: loads to start, fail or cancel. Prefill: requests to publish to decode."""

    recv: list[RecvJob] = dataclasses.field(default_factory=list)
    fail_recv: dict[str, str] = dataclasses.field(default_factory=dict)
    cancel_recv: list[str] = dataclasses.field(default_factory=list)
    send: list[SendJob] = dataclasses.field(default_factory=list)
    # prefill: requests computed before their decode registered (the workers claim it)
    late_send: list[LateSendJob] = dataclasses.field(default_factory=list)
    # decode with sparse offload: request names, finishes
    sparse: SparseDecodeMetadata | None = None
    # Decode: the step computes no token (vLLM steps only to poll the connector), so a
    # worker may wait there for a pull to end (idle_wait_ms).
    idle: bool = False

    @property
    def empty(self) -> bool:
        return not (self.recv or self.fail_recv or self.cancel_recv or self.send or self.late_send
                    or self.sparse)
