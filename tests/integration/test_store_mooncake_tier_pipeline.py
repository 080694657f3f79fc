"""The shared tier's two-part calls (store/shared/tier.py: a publish or fetch large enough
overlaps its hash with its transfer) against a real ``mooncake_master`` on 127.0.0.1:
the bytes a two-part publish stores are the ones a two-part fetch (and a one-part one)
brings back, and a byte torn in a fetched page is a miss in either part."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda and libibverbs")

from ascend_offload.store.services.mooncake_master import MooncakeMaster, master_binary
from ascend_offload.store.shared.mooncake import RemotePages

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(master_binary() is None, reason="mooncake_master not installed"),
]

PAGES = 16
LAYERS = {"model.layers.1.attn": 3000, "model.layers.0.attn": 5000, "model.layers.2.attn": 1024}


def cfg(master: MooncakeMaster, segment: int) -> SimpleNamespace:
    return SimpleNamespace(master_address=master.address, local_hostname="127.0.0.1",
                           metadata_server="P2PHANDSHAKE", protocol="tcp", device_name="",
                           global_segment_bytes=segment, retry_interval_s=0.2)


def planes(seed: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    return {name: (torch.randint(0, 256, (PAGES, n), dtype=torch.uint8, generator=g) if seed is not None
                   else torch.zeros((PAGES, n), dtype=torch.uint8)) for name, n in LAYERS.items()}


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[tuple[RemotePages, RemotePages, dict, dict]]:
    with MooncakeMaster(tmp_path / "master.log") as master:
        src, dst = planes(1), planes(None)
        holder = RemotePages(cfg(master, 32 << 20), src, rank=0)  # holds the pool memory
        reader = RemotePages(cfg(master, 0), dst, rank=0)
        for p in (holder, reader):
            p.pipeline_min_bytes = 1  # every call of two blocks or more is two parts
        yield holder, reader, src, dst
        reader.close()
        holder.close()


def test_two_part_calls_round_trip_and_a_torn_byte_is_a_miss(ranks) -> None:
    holder, reader, src, dst = ranks
    keys = [f"m:f:0:h{i}" for i in range(8)]
    src_pages, dst_pages = [0, 1, 2, 3, 4, 5, 6, 7], [15, 9, 8, 12, 10, 11, 14, 13]
    assert holder.publish(keys, src_pages)
    assert holder.counts.published_blocks == 8
    assert reader.fetch(keys, dst_pages) == (True, True)
    for name in LAYERS:
        for s, d in zip(src_pages, dst_pages, strict=True):
            assert torch.equal(dst[name][d], src[name][s])
    reader.pipeline_min_bytes = float("inf")  # a one-part fetch reads the same objects
    for name in LAYERS:
        dst[name].zero_()
    assert reader.fetch(keys[:3], [0, 1, 2]) == (True, True)
    assert torch.equal(dst["model.layers.0.attn"][2], src["model.layers.0.attn"][2])
    reader.pipeline_min_bytes = 1

    real: Callable[..., list[int]] = reader._client.get

    def tearing(tear: str) -> Callable[..., list[int]]:
        def get(shards: Sequence[str], ptrs: list[list[int]], lens: list[list[int]], **kw) -> list[int]:
            got = real(shards, ptrs, lens, **kw)
            if tear in shards:  # one byte of the block's first-layer row, after it arrived
                ctypes.c_uint8.from_address(ptrs[list(shards).index(tear)][0] + 11).value ^= 0x80
            return got
        return get

    for i in (1, 7):  # in the first part (verified while the last is fetched), in the last
        reader._client.get = tearing(f"{keys[i]}@r0")  # type: ignore[method-assign]
        assert reader.fetch(keys, dst_pages) == (False, True)
    c = reader.counts
    assert c.fetch_corrupt_blocks == 2 and c.fetched_blocks == 8 + 3 + 14
    assert c.fetched_blocks + c.fetch_failed_blocks == 8 + 3 + 16
