"""The control server's side of an agent's provider keys (``[agents.NAME] secret_env``).

The backend hands over *references* only (``{VAR: "/path"}`` or ``{VAR: "credential:NAME"}``, see
``daemon.agents.settings``): in the launch file (every agent's, checked here when the server
starts) and in each ``create_instance`` (that agent's, read here when it is spawned). This module
reads the values, at spawn time, off the event loop: from the file (a regular file of root or the
service user, mode 0600/0640, no symlink) or from ``$CREDENTIALS_DIRECTORY/NAME`` (a systemd
credential of this server's unit, ``LoadCredential=NAME:...``). The values go into that one
agent's environment (``InstanceSpec.secret_env``, merged in ``Instance._spawn``) and nowhere else:
never in a log, an event, a reply, an argv. A failure names the variable and the reference,
never a value.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

from daemon.agentctl.sandbox.bubblewrap import SandboxRequest
from daemon.agents.settings import (
    SECRET_MAX_BYTES,
    KeyFileError,
    SecretKind,
    SecretRef,
    SettingsError,
    check_secret_stat,
)


class SecretUnavailable(ValueError):
    """A secret could not be read; the message names the key and the reference (never a value)."""


def parse_refs(value: Any, key: str) -> dict[str, SecretRef]:
    """``{VAR: reference}`` as it arrives (launch file, ``create_instance``); SettingsError."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 64:
        raise SettingsError(key, "must be a map of at most 64 VARIABLE -> reference")
    out: dict[str, SecretRef] = {}
    for var, ref in value.items():
        if not isinstance(var, str) or not var or "=" in var or "\0" in var:
            raise SettingsError(key, f"{var!r:.80} is not a variable name")
        out[var] = SecretRef.parse(ref, f"{key}.{var}")
    return out


def _inside(path: str, roots: Sequence[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == os.path.realpath(r) or real.startswith(os.path.realpath(r).rstrip("/") + "/") for r in roots)


def _read_fd(fd: int, where: str, *, check_owner: bool) -> str:
    st = os.fstat(fd)
    if check_owner:
        check_secret_stat(st, where)
    elif not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{where} is not a regular file")
    data = os.read(fd, SECRET_MAX_BYTES + 1)
    if len(data) > SECRET_MAX_BYTES:
        raise ValueError(f"{where} is larger than {SECRET_MAX_BYTES} bytes")
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        raise KeyFileError(f"{where} is empty", f"write the key into it (printf '%s' KEY > {where})")
    if b"\0" in data:
        raise ValueError(f"{where} holds a NUL byte")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where} is not UTF-8 text") from None


def read_secret(ref: SecretRef, credentials_dir: str | None, forbidden: Sequence[str] = ()) -> str:
    """The value behind ``ref`` (blocking). ValueError saying what is wrong, never the value."""
    if ref.kind is SecretKind.CREDENTIAL:
        if not credentials_dir:
            raise ValueError(f"systemd passed no credentials to this control server ($CREDENTIALS_DIRECTORY is"
                             f" unset): add LoadCredential={ref.target}:/path/to/file to its unit in a drop-in")
        path, check_owner = os.path.join(credentials_dir, ref.target), False
    else:
        path, check_owner = ref.target, True
        if _inside(path, forbidden):
            raise ValueError(f"{path} is one of the control server's own files")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        if ref.kind is SecretKind.CREDENTIAL:
            raise ValueError(f"this control server's unit has no credential {ref.target!r}: add"
                             f" LoadCredential={ref.target}:/path/to/file in a drop-in") from None
        raise KeyFileError(f"{path} does not exist", f"create it (install -m 600 /dev/null {path}) and write the"
                           " key into it, or correct the path") from None
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc} (a symlink is refused)") from None
    try:
        return _read_fd(fd, path, check_owner=check_owner)
    finally:
        os.close(fd)


def resolve(refs: Mapping[str, SecretRef], key_prefix: str, *, credentials_dir: str | None,
            forbidden: Sequence[str] = ()) -> dict[str, str]:
    """Read every secret of one agent (blocking: call it off the event loop). SecretUnavailable
    names ``<key_prefix>.<VAR>`` and the reference."""
    values: dict[str, str] = {}
    for var, ref in sorted(refs.items()):
        try:
            values[var] = read_secret(ref, credentials_dir, forbidden)
        except ValueError as exc:
            fix = f"; fix: {exc.fix}" if isinstance(exc, KeyFileError) else ""
            raise SecretUnavailable(f"{key_prefix}.{var} = {ref.render()!r}: {exc}{fix}") from None
    return values


def check_all(mapping: Mapping[str, Mapping[str, SecretRef]], *, credentials_dir: str | None,
              forbidden: Sequence[str] = ()) -> None:
    """The start check of every agent's secrets the launch file names: each must be readable now
    (the values are read and dropped). SecretUnavailable naming ``agents.NAME.secret_env.VAR``."""
    for name, refs in sorted(mapping.items()):
        resolve(refs, f"agents.{name}.secret_env", credentials_dir=credentials_dir, forbidden=forbidden)


def file_paths(mapping: Mapping[str, Mapping[str, SecretRef]]) -> list[str]:
    """The secret files named, which no agent's sandbox may show."""
    return sorted({ref.target for refs in mapping.values() for ref in refs.values() if ref.kind is SecretKind.FILE})


def hide_secret_files(request: SandboxRequest, configured: Mapping[str, Mapping[str, SecretRef]],
                      refs: Any) -> SandboxRequest:
    """``request`` with every secret file hidden: those of every agent this server was started
    with, and those this launch names (already checked by ``parse_refs``)."""
    named = file_paths({"": parse_refs(refs, "secret_env")}) if refs else []
    extra = [p for p in (*file_paths(configured), *named) if p not in request.hidden]
    if not extra:
        return request
    return dataclasses.replace(request, hidden=(*request.hidden, *extra))
