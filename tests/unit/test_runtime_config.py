"""daemon.backend.sessions.runtime_config: capture, normalization and the one restore routine (docs/requirements.md#runtime-configuration-across-a-context-reset).

The fake agent below behaves like the mock in the way that matters: a set answer carries its
option list, and a new session starts from defaults that it announces (the test writes them
into the "store" before restore runs, as the backend's event consumer does).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest

from daemon.backend.sessions import runtime_config as rc
from ipc.errors import ErrorCode, IpcError
from tests.support.aio import run


def _option(option_id: str, category: str | None, value: Any, values: list[str]) -> dict[str, Any]:
    out = {"id": option_id, "name": option_id, "type": "select", "currentValue": value,
           "options": [{"value": v, "name": v} for v in values]}
    if category is not None:
        out["category"] = category
    return out


def _catalogue(model: str = "mock-fast", effort: str = "medium", mode: str = "default",
               with_model: bool = True) -> rc.Catalogue:
    options = [_option("effort", "thought_level", effort, ["low", "medium", "high"])]
    if with_model:
        options.insert(0, _option("model", "model", model, ["mock-fast", "mock-smart"]))
    return rc.Catalogue.from_json({
        "modes": {"currentModeId": mode, "availableModes": [{"id": "default"}, {"id": "plan"}]},
        "config_options": options,
    })


class FakeAgent:
    """Records every call with its exact payload; rejects what it is told to."""

    def __init__(self, *, reject: set[tuple[str, Any]] | None = None,
                 model_catalogue: dict[str, list[dict[str, Any]]] | None = None) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.reject = reject or set()
        self.model_catalogue = model_catalogue or {}
        self.state = {"model": "mock-fast", "effort": "medium", "mode": "default"}
        self.seq = 10

    def _options(self) -> list[dict[str, Any]]:
        if self.state["model"] in self.model_catalogue:
            return copy.deepcopy(self.model_catalogue[self.state["model"]])
        return [_option("model", "model", self.state["model"], ["mock-fast", "mock-smart"]),
                _option("effort", "thought_level", self.state["effort"], ["low", "medium", "high"])]

    async def set_mode(self, mode_id: str) -> Mapping[str, Any]:
        self.calls.append(("set_mode", "mode", mode_id))
        if ("mode", mode_id) in self.reject:
            raise IpcError(ErrorCode.AGENT_ERROR, f"mode {mode_id!r} rejected")
        self.state["mode"] = mode_id
        self.seq += 1
        return {"mode_id": mode_id, "last_seq": self.seq}

    async def set_config_option(self, config_id: str, value: rc.OptionValue) -> Mapping[str, Any]:
        self.calls.append(("set_config_option", config_id, value))
        if (config_id, value) in self.reject:
            raise IpcError(ErrorCode.AGENT_ERROR, f"option {config_id}={value} rejected")
        self.state[config_id] = value
        self.seq += 1
        return {"config_options": self._options(), "last_seq": self.seq}


# ---------------------------------------------------------------- capture


def test_capture_is_one_deep_copied_value() -> None:
    """RESETCFG-1, RESETCFG-3: one value; later changes to the store or the live cache never reach it."""
    persisted = {"model": "mock-smart", "mode": "plan", "options": {"effort": "high", "nested": "x"}}
    live = rc.SessionRuntimeConfig(model="mock-fast", mode="default", options={"effort": "low"})
    snap = rc.capture(None, persisted, live, _catalogue())
    persisted["model"] = "mock-fast"
    persisted["options"]["effort"] = "medium"
    persisted["mode"] = "default"
    assert snap.to_json() == {"model": "mock-smart", "mode": "plan", "options": {"effort": "high", "nested": "x"}}
    with pytest.raises(TypeError):
        snap.options["effort"] = "low"  # type: ignore[index]


def test_capture_precedence_profile_persisted_live() -> None:
    """RESETCFG-2: profile first, persisted provider state over it, the live cache only where
    nothing is persisted yet."""
    profile = rc.SessionRuntimeConfig(model="profile-model", mode="default", options={"a": "1", "b": "1"})
    persisted = {"model": None, "mode": "plan", "options": {"b": "2"}}
    live = rc.SessionRuntimeConfig(model="live-model", mode="default", options={"b": "3", "c": "3"})
    snap = rc.capture(profile, persisted, live, rc.Catalogue())
    assert snap.to_json() == {"model": "profile-model", "mode": "plan", "options": {"a": "1", "b": "2", "c": "3"}}
    snap = rc.capture(None, {"model": None, "mode": None, "options": {}}, live, rc.Catalogue())
    assert snap.to_json() == {"model": "live-model", "mode": "default", "options": {"b": "3", "c": "3"}}


@pytest.mark.parametrize(
    "model, mode, options, expected",
    [
        # nil and empty entries are dropped
        ("mock-smart", "plan", {"effort": None, "other": "", "blank": "  "},
         {"model": "mock-smart", "mode": "plan", "options": {}}),
        # an entry that duplicates the model (by id or by category) leaves the options
        ("mock-smart", None, {"model": "mock-fast", "effort": "high"},
         {"model": "mock-smart", "mode": None, "options": {"effort": "high"}}),
        ("mock-smart", None, {"llm": "mock-fast"}, {"model": "mock-smart", "mode": None, "options": {}}),
        # ... and fills an empty top-level field instead
        (None, None, {"model": "mock-smart", "mode": "plan"}, {"model": "mock-smart", "mode": "plan", "options": {}}),
        (None, None, {"llm": "mock-smart", "style": "plan"},
         {"model": "mock-smart", "mode": "plan", "options": {}}),
        # an entry that duplicates the mode leaves the options
        (None, "plan", {"mode": "default", "effort": "low"}, {"model": None, "mode": "plan", "options": {"effort": "low"}}),
        # empty top-level fields are None
        ("", " ", {}, {"model": None, "mode": None, "options": {}}),
        # booleans are kept, other types dropped
        (None, None, {"flag": False, "n": 3}, {"model": None, "mode": None, "options": {"flag": False}}),
    ],
)
def test_normalize_table(model: Any, mode: Any, options: dict[str, Any], expected: dict[str, Any]) -> None:
    """RESETCFG-4, RESETCFG-T4: model and mode never inside the options; nil/empty entries filtered."""
    catalogue = rc.Catalogue.from_json({"config_options": [
        _option("llm", "model", "x", ["x"]), _option("style", "mode", "x", ["x"]),
        _option("effort", "thought_level", "medium", ["low", "medium", "high"])]})
    assert rc.normalize(model, mode, options, catalogue).to_json() == expected


@pytest.mark.parametrize(
    "options",
    [{"model": "mock-smart", "effort": None}, {"effort": "", "mode": "plan"}, {"model": "mock-smart", "mode": "plan"}],
)
def test_restore_never_applies_a_field_twice_or_an_empty_one(options: dict[str, Any]) -> None:
    """RESETCFG-4, RESETCFG-T4: one apply per field, none for an empty entry."""
    snap = rc.capture(None, {"model": "mock-smart", "mode": "plan", "options": options}, None, _catalogue())
    agent = FakeAgent()
    applied = run(rc.restore(snap, agent, _catalogue()))
    assert agent.calls == [("set_config_option", "model", "mock-smart"), ("set_mode", "mode", "plan")]
    assert applied.accepted.model == "mock-smart" and applied.accepted.mode == "plan"


# ---------------------------------------------------------------- restore


def test_restore_uses_the_capture_not_the_announced_defaults() -> None:
    """RESETCFG-T1 (unit half): the new session's defaults land in the store before restore runs;
    restore applies the captured value with exact payloads, in the order model, mode, options by id."""
    store = {"model": "mock-smart", "mode": "plan", "options": {"effort": "high", "alpha": "x"}}
    snap = rc.capture(None, store, None, _catalogue())
    # the reset: the new session announces its defaults, the consumer persists them at once
    store.update({"model": "mock-fast", "mode": "default", "options": {"effort": "medium"}})
    agent = FakeAgent(model_catalogue={"mock-smart": [
        _option("model", "model", "mock-smart", ["mock-fast", "mock-smart"]),
        _option("alpha", None, "y", ["x", "y"]),
        _option("effort", "thought_level", "medium", ["low", "medium", "high"])]})
    applied = run(rc.restore(snap, agent, _catalogue()))
    assert agent.calls == [
        ("set_config_option", "model", "mock-smart"),
        ("set_mode", "mode", "plan"),
        ("set_config_option", "alpha", "x"),
        ("set_config_option", "effort", "high"),
    ]
    assert applied.accepted.to_json() == {"model": "mock-smart", "mode": "plan",
                                          "options": {"alpha": "x", "effort": "high"}}
    assert applied.last_seq == agent.seq


def test_restore_rejected_mode_stops_and_reports_what_was_accepted() -> None:
    """RESETCFG-9, RESETCFG-11: the first refusal ends restore; the accepted model is reported."""
    snap = rc.SessionRuntimeConfig(model="mock-smart", mode="plan", options={"effort": "high"})
    agent = FakeAgent(reject={("mode", "plan")})
    with pytest.raises(rc.ApplyRejected) as info:
        run(rc.restore(snap, agent, _catalogue()))
    rej = info.value
    assert rej.field == "mode" and rej.value == "plan"
    assert rej.accepted.model == "mock-smart" and rej.accepted.mode == "default"  # truthful: still the default
    assert rej.accepted.options == {"effort": "medium"}
    assert ("set_config_option", "effort", "high") not in agent.calls


def test_restore_rejected_option_and_unoffered_option() -> None:
    """RESETCFG-9 for an option; RESETCFG-7: options after the model follow the catalogue the
    agent returned for it (an option it no longer offers is not applied: fail closed)."""
    snap = rc.SessionRuntimeConfig(model=None, mode=None, options={"effort": "high"})
    with pytest.raises(rc.ApplyRejected) as info:
        run(rc.restore(snap, FakeAgent(reject={("effort", "high")}), _catalogue()))
    assert info.value.field == "option effort"
    snap = rc.SessionRuntimeConfig(model="mock-smart", mode=None, options={"effort": "high"})
    agent = FakeAgent(model_catalogue={"mock-smart": [_option("model", "model", "mock-smart", ["mock-smart"])]})
    with pytest.raises(rc.ApplyRejected) as info:
        run(rc.restore(snap, agent, _catalogue()))
    assert info.value.field == "option effort" and "does not offer" in info.value.reason
    assert agent.calls == [("set_config_option", "model", "mock-smart")]


def test_rejected_or_unroutable_model_fails_closed() -> None:
    """RESETCFG-9: a rejected model fails closed; so does a model the agent offers no option for."""
    snap = rc.SessionRuntimeConfig(model="mock-smart", mode="plan")
    agent = FakeAgent(reject={("model", "mock-smart")})
    with pytest.raises(rc.ApplyRejected) as info:
        run(rc.restore(snap, agent, _catalogue()))
    assert info.value.field == "model" and agent.calls == [("set_config_option", "model", "mock-smart")]
    agent = FakeAgent()
    with pytest.raises(rc.ApplyRejected) as info:
        run(rc.restore(snap, agent, _catalogue(with_model=False)))
    assert info.value.field == "model" and agent.calls == []


def test_provider_report_wins_and_options_only_catalogue_counts() -> None:
    """RESETCFG-12: the reported current values; a catalogue with options and no model is ready."""
    only_options = rc.Catalogue.from_json({"config_options": [_option("effort", "thought_level", "low", ["low"])]})
    assert only_options.known and only_options.model_option_id() is None
    state = rc.provider_state(only_options)
    assert state.to_json() == {"model": None, "mode": None, "options": {"effort": "low"}}
    snap = rc.SessionRuntimeConfig(options={"effort": "low"})
    agent = FakeAgent()
    run(rc.restore(snap, agent, only_options))
    assert agent.calls == [("set_config_option", "effort", "low")]
    reported = rc.provider_state(_catalogue(model="mock-smart", effort="high", mode="plan"))
    assert reported.to_json() == {"model": "mock-smart", "mode": "plan", "options": {"effort": "high"}}
    after = rc.provider_options_state(reported, [_option("model", "model", "mock-fast", ["mock-fast"])])
    assert after.to_json() == {"model": "mock-fast", "mode": "plan", "options": {}}
