"""P/D wire protocol: typed msgpack messages between prefill and decode.

Prefill ranks talk to decode TP ranks over ZMQ (prefill DEALER -> decode ROUTER;
replies travel back over the same connection). Every message is a msgpack
array whose first element is the tag — the names vllm-ascend uses (``mf_meta``,
``read_ready_batch``, ``read_done``, ``read_failed``) — followed by the protocol
version, so a peer on another version is rejected by name instead of being
misread. Slot generation ids fence reuse of prefill buffers: an ack for an old
generation can never be taken as an ack for the current contents.

Decoding never raises anything but :class:`ProtocolError`; callers log and drop
(invariant I7: bad wire messages never crash the engine).
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from ascend_offload.errors import AscendOffloadError

PROTOCOL_VERSION = 1

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Pos = Annotated[int, msgspec.Meta(gt=0)]
# Bounded so a garbled length cannot make us allocate or loop without limit.
MAX_NAME = 512
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]


class ProtocolError(AscendOffloadError, ValueError):
    """A message could not be decoded or is inconsistent; it is dropped (and logged)."""


# Failure codes carried by ``read_failed`` (stable strings: part of the protocol).
FAIL_INVALID = "invalid"  # fields inconsistent with decode's layout or the request
FAIL_NO_META = "no_meta"  # decode has no mf_meta from this prefill rank (resend it)
FAIL_UNKNOWN_REQUEST = "unknown_request"  # decode does not expect this request (any more)
FAIL_READ = "read_error"  # the transfer engine reported an error (after retries)
FAIL_LATE = "late"  # the read finished after its budget: the data may be overwritten
FAIL_VERSION = "version"
FAIL_CODES = frozenset({FAIL_INVALID, FAIL_NO_META, FAIL_UNKNOWN_REQUEST, FAIL_READ, FAIL_LATE, FAIL_VERSION})


class TensorDesc(msgspec.Struct, array_like=True, frozen=True):
    """One registered KV tensor of one layer: block ``b`` is at ``base_addr + b * block_stride``."""

    base_addr: NonNeg
    block_bytes: Pos
    block_stride: Pos
    num_blocks: NonNeg

    def block_addr(self, block: int) -> int:
        return self.base_addr + block * self.block_stride


class LayerDesc(msgspec.Struct, array_like=True, frozen=True):
    """Main KV tensors (replicated across TP) and the optional indexer tensor of one layer."""

    main: Annotated[list[TensorDesc], msgspec.Meta(max_length=64)]
    indexer: TensorDesc | None = None


class MfMeta(msgspec.Struct, tag="mf_meta", array_like=True, frozen=True):
    """Prefill -> decode, once per connection: where this prefill rank's KV lives."""

    version: int
    engine_id: Name
    p_rank: NonNeg
    p_tp: Pos
    endpoint: Name
    layers: Annotated[list[LayerDesc], msgspec.Meta(max_length=4096)]


class ReadReady(msgspec.Struct, array_like=True, frozen=True):
    """Layer ``layer`` of request ``request_id`` is readable in prefill blocks ``src_blocks``.

    ``main`` says whether this contributor sends the (replicated) main KV;
    ``index_lo:index_hi`` is its share of the request's blocks for the indexer
    (positions in ``src_blocks`` / decode's block list; empty when it has none).
    """

    request_id: Name
    layer: NonNeg
    slot: NonNeg
    generation: NonNeg
    src_blocks: Annotated[list[NonNeg], msgspec.Meta(max_length=1 << 20)]
    main: bool
    index_lo: NonNeg
    index_hi: NonNeg


class ReadReadyBatch(msgspec.Struct, tag="read_ready_batch", array_like=True, frozen=True):
    """Prefill -> decode: everything one prefill rank made readable after one layer.

    ``read_budget_ms`` is how long after receipt decode may still finish a
    read: past it the producer may already have reused the slot, so decode
    reports the read ``late`` instead of trusting the bytes.
    """

    version: int
    engine_id: Name
    p_rank: NonNeg
    read_budget_ms: Pos
    items: Annotated[list[ReadReady], msgspec.Meta(max_length=1 << 16)]


class ReadDone(msgspec.Struct, tag="read_done", array_like=True, frozen=True):
    """Decode -> prefill: this (request, layer, slot generation) was read completely."""

    version: int
    engine_id: Name
    d_rank: NonNeg
    p_rank: NonNeg
    request_id: Name
    layer: NonNeg
    slot: NonNeg
    generation: NonNeg


class ReadFailed(msgspec.Struct, tag="read_failed", array_like=True, frozen=True):
    """Decode -> prefill: this item was not read (``code`` is one of ``FAIL_CODES``)."""

    version: int
    engine_id: Name
    d_rank: NonNeg
    p_rank: NonNeg
    request_id: Name
    layer: NonNeg
    slot: NonNeg
    generation: NonNeg
    code: Name
    reason: Annotated[str, msgspec.Meta(max_length=4096)] = ""


Message = Union[MfMeta, ReadReadyBatch, ReadDone, ReadFailed]  # noqa: UP007 - msgspec needs a Union object
TO_DECODE = (MfMeta, ReadReadyBatch)
TO_PREFILL = (ReadDone, ReadFailed)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, *, expect: tuple[type, ...] | None = None) -> Message:
    """Decode and validate one message; raise :class:`ProtocolError` with the reason."""
    try:
        msg = _decoder.decode(data)
    except Exception as exc:  # DecodeError, ValidationError, UnicodeDecodeError, ...: all bad input
        raise ProtocolError(f"undecodable message ({len(data)} B): {type(exc).__name__}: {exc}") from None
    if msg.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{type(msg).__name__} version={msg.version}: this side speaks version {PROTOCOL_VERSION}"
        )
    if expect is not None and not isinstance(msg, expect):
        raise ProtocolError(
            f"unexpected {type(msg).__name__} here (accepted: {', '.join(t.__name__ for t in expect)})"
        )
    _check(msg)
    return msg


def _check(msg: Message) -> None:
    """Cross-field checks msgspec's per-field constraints cannot express."""
    if isinstance(msg, MfMeta):
        if msg.p_rank >= msg.p_tp:
            raise ProtocolError(f"mf_meta p_rank={msg.p_rank} not below p_tp={msg.p_tp}")
        for i, layer in enumerate(msg.layers):
            for t in (*layer.main, *([layer.indexer] if layer.indexer else [])):
                if t.block_stride < t.block_bytes:
                    raise ProtocolError(
                        f"mf_meta layer {i}: block_stride={t.block_stride} < block_bytes={t.block_bytes}"
                    )
    elif isinstance(msg, ReadReadyBatch):
        for it in msg.items:
            if it.index_lo > it.index_hi or it.index_hi > len(it.src_blocks):
                raise ProtocolError(
                    f"read_ready {it.request_id!r} layer {it.layer}: indexer range "
                    f"[{it.index_lo}, {it.index_hi}) outside 0..{len(it.src_blocks)}"
                )
    elif isinstance(msg, ReadFailed) and msg.code not in FAIL_CODES:
        raise ProtocolError(f"read_failed code={msg.code!r} (accepted: {', '.join(sorted(FAIL_CODES))})")
