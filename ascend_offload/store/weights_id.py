"""Which weights a stored KV was computed with, as far as the files on disk tell.

Why: the key fingerprint covers the model's name or path, the KV layout and the
parallelism, not the weights; a checkpoint updated in place keeps all of them. KV
kept across restarts (the SSD tier's persisted index) would then serve the old
weights' KV. The identity here is a digest of the model directory's ``config.json``
(its bytes) and of the name, size and modification time of every weight file in it.
A model given by hub id is looked up in the local Hugging Face cache (the snapshot
vLLM loads); a model found nowhere on disk has no identity (None) and the caller
asks for ``model_tag`` instead.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)

#: files whose change means other weights (vLLM's weight formats, their shard indexes)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tensors", ".index.json")


def model_dir(model: str, revision: str | None = None) -> Path | None:
    """The local directory holding ``model``'s files: the path itself, or the cached
    snapshot of a hub id (no download, no network); None when neither exists."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        got = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception as exc:  # a malformed id, an unreadable cache: no identity
        log.debug("weights identity: no cached snapshot of %r (%s)", model, exc)
        return None
    return Path(got).parent if isinstance(got, str) else None


def weights_identity(model: str, revision: str | None = None) -> str | None:
    """A 16-hex-digit digest of ``model``'s config and weight files (see module doc), or
    None when no local directory with weight files is found."""
    d = model_dir(model, revision)
    if d is None:
        return None
    files = sorted(f for f in d.iterdir()
                   if f.name == "config.json" or f.name.endswith(WEIGHT_SUFFIXES))
    if not any(f.name != "config.json" for f in files):
        return None
    h = hashlib.sha256()
    for f in files:
        try:
            st = f.stat()  # follows the hub cache's links to the blobs
            h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
            if f.name == "config.json":
                h.update(f.read_bytes())
        except OSError as exc:
            log.debug("weights identity: %s unreadable (%s)", f, exc)
            return None
    return h.hexdigest()[:16]
