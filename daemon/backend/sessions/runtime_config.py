"""SessionRuntimeConfig: one captured value of a session's model, mode and provider options (docs/requirements.md#runtime-configuration-across-a-context-reset).

A context reset gives the agent a new provider session, and a new session
starts from the provider's defaults. Worse, the new session *announces* those
defaults (``current_mode_update``, ``config_option_update``) before the reset
answer returns, and the backend persists every such event as it arrives. So
the value to restore must be captured **before** the reset and must never be
read back from the store afterwards: that was the original bug
(RESETCFG-1, RESETCFG-5).

- ``capture`` builds the one snapshot (RESETCFG-1, RESETCFG-2): the agent profile's
  values, then the persisted provider state, then the live cache of this
  backend lifetime where nothing is persisted yet. Options are deep-copied
  (RESETCFG-3); model and mode never sit in the options, and empty entries are
  dropped (RESETCFG-4, ``normalize``).
- ``apply_config`` is the one routine that applies a value through the agent,
  for the reset paths (``restore``) and for ``kandev session configure``
  alike (RESETCFG-6): model first (the config option with category
  ``model``), then mode (``session/set_mode`` on the current, i.e. new, ACP
  session), then every option in the stable order of its id (RESETCFG-7).
  Option calls after the model use the option list the agent returned for it.
  The accepted value grows only from answers the agent accepted (RESETCFG-8);
  the first refusal raises ``ApplyRejected`` carrying what was accepted so far
  (RESETCFG-9, RESETCFG-11). A model that cannot be applied fails closed.
- ``Catalogue`` is what the agent reported about its current session (modes
  and config options); ``provider_state`` turns such a report into the
  values it names, which win over older stored entries (RESETCFG-12). A
  catalogue with options but no model option still counts as one.

Legacy ``session/set_model`` (``models`` in the session answer) is not used:
SDK 0.12.1 has no client method for it and schema 1.19 has no such method; a
model is applied only as the config option of category ``model``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from ipc.errors import IpcError

OptionValue = str | bool
MODEL_CATEGORY = "model"
MODE_CATEGORY = "mode"
_RESERVED_IDS = frozenset({"model", "mode"})


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


@dataclass(frozen=True)
class Catalogue:
    """The agent's report about its current session: modes and config options (ACP JSON)."""

    modes: Mapping[str, Any] | None = None
    config_options: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Catalogue:
        data = data or {}
        modes = data.get("modes") if isinstance(data.get("modes"), dict) else None
        options = tuple(o for o in data.get("config_options") or [] if isinstance(o, dict) and o.get("id"))
        return cls(modes=copy.deepcopy(modes), config_options=copy.deepcopy(options))

    def to_json(self) -> dict[str, Any]:
        return {"modes": copy.deepcopy(dict(self.modes)) if self.modes else None,
                "config_options": [copy.deepcopy(dict(o)) for o in self.config_options]}

    def with_options(self, options: list[Mapping[str, Any]] | None) -> Catalogue:
        """This catalogue with the option list an agent answer returned (if it returned one)."""
        if not options:
            return self
        return Catalogue(modes=self.modes, config_options=tuple(copy.deepcopy(o) for o in options if o.get("id")))

    def with_mode(self, mode_id: str) -> Catalogue:
        if not isinstance(self.modes, Mapping):
            return self
        return Catalogue(modes={**self.modes, "currentModeId": mode_id}, config_options=self.config_options)

    @property
    def known(self) -> bool:
        """Whether the agent reported anything at all (options only is enough: RESETCFG-12)."""
        return bool(self.config_options) or bool(self.modes)

    def category(self, option_id: str) -> str | None:
        for o in self.config_options:
            if o.get("id") == option_id:
                return o.get("category")
        return None

    def option_ids(self) -> set[str]:
        return {str(o["id"]) for o in self.config_options}

    def model_option_id(self) -> str | None:
        """The id of the config option that selects the model (category ``model``)."""
        for o in self.config_options:
            if o.get("category") == MODEL_CATEGORY:
                return str(o["id"])
        return None

    def carries_model_or_mode(self, option_id: str) -> bool:
        return option_id in _RESERVED_IDS or self.category(option_id) in (MODEL_CATEGORY, MODE_CATEGORY)


@dataclass(frozen=True)
class SessionRuntimeConfig:
    """Model, mode and provider options; ``options`` is a read-only deep copy."""

    model: str | None = None
    mode: str | None = None
    options: Mapping[str, OptionValue] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(copy.deepcopy(dict(self.options))))

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "mode": self.mode, "options": dict(sorted(self.options.items()))}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, catalogue: Catalogue | None = None) -> SessionRuntimeConfig:
        data = data or {}
        options = data.get("options") if isinstance(data.get("options"), Mapping) else {}
        return normalize(data.get("model"), data.get("mode"), options, catalogue)

    @property
    def empty(self) -> bool:
        return self.model is None and self.mode is None and not self.options

    def merged(self, other: SessionRuntimeConfig) -> SessionRuntimeConfig:
        """``other``'s non-empty fields over this one's."""
        return SessionRuntimeConfig(
            model=other.model if other.model is not None else self.model,
            mode=other.mode if other.mode is not None else self.mode,
            options={**self.options, **other.options},
        )


def normalize(
    model: Any, mode: Any, options: Mapping[str, Any] | None, catalogue: Catalogue | None = None
) -> SessionRuntimeConfig:
    """One clean value (RESETCFG-4): empty model/mode become None; option entries that are None or
    empty, or that carry the model or the mode (id ``model``/``mode``, or category ``model``/``mode``
    in the catalogue), leave the options. Such an entry fills an empty top-level field instead, so a
    value is applied exactly once and through its own operation."""
    cat = catalogue or Catalogue()
    model = None if _empty(model) else str(model)
    mode = None if _empty(mode) else str(mode)
    clean: dict[str, OptionValue] = {}
    for key in sorted(options or {}, key=str):
        value = (options or {})[key]
        option_id = str(key)
        if _empty(option_id) or _empty(value) or not isinstance(value, (str, bool)):
            continue
        if option_id == "model" or cat.category(option_id) == MODEL_CATEGORY:
            if model is None and isinstance(value, str):
                model = value
            continue
        if option_id == "mode" or cat.category(option_id) == MODE_CATEGORY:
            if mode is None and isinstance(value, str):
                mode = value
            continue
        clean[option_id] = value
    return SessionRuntimeConfig(model=model, mode=mode, options=clean)


def capture(
    profile: SessionRuntimeConfig | None,
    persisted: Mapping[str, Any] | SessionRuntimeConfig | None,
    live: SessionRuntimeConfig | None,
    catalogue: Catalogue | None = None,
) -> SessionRuntimeConfig:
    """The one snapshot taken before a reset (RESETCFG-1, RESETCFG-2, RESETCFG-3).

    1. the agent profile's model, mode and options;
    2. over them, the persisted provider state and explicit overrides (their precedence unchanged);
    3. where nothing is persisted yet, the live cache of this backend lifetime.

    The result shares nothing with its inputs: later events or edits cannot change it.
    """
    value = profile or SessionRuntimeConfig()
    if isinstance(persisted, SessionRuntimeConfig):
        stored = persisted
    else:
        stored = SessionRuntimeConfig.from_json(copy.deepcopy(dict(persisted or {})), catalogue)
    value = value.merged(stored)
    if live is not None:
        value = SessionRuntimeConfig(
            model=value.model if value.model is not None else live.model,
            mode=value.mode if value.mode is not None else live.mode,
            options={**live.options, **value.options},
        )
    return normalize(value.model, value.mode, dict(value.options), catalogue)


def provider_state(catalogue: Catalogue) -> SessionRuntimeConfig:
    """The values an agent report names as current (RESETCFG-12): the model option's value, the
    current mode, every other option's current value."""
    model = None
    options: dict[str, OptionValue] = {}
    for o in catalogue.config_options:
        value = o.get("currentValue")
        if _empty(value) or not isinstance(value, (str, bool)):
            continue
        if o.get("category") == MODEL_CATEGORY:
            model = model or (value if isinstance(value, str) else None)
        elif o.get("category") != MODE_CATEGORY and o.get("id") not in _RESERVED_IDS:
            options[str(o["id"])] = value
        elif o.get("id") == "model" and isinstance(value, str):
            model = model or value
    mode = None
    if isinstance(catalogue.modes, Mapping):
        current = catalogue.modes.get("currentModeId")
        mode = None if _empty(current) else str(current)
    return SessionRuntimeConfig(model=model, mode=mode, options=options)


def provider_options_state(current: SessionRuntimeConfig, config_options: list[Any]) -> SessionRuntimeConfig:
    """``current`` after an agent reported its option list (a ``config_option_update`` event or a
    set answer): the reported values win (RESETCFG-12), the mode is kept."""
    reported = provider_state(Catalogue.from_json({"config_options": config_options}))
    return SessionRuntimeConfig(
        model=reported.model if reported.model is not None else current.model,
        mode=current.mode,
        options=dict(reported.options),
    )


# ------------------------------------------------------------------ applying


class Agent(Protocol):
    """The agent operations ``apply_config`` needs (bound to one instance by the caller)."""

    async def set_mode(self, mode_id: str) -> Mapping[str, Any]: ...

    async def set_config_option(self, config_id: str, value: OptionValue) -> Mapping[str, Any]: ...


class ApplyRejected(Exception):
    """A field was refused (or could not be applied); ``accepted`` is what the agent did accept."""

    def __init__(self, field_name: str, value: Any, reason: str, accepted: SessionRuntimeConfig,
                 catalogue: Catalogue, last_seq: int) -> None:
        super().__init__(f"{field_name} {value!r} was not applied: {reason}")
        self.field = field_name
        self.value = value
        self.reason = reason
        self.accepted = accepted
        self.catalogue = catalogue
        self.last_seq = last_seq


@dataclass
class Applied:
    accepted: SessionRuntimeConfig
    catalogue: Catalogue
    calls: list[tuple[str, str, OptionValue]]  # ("set_config_option", id, value) | ("set_mode", "mode", id)
    last_seq: int = 0


async def apply_config(
    target: SessionRuntimeConfig,
    agent: Agent,
    catalogue: Catalogue,
    base: SessionRuntimeConfig | None = None,
) -> Applied:
    """Apply ``target`` in the order model, mode, options by id (RESETCFG-6, RESETCFG-7, RESETCFG-8, RESETCFG-9).

    ``base`` is the state the agent is known to be in; the result is ``base`` plus every field the
    agent accepted. Raises ``ApplyRejected`` at the first field it refuses or that cannot be applied.
    """
    accepted = base or SessionRuntimeConfig()
    calls: list[tuple[str, str, OptionValue]] = []
    last_seq = 0

    def rejected(name: str, value: Any, reason: str) -> ApplyRejected:
        return ApplyRejected(name, value, reason, accepted, catalogue, last_seq)

    def seq_of(result: Mapping[str, Any]) -> int:
        value = result.get("last_seq") if isinstance(result, Mapping) else None
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0

    if target.model is not None:
        option_id = catalogue.model_option_id()
        if option_id is None:  # fail closed: a model we cannot apply is a rejected model
            raise rejected("model", target.model, "the agent offers no model option (config option of category model)")
        calls.append(("set_config_option", option_id, target.model))
        try:
            result = await agent.set_config_option(option_id, target.model)
        except IpcError as exc:
            raise rejected("model", target.model, exc.message) from None
        last_seq = max(last_seq, seq_of(result))
        catalogue = catalogue.with_options(list(result.get("config_options") or []))
        accepted = SessionRuntimeConfig(model=target.model, mode=accepted.mode, options=accepted.options)
        # The model may swap the option catalogue: what the agent now reports is authoritative.
        if result.get("config_options"):
            reported = provider_state(catalogue)
            accepted = SessionRuntimeConfig(model=target.model, mode=accepted.mode, options=reported.options)
    if target.mode is not None:
        calls.append(("set_mode", "mode", target.mode))
        try:
            result = await agent.set_mode(target.mode)
        except IpcError as exc:
            raise rejected("mode", target.mode, exc.message) from None
        last_seq = max(last_seq, seq_of(result))
        catalogue = catalogue.with_mode(target.mode)
        accepted = SessionRuntimeConfig(model=accepted.model, mode=target.mode, options=accepted.options)
    for option_id in sorted(target.options):
        value = target.options[option_id]
        if catalogue.config_options and option_id not in catalogue.option_ids():
            raise rejected(f"option {option_id}", value, "the agent does not offer this option (after the model)")
        calls.append(("set_config_option", option_id, value))
        try:
            result = await agent.set_config_option(option_id, value)
        except IpcError as exc:
            raise rejected(f"option {option_id}", value, exc.message) from None
        last_seq = max(last_seq, seq_of(result))
        catalogue = catalogue.with_options(list(result.get("config_options") or []))
        accepted = SessionRuntimeConfig(
            model=accepted.model, mode=accepted.mode, options={**accepted.options, option_id: value}
        )
    return Applied(accepted=accepted, catalogue=catalogue, calls=calls, last_seq=last_seq)


async def restore(snapshot: SessionRuntimeConfig, agent: Agent, catalogue: Catalogue) -> Applied:
    """The shared restore routine of both reset paths (RESETCFG-6): the whole captured value on the
    new provider session, whose current state is what the agent reported for it."""
    return await apply_config(snapshot, agent, catalogue, provider_state(catalogue))
