"""A small load generator for the soak: greedy completions through the proxy, each with
its own deadline, streamed or not, some fanned out (``n > 1``: the proxy sends one
backend request per sample and merges them), some clients hanging up mid-stream.

Every request ends in exactly one :class:`Outcome`: an answer (its token ids), an
error (the HTTP status and the OpenAI-style error body the server gave), or a
client disconnect (the client closed the stream on purpose after its first
event). Anything else -- a client-side timeout, an answer without token ids, an
error without a proper error body, a fan-out answer missing a choice -- is recorded
as ``kind="broken"`` so the test can fail on it with the evidence.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx


@dataclasses.dataclass(frozen=True)
class Job:
    """One request of the soak: which prompt, how many tokens, how it is consumed."""

    index: int
    phase: str
    prompt_id: int
    max_tokens: int
    stream: bool = False
    disconnect: bool = False  # streamed: close after the first event
    n: int = 1  # samples; greedy, so every one must equal the plain engine's answer


@dataclasses.dataclass
class Outcome:
    job: Job
    kind: str  # "answer" | "error" | "disconnect" | "broken"
    elapsed_s: float
    token_ids: tuple[int, ...] | None = None  # choice 0's
    status: int = 0
    detail: str = ""
    response_id: str = ""
    choices: tuple[tuple[int, ...], ...] = ()  # every choice's token ids, by index


def _answer(job: Job, t0: float, by_index: dict[int, list[int]], raw: str, rid: str) -> Outcome:
    """An answer when every choice ``0..n-1`` (and no other) came with token ids."""
    if sorted(by_index) != list(range(job.n)):
        return Outcome(job, "broken", time.monotonic() - t0, status=200,
                       detail=f"choices {sorted(by_index)} for n={job.n}: {raw[:400]}")
    choices = tuple(tuple(by_index[i]) for i in range(job.n))
    return Outcome(job, "answer", time.monotonic() - t0, choices[0], 200, response_id=rid, choices=choices)


def is_openai_error(obj: Any) -> bool:
    """``{"error": {"message": str, "type": str, ...}}`` (OpenAI's error object)."""
    err = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


def _error_outcome(job: Job, t0: float, status: int, raw: bytes | str) -> Outcome:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        ok = is_openai_error(json.loads(text))
    except ValueError:
        ok = False
    return Outcome(job, "error" if ok else "broken", time.monotonic() - t0, status=status, detail=text[:500])


def run_job(url: str, model: str, prompt: list[int], job: Job, deadline_s: float,
            on_first_event: Callable[[Job, str], None] | None = None) -> Outcome:
    """Send ``job``; return how it ended. Never raises for server behaviour."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": job.max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream": job.stream,
                            "return_token_ids": True}
    if job.n > 1:
        body["n"] = job.n
    t0 = time.monotonic()
    timeout = httpx.Timeout(deadline_s, connect=10.0)
    try:
        if not job.stream:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
            if r.status_code != 200:
                return _error_outcome(job, t0, r.status_code, r.content)
            data = r.json()
            whole: dict[int, list[int]] = {}
            for ch in data["choices"]:
                if ch.get("token_ids") is None:
                    return Outcome(job, "broken", time.monotonic() - t0, status=200, detail=r.text[:500])
                whole[ch["index"]] = list(ch["token_ids"])
            return _answer(job, t0, whole, r.text, data.get("id", ""))
        by_index: dict[int, list[int]] = {}
        rid = ""
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return _error_outcome(job, t0, r.status_code, r.read())
            for line in r.iter_lines():
                if time.monotonic() - t0 > deadline_s:
                    return Outcome(job, "broken", time.monotonic() - t0, detail="stream past its deadline")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return _error_outcome(job, t0, 200, line[6:])
                if not rid:
                    rid = event.get("id", "")
                    if on_first_event is not None:
                        on_first_event(job, rid)
                    if job.disconnect:
                        return Outcome(job, "disconnect", time.monotonic() - t0, response_id=rid)
                for ch in event.get("choices", []):
                    if ch.get("token_ids") is not None:
                        by_index.setdefault(ch.get("index", 0), []).extend(ch["token_ids"])
        return _answer(job, t0, by_index, f"stream of {len(by_index)} choices", rid)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Outcome(job, "broken", time.monotonic() - t0, detail=repr(exc))


def run_jobs(url: str, model: str, prompts: list[list[int]], jobs: Iterable[Job], *, concurrency: int,
             deadline_s: float, on_done: Callable[[Outcome], None] | None = None,
             on_first_event: Callable[[Job, str], None] | None = None) -> list[Outcome]:
    """Run ``jobs`` with ``concurrency`` clients; outcomes in job order."""
    def one(job: Job) -> Outcome:
        out = run_job(url, model, prompts[job.prompt_id], job, deadline_s, on_first_event)
        if on_done is not None:
            on_done(out)
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, list(jobs)))
