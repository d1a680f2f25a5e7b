"""``python -m daemon.cli``: the ``kandev`` command (``daemon.cli.main``)."""

import sys

from daemon.cli import main

sys.exit(main())
