"""``SfaRemoteD2HConnector``: vLLM adapter of the P/D pull (``ascend_offload.pd``).

Decode (``kv_consumer``) — scheduler side: a request carrying
``do_remote_prefill`` + ``metaserver`` is reported as an asynchronous external
load of its whole prompt; once decode's blocks are allocated, the scheduler
registers its endpoint and destination blocks with the proxy metaserver and
tells its workers to expect the request. Worker side: each TP rank pulls every
layer straight into its own KV blocks, or with sparse decode offload into a
host KV pool (``decode_worker``).

Prefill (``kv_producer``) — scheduler side: requests carrying
``do_remote_decode`` are tracked; in the step where a request's prompt
finishes computing, its blocks and decode target go to the workers. Worker
side: after each attention layer the rank publishes that layer to decode
(``prefill_worker``); blocks are freed only after decode answered.

Split by role like vLLM's offloading connector: ``connector`` (the facade
vLLM loads), ``metadata``, ``scheduler``, ``decode_worker``,
``prefill_worker``; ``settings`` and ``kv_region`` are shared by the roles.
The vLLM-free request bookkeeping is ``ascend_offload.pd.decode_requests``
and ``ascend_offload.pd.prefill_requests``.
"""

from ascend_offload.connectors.remote_d2h.connector import SfaRemoteD2HConnector
from ascend_offload.connectors.remote_d2h.metadata import RecvJob, RemoteD2HMetadata, SendJob

__all__ = ["RecvJob", "RemoteD2HMetadata", "SendJob", "SfaRemoteD2HConnector"]
