"""Shared test settings: hypothesis profile with no per-example deadline (CI machines are slow)."""

import pytest
from hypothesis import settings

settings.register_profile("shoal", deadline=None, max_examples=60)
settings.load_profile("shoal")

# tests/hostile_messages.py is a plain helper module whose asserts are the checks of many tests:
# have pytest rewrite them (as it would in a test module) so their failures show the values compared.
pytest.register_assert_rewrite("tests.hostile_messages")
