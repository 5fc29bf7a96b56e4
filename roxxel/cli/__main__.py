"""``python -m roxxel.cli``: the ``roxxel`` command."""

import sys

from roxxel.cli import main

sys.exit(main())
