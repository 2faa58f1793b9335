"""Which device and how many CPU threads each rank gets: pure decisions, no CUDA calls.

Why pure: the rules are easy to get wrong on a GPU node (two ranks on one GPU make NCCL fail
with "Duplicate GPU detected"; a CPU-only torch on a GPU node silently trains on the CPU; cores
bound by `srun --cpu-bind` divided a second time) and this machine has no GPU, so they are
decided here from plain inputs and tested with 0, 1 and N devices. hpdl.rank gathers the inputs
(what each rank on the node sees) and applies the answer.

Policy (HPDL_DEVICE): "auto" (default) uses one GPU per rank when every rank on every node can
have its own, else all ranks run on the CPU with Gloo and a note says why; "cuda" refuses to start
instead of falling back; "cpu" runs on the CPU on purpose.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hpdl import settings

POLICIES = settings.DEVICE.choices  # HPDL_DEVICE's values, declared with it


@dataclass(frozen=True)
class Choice:
    """What one rank uses: `index` into its own visible CUDA devices (None: the CPU)."""

    index: int | None
    backend: str  # torch.distributed: "nccl" on GPUs, "gloo" on CPUs
    note: str = ""  # why not the GPU, shown at start (empty when nothing needs saying)
    refuse: str = ""  # with policy "cuda": the reason and the fix; the rank must not start

    @property
    def device(self) -> str:
        return "cpu" if self.index is None else f"cuda:{self.index}"


def assign(node_visible: Sequence[Sequence[str]]) -> list[int | None] | None:
    """One distinct GPU per local rank, as an index into each rank's own visible list.

    `node_visible[r]` are the identities (UUIDs) of the devices local rank r sees, in its own
    CUDA order: all of them when nothing binds GPUs to tasks, one each under
    `srun --gpus-per-task=1`. Returns None when some rank cannot have a GPU nobody else has.
    """
    taken: set[str] = set()
    out: list[int | None] = []
    for r, seen in enumerate(node_visible):
        # start at the rank's own position so an unbound node maps rank r -> GPU r
        order = list(range(len(seen)))
        order = order[r % len(seen):] + order[:r % len(seen)] if seen else []
        pick = next((i for i in order if seen[i] not in taken), None)
        if pick is None:
            return None
        taken.add(seen[pick])
        out.append(pick)
    return out


def own_index(local_rank: int, visible: int) -> int | None:
    """The placement rule for one rank that knows only its local rank and how many GPUs it sees.

    Under per-task binding (`srun --gpus-per-task=1`, CUDA_VISIBLE_DEVICES set per task) a rank
    sees one GPU, its own: cuda:0 whatever its local rank. Where every rank sees all of the node's
    GPUs, local rank r takes cuda:r. None: no GPU of its own (more ranks than GPUs). This is what
    `assign` decides for a whole node in either case (tests/test_gpu_standin.py checks they agree),
    for scripts that run without the kit's ranks (notebooks/scripts/train_ddp.py).
    """
    if visible == 1:
        return 0
    return local_rank if local_rank < visible else None


def choose(local_rank: int, node_visible: Sequence[Sequence[str]], cuda_build: bool = True,
           gpus_on_node: int = 0, policy: str = "auto") -> Choice:
    """This rank's device from what every rank on its node sees (the same answer on each of them).

    node_visible: per local rank, the device identities torch can use there (empty without CUDA).
    cuda_build: torch was built with CUDA. gpus_on_node: GPUs the node has whatever torch sees
    (e.g. from nvidia-smi), to say so when a CPU-only torch would leave them idle.
    """
    if policy not in POLICIES:
        return Choice(None, "gloo", refuse=f"HPDL_DEVICE={policy!r}: use one of {', '.join(POLICIES)}.")
    local_size = len(node_visible)
    if policy == "cpu":
        return Choice(None, "gloo", note="on the CPU (HPDL_DEVICE=cpu)" if gpus_on_node else "")
    if not any(node_visible):
        if gpus_on_node and not cuda_build:
            why = (f"this node has {gpus_on_node} GPU(s) but torch is a CPU build, so the ranks run on the CPU "
                   "with Gloo. Install a CUDA build of torch (cluster/README.md), then check with `hpdl doctor`.")
        elif gpus_on_node:
            why = (f"this node has {gpus_on_node} GPU(s) but torch sees none (CUDA_VISIBLE_DEVICES? a job without "
                   "--gpus?), so the ranks run on the CPU with Gloo.")
        else:
            return Choice(None, "gloo")
        if policy == "cuda":
            return Choice(None, "gloo", refuse=why)
        return Choice(None, "gloo", note=why)
    picks = assign(node_visible)
    if picks is None:
        gpus = len({d for seen in node_visible for d in seen})
        why = (f"{local_size} ranks on a node with {gpus} usable GPU(s): NCCL needs one GPU per rank. "
               f"Start at most {gpus} rank(s) per node (e.g. hpdl.start(n={gpus})), or ask Slurm for one GPU "
               "per rank (--gpus-per-task=1)")
        if policy == "cuda":
            return Choice(None, "gloo", refuse=why + ".")
        return Choice(None, "gloo", note=why + "; meanwhile all ranks run on the CPU with Gloo.")
    return Choice(picks[local_rank], "nccl")


def agree(backends: Sequence[str], mine: Choice) -> Choice:
    """All ranks must use one backend: if any rank falls back to the CPU, every rank does."""
    if len(set(backends)) == 1 or mine.index is None:
        return mine
    return Choice(None, "gloo", note="not every rank can have a GPU of its own (see the other node's note), so "
                  "all ranks run on the CPU with Gloo.")


def node_gpus() -> int:
    """NVIDIA GPUs this node has according to the driver, whatever torch or CUDA_VISIBLE_DEVICES say."""
    import os

    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def usable_cores() -> set[int]:
    """The cores this process may run on (its own share under `srun --cpu-bind`, a Slurm job's cpuset)."""
    import os

    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


def threads_for(my_cores: set[int] | frozenset[int], node_cores: Sequence[set[int] | frozenset[int]]) -> int:
    """Torch threads for a rank: its usable cores, shared only with the ranks whose cores overlap them.

    Without binding every rank's affinity is the whole node, so cores are divided among the ranks;
    under `srun --cpu-bind=cores` each rank's affinity is already its own share: don't divide again.
    """
    sharing = sum(1 for other in node_cores if set(other) & set(my_cores)) or 1
    return max(1, len(my_cores) // sharing)
