"""Client body validation and the per-backend bodies derived from it.

The proxy sends every backend exactly one prompt with ``n == 1`` (the
metaserver contract): prompt lists and ``n > 1`` become several sub-requests
whose choices are renumbered on the way back. The OpenAI ordering is kept:
prompt ``i``, sample ``j`` is choice ``i * n + j``. With a ``seed``, sample
``j`` gets ``seed + j`` exactly as vLLM's own parallel sampling does, so a
fanned-out request samples the same as an unsplit one would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload

from proxy.errors import ProxyError

_encode = msgspec.json.encode

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(slots=True)
class SubRequest:
    """One backend request: one prompt, one sample."""

    index: int  # the choice index this sub-request's choice 0 becomes
    first_of_prompt: bool  # j == 0: its prompt_tokens count once in merged usage
    body: dict[str, Any]
    weight: int  # rough prompt size, for least-loaded prefill choice


def _bad(key: str, why: str) -> ProxyError:
    return ProxyError(400, f"invalid request: '{key}' {why}", "bad_request")


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _prompt_weight(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt) // 4 + 1
    if isinstance(prompt, list):
        return len(prompt) + 1
    return 1


def _messages_weight(messages: list[Any]) -> int:
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += len(part["text"])
    return total // 4 + 1


def split_request(body: Any, path: str, max_fanout: int = 1024) -> list[SubRequest]:
    """Validate a client body and split it into single-prompt, n=1 sub-requests."""
    if not isinstance(body, dict):
        raise ProxyError(400, "invalid request: body must be a JSON object", "bad_request")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise _bad("n", f"must be an integer >= 1, got {n!r}")
    if body.get("use_beam_search"):
        raise _bad("use_beam_search", "is not supported through the P/D proxy")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise _bad("seed", f"must be an integer, got {seed!r}")

    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "must be a non-empty list")
        prompts: list[Any] = [None]
        weights = [_messages_weight(messages)]
    else:
        if "prompt" not in body:
            raise _bad("prompt", "is required")
        prompt = body["prompt"]
        if isinstance(prompt, str) or (_is_int_list(prompt) and prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt)
            or all(_is_int_list(p) and p for p in prompt)
        ):
            prompts = list(prompt)
        else:
            # vLLM's own schema: str | list[int] | list[str] | list[list[int]] (no mixing).
            raise _bad(
                "prompt",
                "must be a string, a non-empty list of token ids, "
                "or a non-empty list of strings or of token-id lists",
            )
        weights = [_prompt_weight(p) for p in prompts]

    total = len(prompts) * n
    if total > max_fanout:
        raise _bad("n", f"times the number of prompts is {total}, above the proxy limit {max_fanout}")

    if total == 1:
        sub = dict(body)
        sub.pop("n", None)
        return [SubRequest(0, True, sub, weights[0])]

    subs: list[SubRequest] = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            sub = dict(body)
            sub["n"] = 1
            if prompt is not None:
                sub["prompt"] = prompt
            if seed is not None:
                sub["seed"] = seed + j
            subs.append(SubRequest(i * n + j, j == 0, sub, weights[i]))
    return subs


# Keys a sub-request sets itself; everything else is shared by all sub-requests.
_SUB_KEYS = frozenset(("prompt", "n", "seed", "kv_transfer_params"))
# Sampling fields that contradict a one-token, non-streamed prefill and make
# vLLM reject it (stream_options needs stream; min_tokens must be <= max_tokens).
_PREFILL_DROP = frozenset(("stream_options", "min_tokens", "n"))
_PREFILL_SET = frozenset(("max_tokens", "max_completion_tokens", "stream"))


def _tail(d: dict[str, Any]) -> memoryview | None:
    """``d`` encoded without its opening brace (a view: no copy), None when empty."""
    return memoryview(_encode(d))[1:] if d else None


class SharedBody:
    """A client body's JSON, encoded once and shared by all of its sub-requests.

    Why: a fanned-out request (``n`` samples of one prompt) would otherwise
    encode the whole prompt once per sub-request and per backend — ``n``
    copies of a 1 MiB prompt are ``n`` MiB. Here the keys common to all
    sub-requests and each distinct prompt are encoded once; a backend body is
    a list of segments (views of those bytes plus a few small per-request
    fields) written to the socket one after the other (``SegmentsPayload``).
    """

    __slots__ = ("_decode_tail", "_prefill_tail", "_prompts")

    def __init__(self, body: dict[str, Any], path: str) -> None:
        rest = {k: v for k, v in body.items() if k not in _SUB_KEYS}
        self._decode_tail = _tail(rest)
        pre = {k: v for k, v in rest.items() if k not in _PREFILL_DROP and k not in _PREFILL_SET}
        pre["max_tokens"] = 1
        if path == CHAT:
            pre["max_completion_tokens"] = 1
        pre["stream"] = False
        self._prefill_tail = _tail(pre)
        self._prompts: dict[int, bytes] = {}  # id(prompt object) -> its JSON

    def _prompt(self, prompt: Any) -> bytes:
        # Sub-requests of one prompt share the prompt object (split_request),
        # which stays alive as long as they do: its id is a stable key.
        enc = self._prompts.get(id(prompt))
        if enc is None:
            enc = self._prompts[id(prompt)] = _encode(prompt)
        return enc

    def _segments(
        self, sub: dict[str, Any], own: dict[str, Any], tail: memoryview | None
    ) -> list[bytes | memoryview]:
        head = memoryview(_encode(own))  # never empty: kv_transfer_params is in it
        segs: list[bytes | memoryview] = []
        if "prompt" in sub:
            segs += [b'{"prompt":', self._prompt(sub["prompt"]), b",", head[1:-1]]
        else:
            segs.append(head[:-1])
        if tail is None:
            segs.append(b"}")
        else:
            segs += [b",", tail]
        return segs

    def decode_payload(self, sub: dict[str, Any], kv: dict[str, Any]) -> SegmentsPayload:
        """Step 2 of the contract: the sub-request as is, asking for a remote prefill (``kv``)."""
        own: dict[str, Any] = {k: sub[k] for k in ("n", "seed") if k in sub}
        own["kv_transfer_params"] = kv
        return SegmentsPayload(self._segments(sub, own, self._decode_tail))

    def prefill_payload(self, sub: dict[str, Any], registered: dict[str, Any]) -> SegmentsPayload:
        """Step 4: one token, not streamed, the decode's registered parameters (or the
        claim of them, :func:`claim_params`) attached."""
        own: dict[str, Any] = {"seed": sub["seed"]} if "seed" in sub else {}
        # Literal contract order: the proxy's role flags first, decode's keys after.
        own["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, **registered}
        return SegmentsPayload(self._segments(sub, own, self._prefill_tail))


def decode_params(metaserver_url: str, proxy_request_id: str, token: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` a decode gets: the metaserver to register at, and how."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "metaserver": metaserver_url,
        "proxy_request_id": proxy_request_id,
        "registration_token": token,
    }


def claim_params(claim_url: str, proxy_request_id: str, token: str) -> dict[str, Any]:
    """What an early-dispatched prefill gets instead of the registered params: where and
    how to claim them once the decode registered."""
    return {"claim_url": claim_url, "proxy_request_id": proxy_request_id, "claim_token": token}


class SegmentsPayload(Payload):
    """A request body written as several buffers (shared between requests, never joined)."""

    _autoclose = True

    def __init__(self, segments: list[bytes | memoryview]) -> None:
        super().__init__(segments, content_type="application/json")
        self._size = sum(len(s) for s in segments)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"".join(self._value)

    async def write(self, writer: AbstractStreamWriter) -> None:
        for seg in self._value:
            await writer.write(seg)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        if content_length is None:
            await self.write(writer)
            return
        left = content_length
        for seg in self._value:
            if left <= 0:
                break
            part = seg[:left]
            await writer.write(part)
            left -= len(part)
