"""Put on PYTHONPATH by ``lifeguard run`` / ``python -m lifeguard``: installs lifeguard at
interpreter start in the supervised program, which needs no edit for it.

It steps aside for any other ``sitecustomize`` (the environment's own is imported too), and does
nothing unless ``LIFEGUARD_AUTOINSTALL=1``, so a stray PYTHONPATH entry is harmless.
"""

import os
import sys


def _chain_and_install() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    this = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401 - the next one
    except ImportError:
        if this is not None:
            sys.modules["sitecustomize"] = this
    if os.environ.get("LIFEGUARD_AUTOINSTALL") != "1":
        return
    try:
        from lifeguard import api

        api.install_at_start()
    except Exception as exc:  # noqa: BLE001 - never keep the program from starting
        sys.stderr.write(f"lifeguard: automatic install failed: {exc}\n")


_chain_and_install()
