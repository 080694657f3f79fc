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
    """Cuts a byte stream into SSE ``data:`` payloads, across arbitrary read boundaries.

    Linear in the bytes fed: only new data is searched for the blank line that ends an
    event, and the unfinished event's pieces are joined once, when it ends. An event
    still unfinished after ``max_event`` bytes is refused (``ValueError``): a decode
    that never ends its event must not grow the proxy's memory without a bound.
    """

    __slots__ = ("_cr", "_parts", "_size", "max_event")

    def __init__(self, max_event: int = 1 << 62) -> None:
        self.max_event = max_event
        self._parts: list[bytes] = []  # the unfinished event, in pieces
        self._size = 0
        self._cr = False  # the last chunk ended in "\r", maybe half of a "\r\n"

    def feed(self, data: bytes) -> list[bytes]:
        if self._cr:
            data = b"\r" + data
            self._cr = False
        if data.endswith(b"\r"):
            data = data[:-1]
            self._cr = True
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        if self._parts and data.startswith(b"\n") and self._parts[-1].endswith(b"\n"):
            # The blank line straddles two reads.
            self._emit(b"".join(self._parts)[:-1], out)
            self._parts, self._size = [], 0
            data = data[1:]
        pieces = data.split(b"\n\n")
        if len(pieces) > 1:
            self._parts.append(pieces[0])
            self._emit(b"".join(self._parts), out)
            for event in pieces[1:-1]:
                self._emit(event, out)
            self._parts, self._size = [], 0
        tail = pieces[-1]
        if tail:
            self._parts.append(tail)
            self._size += len(tail)
            if self._size > self.max_event:
                raise ValueError(f"an SSE event is above the limit {self.max_event} bytes without its end")
        return out

    @staticmethod
    def _emit(event: bytes, out: list[bytes]) -> None:
        payload = _event_data(event)
        if payload is not None:
            out.append(payload)

    def pending(self) -> bytes:
        return b"".join(self._parts) + (b"\r" if self._cr else b"")

    def finish(self) -> list[bytes]:
        """The stream ended: its last event counts even without the closing blank line."""
        buf = self.pending()
        self._parts, self._size, self._cr = [], 0, False
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


def _count(usage: dict[str, Any], key: str) -> int:
    value = usage.get(key)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"usage {key!r} is not a non-negative integer: {value!r:.80}")
    return value


def _add_usage(total: dict[str, Any], usage: dict[str, Any], count_prompt: bool) -> None:
    if count_prompt:
        total["prompt_tokens"] = total.get("prompt_tokens", 0) + _count(usage, "prompt_tokens")
    total["completion_tokens"] = total.get("completion_tokens", 0) + _count(usage, "completion_tokens")
    total["total_tokens"] = total.get("prompt_tokens", 0) + total["completion_tokens"]


def _choices(obj: dict[str, Any]) -> list[Any]:
    """``obj["choices"]``, checked: the merge renumbers them, so each needs an integer index.

    A decode's answer is a peer's message: an off-schema one is refused here
    (``ValueError``), so it fails its own request with a 502, never the proxy.
    """
    choices = obj.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list):
        raise ValueError(f"'choices' is not a list: {choices!r:.80}")
    for c in choices:
        if not isinstance(c, dict):
            raise ValueError(f"a choice is not an object: {c!r:.80}")
        index = c.get("index", 0)
        if index is None:
            index = 0
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"a choice 'index' is not a non-negative integer: {index!r:.80}")
    return choices


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
        choices = _choices(chunk)
        usage = chunk.get("usage")
        if not choices and isinstance(usage, dict):
            if self.usage is None:
                self.usage = {}
            _add_usage(self.usage, usage, first_of_prompt)
            self._last_usage_chunk = chunk
            return None
        for c in choices:
            c["index"] = index + (c.get("index") or 0)
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
        for c in _choices(resp):
            c["index"] = index + (c.get("index") or 0)
            choices.append(c)
        u = resp.get("usage")
        if isinstance(u, dict):
            have_usage = True
            _add_usage(usage, u, first_of_prompt)
    assert merged is not None
    choices.sort(key=lambda c: c["index"])
    merged["id"] = response_id
    merged["choices"] = choices
    if have_usage:
        merged["usage"] = usage
    merged.pop("kv_transfer_params", None)
    return _encode(merged)
