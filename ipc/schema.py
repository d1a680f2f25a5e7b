"""Operation tables: the one place a protocol's requests are declared.

A protocol (the control server's, the backend's CLI socket) is an ``OpTable``
of ``Op`` entries. The same table object is imported by the server, which
validates every request against it, and by the client, so the two cannot
drift apart. Unknown extra fields are ignored so that fields can be added
(backend N talking to control server N-1); missing or mistyped declared
fields are refused with ``invalid_argument`` naming the field.
"""

from __future__ import annotations

from types import MappingProxyType

from .errors import ErrorCode, IpcError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import Any

TypeSpec = type | tuple[type, ...]
_NO_FIELDS: Mapping[str, TypeSpec] = MappingProxyType({})


def _type_name(spec: TypeSpec) -> str:
    if isinstance(spec, tuple):
        return " or ".join(t.__name__ for t in spec)
    return spec.__name__


def _matches(value: Any, spec: TypeSpec) -> bool:
    types = spec if isinstance(spec, tuple) else (spec,)
    for t in types:
        if t is type(None) and value is None:
            return True
        # bool is an int subclass; never let True pass as a count.
        if t is int and isinstance(value, bool):
            continue
        if t is float and isinstance(value, int) and not isinstance(value, bool):
            return True
        if isinstance(value, t):
            return True
    return False


class Op:
    """One request type: its name, the fields it requires and accepts with their types, and how it
    is served. (A plain class, not a dataclass or a ``typing.NamedTuple``: every CLI call imports
    the op tables, and either would cost it imports of its own.)

    ``auth``: the server's ``authorize`` hook is consulted before the handler.
    ``stream``: after the ok response the connection carries only
    ``{seq, kind, data}`` event frames from the server.
    """

    __slots__ = ("name", "required", "optional", "auth", "stream", "doc")

    def __init__(
        self,
        name: str,
        required: Mapping[str, TypeSpec] = _NO_FIELDS,
        optional: Mapping[str, TypeSpec] = _NO_FIELDS,
        auth: bool = True,
        stream: bool = False,
        doc: str = "",
    ) -> None:
        self.name = name
        self.required = required
        self.optional = optional
        self.auth = auth
        self.stream = stream
        self.doc = doc

    def __repr__(self) -> str:
        return f"Op({self.name!r}, auth={self.auth}, stream={self.stream})"

    def validate(self, args: Any) -> dict[str, Any]:
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"{self.name}: args must be a map")
        out: dict[str, Any] = {}
        for name, spec in self.required.items():
            if name not in args:
                raise IpcError(ErrorCode.INVALID_ARGUMENT, f"{self.name}: missing field '{name}'")
            if not _matches(args[name], spec):
                raise IpcError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"{self.name}: field '{name}' must be {_type_name(spec)}",
                )
            out[name] = args[name]
        for name, spec in self.optional.items():
            if name in args and args[name] is not None:
                if not _matches(args[name], spec):
                    raise IpcError(
                        ErrorCode.INVALID_ARGUMENT,
                        f"{self.name}: field '{name}' must be {_type_name(spec)}",
                    )
                out[name] = args[name]
        return out


class OpTable:
    """A named, versioned protocol: its ops and the capability set it advertises."""

    def __init__(
        self,
        protocol: str,
        version: tuple[int, int],
        ops: Iterable[Op],
        capabilities: Iterable[str] = (),
    ) -> None:
        self.protocol = protocol
        self.version = version
        self.capabilities = tuple(sorted(set(capabilities)))
        self._ops: dict[str, Op] = {}
        for op in ops:
            if op.name in self._ops:
                raise ValueError(f"duplicate op {op.name}")
            self._ops[op.name] = op

    @property
    def major(self) -> int:
        return self.version[0]

    def get(self, name: Any) -> Op:
        op = self._ops.get(name) if isinstance(name, str) else None
        if op is None:
            raise IpcError(ErrorCode.UNKNOWN_OP, f"unknown op {name!r:.100} for {self.protocol}")
        return op

    def __contains__(self, name: object) -> bool:
        return name in self._ops

    @property
    def names(self) -> list[str]:
        return sorted(self._ops)
