"""The files the package ships besides the code, checked on the host (no box, no build): the
default configuration, bash completion, sysusers.d/tmpfiles.d and the polkit rule's logic."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from daemon.cli import parser as cli_parser
from daemon.config.keys import SECTIONS
from daemon.config.settings import Config, load_config

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "packaging"
CONF = PKG / "etc/kandev.toml"
COMPLETION = PKG / "bash-completion/kandev"


def test_default_config_lists_every_key_commented_with_its_default(tmp_path: Path) -> None:
    """Every key the daemons read is in the file, commented out; uncommenting all of them gives
    exactly the built-in defaults (so the file documents them truthfully), survival off."""
    text = CONF.read_text()
    def sections(cfg: Config) -> dict[str, object]:
        return {section: getattr(cfg, section) for section in SECTIONS}

    assert sections(load_config(str(CONF), {})) == sections(Config())  # as shipped: nothing set
    for section, keys in SECTIONS.items():
        hint = "packaging/etc/kandev.toml (the packaged conffile) must list every key, commented out"
        assert f"[{section}]" in text, f"section [{section}] missing: {hint}"
        for key in keys:
            assert re.search(rf"^#{key} = ", text, re.M), f"{section}.{key} missing: {hint}, with default and range"
    unset = re.sub(r'^#\w+ = ""$', "", text, flags=re.M)  # `#key = ""` documents a key unset by default
    uncommented = re.sub(r"^#(\w+ = )", r"\1", unset, flags=re.M)
    (tmp_path / "k.toml").write_text(uncommented)
    cfg = load_config(str(tmp_path / "k.toml"), {})
    assert sections(cfg) == sections(Config())
    assert cfg.features.agent_survival is False


def _complete(*words: str) -> list[str]:
    script = f"source {COMPLETION}\nCOMP_WORDS=(kandev {' '.join(words)})\nCOMP_CWORD={len(words)}\n_kandev\n" \
             'printf "%s\\n" "${COMPREPLY[@]}"'
    p = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], capture_output=True, text=True, timeout=10,
                       check=True)
    return p.stdout.split()


def _subcommands(parser) -> dict[str, object]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_completion_knows_every_command_and_option() -> None:
    parser = cli_parser.build_parser(complete=True)
    commands = _subcommands(parser)
    assert set(_complete("")) >= set(commands) | {"--home", "--json"}
    assert _complete("ta") == ["task"]
    assert _complete("--json", "doc") == ["doctor"]
    for name, sub in commands.items():
        options = {o for a in sub._actions for o in a.option_strings if o.startswith("--")}
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            for leaf_name, leaf in nested[0].choices.items():
                assert leaf_name in _complete(name, ""), (name, leaf_name)
                leaf_opts = {o for a in leaf._actions for o in a.option_strings if o.startswith("--")}
                assert set(_complete(name, leaf_name, "--")) >= leaf_opts, (name, leaf_name)
        else:
            assert set(_complete(name, "--")) >= options, name
    assert _complete("task", "create", "--executor", "") == ["local", "worktree"]


def test_sysusers_and_tmpfiles_match_the_units() -> None:
    sysusers = (PKG / "sysusers.d/kandev.conf").read_text()
    assert re.search(r'^u kandev - "[^"]+" /var/lib/kandev$', sysusers, re.M)
    tmpfiles = (PKG / "tmpfiles.d/kandev.conf").read_text()
    assert re.search(r"^d /var/lib/kandev 0750 kandev kandev -$", tmpfiles, re.M)
    for unit in ("kandev-backend.service", "kandev-agentctl.service"):
        text = (REPO / "units" / unit).read_text()
        assert "User=kandev\n" in text and "Group=kandev\n" in text and "StateDirectoryMode=0750\n" in text
    # the Debian package installs these very files (debian/ links to packaging/)
    assert (REPO / "debian/kandev.sysusers").resolve() == (PKG / "sysusers.d/kandev.conf").resolve()
    assert (REPO / "debian/kandev.tmpfiles").resolve() == (PKG / "tmpfiles.d/kandev.conf").resolve()


POLKIT_HARNESS = r"""
const fs = require("fs");
let rule = null;
const polkit = {Result: {YES: "yes", NO: "no", NOT_HANDLED: null}, addRule: (f) => { rule = f; }};
eval(fs.readFileSync(process.argv[2], "utf8"));
const cases = JSON.parse(process.argv[3]);
const out = cases.map(([user, id, unit, verb]) => {
  const action = {id, lookup: (k) => ({unit, verb})[k]};
  return rule(action, {user});
});
console.log(JSON.stringify(out));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed (the sdbox test checks the real polkitd)")
def test_polkit_rule_grants_only_agentctl_start_stop_restart_to_kandev(tmp_path: Path) -> None:
    m = "org.freedesktop.systemd1.manage-units"
    cases = [
        ["kandev", m, "kandev-agentctl.service", "start"],
        ["kandev", m, "kandev-agentctl.service", "stop"],
        ["kandev", m, "kandev-agentctl.service", "restart"],
        ["kandev", m, "kandev-agentctl.service", "reload"],
        ["kandev", m, "kandev-agentctl.service", "kill"],
        ["kandev", m, "kandev-backend.service", "restart"],
        ["kandev", m, "ssh.service", "start"],
        ["kandev", "org.freedesktop.systemd1.manage-unit-files", "kandev-agentctl.service", None],
        ["alice", m, "kandev-agentctl.service", "start"],
        ["kandev", "org.kandev.agentctl-control-probe", None, None],
        ["alice", "org.kandev.agentctl-control-probe", None, None],
    ]
    (tmp_path / "h.js").write_text(POLKIT_HARNESS)
    p = subprocess.run(["node", str(tmp_path / "h.js"), str(PKG / "polkit/50-kandev.rules"), json.dumps(cases)],
                       capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(p.stdout) == ["yes", "yes", "yes", None, None, None, None, None, None, "yes", None]
    policy = (PKG / "polkit/org.kandev.policy").read_text()
    assert 'id="org.kandev.agentctl-control-probe"' in policy and policy.count("<allow_any>no</allow_any>") == 1
