"""Where things are, for tests in any area folder: the repository's root and tests/ (shared helpers).

Each also as a str (`ROOT_STR`, `TESTS_STR`) for what takes text, not a path:
environments (PYTHONPATH), code passed to `python -c`, `os.path.join`.
"""

import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
TESTS_STR = str(TESTS)
ROOT_STR = str(ROOT)
