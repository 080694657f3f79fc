"""``AscendSparseDecodeConnector``: sparse decode offload in one engine (colocated mode).

``connector`` (the facade vLLM instantiates; it implements
:class:`~ascend_offload.sparse.adapter.SparseDecodeAdapter` for the attention),
``metrics`` (Prometheus). The request bookkeeping is vLLM-free:
:class:`~ascend_offload.sparse.colocated.ColocatedSparseDecode`.
"""

from ascend_offload.connectors.sparse_decode.connector import NAME, AscendSparseDecodeConnector

__all__ = ["NAME", "AscendSparseDecodeConnector"]
