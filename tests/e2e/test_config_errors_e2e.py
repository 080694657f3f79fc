"""Invalid extra config makes a real vLLM engine start fail, naming the key (I7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.e2e.harness import tiny_model

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM
    from vllm.config import KVTransferConfig
    if __name__ == "__main__":
        extra = json.loads(sys.argv[2])
        LLM(model=sys.argv[1], dtype="float32", block_size=32, enforce_eager=True,
            max_model_len=1024, enable_prefix_caching=False,
            kv_transfer_config=KVTransferConfig(kv_connector="AscendStoreConnector",
                kv_role="kv_both", kv_connector_extra_config=extra))
        print("ENGINE STARTED")
    """
)


# One engine start carries all three mistakes (starts cost ~30 s here); the
# error lists every problem, each with its key. Per-key messages are unit-tested.
BAD = {"backend": "nosuchstore", "local": {"capacity_bytes": -1}, "no_such_key": True}
NEEDLES = [
    "key 'backend'",
    "'local'",
    "key 'local.capacity_bytes'",
    "greater than 0",
    "key 'no_such_key'",
    "Extra inputs are not permitted",
]


def test_engine_start_fails_naming_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0")
    proc = subprocess.run(
        [sys.executable, str(script), tiny_model(), json.dumps(BAD)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ENGINE STARTED" not in out
    assert "ConfigError" in out
    for n in NEEDLES:
        assert n in out, n
