"""Replay the journal in a process of its own (started detached by ``install()``).

``python -m lifeguard.guardian.replay``: writes every pending status whose store answers, and
exits. Its output goes nowhere: the program that started it must not see it.
"""

from __future__ import annotations

import sys

__all__ = ["main"]

# Seconds for the whole replay: a dead server is given up on for this round.
BUDGET = 30.0


def main() -> int:
    try:
        from lifeguard.backends.mlflow.runs import replay_journal
    except ImportError:
        return 0  # no mlflow here; `lifeguard sweep` elsewhere will do it
    # The program that started this replay may be about to resume one of these very runs (a
    # requeued job's next attempt): its heartbeat rewrites the owner tags within ADOPT_EVERY of
    # the resume, and replay_journal then leaves the run alone. Give it two of those first;
    # nobody waits on this process.
    import time

    from lifeguard.backends.mlflow.heartbeat import ADOPT_EVERY
    from lifeguard.journal import Journal

    time.sleep(2 * ADOPT_EVERY)
    journal = Journal()
    # Reads only the user's own private entries (journal.py): a planted one is refused, never
    # sent anywhere with the user's credentials.
    counts = replay_journal(journal, budget=BUDGET)
    pending = counts.get("journaled") or counts.get("failed")
    return 1 if pending or journal.refused else 0


if __name__ == "__main__":
    sys.exit(main())
