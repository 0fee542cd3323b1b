"""Which rank this process is, for finalizers registered for rank 0 only.

Detected at finalization time, not at install(): torch.distributed is usually initialised after
lifeguard is installed. torch is never imported here; it is asked only if the program already
imported it and initialised a process group. Otherwise the launchers' environment variables
tell: torchrun (RANK, LOCAL_RANK, WORLD_SIZE), Slurm (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS),
Open MPI (OMPI_COMM_WORLD_*), and MPICH/Intel MPI (PMI_RANK, PMI_SIZE).
"""

from __future__ import annotations

import os
import sys

__all__ = ["ENV_SOURCES", "RankInfo", "detect"]

# (rank, local rank, world size) variables, most specific launcher first.
ENV_SOURCES = (
    ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("pmi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
)


class RankInfo:
    __slots__ = ("rank", "local_rank", "world_size", "source")

    def __init__(self, rank: int, local_rank: int, world_size: int, source: str) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.source = source

    def __repr__(self) -> str:
        return (
            f"RankInfo(rank={self.rank}/{self.world_size}, local={self.local_rank}, {self.source})"
        )


def detect(environ: dict[str, str] | os._Environ[str] | None = None) -> RankInfo:
    env = os.environ if environ is None else environ
    from_torch = _from_torch()
    if from_torch is not None:
        return from_torch
    for source, rank_var, local_var, size_var in ENV_SOURCES:
        rank = _int(env.get(rank_var))
        if rank is None:
            continue
        local = _int(env.get(local_var))
        size = _int(env.get(size_var))
        return RankInfo(rank, rank if local is None else local, size or rank + 1, source)
    return RankInfo(0, 0, 1, "single process")


def _from_torch() -> RankInfo | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        rank, size = int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - a torn-down process group: fall back to the environment
        return None
    local = _int(os.environ.get("LOCAL_RANK"))
    return RankInfo(rank, rank if local is None else local, size, "torch.distributed")


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None
