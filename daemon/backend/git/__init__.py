"""A task's git: the per-session git and credential endpoints an agent reaches, git's wire protocol,
the upstream, the recorded workspace paths and worktrees.
"""
