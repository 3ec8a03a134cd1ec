"""Which backend and device a rank of a distributed run uses: a pure function of the
``dist.backend`` setting, the ranks per machine and the GPUs per machine.

``auto``: with at least as many GPUs as ranks on the machine, each rank has its own GPU
(``cuda:LOCAL_RANK``) and NCCL; with fewer (but some), the ranks share the GPUs
(``cuda:LOCAL_RANK % gpus``) and talk over gloo, whose collectives take CUDA tensors (staged
through the host): NCCL refuses two ranks on one GPU ("Duplicate GPU detected"). Without a
GPU, the CPU and gloo. ``gloo``: the CPU always (as one process with ``dist.backend=gloo``).
``nccl``: one GPU per rank, or an error naming why not.

Worked example: 2 ranks per machine, 1 GPU, ``auto`` -> gloo, both ranks on ``cuda:0``,
``shared`` (rank 0 says so once at start); 8 ranks, 8 GPUs -> NCCL, rank ``r`` on ``cuda:r``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrec.errors import ConfigError

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class DeviceChoice:
    backend: str
    """The process group's backend: ``nccl`` or ``gloo``."""
    gpus: int
    """GPUs the ranks of a machine use (0: the CPU)."""
    shared: bool = False
    """More ranks than GPUs on a machine: ranks share GPUs over gloo."""

    def device(self, local_rank: int) -> str:
        """This rank's device string: ``cuda:K`` or ``cpu``."""
        return f"cuda:{local_rank % self.gpus}" if self.gpus else "cpu"

    def note(self, ranks_per_machine: int) -> str | None:
        """The one line rank 0 prints at start when the ranks share GPUs (None otherwise)."""
        if not self.shared:
            return None
        return (f"{ranks_per_machine} ranks per machine share {self.gpus} GPU(s) over gloo (its collectives "
                "stage CUDA tensors through the host); NCCL needs one GPU per rank")


def choose_backend(setting: str, ranks_per_machine: int, gpu_count: int) -> DeviceChoice:
    """The backend and GPUs of the ranks of one machine (see the module docstring).
    ``nccl`` without a GPU per rank is a ConfigError."""
    if setting not in BACKENDS:
        raise ConfigError(f"dist.backend {setting!r}: auto, gloo or nccl")
    if ranks_per_machine < 1 or gpu_count < 0:
        raise ValueError(f"ranks_per_machine={ranks_per_machine}, gpu_count={gpu_count}")
    if setting == "gloo" or (setting == "auto" and gpu_count == 0):
        return DeviceChoice("gloo", 0)
    if gpu_count >= ranks_per_machine:
        return DeviceChoice("nccl", ranks_per_machine)
    if setting == "nccl":
        why = "CUDA is not available here" if gpu_count == 0 else \
            f"{ranks_per_machine} ranks per machine and {gpu_count} GPU(s): NCCL needs one GPU per rank"
        raise ConfigError(f"dist.backend=nccl: {why}; use dist.backend=auto (ranks share GPUs over gloo) or gloo")
    return DeviceChoice("gloo", gpu_count, shared=True)
