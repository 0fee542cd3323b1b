"""``python -m lifeguard``: the same commands as ``lifeguard``, or a program run under
supervision exactly as python would run it: ``python -m lifeguard script.py ARGS``,
``python -m lifeguard -m MODULE ARGS`` and ``python -m lifeguard -c CODE ARGS``."""

import sys

from lifeguard.cli import main

sys.exit(main())
