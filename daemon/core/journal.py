"""Structured logging for both daemons: journald when present, else stderr, plus a bounded file.

``setup_logging`` installs the handlers on the root logger once per process
(calling it again replaces them). ``log_event`` writes one structured entry:
in the journal it carries ``KANDEV_EVENT``, ``KANDEV_COMPONENT`` and every
field upper-cased (``SESSION_ID``, ``TASK_ID``, ``INSTANCE_ID``, ``REASON``...);
on stderr and in the file it is one line::

    2025-01-31T12:00:00.123Z INFO backend session_state session_id=ab12 to_state=RUNNING msg="..."

i.e. timestamp (UTC), level, component, event, the fields as lower-case
``key=value`` (values with spaces, quotes, ``=`` or control characters are
JSON-quoted, C1 controls escaped too), then the message. Plain ``logging``
records use the same prefix followed by ``logger: message``, its control
characters but newline and tab escaped: no line carries a sequence a terminal
would obey.

Secrets never go through here: the API takes event names, sentences and
identifiers only. Never pass a credential, token, HMAC or challenge as a
field or in a message.

The file (the control server's ``<home>/logs/agentctl.log``,
AC-EXECUTORS-SURVIVAL-001.3) is bounded by size, backup count and age; all
three must be non-zero, since zero means "unlimited" in ``logging.handlers``.
The bounds are fixed constants chosen by the caller, not settings.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import re
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
EVENT_LOGGER = "kandev.event"
_FIELD_NAME = re.compile(r"^[A-Z0-9][A-Z0-9_]{0,63}$")
_RESERVED = {"MESSAGE", "PRIORITY", "KANDEV_EVENT", "KANDEV_COMPONENT", "SYSLOG_IDENTIFIER"}
_LEVELS = {0: logging.CRITICAL, 1: logging.CRITICAL, 2: logging.CRITICAL, 3: logging.ERROR,
           4: logging.WARNING, 5: logging.INFO, 6: logging.INFO, 7: logging.DEBUG}

_component = "kandev"
_installed: list[logging.Handler] = []


def _journal_send(message: str, **fields: str) -> None:
    """Send one entry to journald (tests replace this)."""
    from systemd import journal

    journal.send(message, **fields)


def _priority(record: logging.LogRecord) -> int:
    explicit = getattr(record, "kandev_priority", None)
    if explicit is not None:
        return int(explicit)
    if record.levelno >= logging.CRITICAL:
        return 2
    if record.levelno >= logging.ERROR:
        return 3
    if record.levelno >= logging.WARNING:
        return 4
    return 6 if record.levelno >= logging.INFO else 7


class JournalHandler(logging.Handler):
    """Writes each record to journald with the Kandev fields."""

    def __init__(self, send: Callable[..., None] | None = None) -> None:
        super().__init__()
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = {
                "PRIORITY": str(_priority(record)),
                "SYSLOG_IDENTIFIER": f"kandev-{_component}",
                "KANDEV_COMPONENT": _component,
                "LOGGER": record.name,
            }
            event = getattr(record, "kandev_event", None)
            if event:
                fields["KANDEV_EVENT"] = event
                fields.update(getattr(record, "kandev_fields", {}))
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            (self._send or _journal_send)(message, **fields)
        except Exception:
            self.handleError(record)


_NEEDS_QUOTES = re.compile(r'[\s"=\\\x00-\x1f\x7f-\x9f]')
# Control characters a terminal would obey (`tail -f` of the file): what agents wrote reaches
# log lines (their errors, their stderr tail), so none is written as it is.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_C1 = re.compile(r"[\x7f-\x9f]")  # json.dumps(ensure_ascii=False) escapes only what is below 0x20


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def _quote(value: str) -> str:
    if value and _NEEDS_QUOTES.search(value) is None:  # one regex scan, not a Python loop per character
        return value
    return _C1.sub(_escape, json.dumps(value, ensure_ascii=False))


def _plain(message: str) -> str:
    """A plain record's message with its control characters escaped (newline and tab kept: task
    dumps and other multi-line messages of kandev's own)."""
    return message if _CONTROL.search(message) is None else _CONTROL.sub(_escape, message)


class LineFormatter(logging.Formatter):
    """``<UTC time> <LEVEL> <component> <event> key=value ... msg="..."`` (see module doc)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        head = f"{ts} {record.levelname} {_component}"
        event = getattr(record, "kandev_event", None)
        if event:
            fields = getattr(record, "kandev_fields", {})
            pairs = "".join(f" {k.lower()}={_quote(v)}" for k, v in fields.items())
            line = f"{head} {event}{pairs} msg={_quote(record.getMessage())}"
        else:
            line = f"{head} {record.name}: {_plain(record.getMessage())}"
        if record.exc_info:
            line += " " + json.dumps(self.formatException(record.exc_info))
        return line


class BoundedFileHandler(logging.handlers.RotatingFileHandler):
    """Size-rotated file with a backup count, whose rotated files are also removed after an age."""

    def __init__(self, path: Path, *, max_bytes: int, backups: int, max_age_days: float) -> None:
        if max_bytes <= 0 or backups <= 0 or max_age_days <= 0:
            raise ValueError("log file bounds must all be > 0 (0 means unlimited in logging.handlers)")
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self.max_age = max_age_days * 86400.0
        self.prune()

    def doRollover(self) -> None:  # noqa: N802 (logging's name)
        super().doRollover()
        self.prune()

    def prune(self) -> None:
        """Remove rotated files (``<file>.N``) older than the age bound."""
        base = Path(self.baseFilename)
        cutoff = time.time() - self.max_age
        for old in base.parent.glob(base.name + ".*"):
            suffix = old.name[len(base.name) + 1:]
            try:
                if suffix.isdigit() and old.lstat().st_mtime < cutoff:
                    old.unlink()
            except OSError:
                pass


def setup_logging(
    component: str,
    *,
    verbose: bool = False,
    log_file: Path | None = None,
    file_max_bytes: int = 0,
    file_backups: int = 0,
    file_max_age_days: float = 0,
    use_journal: bool | None = None,
) -> logging.Logger:
    """Install the process's handlers; returns the root logger.

    ``use_journal`` None: journald if ``/run/systemd/journal/socket`` exists,
    else stderr. With ``log_file`` the three bounds are required (> 0).
    """
    global _component
    _component = component
    root = logging.getLogger()
    for handler in _installed:
        root.removeHandler(handler)
        handler.close()
    _installed.clear()
    if use_journal is None:
        use_journal = JOURNAL_SOCKET.exists()
    console: logging.Handler = JournalHandler() if use_journal else logging.StreamHandler(sys.stderr)
    console.setFormatter(LineFormatter())
    _installed.append(console)
    if log_file is not None:
        file_handler = BoundedFileHandler(log_file, max_bytes=file_max_bytes, backups=file_backups,
                                          max_age_days=file_max_age_days)
        file_handler.setFormatter(LineFormatter())
        _installed.append(file_handler)
    for handler in _installed:
        root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    return root


def _field_name(key: str) -> str:
    name = key.upper()
    if not _FIELD_NAME.match(name) or name in _RESERVED:
        raise ValueError(f"invalid journal field name {key!r}")
    return name


def log_event(event: str, message: str, *, priority: int = 6, **fields: str | int | None) -> None:
    """One structured entry: ``KANDEV_EVENT=event`` plus each non-None field, upper-cased.

    ``priority`` is the syslog level (0 emerg .. 7 debug). Never pass a secret.
    """
    values: dict[str, Any] = {_field_name(k): str(v) for k, v in fields.items() if v is not None}
    logging.getLogger(EVENT_LOGGER).log(
        _LEVELS.get(priority, logging.INFO),
        message,
        extra={"kandev_event": event, "kandev_fields": values, "kandev_priority": priority},
    )


def current_component() -> str:
    """The component name given to ``setup_logging`` (``kandev`` before it is called)."""
    return _component
