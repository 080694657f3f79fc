"""The library's exception root.

Why one root: a caller (an engine hook, the CLI, a test) can catch every error this
package raises on purpose with one ``except AscendOffloadError``, while each class
keeps the builtin base its callers already catch (``ValueError`` for refused input,
``RuntimeError`` for a failed operation, ``TimeoutError`` for a deadline).
``tests/unit/core/test_exception_root.py`` checks every exception class of the
package derives from it. The proxy (``proxy/``) imports nothing of the library and
has its own root, ``proxy.errors.AscendOffloadProxyError``.
"""

from __future__ import annotations


class AscendOffloadError(Exception):
    """Root of every exception class defined in ``ascend_offload``."""
