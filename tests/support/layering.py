"""The product's layers (Issue 43): the one table the structure tests read, and the check of an import
graph against it (tests/unit/test_module_structure.py, tests/unit/test_architecture_tree.py).

docs/architecture.md's tree lists the same layers bottom up, with what each package owns.
"""

from __future__ import annotations

# Generated alembic revisions are data, not modules anybody imports.
EXCLUDED = ("daemon/store/migrations/",)

# The one table of the product's layers, lowest first: a module may import its own entry's modules
# and those of entries with a lower number, never a higher or equal one of another entry. An entry is
# a package (its sub-packages included unless they have an entry of their own) or a module directly
# in ``daemon/``, ``daemon/agentctl/`` or ``daemon/backend/`` (the composition roots and entry points
# at the top of those packages sit above the sub-packages they wire together; shared low pieces such
# as the control server's protocol sit below them). docs/architecture.md explains each entry.
LAYERS: dict[str, int] = {
    # the package roots: their __init__ holds a docstring and nothing any module imports
    "daemon": 0, "daemon.agentctl": 0, "daemon.backend": 0,
    "ipc": 1,                                   # framing, codecs, the server and clients
    "daemon.core": 2,                           # version, journal, daemon skeleton, limits, faults
    "daemon.api": 3,                            # the backend's CLI protocol (op table, version)
    "daemon.host": 3,                           # the home, paths, the agent user, process identity
    "daemon.store": 4,                          # the database: models, states, transitions, board
    "daemon.git_credential_helper": 4,          # entry point run inside a sandbox (git's helper)
    "daemon.git_transport": 5,                  # entry point run inside a sandbox (git's ext:: pipe)
    "daemon.agents": 5,                         # the registry of agents and their [agents.NAME] tables
    "daemon.config": 6,                         # settings, keys, the platform check
    "daemon.credentials": 7,                    # the git credential broker
    "daemon.runtimes": 7,                       # the managed npm runtimes
    "daemon.agents.mock": 8,                    # the mock agent (a program of its own)
    # the control server, bottom to top
    "daemon.agentctl.protocol": 10, "daemon.agentctl.auth": 10,
    "daemon.agentctl.sandbox": 11,
    "daemon.agentctl.handover": 12, "daemon.agentctl.launch": 12, "daemon.agentctl.acp_lean": 12,
    "daemon.agentctl.egress": 12,
    "daemon.agentctl.instance": 13,
    "daemon.agentctl.ownership": 14, "daemon.agentctl.client": 14,
    "daemon.agentctl.server_context": 15,
    "daemon.agentctl.sandbox_host": 16, "daemon.agentctl.connection_auth": 16,
    "daemon.agentctl.instances": 17,
    "daemon.agentctl.reload": 18,
    "daemon.agentctl.api": 19,
    "daemon.agentctl.server": 20,
    "daemon.agentctl.main": 21,
    # the backend, bottom to top
    "daemon.backend.cluster": 29,               # several hosts on one PostgreSQL: identity, membership
    "daemon.backend.state": 30, "daemon.backend.git": 30,
    "daemon.backend.recovery": 31,
    "daemon.backend.control": 32, "daemon.backend.views": 32,
    "daemon.backend.lifetime": 33,
    "daemon.backend.tasks": 34,
    "daemon.backend.sessions": 35,
    "daemon.backend.handlers": 36,
    "daemon.backend.app": 37,
    "daemon.backend.main": 38,
    # the command line, over everything
    "daemon.cli.human": 40,
    "daemon.cli": 41,
}
# Where a layer entry may name a single module rather than a package.
TOPS = ("daemon", "daemon.agentctl", "daemon.backend")


def layer_of(module: str, layers: dict[str, int] = LAYERS) -> str | None:
    """The entry of ``layers`` ``module`` belongs to: the longest that names it or a package holding it."""
    name = module
    while name:
        if name in layers:
            return name
        name = name.rpartition(".")[0]
    return None


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int] = LAYERS) -> list[str]:
    """Every import of a module of another entry whose layer is not lower than the importer's."""
    out = []
    for module, deps in sorted(graph.items()):
        own = layer_of(module, layers)
        for dep in sorted(deps):
            other = layer_of(dep, layers)
            if own is None or other is None or other == own:
                continue
            if layers[other] >= layers[own]:
                out.append(f"{module} ({own}, layer {layers[own]}) imports {dep} ({other}, layer {layers[other]})")
    return out


MAX_MODULES_PER_FOLDER = 15
# The modules ``daemon/`` itself may hold: its entry points (each is a command, run with ``-m`` or as
# a console script; their module names are written into agents' git configuration, so they stay).
DAEMON_ENTRY_POINTS = {"__init__.py", "git_credential_helper.py", "git_transport.py"}


