"""The MLflow side of ``lifeguard sweep``: page through RUNNING runs, decide, end the orphans.

Reads are paged with a server-side filter (``attributes.status = 'RUNNING'``), up to 100
experiments and 1000 runs a request. Writes go out with bounded concurrency, and MLflow's HTTP
retries are bounded (3 retries, short backoff) so that a dead server fails the sweep in seconds
rather than minutes. Nothing is lost when the server dies half-way: every decision is derived
from the server's own data and the sweeper's own sightings, so the next sweep reaches the same
decisions and finishes the job.

Every error text that leaves this module is redacted (``lifeguard.redact``): it may quote the
tracking URI, with its password, or a server's answer.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

from mlflow.entities import RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from lifeguard._log import logger
from lifeguard.backends.mlflow.runs import (
    all_experiment_ids,
    environment,
    first_line,
    iter_running,
    set_terminated,
    still_running,
)
from lifeguard.journal import Entry, Journal
from lifeguard.names import TAG_ENDED_BY
from lifeguard.redact import redact, redact_uri
from lifeguard.sweep import (
    DEFAULT_STALE_AFTER,
    END,
    LEGACY_PATIENCE,
    LIVE_BEATS,
    SKIP,
    Decision,
    RunFacts,
    Sightings,
    decide,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

__all__ = ["SweepError", "SweepReport", "sweep"]

STATUS = "KILLED"


class SweepError(RuntimeError):
    """The server could not be read at all: nothing was decided."""


class NoSuchExperiment(SweepError):
    """An ``--experiment`` the server does not have: a usage error (exit 2), which the next sweep
    of a service would repeat."""


class SweepReport:
    def __init__(self) -> None:
        self.decisions: list[Decision] = []
        self.ended: list[str] = []
        self.errors: dict[str, str] = {}
        self.journal: dict[str, int] = {}
        # One line per journal file (or the journal directory) refused as not the user's own.
        self.refused: list[str] = []
        # Entries that can never be written (lifeguard.aside): where they are, how many, the
        # first of them, and the run ids this sweep moved there.
        self.aside_directory = ""
        self.aside_count = 0
        self.aside: list[dict[str, object]] = []
        self.moved_aside: list[str] = []
        self.seconds = 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "decisions": [d.as_dict() for d in self.decisions],
            "ended": self.ended,
            "errors": self.errors,
            "journal": self.journal,
            "refused": self.refused,
            "moved_aside": {
                "directory": self.aside_directory,
                "count": self.aside_count,
                "entries": self.aside,
                "by_this_sweep": self.moved_aside,
            },
            "seconds": round(self.seconds, 3),
        }


def _bounded_retries(timeout: float) -> contextlib.AbstractContextManager[None]:
    return environment(
        # MLflow prints a "View run" link per ended run to stdout: noise here, and it would
        # corrupt --json output.
        MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT="true",
        MLFLOW_HTTP_REQUEST_MAX_RETRIES="3",
        MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="1",
        MLFLOW_HTTP_REQUEST_TIMEOUT=str(max(1, int(timeout))),
    )


def sweep(
    tracking_uri: str,
    *,
    experiments: Sequence[str] = (),
    stale_after: float = DEFAULT_STALE_AFTER,
    include_untagged: bool = False,
    older_than: float | None = None,
    dry_run: bool = False,
    workers: int = 8,
    timeout: float = 30.0,
    journal_dir: str | None = None,
) -> SweepReport:
    started = time.monotonic()
    report = SweepReport()
    journal = Journal(journal_dir)
    shown_uri = redact_uri(tracking_uri)
    sightings = Sightings(journal.directory, tracking_uri).load()
    try:
        client = MlflowClient(tracking_uri=tracking_uri)
    except Exception as exc:  # noqa: BLE001 - a driver missing, a file that is no database
        raise SweepError(redact(f"cannot open {shown_uri}: {first_line(exc)}")) from None
    with _bounded_retries(timeout):
        if not dry_run:
            from lifeguard.aside import Failures
            from lifeguard.backends.mlflow.runs import replay_journal

            # ended_by "replay": the status is the journal's (its true end time), not an
            # orphan's ending guessed by the sweep ("sweep", below).
            failures = Failures(journal)
            report.journal = replay_journal(
                journal, tracking_uri=tracking_uri, budget=timeout, failures=failures
            )
            report.refused = list(journal.refused)
            report.moved_aside = [str(moved["run_id"]) for moved in failures.moved]
        _list_aside(report, journal)
        try:
            experiment_ids = _experiment_ids(client, experiments)
            now = int(time.time() * 1000)
            running = list(_running(client, experiment_ids))
            sightings.finished_reading()
            for facts in running:
                report.decisions.append(
                    decide(
                        facts,
                        now_ms=now,
                        stale_after=stale_after,
                        quiet_for=sightings.quiet_for(facts),
                        include_untagged=include_untagged,
                        older_than=older_than,
                    )
                )
        except MlflowException as exc:
            raise SweepError(redact(f"cannot read runs from {shown_uri}: {exc.message}")) from None
        except OSError as exc:
            raise SweepError(redact(f"cannot reach {shown_uri}: {exc}")) from None
        except SweepError:
            raise
        except Exception as exc:  # noqa: BLE001 - a store MLflow cannot open: one line, no trace
            raise SweepError(
                redact(f"cannot read runs from {shown_uri}: {type(exc).__name__}: {exc}")
            ) from None
        # Recorded before anything is ended, so that a failure below loses no sighting. A dry
        # run writes nothing anywhere: it judges by what earlier sweeps recorded.
        if not dry_run:
            try:
                sightings.save(experiment_ids)
            except OSError as exc:
                raise SweepError(redact(f"cannot record what this sweep saw: {exc}")) from None
        _hold_back_note(report.decisions, stale_after)
        if not dry_run:
            _leave_journaled(report.decisions, journal)
        to_end = [d for d in report.decisions if d.verdict == END]
        if to_end and not dry_run:
            with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
                for decision, (ended, error) in zip(
                    to_end, pool.map(lambda d: _end(client, d), to_end), strict=True
                ):
                    if error is not None:
                        report.errors[decision.run_id] = error
                    elif ended:
                        report.ended.append(decision.run_id)
                    else:
                        decision.verdict = SKIP
                        decision.reason = "ended by another meanwhile; that status stands"
    report.seconds = time.monotonic() - started
    return report


def _list_aside(report: SweepReport, journal: Journal) -> None:
    """The entries that can never be written, moved aside by this sweep or an earlier replay
    (``lifeguard.aside``): the user's to read, and to remove or move back."""
    import os

    from lifeguard.aside import DEAD, moved_aside

    report.aside_directory = os.path.join(journal.directory, DEAD)
    report.aside_count, report.aside = moved_aside(journal)


def _leave_journaled(decisions: list[Decision], journal: Journal) -> None:
    """A run whose true status is still in the journal is not an orphan: the replay above could
    not write it (its store refused it), or another replay holds it while it writes it (a dying
    program's last-gasp replayer). Ending it here would write a guessed end time over the truth
    that lands a moment later."""
    ending = [d for d in decisions if d.verdict == END]
    if not ending:
        return
    journaled = {entry.run_id for entry in journal.entries()}
    for decision in ending:
        if decision.run_id in journaled:
            decision.verdict = SKIP
            decision.reason = "its status is journaled, not written yet; a replay writes it"


def _hold_back_note(decisions: list[Decision], stale_after: float) -> None:
    """One line when --stale-after is shorter than some runs' own patience (several of their
    heartbeat intervals, sweep.LIVE_BEATS): those runs are judged by theirs, not by it."""
    held = [d.patience for d in decisions if d.patience is not None and d.patience > stale_after]
    if held:
        logger().warning(
            "%d run(s) are judged lost only after %.0fs to %.0fs unchanged, not --stale-after "
            "%.0fs: a run is never judged before %.0f of its own heartbeat intervals (or %.0fs "
            "for a run that records none) have passed",
            len(held),
            min(held),
            max(held),
            stale_after,
            LIVE_BEATS,
            LEGACY_PATIENCE,
        )


def _experiment_ids(client: MlflowClient, wanted: Sequence[str]) -> list[str]:
    if not wanted:
        return all_experiment_ids(client)
    ids = []
    for name_or_id in wanted:
        experiment = client.get_experiment_by_name(name_or_id)
        if experiment is None:
            try:
                experiment = client.get_experiment(name_or_id)
            except MlflowException:
                raise NoSuchExperiment(
                    f"--experiment {name_or_id!r}: no experiment of that name or id"
                ) from None
        ids.append(experiment.experiment_id)
    return ids


def _running(client: MlflowClient, experiment_ids: list[str]) -> Iterator[RunFacts]:
    for run in iter_running(client, experiment_ids):
        metrics = getattr(run.data, "_metric_objs", None) or []
        yield RunFacts(
            run.info.run_id,
            run.info.experiment_id,
            run.info.start_time or 0,
            dict(run.data.tags),
            end_time=run.info.end_time,
            params=dict(run.data.params),
            metrics=[(m.key, m.timestamp, m.step, m.value) for m in metrics],
            status=run.info.status,
        )


def _end(client: MlflowClient, decision: Decision) -> tuple[bool, str | None]:
    """End one orphan unless it is no longer RUNNING: (whether this ended it, an error message
    or None). Its owner may have ended it since it was read (it was alive after all): that
    status stands, never overwritten with the sweep's KILLED."""
    from lifeguard.backends.mlflow import sql

    assert decision.end_time is not None  # an END decision always has one
    tags = {
        TAG_ENDED_BY: "sweep",
        "lifeguard.outcome": "lost",
        "lifeguard.reason": f"swept: {decision.reason}",
    }
    entry = Entry(decision.run_id, client.tracking_uri, STATUS, decision.end_time, tags)
    try:
        # SQL stores: the check, the status and the tags in one transaction.
        ended = sql.end(client, entry, seconds=None)
        if ended is not None:
            return ended, None
        # Over REST: a read just before the write, the narrowest window MLflow's API allows.
        if not still_running(client, decision.run_id):
            return False, None
        # The status first: a sweep cut short between the two writes must not leave a RUNNING
        # run that already says "swept".
        set_terminated(client, entry)
    except Exception as exc:  # noqa: BLE001 - reported per run; the next sweep retries it
        return False, redact(first_line(exc))
    try:
        client.log_batch(decision.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    except Exception as exc:  # noqa: BLE001 - the status is in; only the reason is missing
        logger().warning(
            "run %s ended %s, but its reason tags could not be written: %s",
            decision.run_id,
            STATUS,
            redact(first_line(exc)),
        )
    return True, None
