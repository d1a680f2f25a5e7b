"""Managed npm runtimes (RESUME-11, RESUME-12, RESUME-13, NPM-CTX-1, NPM-CTX-2, NPM-CTX-3, NPM-CTX-4, NPM-CTX-5, NPM-CTX-6).

- ``npx_cache``: the ``_npx`` key of an exact spec and the one repair kandev
  ever makes to the npm cache (remove ``<cache>/_npx/<key>`` of a built-in spec).
- ``proc``: bounded subprocess runs (direct argv, own process group, time limit)
  and the sanitizer for error text.
- ``probe``: the ACP ``initialize`` probe of a candidate runtime.
- ``update``: the update job's state machine and the job manager the backend
  serves through ``daemon.backend.handlers.runtimes``.
- ``cli``: ``kandev runtime update AGENT`` (start or join the job, show its
  progress on stderr, return the final result).
"""
