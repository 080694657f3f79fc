"""Generated test models are written once even when parallel test workers ask together."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

from ascend_offload.harness.generated import generated_dir

SPEC = {"layers": 2}


def _slow_write(out: Path) -> None:
    with open(out / "writes.log", "a") as f:
        f.write("w\n")
    time.sleep(0.5)  # long enough that the other process arrives mid-write
    (out / "weights").write_text("complete")


def _ask(out: str, q: mp.Queue) -> None:
    d = generated_dir(Path(out), ".spec.json", SPEC, _slow_write)
    q.put((d / "weights").read_text())


def test_two_processes_write_once_and_both_see_a_complete_dir(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(str(tmp_path / "m"), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(q.get(timeout=5) for _ in procs) == ["complete", "complete"]
    assert (tmp_path / "m" / "writes.log").read_text() == "w\n"


def test_a_changed_spec_rewrites(tmp_path: Path) -> None:
    generated_dir(tmp_path / "m", ".spec.json", SPEC, _slow_write)
    generated_dir(tmp_path / "m", ".spec.json", {"layers": 3}, _slow_write)
    generated_dir(tmp_path / "m", ".spec.json", {"layers": 3}, _slow_write)
    assert (tmp_path / "m" / "writes.log").read_text() == "w\nw\n"


def test_a_changed_generator_rewrites_the_directory(tmp_path: Path) -> None:
    def write_v1(out: Path) -> None:
        (out / "weights").write_text("v1")

    def write_v2(out: Path) -> None:
        (out / "weights").write_text("v2")

    d = generated_dir(tmp_path / "m", ".spec.json", SPEC, write_v1)
    assert (d / "weights").read_text() == "v1"
    assert (generated_dir(tmp_path / "m", ".spec.json", SPEC, write_v1) / "weights").read_text() == "v1"
    # same spec, another generator (here: one whose code differs while the file is the same)
    import ascend_offload.harness.generated as g

    digest = g.generator_digest
    try:
        g.generator_digest = lambda write: "other-code"  # type: ignore[assignment]
        assert (generated_dir(tmp_path / "m", ".spec.json", SPEC, write_v2) / "weights").read_text() == "v2"
    finally:
        g.generator_digest = digest
