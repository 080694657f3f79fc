"""Merging several single-choice backend answers into one OpenAI answer.

A request that was not fanned out is relayed byte for byte and never touches
this module: parsing every chunk is what makes naive proxies slow. Only
fanned-out requests (prompt lists, ``n > 1``) need their choices renumbered,
so only they pay for JSON decoding here.
"""

from __future__ import annotations

from typing import Any

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode

DONE = b"[DONE]"


class SSESplitter:
    """Cuts a byte stream into SSE ``data:`` payloads, across arbitrary read boundaries."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._buf = events.pop()
        out: list[bytes] = []
        for event in events:
            payload = _event_data(event)
            if payload is not None:
                out.append(payload)
        return out

    def pending(self) -> bytes:
        return self._buf

    def finish(self) -> list[bytes]:
        """The stream ended: its last event counts even without the closing blank line."""
        buf, self._buf = self._buf, b""
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        payload = _event_data(buf.strip(b"\n"))
        return [payload] if payload is not None else []


def _event_data(event: bytes) -> bytes | None:
    """The joined ``data:`` lines of one SSE event (None for comments/empty events)."""
    parts = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    if not parts:
        return None
    return b"\n".join(parts)


def _add_usage(total: dict[str, Any], usage: dict[str, Any], count_prompt: bool) -> None:
    if count_prompt:
        total["prompt_tokens"] = total.get("prompt_tokens", 0) + int(usage.get("prompt_tokens") or 0)
    total["completion_tokens"] = total.get("completion_tokens", 0) + int(
        usage.get("completion_tokens") or 0
    )
    total["total_tokens"] = total.get("prompt_tokens", 0) + total["completion_tokens"]


class StreamMerger:
    """Rewrites chunks of several sub-streams into one stream.

    Each chunk's choices get the sub-request's output index and all chunks the
    same response id. Usage-only chunks (``stream_options.include_usage``) are
    held back and summed into a single usage chunk sent just before
    ``[DONE]``, as a single backend would.
    """

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        self.usage: dict[str, Any] | None = None
        self._last_usage_chunk: dict[str, Any] | None = None

    def rewrite(self, payload: bytes, index: int, first_of_prompt: bool) -> bytes | None:
        """The SSE event to forward for one sub-stream payload, or None to hold it back."""
        if payload.strip() == DONE:
            return None
        chunk = _decode(payload)
        if not isinstance(chunk, dict):
            return b"data: " + payload + b"\n\n"
        if "error" in chunk and "choices" not in chunk:
            return b"data: " + payload + b"\n\n"
        chunk["id"] = self.response_id
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        if not choices and isinstance(usage, dict):
            if self.usage is None:
                self.usage = {}
            _add_usage(self.usage, usage, first_of_prompt)
            self._last_usage_chunk = chunk
            return None
        for c in choices:
            if isinstance(c, dict):
                c["index"] = index + int(c.get("index") or 0)
        return b"data: " + _encode(chunk) + b"\n\n"

    def finish(self) -> bytes:
        tail = b""
        if self.usage is not None and self._last_usage_chunk is not None:
            chunk = dict(self._last_usage_chunk)
            chunk["usage"] = self.usage
            tail = b"data: " + _encode(chunk) + b"\n\n"
        return tail + b"data: [DONE]\n\n"


def merge_responses(
    parts: list[tuple[int, bool, bytes]], response_id: str
) -> bytes:
    """One non-streamed response from several (index, first_of_prompt, body) parts."""
    merged: dict[str, Any] | None = None
    choices: list[Any] = []
    usage: dict[str, Any] = {}
    have_usage = False
    for index, first_of_prompt, raw in parts:
        resp = _decode(raw)
        if not isinstance(resp, dict):
            raise ValueError("backend answer is not a JSON object")
        if merged is None:
            merged = resp
        for c in resp.get("choices") or []:
            if isinstance(c, dict):
                c["index"] = index + int(c.get("index") or 0)
            choices.append(c)
        u = resp.get("usage")
        if isinstance(u, dict):
            have_usage = True
            _add_usage(usage, u, first_of_prompt)
    assert merged is not None
    choices.sort(key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
    merged["id"] = response_id
    merged["choices"] = choices
    if have_usage:
        merged["usage"] = usage
    merged.pop("kv_transfer_params", None)
    return _encode(merged)
