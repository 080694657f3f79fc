"""Sparse decode offload in an engine: no main KV on the device.

``connector`` (``AscendSparseDecodeConnector``, colocated mode: the facade vLLM
instantiates; it implements :class:`~ascend_offload.sparse.adapter.SparseDecodeAdapter`
for the attention), ``settings`` (startup facts and checks), ``scheduler``
(request names, host-pool admission), ``worker`` (the manager over the engine's
hot regions), ``kv_cut`` (the engine-core rewrite of the KV allocation),
``metrics`` (Prometheus). The remote-D2H decode side reuses ``settings``,
``scheduler`` and ``worker``. The request bookkeeping is vLLM-free:
:class:`~ascend_offload.sparse.colocated.ColocatedSparseDecode`.
"""

from ascend_offload.connectors.sparse_decode.connector import NAME, AscendSparseDecodeConnector

__all__ = ["NAME", "AscendSparseDecodeConnector"]
