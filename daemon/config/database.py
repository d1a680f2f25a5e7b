"""The database password (Issue 47 item 6): ``database.password_file`` read when connecting.

The password is never in the configuration nor in ``database.url``: ``database.password_file``
names a file (checked like an agent's ``secret_env`` file: regular, no symlink, mode
0600/0640/0400/0440, owner root or the service user, not empty) or ``credential:NAME``, a systemd
credential of ``kandev-backend.service`` (``LoadCredential=NAME:/path``), read from
``$CREDENTIALS_DIRECTORY/NAME``. ``connect_args`` hands it to the driver as a connection argument,
so it never becomes part of a URL that could be logged or shown; no message here repeats it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from daemon.agents.file_checks import check_secret_file
from daemon.agents.settings import SECRET_MAX_BYTES, KeyFileError, SecretKind, SecretRef, SettingsError
from daemon.config.keys import ConfigError, Where
from daemon.config.settings import Config

KEY = "database.password_file"


def _refuse(config: Config, problem: str) -> ConfigError:
    ref = config.database.password_file
    return Where(KEY, config.origins.get(KEY)).error(config.given.get(KEY, f'"{ref}"'), problem)


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        data = os.read(fd, SECRET_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > SECRET_MAX_BYTES:
        raise KeyFileError(f"{path} is larger than {SECRET_MAX_BYTES} bytes", "write only the password into it")
    return data.decode().rstrip("\r\n")


def database_password(config: Config, environ: Mapping[str, str] | None = None) -> str | None:
    """The password ``database.password_file`` names, or None when it is unset. ``ConfigError`` naming
    the key when it cannot be read (the file's problem and its fix; never the password)."""
    ref = config.database.password_file
    if ref is None:
        return None
    env = os.environ if environ is None else environ
    try:
        parsed = SecretRef.parse(ref, KEY)
        if parsed.kind is SecretKind.CREDENTIAL:
            directory = env.get("CREDENTIALS_DIRECTORY")
            if not directory:
                raise KeyFileError("systemd passed no credentials to this backend ($CREDENTIALS_DIRECTORY is unset)",
                                   f"add LoadCredential={parsed.target}:/path/of/the/password to a drop-in of"
                                   " kandev-backend.service")
            path = os.path.join(directory, parsed.target)
        else:
            path = parsed.target
        check_secret_file(path, variable="PASSWORD")
        password = _read(path)
    except SettingsError as exc:
        raise _refuse(config, f"is refused: {str(exc)[len(exc.key) + 2:]}") from None
    except KeyFileError as exc:
        raise _refuse(config, f"cannot be used: {exc}; fix: {exc.fix}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _refuse(config, f"cannot be read: {type(exc).__name__}") from None
    if not password:
        raise _refuse(config, "holds an empty password")
    return password


def connect_args(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The driver's connection arguments for the store: the password when one is configured."""
    password = database_password(config, environ)
    return {} if password is None else {"password": password}
