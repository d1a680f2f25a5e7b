"""kandev test suite (a package so that `from tests.helpers import ...` works everywhere)."""
