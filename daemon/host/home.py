"""Which Kandev home a process uses, and where that home's backend listens, as plain strings.

These are the two facts every ``kandev`` call needs before it talks to the backend. They live here,
without pathlib, because a CLI call is a whole interpreter start and importing pathlib is about a
tenth of one (tests/unit/test_cli_imports.py). ``daemon.host.paths`` builds every path of the home
(``Paths``) from ``resolve_home_dir``; ``tests/unit/test_home.py`` checks that both spell each path
exactly as pathlib does.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from collections.abc import Mapping

BACKEND_SOCKET = ("run", "backend.sock")  # under the home: where Paths.backend_socket is too


def resolve_home_dir(cli_home: str | None, env: Mapping[str, str] | None = None) -> str:
    """The Kandev home: ``--home``, else ``$KANDEV_HOME``, else the first entry of
    ``$STATE_DIRECTORY`` (systemd's ``StateDirectory=``), else ``~/.local/share/kandev``; made
    absolute against the working directory, a leading ``~`` expanded (not in ``$STATE_DIRECTORY``),
    ``..`` kept as given (as pathlib's ``absolute()``: a symlink before it is the kernel's to follow)."""
    environ = os.environ if env is None else env
    if cli_home:
        return _absolute(_expand_user(cli_home))
    if environ.get("KANDEV_HOME"):
        return _absolute(_expand_user(environ["KANDEV_HOME"]))
    state = environ.get("STATE_DIRECTORY", "").split(":")[0]
    if state:
        return _absolute(state)
    return _clean(_expand_user("~") + "/.local/share/kandev")


def backend_socket_path(home: str) -> str:
    """The backend's CLI socket in ``home`` (a path from ``resolve_home_dir``)."""
    home = _clean(home)
    return home + ("" if home.endswith("/") else "/") + "/".join(BACKEND_SOCKET)  # "/" alone ends in one


def _expand_user(path: str) -> str:
    if not path.startswith("~"):
        return path
    first, sep, rest = path.partition("/")
    expanded = os.path.expanduser(first)
    if expanded.startswith("~"):
        raise RuntimeError("Could not determine home directory.")  # what pathlib's expanduser raises
    return expanded + sep + rest


def _absolute(path: str) -> str:
    path = _clean(path)
    return path if path.startswith("/") else _clean(os.getcwd() + "/" + path)


def _clean(path: str) -> str:
    """``path`` as ``str(pathlib.PurePosixPath(path))`` spells it: no empty or ``.`` components,
    no trailing slash, a leading ``//`` (exactly two) kept, ``..`` untouched."""
    root = "//" if path.startswith("//") and not path.startswith("///") else "/" if path.startswith("/") else ""
    parts = [part for part in path.split("/") if part and part != "."]
    return (root + "/".join(parts)) or "."
