"""The reuse-gate seam: the store's real layerwise pipeline and gate still provide what
the P/D producer and AscendMultiConnector use of them (pd.slot_sharing)."""

from __future__ import annotations

from ascend_offload.layerwise.gate import ReuseGate
from ascend_offload.layerwise.pipeline import LayerwisePipeline
from ascend_offload.layerwise.plan import plan_uniform
from ascend_offload.pd.slot_sharing import LayerPlan, ReadGate, SharedStepPipeline, SlotSharing
from tests.unit.layerwise.dict_store import DictStore


def test_layerwise_pipeline_conforms() -> None:
    pipe = LayerwisePipeline(plan_uniform(3, 1, [0]), DictStore())
    try:
        assert isinstance(pipe, SlotSharing) and isinstance(pipe, SharedStepPipeline)
        assert isinstance(pipe.gate, ReadGate) and isinstance(pipe.plan, LayerPlan)
        assert pipe.members_of("layers.1") == ("layers.1",)
        assert pipe.in_step is False and pipe.defer_next_ready is False
    finally:
        pipe.close()


def test_a_gate_token_holds_the_slot_as_the_producer_uses_it() -> None:
    """The calls the producer makes through ReadGate (positional, as in prefill_worker)."""
    gate = ReuseGate(1, default_timeout_s=0.1)
    assert isinstance(gate, ReadGate)
    lease = gate.acquire_write(0, "a")
    gate.release_write(lease)
    tok = gate.add_consumer(0, lease.generation, "reader")
    assert not gate.is_free(0)
    assert gate.release_consumer(tok, None) is True and gate.is_free(0)
    gate.outwait(2.0)
    assert gate.default_timeout_s >= 2.0
