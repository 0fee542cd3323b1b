"""``python -m lifeguard``: the same commands as ``lifeguard``, or ``python -m lifeguard
script.py ARGS`` to run a script under supervision, exactly as ``python script.py ARGS``."""

import sys

from lifeguard.cli import main

sys.exit(main())
