"""Shared test settings: hypothesis profile with no per-example deadline (CI machines are slow)."""

from hypothesis import settings

settings.register_profile("shoal", deadline=None, max_examples=60)
settings.load_profile("shoal")
