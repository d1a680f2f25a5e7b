"""A sealed memory file: bytes handed to another process by descriptor, never through a path.

The control server hands its state to its next image this way (``daemon.agentctl.handover``) and
the agents' system-call filter to bwrap (``daemon.agentctl.sandbox.seccomp_filter``): nothing is
written to disk, and once sealed the content can neither change nor grow.
"""

from __future__ import annotations

import fcntl
import os


def sealed_memfd(name: str, data: bytes) -> int:
    """A new close-on-exec memfd named ``name`` holding ``data``, sealed against any change, its file
    position at 0 (a reader that reads to the end gets all of it). The caller owns the descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
