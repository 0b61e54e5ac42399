"""Where things are, for tests in any area folder: the repository's root and tests/ (shared helpers)."""

import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
