"""Decode hands the proxy's registration token back, and both sides agree on the schema."""

from __future__ import annotations

from typing import Any

import msgspec
from test_decode_requests import Req, _params, _requests

from ascend_offload.pd import registration
from ascend_offload.pd.registration import DecodeRegistration
from proxy.registration import RegisteredParams


def test_decode_passes_the_token_it_received_to_the_registrar() -> None:
    reqs, reg = _requests()
    reqs.after_alloc(Req("r", 32, kv_transfer_params=_params(registration_token="tok-1")), [1, 2], 32)
    reqs.after_alloc(Req("s", 32, kv_transfer_params=_params()), [3, 4], 32)
    assert reg.tokens == ["tok-1", None]


def test_register_posts_the_token_next_to_the_request_id() -> None:
    bodies: list[dict[str, Any]] = []

    class Http:
        def post(self, url: str, json: dict[str, Any], timeout: float) -> Any:
            bodies.append(json)
            return type("R", (), {"status_code": 200, "json": lambda self: {"status": "dispatched"}})()

    params = DecodeRegistration(remote_host="h", remote_port=5, remote_request_id="r", remote_block_ids=[1])
    registration.register("http://proxy:1/v1/metaserver", "px", params, registration_token="tok",
                          client=Http())  # type: ignore[arg-type]
    assert bodies[0]["registration_token"] == "tok" and bodies[0]["proxy_request_id"] == "px"
    # What decode registers is exactly what the proxy's schema accepts.
    assert msgspec.convert(bodies[0]["kv_transfer_params"], RegisteredParams) is not None


def test_proxy_schema_mirrors_decode_registration() -> None:
    ours = msgspec.inspect.type_info(RegisteredParams)
    theirs = msgspec.inspect.type_info(DecodeRegistration)
    assert isinstance(ours, msgspec.inspect.StructType) and isinstance(theirs, msgspec.inspect.StructType)
    assert [(f.name, f.required, f.default) for f in ours.fields] == [
        (f.name, f.required, f.default) for f in theirs.fields
    ]
    # Same base types; the proxy may only bound sizes further.
    for a, b in zip(ours.fields, theirs.fields, strict=True):
        assert type(a.type) is type(b.type), a.name
    assert ours.forbid_unknown_fields and theirs.forbid_unknown_fields
