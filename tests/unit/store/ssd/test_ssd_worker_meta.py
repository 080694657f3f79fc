"""The SSD tier's worker side in the connector (connectors/store/ssd.py: SsdWorker) and
its reports in ``StoreWorkerMetadata``: spills reported once written, a promote's
leading good blocks and corrupt keys per rank, summed across ranks by ``aggregate``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ascend_offload.config import ConfigError, StoreConnectorConfig, parse
from ascend_offload.store.ssd import format as fmt
from ascend_offload.store.ssd.jobs import PromoteJob, SpillJob

LAYERS = (1024, 2048)


def settings(tmp_path: Path, capacity: int = 8 * 4096) -> SimpleNamespace:
    c = parse(StoreConnectorConfig, {"local": {"ssd": {"path": str(tmp_path), "capacity_bytes": capacity}}},
              where="x")
    return SimpleNamespace(cfg=c, page_bytes=sum(LAYERS), num_pages=8, world_size=2, fingerprint="fpw")


def planes(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randint(0, 256, (8, b), dtype=torch.uint8, generator=g) for i, b in enumerate(LAYERS)}


def test_worker_reports_spills_and_promotes_and_ranks_aggregate(tmp_path: Path) -> None:
    from ascend_offload.connectors.store.metadata import StoreWorkerMetadata
    from ascend_offload.connectors.store.ssd import SsdWorker

    ranks = [SsdWorker(settings(tmp_path), planes(r), rank=r) for r in range(2)]  # type: ignore[arg-type]
    try:
        assert {p.name for p in tmp_path.iterdir()} == {"ssd-fpw-r0.slots", "ssd-fpw-r1.slots"}
        spill = SpillJob(1, ("a", "b", "c"), (0, 1, 2), (4, 5, 6))
        for w in ranks:
            w.submit_spills([spill])
            assert w.tier.wait_idle(30)
        # rank 1's copy of b is damaged on disk
        with open(tmp_path / "ssd-fpw-r1.slots", "r+b") as f:
            f.seek(5 * fmt.slot_bytes(sum(LAYERS)) + fmt.HEADER_BYTES + 10)
            f.write(b"\xff\x00\xff")
        promote = PromoteJob(2, ("a", "b", "c"), (7, 6, 5), (4, 5, 6))
        metas = []
        for w in ranks:
            w.run_promotes([promote])
            metas.append(StoreWorkerMetadata(**w.take_report()))
        assert metas[0].ssd_spilled == Counter({1: 1}) and metas[0].ssd_promoted == Counter({(2, 3): 1})
        assert metas[1].ssd_promoted == Counter({(2, 1): 1}) and metas[1].ssd_corrupt == Counter({"b": 1})
        both = metas[0].aggregate(metas[1])
        assert both.ssd_spilled == Counter({1: 2}) and not both.empty()
        assert both.ssd_promoted == Counter({(2, 3): 1, (2, 1): 1})
        assert StoreWorkerMetadata(**ranks[0].take_report()).empty()  # each report is taken once
    finally:
        for w in ranks:
            w.close()


def test_capacity_below_one_slot_names_the_key(tmp_path: Path) -> None:
    from ascend_offload.connectors.store.ssd import SsdWorker

    with pytest.raises(ConfigError, match=r"local\.ssd\.capacity_bytes"):
        SsdWorker(settings(tmp_path, capacity=4095), planes(0), rank=0)  # type: ignore[arg-type]
