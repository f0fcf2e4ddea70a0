"""Fault-injection suite: make the shared test helpers (the package ``tests/helpers/``) importable from here."""

import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
