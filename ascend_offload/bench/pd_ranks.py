"""Prefill / decode rank *processes* for ``bench pd`` (and, extended, the P/D integration tests).

Each rank is a real spawned process with its own transfer engine (Mooncake
over TCP on 127.0.0.1 by default), KV buffers (numpy, so a rank starts in
~0.5 s without importing torch) and producer or consumer. The parent drives it
with small RPCs over multiprocessing queues; every RPC has a deadline that
becomes :class:`RankError`, and :meth:`RankProcess.close` always reaps the
process (kill as the last resort), so a failed run never leaks ranks.

What a rank process runs is :meth:`RankConfig.build`: the tests subclass the
config (``tests/support/pd_ranks.py``: a manual clock, authentication, RPCs that
inspect state) and the spawned process builds their ranks, so nothing test-only
ships here.

KV contents are a deterministic function of ``(seed, layer)``, identical on
every prefill rank (main KV and indexer are replicated across TP), so the
parent can compute what each decode block must hold.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ascend_offload.errors import AscendOffloadError

if TYPE_CHECKING:
    from ascend_offload.pd.auth import ControlKeys
    from ascend_offload.pd.consumer_records import RecvOutcome
    from ascend_offload.pd.producer import SlotListener

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class RankError(AscendOffloadError, RuntimeError):
    """A rank process failed a command, crashed, or did not answer before the deadline."""


@dataclass(frozen=True)
class KVShape:
    """Per-layer host KV of a rank: two main tensors (K/V halves of one buffer) + indexer."""

    num_layers: int = 4
    num_blocks: int = 32
    main_block_bytes: int = 2048
    indexer_block_bytes: int = 256  # 0 = no indexer

    def arrays(self, seed: int | None) -> list[tuple[np.ndarray, np.ndarray | None]]:
        out = []
        for layer in range(self.num_layers):
            if seed is None:
                kv = np.zeros((2, self.num_blocks, self.main_block_bytes), dtype=np.uint8)
                idx = (np.zeros((self.num_blocks, self.indexer_block_bytes), dtype=np.uint8)
                       if self.indexer_block_bytes else None)
            else:
                g = np.random.default_rng([seed, layer])
                kv = g.integers(0, 256, (2, self.num_blocks, self.main_block_bytes), dtype=np.uint8)
                idx = (g.integers(0, 256, (self.num_blocks, self.indexer_block_bytes), dtype=np.uint8)
                       if self.indexer_block_bytes else None)
            out.append((kv, idx))
        return out


@dataclass
class RankConfig:
    role: str  # "prefill" | "decode"
    rank: int
    p_tp: int
    d_tp: int
    shape: KVShape
    seed: int = 1234
    backend: str = "mooncake"
    host: str = "127.0.0.1"
    kv_port: int = 0  # decode: base port (its port = kv_port + dp_rank * d_tp + rank)
    dp_rank: int = 0
    ack_timeout_s: float = 10.0
    read_timeout_s: float = 10.0
    request_timeout_s: float = 20.0
    read_retries: int = 1
    engine_id: str = ""

    def build(self) -> PrefillRank | DecodeRank:
        """The rank object the spawned process serves RPCs from (a subclass may extend it)."""
        return PrefillRank(self) if self.role == "prefill" else DecodeRank(self)


def _layers(arrays: list[tuple[np.ndarray, np.ndarray | None]]) -> list[Any]:
    from ascend_offload.pd.layout import layer_desc

    return [layer_desc([kv[0], kv[1]], idx) for kv, idx in arrays]


class PrefillRank:
    """A prefill rank's producer over its numpy KV; its public methods are the RPCs."""

    def __init__(self, cfg: RankConfig, *, clock: Clock = time.monotonic, keys: ControlKeys | None = None,
                 listener: SlotListener | None = None) -> None:
        from ascend_offload.pd.producer import Producer
        from ascend_offload.pd.topology import Topology
        from ascend_offload.transfer.base import create_engine

        self.cfg = cfg
        self.engine = create_engine(cfg.backend, host=cfg.host)
        self.arrays = cfg.shape.arrays(cfg.seed)
        self.producer = Producer(
            engine_id=cfg.engine_id or "prefill", p_rank=cfg.rank, topology=Topology(cfg.p_tp, cfg.d_tp),
            transfer=self.engine, layers=_layers(self.arrays), ack_timeout_s=cfg.ack_timeout_s,
            listener=listener, request_timeout_s=cfg.request_timeout_s, clock=clock, keys=keys,
        )
        self.outcomes: list[Any] = []

    def info(self) -> dict[str, Any]:
        return {"endpoint": self.engine.endpoint}

    def add(self, rid: str, src_blocks: list[int], host: str, kv_port: int, d_tp: int,
            dp_rank: int = 0, num_layers: int | None = None) -> None:
        from ascend_offload.pd.producer import DecodeTarget

        self.producer.add_request(rid, src_blocks, DecodeTarget(host, kv_port, d_tp, dp_rank), num_layers)

    def run(self, layers: list[int], layer_delay_s: float = 0.0) -> float:
        """Publish ``layers`` in order, sleeping ``layer_delay_s`` before each (simulated compute).

        Returns when the run began, on ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one
        clock for every process of the host), so a pull can be timed from here to the decode
        rank's outcome without the parent's queue hops."""
        t0 = time.perf_counter()
        for layer in layers:
            if layer_delay_s:
                time.sleep(layer_delay_s)
            self.producer.publish_layer(layer)
        return t0

    def finished(self, count: int, timeout_s: float) -> list[tuple[str, bool, tuple[int, ...]]]:
        end = time.monotonic() + timeout_s
        while True:
            self.outcomes += self.producer.finished()
            if len(self.outcomes) >= count or time.monotonic() >= end:
                break
            time.sleep(0.005)
        out, self.outcomes = self.outcomes, []
        return [(o.request_id, o.ok, o.failed_layers) for o in out]

    def meta(self) -> bytes:
        """This rank's encoded ``mf_meta`` (endpoint + layout), for raw-read baselines."""
        return self.producer._meta

    def stats(self) -> dict[str, int]:
        return asdict(self.producer.stats)

    def close(self) -> None:
        self.producer.close()
        self.engine.close()


class DecodeRank:
    """A decode rank's consumer over its numpy KV; its public methods are the RPCs."""

    def __init__(self, cfg: RankConfig, *, clock: Clock = time.monotonic,
                 keys: ControlKeys | None = None) -> None:
        from ascend_offload.pd.consumer import Consumer
        from ascend_offload.pd.topology import Topology, decode_port
        from ascend_offload.transfer.base import create_engine

        self.cfg = cfg
        self.engine = create_engine(cfg.backend, host=cfg.host, timeout_s=cfg.read_timeout_s)
        self.arrays = cfg.shape.arrays(None)
        self.port = decode_port(cfg.kv_port, dp_rank=cfg.dp_rank, d_tp=cfg.d_tp, tp_rank=cfg.rank)
        self.consumer = Consumer(
            engine_id=cfg.engine_id or "decode", d_rank=cfg.rank, topology=Topology(cfg.p_tp, cfg.d_tp),
            transfer=self.engine, layers=_layers(self.arrays), host=cfg.host, port=self.port,
            read_timeout_s=cfg.read_timeout_s, request_timeout_s=cfg.request_timeout_s,
            read_retries=cfg.read_retries, clock=clock, keys=keys,
        )

    def info(self) -> dict[str, Any]:
        return {"endpoint": self.engine.endpoint, "port": self.port}

    def expect(self, rid: str, dst_blocks: list[int], num_layers: int | None = None) -> None:
        self.consumer.expect(rid, dst_blocks, num_layers)

    def wait(self, count: int, timeout_s: float) -> list[tuple[str, bool, tuple[int, ...], tuple[str, ...], float]]:
        """Up to ``count`` outcomes: (request, ok, failed blocks, reasons, when this rank had them
        on ``time.perf_counter``, the clock :meth:`PrefillRank.run` reports)."""
        outs: list[RecvOutcome] = []
        end = time.monotonic() + timeout_s
        while len(outs) < count and time.monotonic() < end:
            outs += self.consumer.wait_finished(count - len(outs), max(0.0, end - time.monotonic()))
        now = time.perf_counter()
        return [(o.request_id, o.ok, o.failed_blocks, o.reasons, now) for o in outs]

    def raw_pull(self, meta: bytes, src_blocks: list[int], dst_blocks: list[int], iters: int) -> list[float]:
        """Baseline: the same per-layer reads straight through the engine, no protocol."""
        from ascend_offload.pd import protocol as P
        from ascend_offload.pd.reads import build_ops

        m = P.decode(meta, expect=(P.MfMeta,))
        assert isinstance(m, P.MfMeta)
        per_layer = [build_ops(m.layers[i], self.consumer.layers[i], src_blocks, dst_blocks, main=True,
                               index_range=(0, len(dst_blocks))) for i in range(len(self.consumer.layers))]
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            for ops in per_layer:
                self.engine.read(m.endpoint, ops)
            times.append(time.perf_counter() - t0)
        return times

    def stats(self) -> dict[str, int]:
        return asdict(self.consumer.stats)

    def close(self) -> None:
        self.consumer.close()
        self.engine.close()


def _rank_main(cfg: RankConfig, cmd_q: Any, rep_q: Any) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[{cfg.role}{cfg.rank}] %(levelname)s %(name)s: %(message)s")
    try:
        obj: Any = cfg.build()
        rep_q.put(("ok", obj.info()))
    except BaseException:
        rep_q.put(("err", traceback.format_exc()))
        return
    try:
        while True:
            cmd, args, kwargs = cmd_q.get()
            if cmd == "stop":
                obj.close()
                rep_q.put(("ok", None))
                return
            try:
                rep_q.put(("ok", getattr(obj, cmd)(*args, **kwargs)))
            except BaseException:
                rep_q.put(("err", traceback.format_exc()))
    finally:
        # Flush replies, then exit without interpreter teardown racing live engine threads.
        import os

        rep_q.close()
        rep_q.join_thread()
        os._exit(0)


class RankProcess:
    """Parent-side handle of one rank process."""

    def __init__(self, cfg: RankConfig, *, start_timeout_s: float = 60.0, wait: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.cfg = cfg
        self._cmd: Any = ctx.Queue()
        self._rep: Any = ctx.Queue()
        self.proc = ctx.Process(target=_rank_main, args=(cfg, self._cmd, self._rep), daemon=True,
                                name=f"{cfg.role}{cfg.rank}")
        self.proc.start()
        self.info: dict[str, Any] = {}
        self.start_timeout_s = start_timeout_s
        if wait:
            self.started()

    def started(self) -> RankProcess:
        """Wait for the rank to come up (its transfer engine and sockets are ready)."""
        if not self.info:
            self.info = self._answer(self.start_timeout_s, "start")
        return self

    def _answer(self, timeout_s: float, what: str) -> Any:
        end = time.monotonic() + timeout_s
        while True:
            try:
                status, value = self._rep.get(timeout=min(0.2, max(0.01, end - time.monotonic())))
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RankError(f"{self.proc.name} died (exit {self.proc.exitcode}) during {what}") from None
                if time.monotonic() >= end:
                    raise RankError(f"{self.proc.name}: no answer to {what} within {timeout_s:.1f}s") from None
        if status != "ok":
            raise RankError(f"{self.proc.name} failed {what}:\n{value}")
        return value

    def call(self, cmd: str, *args: Any, timeout_s: float = 30.0, **kwargs: Any) -> Any:
        self.post(cmd, *args, **kwargs)
        return self._answer(timeout_s, cmd)

    def post(self, cmd: str, *args: Any, **kwargs: Any) -> None:
        """Send an RPC without waiting; :meth:`collect` takes its answer (RPCs answer in order).
        Lets the parent have two ranks work at once, e.g. a decode already waiting for an
        outcome before the prefill publishes."""
        self._cmd.put((cmd, args, kwargs))

    def collect(self, what: str, timeout_s: float = 30.0) -> Any:
        """The answer to the oldest :meth:`post` not yet collected (:class:`RankError` after the deadline)."""
        return self._answer(timeout_s, what)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout_s=5)
            except RankError:
                pass
            self.proc.join(5)
        self.kill()
        self._cmd.close()
        self._rep.close()


def start_ranks(cfgs: list[RankConfig], *, start_timeout_s: float = 60.0) -> list[RankProcess]:
    """Start several ranks in parallel; on any failure every started one is closed."""
    procs: list[RankProcess] = []
    try:
        for cfg in cfgs:
            procs.append(RankProcess(cfg, start_timeout_s=start_timeout_s, wait=False))
        for p in procs:
            p.started()
    except BaseException:
        for p in procs:
            p.close()
        raise
    return procs
