"""OpenAI-style error bodies, the one exception type the proxy raises, and the root of
the proxy's exceptions.

Every failure the client can see is a ``ProxyError`` carrying an HTTP status,
so handlers turn any of them into the same JSON shape vLLM itself uses:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import msgspec

_TYPES: dict[int, str] = {
    400: "BadRequestError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class AscendOffloadProxyError(Exception):
    """Root of every exception class defined in ``proxy`` (which imports nothing of the
    library, so it does not share ``ascend_offload.errors.AscendOffloadError``)."""


class ProxyError(AscendOffloadProxyError):
    """A failure with the HTTP status the client should receive."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        *,
        retry_after: int | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        # ``kind`` is a short machine label for metrics (e.g. "prefill_down").
        self.kind = kind or _TYPES.get(status, "error")
        # Seconds for a ``Retry-After`` header (overload answers: 429/503).
        self.retry_after = retry_after
        # Close the connection after answering: the request body was not read
        # to its end (too large, stalled), so the connection cannot be reused.
        self.close = close

    def body(self) -> bytes:
        return error_body(self.status, self.message)

    def __repr__(self) -> str:
        return f"ProxyError({self.status}, {self.message!r}, kind={self.kind!r})"


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """The JSON bytes of an OpenAI-style error object."""
    return msgspec.json.encode(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "Error"),
                "param": param,
                "code": status,
            }
        }
    )


def sse_error_event(status: int, message: str) -> bytes:
    """An error as one SSE event, for failures after a stream has started.

    Once response headers are out the status cannot change any more; vLLM
    itself reports mid-stream errors as a ``data:`` event carrying the error
    object, followed by ``[DONE]``, and clients already handle that shape.
    """
    return b"data: " + error_body(status, message) + b"\n\ndata: [DONE]\n\n"
