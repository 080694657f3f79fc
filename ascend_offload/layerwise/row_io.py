"""Layer I/O on the native row queue: a layer's load or save is one packed row job
between its host KV block rows and the store's row planes, run without Python.

Why its own path: Python I/O threads took the GIL for ~25-50 us a job and slowed
the model thread by ~7 % (docs/bench-layerwise.md); here the worker is C++ and the
model thread's share is one submit. A step's store bookkeeping (pin, allocate,
row lookup) is done in one pass at its start (:class:`_StepPlan`); a layer missing
there takes the per-layer path, and one whose objects do not sit in rows that fit
is copied on the model thread with the Python copies of :class:`LayerIO`.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ascend_offload import device
from ascend_offload.layerwise.layer_io import LayerIO, LayerRefs, LoadJob, SaveJob
from ascend_offload.layerwise.steps import BlockRef
from ascend_offload.native import int32_array
from ascend_offload.store.base import Pin, WriteHandle
from ascend_offload.transfer.copy_queue import NativeRowQueue, RowJob


@dataclasses.dataclass
class _RowCopy:
    """One layer's rows, resolved ahead: a load (plane -> KV) or a save (KV -> plane)."""

    job: RowJob
    keep: tuple[array.array, array.array]  # its index arrays, alive until submitted
    block_ids: list[int]
    handles: list[WriteHandle]  # saves: the pending objects, in row order


@dataclasses.dataclass
class _StepPlan:
    """A step's store bookkeeping done in one pass at its start.

    Why: per layer, pin + row lookup + allocate + their Python cost ~230 us on the
    model thread inside a step (cold caches between the layer's compute), against
    ~20 us measured alone; one pass over every layer's keys costs a fraction of that.
    Layers missing here (an object absent, the store full) take the per-layer path.
    """

    pin: Pin | None = None  # every planned load object, held until the step ends
    loads: dict[str, _RowCopy] = dataclasses.field(default_factory=dict)
    saves: dict[str, _RowCopy] = dataclasses.field(default_factory=dict)
    save_refs: dict[str, Sequence[BlockRef]] = dataclasses.field(default_factory=dict)  # planned from
    nothing_to_save: set[str] = dataclasses.field(default_factory=set)  # all duplicates


class RowLayerIO(LayerIO):
    """Native row jobs between host KV block rows and the store's row planes.

    A layer whose store objects do not sit in rows that fit (``pinned_rows`` /
    ``pending_rows`` say no) is copied on the model thread with the Python copies,
    after everything queued before it.
    """

    queue: NativeRowQueue

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._plan: _StepPlan | None = None
        self._rows_ok: dict[tuple[int, str], bool] = {}

    def _open_queue(self) -> NativeRowQueue:
        return NativeRowQueue()

    def plan_step(self, loads: LayerRefs, saves: LayerRefs) -> None:
        """Pin every load object and allocate every save object of ``loads``/``saves``
        in one store call each, and pack their native jobs."""
        self._plan = self._build_plan(loads, saves)

    def end_plan(self) -> None:
        """Release what the step plan held: the load pin (every load job ended by now)
        and the objects of layers that never saved (their layer did not run)."""
        plan, self._plan = self._plan, None
        if plan is None:
            return
        if plan.pin is not None:
            self.store.unpin(plan.pin)
        for rc in plan.saves.values():
            self.store.abort(rc.handles)

    def queue_load(self, layer: str, refs: Sequence[BlockRef]) -> int:
        if self._injected_load_failure(layer, refs):
            return 0  # a planned load stays in the plan: end_plan releases its pin
        planned = self._plan.loads.pop(layer, None) if self._plan is not None else None
        if planned is not None:
            ticket = self.queue.submit(planned.job)
            return self._enqueue(LoadJob(ticket, layer, None, planned.block_ids, native=True))
        return super().queue_load(layer, refs)

    def queue_save(self, layer: str, refs: Sequence[BlockRef], errors: list[BaseException],
                   delay_s: float) -> int:
        plan = self._plan
        if plan is not None:
            planned = plan.saves.pop(layer, None)
            if planned is None and layer in plan.nothing_to_save:
                plan.nothing_to_save.discard(layer)
                return 0
            if planned is not None and refs is not plan.save_refs.get(layer):
                # a part of the step's saves (a failed load dropped its owners'): the plan
                # packed them all, so its objects go back and this part takes the layer path
                self.store.abort(planned.handles)
                planned = None
            if planned is not None:
                if delay_s:  # packed with none
                    planned.job.delay_s = delay_s
                try:
                    ticket = self.queue.submit(planned.job)
                except BaseException:
                    self.store.abort(planned.handles)
                    raise
                return self._enqueue(SaveJob(ticket, layer, planned.handles, True, errors))
        return super().queue_save(layer, refs, errors, delay_s)

    def _submit_load(self, layer: str, pin: Pin, refs: list[BlockRef], keys: list[str]
                     ) -> LoadJob | None:
        ids = [r.block_id for r in refs]
        rc = self._load_rows(layer, self.store.pinned_rows(pin, keys), ids)
        if rc is None:  # not row-addressable: copy here, after everything queued before
            self._drain_queue()
            bad = self._copy_in(layer, pin, refs, keys)
            self._count_load(layer, len(refs) - len(bad), bad)
            self.store.unpin(pin)
            return None
        return LoadJob(self.queue.submit(rc.job), layer, pin, ids, native=True)

    def _submit_save(self, layer: str, pairs: list[tuple[BlockRef, WriteHandle]],
                     handles: list[WriteHandle], errors: list[BaseException], delay_s: float
                     ) -> SaveJob | None:
        rc = self._save_rows(layer, handles, [r.block_id for r, _ in pairs])
        if rc is None:  # not row-addressable: copy here, in queue order
            self._drain_queue()
            copy_error: BaseException | None = None
            try:
                self._copy_out(layer, pairs, None, delay_s)
            except Exception as exc:
                copy_error = exc
            self._finish_save(SaveJob(0, layer, handles, False, errors), copy_error)
            return None
        if delay_s:  # packed with none
            rc.job.delay_s = delay_s
        return SaveJob(self.queue.submit(rc.job), layer, handles, True, errors)

    def _build_plan(self, loads: LayerRefs, saves: LayerRefs) -> _StepPlan:
        plan = _StepPlan()
        ids_of: dict[int, tuple[list[int], array.array]] = {}  # refs seen -> block ids

        def block_ids(refs: Sequence[BlockRef]) -> tuple[list[int], array.array]:
            got = ids_of.get(id(refs))
            if got is None:
                ids = [r.block_id for r in refs]
                got = ids_of[id(refs)] = (ids, int32_array(ids))
            return got

        want = [(layer, refs, self.keys(refs, layer)) for layer, refs in loads if refs]
        all_keys = [k for _, _, keys in want for k in keys]
        if all_keys:
            plan.pin = self.store.pin(all_keys)  # None (something missing): per-layer path
        if plan.pin is not None:
            joint = self.store.pinned_rows(plan.pin, all_keys) if len(want) > 1 else None
            at = 0
            for layer, refs, keys in want:
                if joint is not None:
                    placed: tuple[torch.Tensor, list[int]] | None = (
                        joint[0], joint[1][at:at + len(keys)])
                else:
                    placed = self.store.pinned_rows(plan.pin, keys)
                at += len(keys)
                rc = self._load_rows(layer, placed, *block_ids(refs))
                if rc is not None:
                    plan.loads[layer] = rc
        save_want = [(layer, refs, self.keys(refs, layer)) for layer, refs in saves if refs]
        save_keys = [k for _, _, keys in save_want for k in keys]
        if not save_keys:
            return plan
        sizes = [self._page_bytes[layer] for layer, _, keys in save_want for _ in keys]
        got = self.store.allocate(save_keys, sizes)
        if got is None:
            return plan  # store full for all of them at once: per layer at save time
        at = 0
        dups = 0
        for layer, refs, keys in save_want:
            part = got[at:at + len(keys)]
            at += len(keys)
            if all(h is not None for h in part):  # the usual case: the step's ids, shared
                handles: list[WriteHandle] = part  # type: ignore[assignment]
                ids, kv_idx = block_ids(refs)
            else:
                pairs = self._allocated(refs, part)
                dups += len(keys) - len(pairs)
                if not pairs:
                    plan.nothing_to_save.add(layer)
                    continue
                handles = [h for _, h in pairs]
                ids, kv_idx = [r.block_id for r, _ in pairs], None
            rc = self._save_rows(layer, handles, ids, kv_idx)
            if rc is None:
                self.store.abort(handles)  # allocated again on the per-layer path
                continue
            plan.saves[layer] = rc
            plan.save_refs[layer] = refs
        with self._lock:
            self._stats.save_duplicates += dups
        return plan

    def _load_rows(self, layer: str, placed: tuple[torch.Tensor, list[int]] | None,
                   ids: list[int], kv_idx: array.array | None = None) -> _RowCopy | None:
        """The packed native job copying ``placed`` (store plane, rows) into ``layer``'s
        blocks ``ids``, or None when the plane's rows do not fit the layer's."""
        if placed is None or not self._same_rows(placed[0], layer):
            return None
        kv_rows = self._rows_of[layer]
        assert kv_rows is not None  # _same_rows checked it
        kv_idx = int32_array(ids) if kv_idx is None else kv_idx
        src_idx = int32_array(placed[1])
        return _RowCopy(self.queue.prepare_rows(placed[0], src_idx, kv_rows, kv_idx),
                        (src_idx, kv_idx), ids, [])

    def _save_rows(self, layer: str, handles: list[WriteHandle], ids: list[int],
                   kv_idx: array.array | None = None) -> _RowCopy | None:
        """The packed native job copying ``layer``'s blocks ``ids`` into pending ``handles``,
        or None when the store cannot place them as rows that fit."""
        placed = self.store.pending_rows(handles)
        if placed is None or not self._same_rows(placed[0], layer):
            return None
        kv_rows = self._rows_of[layer]
        assert kv_rows is not None
        kv_idx = int32_array(ids) if kv_idx is None else kv_idx
        dst_idx = int32_array(placed[1])
        return _RowCopy(self.queue.prepare_rows(kv_rows, kv_idx, placed[0], dst_idx),
                        (kv_idx, dst_idx), ids, handles)

    def _same_rows(self, plane: torch.Tensor, layer: str) -> bool:
        """``plane``'s rows take ``layer``'s block rows (host, 2-D, same bytes); cached."""
        key = (plane.data_ptr(), layer)
        ok = self._rows_ok.get(key)
        if ok is None:
            kv_rows = self._rows_of.get(layer)
            ok = self._rows_ok[key] = (
                kv_rows is not None and plane.dim() == 2 and plane.is_contiguous()
                and device.is_host(plane)
                and plane.shape[1] * plane.element_size()
                == kv_rows.shape[1] * kv_rows.element_size())
        return ok
