"""Route ``ascend_offload.*`` log records through vLLM's handlers.

vLLM configures handlers only for its own ``vllm`` logger; without this our
connectors' messages (startup summaries, load failures) would vanish in a
vLLM process. Idempotent: the first connector built in a process wires it.
"""

from __future__ import annotations

import logging


def wire_logging() -> None:
    """Give the ``ascend_offload`` logger vLLM's handlers at INFO, unless it already has handlers."""
    ours = logging.getLogger("ascend_offload")
    if ours.handlers:
        return
    for h in logging.getLogger("vllm").handlers:
        ours.addHandler(h)
    ours.setLevel(logging.INFO)
    ours.propagate = False
