"""Files the store keeps on disk (the SSD tier's slot files, its lock and index files):
private to the engine's user, never reached through a planted link.

Why: a slot file holds KV computed from users' prompts, so it must not be readable by
other local users (0600 files in a 0700 directory); and the files are opened, truncated
and written by name, so a symlink planted under one of those names would make the
engine truncate and zero-fill (or overwrite) whatever it points at (``O_NOFOLLOW``,
``O_EXCL`` for temporary files). A directory that another user can write is refused:
whoever can write it can swap the files under the engine (rename, unlink, plant).
Errors name the config key and the path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from ascend_offload.errors import AscendOffloadError

FILE_MODE = 0o600
DIR_MODE = 0o700
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class PrivatePathError(AscendOffloadError, RuntimeError):
    """A store path is unsafe or unusable (the message names the key and the path)."""


def private_dir(path: Path, key: str) -> Path:
    """``path`` as a directory only this user can write: missing components are created
    0700; an existing one must be a directory owned by this user (or root) that neither
    its group nor others can write."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass  # another process made it meanwhile: checked below like any existing one
        except OSError as exc:
            raise PrivatePathError(f"key {key!r}: cannot create {d}: {exc.strerror or exc}") from None
    check_private_dir(path, key)
    return path


def check_private_dir(path: Path, key: str) -> None:
    """An existing ``path`` is a directory owned by this user (or root) that neither its
    group nor others can write (what :func:`private_dir` requires; ``check-config`` runs
    it without creating anything)."""
    try:
        st = os.stat(path)  # the configured directory may itself be a link (to a mount)
    except OSError as exc:
        raise PrivatePathError(f"key {key!r}: {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise PrivatePathError(f"key {key!r}: {path} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise PrivatePathError(f"key {key!r}: {path} belongs to uid {st.st_uid}, not to this user "
                               f"(uid {os.geteuid()}): its owner could swap the store's files")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PrivatePathError(f"key {key!r}: {path} is writable by other users (mode "
                               f"{stat.S_IMODE(st.st_mode):o}); use a directory only this user "
                               f"can write (chmod go-w, or a new one: created 0700)")


def open_private(path: Path, flags: int, key: str, *, exclusive: bool = False) -> int:
    """``os.open`` of a regular file of this user, never through a symlink, created 0600
    (``exclusive``: it must not exist yet, for temporary files); a file of an earlier run
    with a looser mode is narrowed to 0600. Returns the descriptor."""
    flags |= _NOFOLLOW | _CLOEXEC | (os.O_CREAT | os.O_EXCL if exclusive else 0)
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PrivatePathError(f"key {key!r}: {path} is a symbolic link; refused (the store "
                                   "never writes through a link)") from None
        raise PrivatePathError(f"key {key!r}: cannot open {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PrivatePathError(f"key {key!r}: {path} is not a regular file; refused")
        if st.st_uid != os.geteuid():
            raise PrivatePathError(f"key {key!r}: {path} belongs to uid {st.st_uid}, not to this "
                                   f"user (uid {os.geteuid()}); refused")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return fd


def same_file(fd_a: int, fd_b: int) -> bool:
    """Both descriptors are the same file (a second open by name reached the first's inode)."""
    a, b = os.fstat(fd_a), os.fstat(fd_b)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
