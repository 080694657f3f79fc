"""OpenAI-compatible P/D proxy with a metaserver endpoint (decode-first flow).

The client talks to the proxy; the proxy forwards each (sub-)request to a
decode instance with ``do_remote_prefill``; the decode's connector registers
its KV destination at ``/v1/metaserver``; only then is the prefill dispatched
with the decode's parameters. See ``docs/proxy.md``.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
