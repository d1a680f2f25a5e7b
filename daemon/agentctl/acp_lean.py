"""The ACP SDK imported without the work kandev never uses (imported for effect, before the SDK).

Every control-server start (each reload in place re-executes it, and its preflight imports
the same) imports the SDK, and that import is most of what a start costs: ``acp.schema``
defines some 270 pydantic models, and pydantic finishes each one as its class statement runs.
Two parts of that are work no agent conversation uses:

- the SDK's models ask for attribute docstrings (``use_attribute_docstrings``), so for every
  class pydantic walks the stack, reads ``schema.py``'s source and parses the class's block, only
  to fill field descriptions that appear in a generated JSON schema;
- every model's validator is built up front, though one conversation validates a few dozen.

Imported before the SDK, this module turns both off for the process: no attribute docstrings,
and models finished on first use (pydantic's ``defer_build``: the same validation, built when a
model is first validated or dumped instead of at import). That took a control server's start
from 1.45 s to 0.9 s of CPU on the CI machine.

Neither setting has a public switch for a third party's models, so both are set where
pydantic keeps them; a pydantic without them is left as it is (the import is then just slower).
The control server (``daemon.agentctl.main``) imports this module first (the mock agent does
not use the SDK: ``daemon.agents.mock.acp_wire``); its preload then builds the validators of the
models every conversation uses before it reports ready (``daemon.agentctl.reload.preload.warm_up``). The backend does not import the SDK at
start at all (only a runtime probe does).
"""

from __future__ import annotations

import pydantic._internal._config as _config
import pydantic._internal._fields as _fields


def _no_attribute_docstrings(cls: type, use_inspect: bool = False) -> dict[str, str]:
    return {}


if callable(getattr(_fields, "extract_docstrings_from_cls", None)):
    setattr(_fields, "extract_docstrings_from_cls", _no_attribute_docstrings)  # noqa: B010
if isinstance(getattr(_config, "config_defaults", None), dict) and "defer_build" in _config.config_defaults:
    _config.config_defaults["defer_build"] = True
