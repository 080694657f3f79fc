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

from proxy.errors import ProxyError

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


def decode_body(sub: dict[str, Any], metaserver_url: str, proxy_request_id: str) -> dict[str, Any]:
    """Step 2 of the contract: the decode request asks for a remote prefill."""
    body = dict(sub)
    body["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "metaserver": metaserver_url,
        "proxy_request_id": proxy_request_id,
    }
    return body


# Sampling fields that contradict a one-token, non-streamed prefill and make
# vLLM reject it (stream_options needs stream; min_tokens must be <= max_tokens).
_PREFILL_DROP = ("stream_options", "min_tokens", "n")


def prefill_body(sub: dict[str, Any], path: str, registered: dict[str, Any]) -> dict[str, Any]:
    """Step 4 of the contract: one token, not streamed, decode's parameters attached."""
    body = dict(sub)
    for key in _PREFILL_DROP:
        body.pop(key, None)
    body["max_tokens"] = 1
    if path == CHAT:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    # Literal contract order: decode's registered keys come last.
    body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, **registered}
    return body
