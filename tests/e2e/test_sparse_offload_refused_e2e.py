"""``sparse_offload.enabled`` on a model without sparse attention fails at startup, naming the key.

The tiny Llama (no ``index_topk``) with ``AscendSparseDecodeConnector``: the
engine core refuses to start and the user sees why. The engine runs in-process,
so the engine core's error reaches the test as it is; the multi-process start
(a generic ``RuntimeError`` in the frontend, the cause in the engine core's log)
is checked once, for the store connector, in ``test_config_errors_e2e.py``.
The cheaper check builds the connector from that model's real ``VllmConfig``.
"""

from __future__ import annotations

import re

import pytest

from ascend_offload.config import ConfigError
from tests.e2e.harness import make_engine, tiny_model

SPARSE = {"kv_connector": "AscendSparseDecodeConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"sparse_offload": {"enabled": True,
                                                           "topk_buffer_size": 64}}}
KEY = "'sparse_offload.enabled'=True"


def test_the_connector_refuses_the_model_config() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from ascend_offload.config import ConfigError
    from ascend_offload.connectors.sparse_decode.connector import AscendSparseDecodeConnector

    cfg = EngineArgs(model=tiny_model(), dtype="float32", enforce_eager=True, block_size=32,
                     max_model_len=1024, enable_prefix_caching=False,
                     kv_transfer_config=KVTransferConfig(**SPARSE)).create_engine_config()
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=r"'sparse_offload\.enabled'=True.*no sparse attention"):
            AscendSparseDecodeConnector(cfg, role)


@pytest.mark.timeout(300)
def test_engine_startup_fails_naming_the_key(capfd: pytest.CaptureFixture[str]) -> None:
    # In-process, the engine core's error reaches the caller as it is (a multi-process
    # start raises a RuntimeError naming no cause: tests/e2e/test_config_errors_e2e.py)
    with pytest.raises(ConfigError) as exc, \
            make_engine(kv_transfer_config=SPARSE, core=0, max_model_len=1024):
        pass
    out = capfd.readouterr()
    seen = f"{exc.value!r}\n{out.out}\n{out.err}"
    assert KEY in seen, seen[-4000:]
    # why, and what is accepted (the engine core's KV cut or the connector says it first:
    # no sparse main-KV cache layer / no sparse attention)
    assert re.search(r"'sparse_offload\.enabled'=True: [^\n]*no sparse [^\n]*accepted: False",
                     seen), seen[-4000:]
