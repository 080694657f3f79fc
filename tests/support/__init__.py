"""Fakes and scaffolding that only the tests use (not shipped in the wheel)."""
