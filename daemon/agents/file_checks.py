"""The files ``[agents.NAME]`` names, checked on the host before any agent needs them.

Every ``secret_env`` file and every ``home_files`` source must be a regular file of root or the
service user, no symlink, mode 0600/0640 (0400/0440 too), readable by the service user; a key
file must also hold something (an empty one, or one of a lone newline, would reach the agent as
an empty key: its provider's refusal would come only at the first turn). Each problem is a
``FileProblem``: the dotted key it is about, what is wrong, and the fix.

``validate_settings`` (``kandev up`` and the backend at start: the first problem refuses the
configuration) and ``file_problems`` (``kandev doctor``, and the backend's ``config_show`` op for
the files as the service user sees them: every problem) run the same checks. Nothing here reads a
key, except the one or two bytes of a file that small (to tell a lone newline from a key), and no
message holds one. ``credential:NAME`` references are the control server's to check (only its unit
has them).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from daemon.agents.settings import (
    SERVICE_GROUP,
    AgentSettings,
    KeyFileError,
    SecretKind,
    SettingsError,
    check_secret_stat,
)

_NEWLINE_ONLY = (b"", b"\n", b"\r\n")


@dataclass(frozen=True)
class FileProblem:
    """One configured file kandev refuses: its dotted key, what is wrong, and what to do."""

    key: str  # agents.NAME.secret_env.VAR or agents.NAME.home_files.DEST
    what: str
    fix: str

    def text(self) -> str:
        return f"{self.key}: {self.what}; fix: {self.fix}"

    def as_dict(self) -> dict[str, str]:
        return {"key": self.key, "what": self.what, "fix": self.fix}


def _empty(path: str, size: int) -> bool:
    """Whether a key file holds nothing but, at most, one line break."""
    if size == 0:
        return True
    if size > 2:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False  # not readable: said by the readability check
    try:
        return os.read(fd, 3) in _NEWLINE_ONLY
    finally:
        os.close(fd)


def check_secret_file(path: str, *, variable: str | None = None) -> None:
    """Presence, type, owner, mode and readability of a configured file, and for a key file
    (``variable``: the variable it gives) that it is not empty. ``KeyFileError``."""
    what_it_holds = f"the value of {variable}" if variable else "the file's contents"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise KeyFileError(f"{path} does not exist", f"create it (install -m 600 /dev/null {path}) and write"
                           f" {what_it_holds} into it, or correct the path") from None
    except OSError as exc:
        raise KeyFileError(f"{path}: {exc.strerror or exc}", f"let uid {os.geteuid()} reach {path}"
                           " (every directory above it searchable)") from None
    if stat.S_ISLNK(st.st_mode):
        raise KeyFileError(f"{path} is a symlink", f"name the file itself ({os.path.realpath(path)})")
    check_secret_stat(st, path)
    if not os.access(path, os.R_OK):
        raise KeyFileError(f"{path} is not readable by uid {os.geteuid()} (the service user)",
                           f"make it 0640 root:{SERVICE_GROUP}, or load it with LoadCredential= and write"
                           " \"credential:NAME\"")
    if variable is not None and _empty(path, st.st_size):
        raise KeyFileError(f"{path} is empty", f"write the key into it: printf '%s' \"${variable}\" > {path}")


def file_problems(configured: Mapping[str, AgentSettings]) -> list[FileProblem]:
    """Every problem of every configured file, by agent, then key."""
    problems: list[FileProblem] = []
    for name, settings in sorted(configured.items()):
        for var, ref in sorted(settings.secret_env.items()):
            if ref.kind is SecretKind.FILE:
                try:
                    check_secret_file(ref.target, variable=var)
                except KeyFileError as exc:
                    problems.append(FileProblem(f"agents.{name}.secret_env.{var}", str(exc), exc.fix))
        for dest, source in sorted(settings.home_files.items()):
            try:
                check_secret_file(source)
            except KeyFileError as exc:
                problems.append(FileProblem(f"agents.{name}.home_files.{dest}", str(exc), exc.fix))
    return problems


def validate_settings(configured: Mapping[str, AgentSettings]) -> None:
    """The start check (``kandev up``, the backend): the first problem as a ``SettingsError`` naming
    its key, what is wrong and the fix."""
    problems = file_problems(configured)
    if problems:
        first = problems[0]
        raise SettingsError(first.key, f"{first.what}; fix: {first.fix}")
