"""Fake of ``vllm_ascend/device/device_op.py`` (vllm-ascend main 182b75ea).

``DeviceOperator`` is ``get_device_adaptor()`` there: ``BaseDeviceAdaptor`` on A2/A3
(A5 and 310P subclasses do not override this method).
``BaseDeviceAdaptor.execute_sparse_flash_attention_process`` keeps the published
signature; its body is a torch reference of what it calls,
``torch.ops._C_ascend.npu_sparse_flash_attention`` with ``layout_query="TND"``,
``layout_kv="PA_BSND"``, ``sparse_block_size=1`` and MLA absorbed attention
(``value = key``): query token ``t`` of request ``r`` (``r`` from the cumulative
``actual_seq_lengths_query``) attends over the rows its ``sparse_indices[t, 0]``
name (logical positions of request ``r``, ``-1`` = padding), read through
``block_table[r]``.
"""

from __future__ import annotations

from typing import Any

import torch


class BaseDeviceAdaptor:
    calls: list[dict[str, Any]] = []  # test hook: what each kernel call was given

    @classmethod
    def execute_sparse_flash_attention_process(
        cls,
        sfa_impl: Any,
        ql_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: tuple,
        topk_indices: torch.Tensor,
        attn_metadata: Any,
        actual_seq_lengths_query: torch.Tensor,
        actual_seq_lengths_key: torch.Tensor,
        *,
        block_table: torch.Tensor | None = None,
        sparse_mode: int = 3,
        return_lse: bool = False,
    ) -> torch.Tensor:
        if block_table is None:
            block_table = attn_metadata.block_table
        key, key_rope = kv_cache[0], kv_cache[1]
        bs = key.shape[1]
        cum = actual_seq_lengths_query.to(torch.int64)
        cls.calls.append({"tokens": ql_nope.shape[0], "key_shape": tuple(key.shape),
                          "block_table": block_table.clone(), "cum_q": cum.clone(),
                          "kv_lens": actual_seq_lengths_key.clone()})
        out = torch.zeros(ql_nope.shape[0], ql_nope.shape[1], key.shape[-1], dtype=ql_nope.dtype)
        idx = topk_indices.reshape(topk_indices.shape[0], -1).to(torch.int64)
        for t in range(ql_nope.shape[0]):
            r = int(torch.searchsorted(cum, torch.tensor(t), right=True))
            if r >= cum.numel():
                continue  # padding token
            pos = idx[t][idx[t] >= 0]
            assert bool((pos < int(actual_seq_lengths_key[r])).all()), "index past the kv length"
            blocks = block_table[r].to(torch.int64)[pos // bs]
            k = key[blocks, pos % bs, 0]  # [n, r]
            kr = key_rope[blocks, pos % bs, 0]  # [n, rope]
            s = (ql_nope[t] @ k.T + q_pe[t] @ kr.T) * sfa_impl.scale  # [H, n]
            out[t] = torch.softmax(s, dim=-1) @ k
        return out


DeviceOperator: type[BaseDeviceAdaptor] = BaseDeviceAdaptor
