"""device.HostMirror and transfer.staged.StagedEngine over the fake device: host twins
with the device tensor's layout, block copies in both directions, reads landed on the
device block by block."""

from __future__ import annotations

import pytest
import torch

from ascend_offload import device
from ascend_offload.transfer.base import LoopbackEngine, ReadOp, TransferError
from ascend_offload.transfer.staged import StagedEngine
from tests.support.fake_device import (
    FakeDevice,
    FakeDeviceAccess,
    GuardedEngine,
    installed,
)


def test_memory_model_is_installed_and_restored() -> None:
    t = torch.zeros(2)
    fake = FakeDevice()
    with installed(fake):
        placed = fake.place(t)
        assert not device.is_host(placed) and device.is_accelerator(placed) and device.is_host(t)
        assert not device.host_addressable_pages(placed.view(2, 1), 0)
        with pytest.raises(FakeDeviceAccess):
            placed + 1
        view = placed[1:]  # views and metadata stay allowed
        assert view.data_ptr() == t.data_ptr() + 4 and not device.is_host(view)
    assert device.is_host(placed)  # the default model answers by t.device again


def test_mirror_twins_share_storage_and_copy_only_listed_blocks() -> None:
    base = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
    with installed() as fake:
        kv = fake.place(base)
        k, v = kv[0], kv[1]  # two block-major views of one buffer (K and V halves)
        alias = fake.place(base)[0]  # another layer aliasing the same buffer
        mirror = device.HostMirror()
        tk, tv, ta = mirror.twin(k), mirror.twin(v), mirror.twin(alias)
        assert mirror.nbytes == base.numel() * 4  # one twin for the shared storage
        assert device.is_host(tk) and tk.stride() == k.stride() and tk.shape == k.shape
        assert ta.data_ptr() == tk.data_ptr() and tv.data_ptr() == tk.data_ptr() + 6 * 3 * 4
        mirror.to_host(k, [4, 1, 2])
        assert torch.equal(tk[[1, 2, 4]], base[0][[1, 2, 4]])
        assert not tk[[0, 3, 5]].any() and not tv.any()
        tv.fill_(-1.0)
        mirror.from_host(v, [5])
        assert torch.equal(base[1][5], torch.full((3,), -1.0))
        assert torch.equal(base[1][:5], torch.arange(18, 33, dtype=torch.float32).view(5, 3))
        mirror.from_host(v, [])  # nothing to do
        assert fake.accesses == 2


def test_mirror_scattered_blocks_gather_in_one_transfer() -> None:
    """More runs than per-run copies are worth: the gather path moves the same blocks."""
    base = torch.randn(40, 3, 2)
    orig = base.clone()
    with installed() as fake:
        kv = fake.place(base)
        mirror = device.HostMirror()
        twin = mirror.twin(kv)
        odd = list(range(1, 40, 2))  # 20 runs of one block
        mirror.to_host(kv, odd)
        assert torch.equal(twin[odd], orig[odd]) and not twin[0::2].any()
        twin.neg_()
        mirror.from_host(kv, odd[::-1])
        assert torch.equal(base[odd], -orig[odd]) and torch.equal(base[0::2], orig[0::2])


def test_staged_engine_lands_interleaved_tensors_block_by_block() -> None:
    """Two tensors whose blocks interleave in one buffer (per-head views): a read into one
    lands only that tensor's blocks on the device."""
    src = torch.arange(6 * 2 * 4, dtype=torch.float32).view(6, 2, 4)
    dst = torch.zeros(6, 2, 4)
    with installed() as fake:
        dev = fake.place(dst)
        mirror = device.HostMirror()
        pairs = [(dev[:, j], mirror.twin(dev[:, j])) for j in range(2)]
        peer = LoopbackEngine()
        peer.register(src.data_ptr(), src.numel() * 4)
        inner = GuardedEngine(fake)
        staged = StagedEngine(inner, mirror, pairs)
        host0, host1 = pairs[0][1], pairs[1][1]
        staged.register(host0.data_ptr(), 6 * 2 * 4 * 4)  # the whole twin buffer
        ops = [ReadOp(host1[b].data_ptr(), src[sb, 1].data_ptr(), 16) for b, sb in ((0, 5), (3, 2), (4, 4))]
        ops.append(ReadOp(host0[2].data_ptr(), src[1, 0].data_ptr(), 16))  # head 0, inside head 1's range
        assert staged.read(peer.endpoint, ops) == 4
        assert torch.equal(dst[[0, 3, 4], 1], src[[5, 2, 4], 1]) and torch.equal(dst[2, 0], src[1, 0])
        assert not dst[[0, 1, 3, 4, 5], 0].any() and not dst[[1, 2, 5], 1].any()
        assert staged.landed_blocks == 4 and inner.violations == []
        bad = ReadOp(host1.data_ptr() + 6 * 2 * 4 * 4, src.data_ptr(), 4)  # past the staged KV
        with pytest.raises(TransferError):
            staged._land([bad])
        staged.close()
        peer.close()


def test_failed_read_lands_nothing() -> None:
    dst = torch.zeros(4, 8)
    with installed() as fake:
        dev = fake.place(dst)
        mirror = device.HostMirror()
        twin = mirror.twin(dev)
        twin.fill_(7.0)  # stale twin bytes must not reach the device when the read fails
        staged = StagedEngine(GuardedEngine(fake), mirror, [(dev, twin)])
        staged.register(twin.data_ptr(), twin.numel() * 4)
        with pytest.raises(TransferError):
            staged.read("loopback:no-such-peer", [ReadOp(twin.data_ptr(), 1, 32)])
        assert not dst.any() and staged.landed_blocks == 0
        staged.close()
