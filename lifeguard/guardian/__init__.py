"""Out-of-process guardians: the watchdog sidecar, the ``lifeguard run`` supervisor, and the
journal they (and the in-process layer) fall back on when a status cannot be written now."""
