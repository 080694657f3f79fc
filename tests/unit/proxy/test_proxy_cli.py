from __future__ import annotations

import pytest

from proxy.cli import build_parser, config_from_args, main, pair_addresses
from proxy.config import ProxyConfig


def test_pairing_rules() -> None:
    assert pair_addresses("decoder", ["a", "b"], ["1", "2"]) == [("a", 1), ("b", 2)]
    assert pair_addresses("decoder", ["a"], ["1", "2"]) == [("a", 1), ("a", 2)]
    assert pair_addresses("decoder", ["a,b"], ["7"]) == [("a", 7), ("b", 7)]
    with pytest.raises(ValueError, match="--decoder-hosts has 2 values and --decoder-ports has 3"):
        pair_addresses("decoder", ["a", "b"], ["1", "2", "3"])
    with pytest.raises(ValueError, match="--prefiller-ports must be integers"):
        pair_addresses("prefiller", ["a"], ["x"])
    with pytest.raises(ValueError, match="70000"):
        pair_addresses("prefiller", ["a"], ["70000"])


def test_config_from_args() -> None:
    args = build_parser().parse_args(
        ["--port", "9000", "--prefiller-hosts", "p1", "p2", "--prefiller-ports", "8100",
         "--decoder-ports", "8200", "8201", "--timeout-s", "5", "--register-timeout-s", "2"]
    )
    cfg = config_from_args(args)
    assert cfg.prefillers == [("p1", 8100), ("p2", 8100)]
    assert cfg.decoders == [("127.0.0.1", 8200), ("127.0.0.1", 8201)]
    assert cfg.timeout_s == 5 and cfg.register_timeout_s == 2 and cfg.port == 9000


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"register_timeout_s": -1}, "register_timeout_s"),
        ({"max_connections": -1}, "max_connections"),
        ({"max_fanout": 0}, "max_fanout"),
        ({"max_body_mb": 0}, "max_body_mb"),
        ({"prefillers": []}, "prefill"),
    ],
)
def test_config_validation_names_the_key(kw: dict, msg: str) -> None:
    base = {"prefillers": [("h", 1)], "decoders": [("h", 2)]}
    with pytest.raises(ValueError, match=msg):
        ProxyConfig(**{**base, **kw})


def test_main_rejects_bad_addresses(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--prefiller-ports", "1", "2", "--prefiller-hosts", "a", "b", "c", "--decoder-ports", "3"])
    assert rc == 2
    assert "--prefiller-hosts has 3 values" in capsys.readouterr().err
