"""Lesson 05's data-parallel training as one script: take it to your own cluster.

Runs unchanged under the three usual launchers:

    mpiexec -n 2 python train_ddp.py                       # MPI: rank and size from MPI
    srun -n 2 python train_ddp.py                          # Slurm: from SLURM_PROCID, SLURM_NTASKS
    torchrun --nproc-per-node 2 train_ddp.py               # torchrun: RANK, WORLD_SIZE, MASTER_ADDR set

Every rank trains the same small network on its own shard of scikit-learn's bundled handwritten
digits (no download), with DistributedDataParallel: Gloo on CPUs, NCCL with one GPU per rank on
GPU nodes. The learning rate is scaled by the number of ranks after a linear warm-up (Goyal et
al., 2017); metrics are averaged across ranks; rank 0 alone writes the checkpoint, and a resumed
run broadcasts rank 0's copy. `--out DIR` makes every rank write what it ended with (rank, world
size, loss per epoch, test accuracy, a digest of its parameters) to DIR/rank<r>.json.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import socket
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rendezvous() -> tuple[int, int, int, str]:
    """Who am I, how many are we, and where does everyone meet: (rank, world size, local rank, launcher).

    torch.distributed's `env://` rendezvous needs MASTER_ADDR and MASTER_PORT (where rank 0
    listens), RANK and WORLD_SIZE on every process. torchrun sets all four; under mpiexec and
    srun we set them from what those launchers provide.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:           # torchrun
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun"
    if any(name in env for name in MPI_RANK_VARIABLES):                          # mpiexec
        from mpi4py import MPI

        from hpdl.sites import outward_address

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank = local.Get_rank()
        local.Free()
        hosts = comm.allgather(socket.gethostname())
        # rank 0 chooses where to meet and tells everyone: MPI carries the rendezvous
        where = None
        if rank == 0:
            addr = "127.0.0.1" if len(set(hosts)) == 1 else outward_address(hosts[0])  # not Debian's 127.0.1.1
            where = (env.get("MASTER_ADDR", addr), int(env.get("MASTER_PORT", _free_port())))
        addr, port = comm.bcast(where, root=0)
        env["MASTER_ADDR"], env["MASTER_PORT"] = addr, str(port)
        return rank, size, local_rank, "mpiexec"
    if "SLURM_PROCID" in env:                                                    # srun
        if "MASTER_ADDR" not in env:   # the job's first node; every task computes the same answer
            nodes = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
                                   capture_output=True, text=True, check=True).stdout.split()
            env["MASTER_ADDR"] = nodes[0]
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "srun"
    env.setdefault("MASTER_ADDR", "127.0.0.1")                                   # plain python: one rank
    env.setdefault("MASTER_PORT", str(_free_port()))
    return 0, 1, 0, "none"


def pick_device(local_rank: int) -> torch.device:
    """This rank's own GPU on GPU nodes (refusing to put two ranks on one GPU), else the CPU.

    One rule, the kit's (hpdl.devices.own_index): a rank that sees one GPU — Slurm's per-task
    binding, `srun --gpus-per-task=1` — uses it, cuda:0; where every rank sees all of the node's
    GPUs, local rank r uses cuda:r.
    """
    from hpdl.devices import own_index

    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = own_index(local_rank, torch.cuda.device_count())
    if index is None:
        raise SystemExit(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} visible): "
                         "start at most one rank per GPU on each node, or bind one to each (--gpus-per-task=1)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def digits(device: torch.device) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 1797 bundled 8×8 digits, 80% to train and 20% to test (the same split everywhere)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test].to(device), y[test].to(device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.02, help="for one rank; scaled by the number of ranks")
    ap.add_argument("--warmup-epochs", type=float, default=1.0)
    ap.add_argument("--checkpoint", type=Path, help="written by rank 0 after every epoch; resumed from if present")
    ap.add_argument("--out", type=Path, help="every rank writes its results to OUT/rank<r>.json")
    args = ap.parse_args()

    rank, world_size, local_rank, launcher = rendezvous()
    device = pick_device(local_rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://",
                            rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120),
                            device_id=device if device.type == "cuda" else None)  # NCCL binds its GPU now
    if rank == 0:
        print(f"{world_size} ranks via {launcher}; rendezvous at {os.environ['MASTER_ADDR']}:"
              f"{os.environ['MASTER_PORT']}; backend {dist.get_backend()}", flush=True)

    train, test = digits(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    first_epoch = 0
    if args.checkpoint and args.checkpoint.exists():       # rank 0 reads it; a broadcast hands it to all
        box = [torch.load(args.checkpoint, map_location="cpu") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        model.load_state_dict(box[0]["model"])
        opt.load_state_dict(box[0]["optimizer"])             # momentum too, or the resumed run drifts
        first_epoch = box[0]["epoch"] + 1
    model = DDP(model)                                       # also broadcasts rank 0's parameters

    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    peak_lr = args.lr * world_size                           # linear scaling rule
    warmup_steps = max(1, int(args.warmup_epochs * len(loader)))
    losses = []
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)                             # a new shuffle each epoch, the same on every rank
        total = torch.zeros(2, device=device)                # sum of losses, number of batches
        for i, (x, y) in enumerate(loader):
            step = epoch * len(loader) + i
            for group in opt.param_groups:                   # warm up from the one-rank rate to the scaled one
                group["lr"] = args.lr + (peak_lr - args.lr) * min(1.0, step / warmup_steps)
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()                                  # DDP averages the gradients here
            opt.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)                               # the epoch's loss over all ranks' batches
        losses.append((total[0] / total[1]).item())
        with torch.no_grad():
            x, y = test.tensors
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch}: loss {losses[-1]:.4f}, test accuracy {accuracy:.3f}, lr {group['lr']:.3f}",
                  flush=True)
            if args.checkpoint:                              # one writer: rank 0
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                           args.checkpoint)
        dist.barrier()                                       # nobody reads a half-written checkpoint

    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"rank": rank, "world_size": world_size, "launcher": launcher, "device": str(device), "losses": losses,
                  "first_epoch": first_epoch, "accuracy": accuracy if losses else None, "digest": digest}
        (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    # DDP holds the process group: let go of it first, so that destroying the group joins Gloo's
    # worker threads now. Left to interpreter shutdown, a worker may drop its last tensor after
    # Python has stopped and the rank aborts ("terminate called without an active exception").
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
