"""The metaserver's wire schema: what a decode may register, parsed at the boundary.

A registration is ``{"proxy_request_id", "registration_token",
"kv_transfer_params"}``; with early prefill dispatch the prefill claims it with
``{"proxy_request_id", "claim_token"}`` (a second token, sent only to the
prefill). The token is minted per sub-request
(``secrets.token_urlsafe``) and sent only to the decode the request was
forwarded to, inside its ``kv_transfer_params``; request ids leak to clients
(response ids, vLLM's ``cmpl-<X-Request-Id>``), the token does not. It is
checked (constant-time) before the params are even parsed, so an
unauthenticated peer learns nothing but 403/404.

``RegisteredParams`` mirrors ``ascend_offload.pd.registration.DecodeRegistration``
field for field (the proxy imports neither vLLM nor the library, so the schema
is restated here; a unit test keeps the two identical). Unknown keys are
rejected, so a registration can never set the proxy's own keys
(``do_remote_decode``, ``do_remote_prefill``) nor smuggle others to the prefill.
"""

from __future__ import annotations

import hmac
from typing import Annotated

import msgspec

from proxy.errors import ProxyError

_Count = Annotated[int, msgspec.Meta(ge=0)]
_Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
# A prompt of 4M tokens in 16-token blocks; the body cap bounds it further.
_MAX_BLOCKS = 1 << 18


class RegisteredParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Decode's endpoint and destination blocks for one request (passed on to the prefill)."""

    remote_engine_id: Annotated[str, msgspec.Meta(max_length=512)] = ""
    remote_host: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    remote_port: _Port
    remote_tp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    remote_dp_rank: _Count = 0
    remote_request_id: _Id
    remote_block_ids: Annotated[list[_Count], msgspec.Meta(max_length=_MAX_BLOCKS)]
    remote_block_offset: _Count = 0
    transfer_protocol: Annotated[str, msgspec.Meta(max_length=64)] = ""


class Envelope(msgspec.Struct, forbid_unknown_fields=True):
    """The outer registration message; the params stay raw until the token checked out."""

    proxy_request_id: _Id
    registration_token: _Id
    kv_transfer_params: msgspec.Raw


class ClaimEnvelope(msgspec.Struct, forbid_unknown_fields=True):
    """A prefill's claim of its decode's registration (early dispatch)."""

    proxy_request_id: _Id
    claim_token: _Id


# A claim is two ids of at most 512 characters, the keys and room for escapes.
CLAIM_MAX_BYTES = 4096

_envelope = msgspec.json.Decoder(Envelope)
_claim = msgspec.json.Decoder(ClaimEnvelope)
_params = msgspec.json.Decoder(RegisteredParams)


def parse_envelope(raw: bytes) -> Envelope:
    """The registration's id and token; 400 for anything else than the schema."""
    try:
        return _envelope.decode(raw)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ProxyError(400, f"metaserver: malformed registration: {e}", "malformed") from None


def parse_claim(raw: bytes) -> ClaimEnvelope:
    """A claim's id and token; 400 for anything else than the schema."""
    try:
        return _claim.decode(raw)
    except msgspec.DecodeError as e:
        raise ProxyError(400, f"metaserver: malformed claim: {e}", "malformed") from None


def parse_params(env: Envelope) -> RegisteredParams:
    """The registered params, once the token was accepted; 400 when off-schema."""
    try:
        return _params.decode(env.kv_transfer_params)
    except msgspec.DecodeError as e:
        raise ProxyError(
            400, f"metaserver: malformed registration: {e} (in 'kv_transfer_params')", "malformed"
        ) from None


def token_matches(expected: str, given: str) -> bool:
    """Constant-time compare: timing does not tell how much of a guess was right."""
    return hmac.compare_digest(expected.encode(), given.encode())
