"""Issue 19's hostile workspaces, shared by the two places that prove them: kandev running as root
(tests/integration/test_hostile_workspaces.py) and the installed package under systemd, as the
packaged ``kandev`` user (tests/systemd/test_package.py).

Everything here is a shell script or an argv over path strings, so that it runs as well on the
host as inside a sdbox (``SdBox.run``) or in an agent's ``/sh``: what the test prepares (a
repository, canary files), what the agent plants from inside, the attempts it then makes with
their expected verdicts (``tests/support/sandbox_attacks.py`` runs and reads them), what the test
plants in a repository as its user could have, and a snapshot of a directory tree to prove nothing
outside changed.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

# The identity for commits, and safe.directory: the repository's git directory belongs to the
# agents' uid, not necessarily to whoever runs git on the host.
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "safe.directory=*"]
# The hooks planted in the repository scenario: those a ``git worktree add``, a checkout or a commit would run.
HOOKS = ("post-checkout", "reference-transaction", "post-index-change", "pre-commit")
Attempts = dict[str, list[str]]


def _git(*args: str) -> str:
    return " ".join(shlex.quote(a) for a in [*GIT, *args])


def repository_script(path: str) -> str:
    """``sh -c`` script: a repository at ``path`` (branch main, one commit of ``README`` = hello)."""
    p = shlex.quote(path)
    return (f"mkdir {p} && cd {p} && {_git('init', '-q', '-b', 'main')} && echo hello > README"
            f" && {_git('add', 'README')} && {_git('commit', '-q', '-m', 'init')}")


def canary_script(canary: str) -> str:
    """``sh -c`` script: canary files, with ``one`` and ``two`` what ``git worktree prune`` would take
    for stale worktree entries if it ever pruned through a planted ``worktrees`` symlink."""
    c = shlex.quote(canary)
    return (f"mkdir -p {c}/one {c}/two && echo 'canary one' > {c}/one/keep && echo 'canary two' > {c}/two/keep"
            f" && echo 'canary file' > {c}/file")


def tree_argv(root: str) -> list[str]:
    """A command printing every entry below ``root`` as JSON (relative path -> content, ``<dir>`` for
    a directory, ``-> target`` for a symlink), never following a symlink; read with ``json.loads``."""
    src = (
        "import json, os, sys\n"
        "root, out = sys.argv[1], {}\n"
        "for d, dirs, files in os.walk(root):\n"
        "    for n in dirs + files:\n"
        "        p = os.path.join(d, n)\n"
        "        r = os.path.relpath(p, root)\n"
        "        if os.path.islink(p):\n"
        "            out[r] = '-> ' + os.readlink(p)\n"
        "        elif os.path.isdir(p):\n"
        "            out[r] = '<dir>'\n"
        "        else:\n"
        "            out[r] = open(p, errors='replace').read()\n"
        "print(json.dumps(out, sort_keys=True))\n"
    )
    return ["python3", "-c", src, root]


def parse_tree(stdout: str) -> dict[str, Any]:
    tree: dict[str, Any] = json.loads(stdout)
    return tree


def agent_said(show: dict[str, Any]) -> str:
    """The agent's last message chunk of a ``session show`` (a ``/sh`` answers in one)."""
    return [m["text"] for m in show["transcript"] if m["kind"] == "agent_message_chunk"][-1]


# ---------------------------------------------------------------- a planted gitdir (Issue 19 scenario A)


def plant_gitdir(canary: str, home: str, admin: str) -> str:
    """For the agent's ``/sh`` in its worktree: its ``.git`` file names a fake git
    directory whose ``worktrees`` is a symlink to ``canary``, and its own admin directory
    (``admin``) names, as ``commondir``, another whose ``worktrees`` is the kandev ``home``. Prints
    ``planted``."""
    return " && ".join([
        "git init -q --bare fake", "rm -rf fake/worktrees", f"ln -s {shlex.quote(canary)} fake/worktrees",
        "git init -q --bare fake2", "rm -rf fake2/worktrees", f"ln -s {shlex.quote(home)} fake2/worktrees",
        'printf "gitdir: %s/fake\\n" "$PWD" > .git',
        f'printf "%s/fake2\\n" "$PWD" > {shlex.quote(admin)}/commondir',
        f'printf "%s/fake2/.git\\n" "$PWD" > {shlex.quote(admin)}/gitdir',
        "echo planted"])


# ---------------------------------------------------------------- a planted commondir (Issue 19 scenario B)


def plant_commondir(outside: str, admin: str) -> str:
    """For the agent's ``/sh`` in its worktree: a ``.git`` file naming a fake git
    directory whose ``commondir`` is ``outside``, and its own admin directory's ``commondir`` too.
    Prints ``planted``."""
    o = shlex.quote(outside)
    return " && ".join([
        "mkdir -p fakegit", f"echo {o} > fakegit/commondir", 'printf "gitdir: %s/fakegit\\n" "$PWD" > .git',
        f"echo {o} > {shlex.quote(admin)}/commondir", "echo planted"])


def contained_attempts(home: str, bystander: str, outside: str, admin: str) -> tuple[Attempts, Attempts]:
    """What a new agent of the attacking session tries: (denied, allowed). It cannot
    write ``outside``, list ``<home>/sessions`` (the parents the sandbox makes to reach its own
    session directory are traverse-only, in a read-only root: it cannot chmod them open either,
    though under the units it owns them) nor see another session's directory; it works in its
    workspace, its own HOME and its own admin directory."""
    denied = {
        "write_outside": ["sh", "-c", f"echo pwned > {shlex.quote(outside)}/pwned"],
        "list_sessions": ["ls", f"{home}/sessions"],
        "open_sessions": ["chmod", "0755", f"{home}/sessions"],
        "list_other_session": ["ls", f"{home}/sessions/{bystander}"],
    }
    allowed = {
        "write_workspace": ["sh", "-c", "echo hi > probe.txt && test \"$(cat probe.txt)\" = hi"],
        "own_home": ["sh", "-c", 'ls -a "$HOME" && touch "$HOME/probe"'],
        "own_admin_dir": ["test", "-f", f"{admin}/HEAD"],
    }
    return denied, allowed


# ---------------------------------------------------------------- the repository (Issue 19 scenario C)


def repository_attempts(common: str, ws: str, ran: str, sibling_task: str) -> tuple[Attempts, Attempts]:
    """What the agent of a worktree session of the repository whose git directory is
    ``common`` tries: (denied, allowed). Every way to reach the next git on the host (config,
    ``config.worktree``, hooks, ``info/attributes``, ``commondir``, the main index, a sibling's
    admin directory) fails; commit, branch, rebase and status work. ``<ws>/evil.sh`` (allowed: it is
    the agent's workspace) would leave ``<ran>/evil.sh-ran`` wherever it ran."""
    evil = f"{ws}/evil.sh"
    fsmonitor = f"printf '[core]\\n\\tfsmonitor = {evil}\\n'"
    denied = {
        "config": ["git", "config", "core.fsmonitor", evil],
        "config_append": ["sh", "-c", f"{fsmonitor} >> {common}/config"],
        "config_worktree": ["sh", "-c", f"{fsmonitor} > {common}/config.worktree"],
        "hook": ["sh", "-c", f"cp {evil} {common}/hooks/post-commit"],
        "info_attributes": ["sh", "-c", f"echo '* filter=evil' > {common}/info/attributes"],
        "commondir": ["sh", "-c", f"echo {ws}/fake > {common}/commondir"],
        "main_index": ["sh", "-c", f"echo x > {common}/index"],
        "sibling_admin": ["ls", f"{common}/worktrees/{sibling_task}"],
    }
    allowed = {
        "write_evil": ["sh", "-c", f"printf '#!/bin/sh\\ntouch {ran}/$(basename $0)-ran\\n' > {evil}"
                       f" && chmod +x {evil}"],
        "commit": [*GIT, "commit", "-q", "--allow-empty", "-m", "one"],
        "commit_again": [*GIT, "commit", "-q", "--allow-empty", "-m", "two"],
        "branch": ["git", "branch", "feature"],
        "rebase": [*GIT, "rebase", "-q", "--onto", "HEAD~2", "HEAD~1"],
        "status": ["git", "status", "--porcelain"],
    }
    return denied, allowed


def plant_repository(repo: str, ran: str, fsmonitor: str) -> str:
    """``sh -c`` script: the plants of the repository scenario, as the repository's user could have made them: a
    required smudge filter on every file (``info/attributes``), the ``HOOKS``, and ``core.fsmonitor``
    set to an executable ``fsmonitor`` program. Each leaves ``<ran>/<its name>`` if it runs where
    ``ran`` is reachable (the host); the filter, where it is not (inside a sandbox), leaves
    ``filter-ran-inside-a-sandbox`` in the directory it runs in instead, then passes its input on."""
    common = f"{repo}/.git"
    tattle = f"touch {ran}/$0 2>/dev/null || touch $0-ran-inside-a-sandbox"
    lines = [
        f"cd {shlex.quote(repo)}",
        _git("config", "filter.evil.smudge", f"sh -c '{tattle}; cat' filter"),
        _git("config", "filter.evil.required", "true"),
        _git("config", "core.fsmonitor", fsmonitor),
        f"printf '#!/bin/sh\\ntouch {ran}/fsmonitor\\n' > {fsmonitor}", f"chmod 0755 {fsmonitor}",
        f"mkdir -p {common}/info", f"echo '* filter=evil' > {common}/info/attributes",
    ]
    for hook in HOOKS:
        # (inside a sandbox the directory is absent: the hook then ends well, not to fail the checkout)
        lines += [f"printf '#!/bin/sh\\ntouch {ran}/{hook} 2>/dev/null\\nexit 0\\n' > {common}/hooks/{hook}",
                  f"chmod 0755 {common}/hooks/{hook}"]
    return " && ".join(lines)
