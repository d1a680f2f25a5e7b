"""kandev test suite (a package so that `from tests.support.waiting import ...` works everywhere)."""
