"""How an agent's end is told: the ``agent_exited`` event's data, the words for its turn, and the
journal entry.

An agent that exited by itself is ``agent_exited`` with its exit code. One killed by a signal
nobody in kandev sent (the kernel's OOM killer, a stray ``kill``) carries the ``signal``, and the
journal says ``agent_killed`` (``REASON=signal``). One its memory bound ended (its memory cgroup
ran out: ``daemon.agentctl.instance.memory``) also carries ``reason: "memory"`` and its
``max_memory`` in bytes, and the journal's ``agent_killed`` says ``REASON=memory``, the bound and
the cgroup.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from daemon.agentctl.instance.memory import AgentMemory
from daemon.agentctl.instance.process import InstanceSpec
from daemon.core.journal import log_event


@dataclass(frozen=True)
class AgentEnd:
    """One agent's end: its exit code, the signal it died of (None: it exited), and the memory
    cgroup whose bound killed it (None: the bound did not)."""

    code: int | None
    sig: signal.Signals | None
    memory: AgentMemory | None

    @classmethod
    def read(cls, code: int | None, sig: signal.Signals | None, memory: AgentMemory | None) -> AgentEnd:
        """The end of an agent that exited with ``code`` (``sig``: the signal it says), asking its
        memory cgroup whether the bound did it."""
        return cls(code, sig, memory if memory is not None and memory.killed_by_bound() else None)

    def event_data(self, stderr_tail: str) -> dict[str, Any]:
        """``agent_exited``'s data."""
        data: dict[str, Any] = {"exit_code": self.code, "stderr_tail": stderr_tail}
        if self.sig is not None:
            data["signal"] = self.sig.name
        if self.memory is not None:
            data.update(reason="memory", max_memory=self.memory.limit)
        return data

    def how(self) -> str:
        """The agent's end in words, after "the agent" (a turn's error)."""
        said = f"was killed by {self.sig.name}" if self.sig is not None else f"exited with code {self.code}"
        if self.memory is not None:
            said += f" (its memory bound, max_memory {self.memory.limit} bytes)"
        return said

    def log(self, spec: InstanceSpec, pid: int | None) -> None:
        """The journal entry: ``agent_killed`` (reason memory or signal) or ``agent_exited``."""
        iid = spec.instance_id
        fields: dict[str, Any] = {"INSTANCE_ID": iid, "SESSION_ID": spec.session_id, "TASK_ID": spec.task_id,
                                  "PID": pid, "EXIT_CODE": self.code}
        sig = self.sig.name if self.sig is not None else None
        if self.memory is not None:
            log_event("agent_killed", f"agent of instance {iid} was killed by its memory bound: it used more than"
                      f" max_memory {self.memory.limit} bytes (cgroup {self.memory.path}); nothing else was touched",
                      priority=4, SIGNAL=sig, REASON="memory", MAX_MEMORY=self.memory.limit, CGROUP=self.memory.path,
                      **fields)
        elif sig is not None:
            log_event("agent_killed", f"agent of instance {iid} was killed by {sig}, a signal kandev did not send (the"
                      " kernel's OOM killer, or someone's kill)", priority=4, SIGNAL=sig, REASON="signal", **fields)
        else:
            log_event("agent_exited", f"agent of instance {iid} exited with code {self.code}", priority=5, **fields)
