"""A small filesystem a test can fill (Issue 21 scenario E, Issue 45 scenario C): a tmpfs or an
ext4 image mounted for the test, and a filler file that takes its free space and gives it back.

``small_filesystem(path, size)`` mounts a tmpfs of ``size`` at ``path`` (root only) and unmounts it
when the block ends (lazily if something still holds it, so a failing test never leaves a mount
behind). ``small_ext4(path, image, size)`` does the same with an ext4 filesystem made in the file
``image`` and loop-mounted: unlike a tmpfs it keeps blocks only root may use (``mkfs.ext4 -m``),
so root-run daemons can still write when unprivileged writers (the agents) get ``ENOSPC``. ``Filler(directory)`` grows one file until the filesystem has no space (``fill``, leaving
``leave`` bytes free) and removes it (``free``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(mode=0o700, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True,
                   capture_output=True, text=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def small_ext4(path: Path, image: Path, size: str, reserved_percent: int = 5) -> Iterator[Path]:
    path.mkdir(mode=0o700, exist_ok=True)
    subprocess.run(["truncate", "-s", size, str(image)], check=True, capture_output=True, text=True)
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", str(reserved_percent), str(image)], check=True,
                       capture_output=True, text=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(path)], check=True, capture_output=True, text=True)
        try:
            path.chmod(0o700)
            yield path
        finally:
            if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(path)], capture_output=True)
    finally:
        image.unlink(missing_ok=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class Filler:
    """One file that takes a filesystem's free space."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "filler"

    def fill(self, leave: int = 0) -> None:
        """Grow the file until nothing is free, then give ``leave`` bytes back."""
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for block in (1 << 20, 1 << 12):
                data = b"\0" * block
                while True:
                    try:
                        os.write(fd, data)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
            if leave:
                os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
        finally:
            os.close(fd)

    def free(self) -> None:
        self.path.unlink(missing_ok=True)
