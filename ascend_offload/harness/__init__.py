"""What ``ascend-offload demo`` and the benches run on, shipped with the package (the tests
reuse it): server processes (``servers``), engine owners and steppers (``engines``), tiny
generated models (``tiny_model``, ``tiny_sparse_model``, ``generated``) and fake OpenAI
backends for ``bench proxy`` (``fake_backends``). Fakes only the tests use live in the
repository's ``tests/support/`` and are not shipped."""
