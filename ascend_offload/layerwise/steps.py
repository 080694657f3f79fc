"""The step vocabulary of the layerwise pipeline: which device blocks a forward step
loads and saves, under which store keys, and the scheduler-side builder of it.

Why its own module: the connector's scheduler side builds steps (:class:`StepBuilder`)
and its worker side hands them to the pipeline (:class:`StepIO`); neither needs the
pipeline's orchestration or its copy code to name what moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ascend_offload.errors import AscendOffloadError

KeyFn = Callable[[str, str], str]


def default_key(block_key: str, layer: str) -> str:
    """Store key of one layer's page of one block."""
    return f"{block_key}|{layer}"


class PipelineError(AscendOffloadError, RuntimeError):
    """The pipeline was driven against its protocol (unknown layer, save before load...)."""


class LoadTimeout(AscendOffloadError, TimeoutError):
    """A layer's store load did not finish within ``load_timeout_s``."""


@dataclasses.dataclass(frozen=True)
class BlockRef:
    """One device block (index along the block dim of every layer's KV tensor) and its key."""

    block_id: int
    key: str
    # the request the block belongs to ("" unknown): a failed load then costs only its
    # owner's saves of the step, not every request's (see LayerwisePipeline.save_layer)
    owner: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass(frozen=True)
class StepIO:
    """What one forward step moves; built by the connector from its scheduler metadata."""

    load: tuple[BlockRef, ...] = ()  # store prefix hits: every layer loads them
    load_shared: tuple[BlockRef, ...] = ()  # own earlier KV: only layers of shared slots reload it
    save: tuple[BlockRef, ...] = ()  # KV computed in this step: every layer saves it

    def __post_init__(self) -> None:
        ids = [r.block_id for r in (*self.load, *self.load_shared)]
        if len(set(ids)) != len(ids):
            raise PipelineError(f"StepIO: a device block is loaded twice in one step: {sorted(ids)}")
        saved = [r.block_id for r in self.save]
        if len(set(saved)) != len(saved):
            raise PipelineError(f"StepIO: a device block is saved twice in one step: {sorted(saved)}")


@dataclasses.dataclass
class _Tracked:
    block_ids: list[int]
    keys: dict[int, str]  # block index -> key of its latest saved (or hit) object
    hits: int  # leading blocks loaded from the store in the request's first step
    first: bool = True


class StepBuilder:
    """Scheduler-side bookkeeping that turns the scheduled requests into a :class:`StepIO`.

    Why here: which blocks a step must load and save follows from block ids and token
    counts alone, so it is plain logic the connector feeds from vLLM's SchedulerOutput:

    * ``begin(req, block_ids, hit_keys)`` - a request is scheduled for the first time
      (or again after preemption); ``hit_keys`` name its leading blocks found in the store;
    * ``add_blocks(req, ids)`` - blocks appended to a running request;
    * ``schedule(req, num_computed, num_scheduled, full_key)`` - it runs in this step;
      ``full_key(i)`` is the shareable key of full block ``i`` (its block hash) or None;
    * ``build()`` - the step's StepIO (and reset); ``end(req)`` - forget a request.

    A full block is saved under ``full_key(i)``; a partial one under
    ``{partial_prefix}/{req}/{i}/{fill}`` (objects are immutable, so every fill level
    is its own object), and later steps load whatever key was saved last.
    """

    def __init__(self, block_size: int, partial_prefix: str = "partial") -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.block_size = block_size
        self.partial_prefix = partial_prefix
        self._reqs: dict[str, _Tracked] = {}
        self._load: list[BlockRef] = []
        self._shared: list[BlockRef] = []
        self._save: list[BlockRef] = []

    def begin(self, req_id: str, block_ids: Sequence[int], hit_keys: Sequence[str] = ()) -> None:
        if len(hit_keys) > len(block_ids):
            raise PipelineError(
                f"StepBuilder: request {req_id!r} has {len(hit_keys)} store hits but only "
                f"{len(block_ids)} blocks"
            )
        self._reqs[req_id] = _Tracked(list(block_ids), dict(enumerate(hit_keys)), len(hit_keys))

    def add_blocks(self, req_id: str, block_ids: Sequence[int]) -> None:
        self._tracked(req_id).block_ids.extend(block_ids)

    def schedule(
        self, req_id: str, num_computed: int, num_scheduled: int,
        full_key: Callable[[int], str | None],
    ) -> None:
        st = self._tracked(req_id)
        bs = self.block_size
        ids = st.block_ids
        end = num_computed + num_scheduled
        if -(-end // bs) > len(ids):
            raise PipelineError(
                f"StepBuilder: request {req_id!r} computes up to token {end} but has only "
                f"{len(ids)} blocks of {bs}"
            )
        own_from = 0
        if st.first:
            self._load += [BlockRef(ids[i], st.keys[i], req_id) for i in range(st.hits)]
            own_from = st.hits
            st.first = False
        for i in range(own_from, -(-num_computed // bs)):
            if i not in st.keys:
                raise PipelineError(
                    f"StepBuilder: request {req_id!r} block {i} was computed but never saved"
                )
            self._shared.append(BlockRef(ids[i], st.keys[i], req_id))
        for i in range(num_computed // bs, -(-end // bs)):
            fill = min(bs, end - i * bs)
            key = full_key(i) if fill == bs else None
            st.keys[i] = key or f"{self.partial_prefix}/{req_id}/{i}/{fill}"
            self._save.append(BlockRef(ids[i], st.keys[i], req_id))

    def build(self) -> StepIO:
        io = StepIO(tuple(self._load), tuple(self._shared), tuple(self._save))
        self._load, self._shared, self._save = [], [], []
        return io

    def end(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reqs

    def _tracked(self, req_id: str) -> _Tracked:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise PipelineError(f"StepBuilder: unknown request {req_id!r} (begin was not called)") from None


@dataclasses.dataclass
class PipelineStats:
    """What a pipeline moved, counted over its life (``LayerwisePipeline.stats()``)."""

    steps: int = 0
    loads: int = 0  # (layer, step) loads that moved at least one block
    prefetched_loads: int = 0  # of which started ahead of their layer
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_errors: int = 0  # blocks that could not be loaded (missing, evicted, failed)
    load_wait_s: float = 0.0  # time wait_for_layer_load blocked (gate + load)
    saves: int = 0
    blocks_saved: int = 0
    bytes_saved: int = 0
    save_duplicates: int = 0  # objects already in the store
    save_skipped: int = 0  # objects not stored because the store was full
    save_errors: int = 0
    # objects not saved because a load earlier in their step failed: that step's later
    # layers computed over a buffer the load never filled (vLLM recomputes the request)
    save_dropped: int = 0
    native_jobs: int = 0  # copies run by the native queue (the rest: the Python queue or inline)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)
