"""``python -m lifeguard``: the same commands as the ``lifeguard`` command."""

import sys

from lifeguard.cli import main

sys.exit(main())
