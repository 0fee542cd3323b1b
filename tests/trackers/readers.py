"""Read back what each tracker wrote to disk, with the tracker's own formats (test helpers)."""

from __future__ import annotations

import sqlite3
import struct
from pathlib import Path


def _leveldb_log(path: Path, header: int) -> list[bytes]:
    """Records of a LevelDB-style log, the format of wandb's ``.wandb`` files: 32 KiB blocks of
    chunks, each with a 7-byte header (CRC32, little-endian length, type)."""
    block, chunk_header = 32 * 1024, 7
    data = path.read_bytes()
    records, pending, pos = [], b"", header
    while pos + chunk_header <= len(data):
        if block - pos % block < chunk_header:
            pos += block - pos % block  # the tail of a block too short for a header is padding
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + chunk_header : pos + chunk_header + length]
        pos += chunk_header + length
        if kind == 1:  # full
            records.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            records.append(pending + chunk)
        else:
            break
    return records


class WandbRun:
    """An offline wandb run: its exit record (None if it has none) and final summary."""

    def __init__(self, out: Path, run_id: str) -> None:
        import json

        from wandb.proto import wandb_internal_pb2

        (path,) = out.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
        if path.read_bytes()[:4] != b":W&B":
            raise ValueError(f"{path} is not a wandb datastore")
        self.exit_code: int | None = None
        self.summary: dict[str, object] = {}
        self.history_steps = 0
        for raw in _leveldb_log(path, header=7):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "exit":
                self.exit_code = record.exit.exit_code
            elif kind == "history":
                self.history_steps += 1
            elif kind == "summary":
                for item in record.summary.update:
                    key = "/".join([*item.nested_key]) if item.nested_key else item.key
                    self.summary[key] = json.loads(item.value_json)


def tensorboard_events(logdir: Path) -> tuple[list[tuple[str, int, float]], dict[str, str]]:
    """(scalars as (tag, step, value), texts by tag) from every event file under ``logdir``."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    scalars: list[tuple[str, int, float]] = []
    texts: dict[str, str] = {}
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.append((value.tag, event.step, value.simple_value))
                elif value.metadata.plugin_data.plugin_name == "text":
                    texts[value.tag] = value.tensor.string_val[0].decode()
                elif value.HasField("tensor") and value.tensor.float_val:
                    scalars.append((value.tag, event.step, value.tensor.float_val[0]))
    return scalars, texts


class SwanlabRun:
    """An offline SwanLab run: its finish record's state (None if it has none)."""

    def __init__(self, out: Path) -> None:
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record
        from swanlab.proto.swanlab.run.v1.run_pb2 import RunState
        from swanlab.sdk.internal.core_python.store import DataStoreReader

        (path,) = out.glob("swanlog/run-*/run-*.swanlab")
        self.state: str | None = None
        self.error: str | None = None
        self.scalars = 0
        if path.stat().st_size == 0:  # nothing was ever flushed to it
            return
        reader = DataStoreReader()
        reader.open(path)
        try:
            while (raw := reader.scan()) is not None:
                record = Record()
                record.ParseFromString(raw)
                kind = record.WhichOneof("record_type")
                if kind == "finish":
                    self.state = RunState.Name(record.finish.state)
                    self.error = record.finish.error
                elif kind == "scalar":
                    self.scalars += 1
        finally:
            reader.close()


class TrackioRun:
    """A trackio run in its project's sqlite file: metric rows and alerts."""

    def __init__(self, trackio_dir: Path, project: str, run_name: str) -> None:
        with sqlite3.connect(trackio_dir / f"{project}.db") as db:
            self.steps = sorted(
                row[0]
                for row in db.execute("SELECT step FROM metrics WHERE run_name = ?", (run_name,))
            )
            self.alerts = list(
                db.execute("SELECT title, text FROM alerts WHERE run_name = ?", (run_name,))
            )
