"""The step vocabulary: StepBuilder turns scheduled requests into exactly the blocks a
step loads and saves, under the keys they were saved with; StepIO refuses a block
saved twice (loaded twice: test_pipeline's protocol errors)."""

from __future__ import annotations

import pytest

from ascend_offload.layerwise.steps import BlockRef, PipelineError, StepBuilder, StepIO


def _full(prefix: str, n_full: int):
    return lambda i: f"{prefix}{i}" if i < n_full else None


def test_step_builder_chunked_prefill_decode_and_hits() -> None:
    sb = StepBuilder(block_size=4, partial_prefix="p")
    # request A: 10 prompt tokens (2 full blocks + 2 tokens), chunks of 4 tokens, then decode
    sb.begin("A", [7, 8, 9])
    sb.schedule("A", 0, 4, _full("h", 2))
    io = sb.build()
    assert io == StepIO((), (), (BlockRef(7, "h0"),))
    sb.schedule("A", 4, 4, _full("h", 2))
    io = sb.build()
    assert io.load_shared == (BlockRef(7, "h0"),) and io.save == (BlockRef(8, "h1"),)
    sb.schedule("A", 8, 2, _full("h", 2))
    assert sb.build().save == (BlockRef(9, "p/A/2/2"),)
    sb.schedule("A", 10, 1, _full("h", 2))  # decode: the partial block grows
    io = sb.build()
    assert io.load_shared == (BlockRef(7, "h0"), BlockRef(8, "h1"), BlockRef(9, "p/A/2/2"))
    assert io.save == (BlockRef(9, "p/A/2/3"),)
    # request B shares two full blocks from the store; scheduled together with A
    sb.begin("B", [20, 21, 22], hit_keys=["h0", "h1"])
    sb.schedule("B", 8, 3, _full("g", 2))
    sb.schedule("A", 11, 1, _full("h", 3))
    io = sb.build()
    assert io.load == (BlockRef(20, "h0"), BlockRef(21, "h1"))
    assert BlockRef(22, "p/B/2/3") in io.save and BlockRef(9, "h2") in io.save
    assert BlockRef(9, "p/A/2/3") in io.load_shared
    # every ref names its request (a failed load then drops only its owner's saves)
    owners = {r.block_id: r.owner for r in (*io.load, *io.load_shared, *io.save)}
    assert owners == {20: "B", 21: "B", 22: "B", 7: "A", 8: "A", 9: "A"}
    sb.schedule("B", 11, 1, _full("g", 3))
    io = sb.build()
    assert io.load == () and BlockRef(20, "h0") in io.load_shared  # hits reload like own blocks
    sb.end("A")
    assert "A" not in sb and "B" in sb


def test_step_builder_errors() -> None:
    sb = StepBuilder(block_size=4)
    with pytest.raises(PipelineError, match="unknown request"):
        sb.schedule("x", 0, 1, _full("h", 0))
    sb.begin("x", [1])
    with pytest.raises(PipelineError, match="only 1 blocks"):
        sb.schedule("x", 0, 5, _full("h", 0))
    with pytest.raises(PipelineError, match="store hits"):
        sb.begin("y", [1], hit_keys=["a", "b"])
    sb.begin("z", [1, 2])
    with pytest.raises(PipelineError, match="never saved"):
        sb.schedule("z", 4, 1, _full("h", 0))  # 4 tokens computed that nobody saved
    with pytest.raises(ValueError):
        StepBuilder(0)


def test_step_io_refuses_a_block_saved_twice() -> None:
    with pytest.raises(PipelineError, match="saved twice"):
        StepIO(save=(BlockRef(2, "a"), BlockRef(2, "b")))
