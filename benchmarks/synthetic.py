"""Synthetic data-parallel benchmark: images/s per rank and scaling efficiency, DDP or Horovod.

In the spirit of Horovod's pytorch_synthetic_benchmark.py: random images, a real model, timed
training steps, no input pipeline — what is measured is compute plus gradient communication.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/synthetic.py --framework ddp
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/synthetic.py --framework horovod --fp16-allreduce
    .venv/bin/horovodrun --gloo -np 2 .venv/bin/python benchmarks/synthetic.py --framework horovod
    srun --mpi=pmi2 python benchmarks/synthetic.py --framework horovod --model resnet50   # see synthetic.sbatch
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/synthetic.py --scaling    # + one rank alone, efficiency

Printed: per iteration the images/s of one rank, then the mean ± 1.96 σ per rank and in total.
With --scaling, rank 0 first trains alone (plain PyTorch, no communication, the others waiting
idle): scaling efficiency = (images/s per rank with all ranks) / (images/s of one rank alone).
From a notebook, `run(...)` works on ranks that are already set up (hpdl.start).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

MODELS = {
    # name: (input shape without batch, classes); --image-size changes a ResNet's height and width
    "digits_cnn": ((1, 8, 8), 10),
    "resnet_tiny": ((3, 64, 64), 1000),
    "resnet50": ((3, 224, 224), 1000),
}


def input_shape(model_name: str, image_size: int | None = None) -> tuple[tuple[int, ...], int]:
    shape, classes = MODELS[model_name]
    if image_size and model_name.startswith("resnet"):
        shape = (shape[0], image_size, image_size)
    return shape, classes


def make_model(name: str, device) -> torch.nn.Module:
    import hpdl.models as models

    torch.manual_seed(0)
    if name == "digits_cnn":
        model = models.DigitsCNN()
    elif name == "resnet_tiny":
        model = models.resnet_tiny()
    elif name == "resnet50":
        model = models.resnet50()
    else:
        raise SystemExit(f"--model: choose one of {', '.join(MODELS)}")
    return model.to(device)


def _rank_size(framework: str) -> tuple[int, int]:
    if framework == "horovod":
        import horovod.torch as hvd

        return hvd.rank(), hvd.size()
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _mean_over_ranks(framework: str, value: float, device) -> float:
    """The mean of `value` over all ranks, the same on every rank.

    DDP: the tensor lives on the group's device — an NCCL group reduces GPU tensors only, so a
    CPU tensor there fails ("No backend type associated with device type cpu"). Horovod moves
    CPU tensors itself.
    """
    if framework == "horovod":
        import horovod.torch as hvd

        return hvd.allreduce(torch.tensor([value], dtype=torch.float64), name="synthetic.mean").item()
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _idle_barrier(framework: str, tag: str) -> None:
    """Wait for the other ranks without spinning a core (they may be timing something)."""
    if framework == "horovod":
        import horovod.torch as hvd

        handle = hvd.allreduce_async(torch.zeros(1), name=f"synthetic.idle.{tag}")
        while not hvd.poll(handle):
            time.sleep(0.005)
        hvd.synchronize(handle)
    else:
        import torch.distributed as dist

        dist.barrier()  # Gloo and NCCL wait in the kernel here, not in a busy loop


def wrap(model, framework: str, device, fp16_allreduce: bool = False):
    """The model and optimizer, data parallel with DDP or Horovod ('none': one rank alone)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if framework == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if fp16_allreduce:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif framework == "horovod":
        import horovod.torch as hvd

        compression = hvd.Compression.fp16 if fp16_allreduce else hvd.Compression.none
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    return model, opt


def images_per_second(model, opt, data, target, batches_per_iter: int, iters: int, warmup: int,
                      device, log=None) -> list[float]:
    """Images/s of this rank, one value per iteration of `batches_per_iter` steps."""

    def step():
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    rates = []
    for i in range(iters):
        t0 = time.perf_counter()
        for _ in range(batches_per_iter):
            step()
        sync()
        rates.append(len(data) * batches_per_iter / (time.perf_counter() - t0))
        if log:
            log(f"Iter #{i}: {rates[-1]:.1f} img/sec per rank")
    return rates


def run(framework: str = "ddp", model_name: str = "digits_cnn", batch_size: int = 32, warmup: int = 2,
        batches_per_iter: int = 5, iters: int = 5, fp16_allreduce: bool = False, scaling: bool = False,
        device=None, verbose: bool = True, image_size: int | None = None) -> dict:
    """Benchmark on ranks that already have `framework` set up; the same dict on every rank.

    {"per_rank": mean images/s of one rank, "total": all ranks, "ci": 1.96 σ, "ranks": n,
     "alone": images/s of rank 0 alone (with scaling=True), "efficiency": per_rank / alone}
    """
    if framework not in ("ddp", "horovod"):
        raise SystemExit("--framework: ddp or horovod")
    if model_name not in MODELS:
        raise SystemExit(f"--model: choose one of {', '.join(MODELS)}")
    device = device or torch.device("cpu")
    rank, size = _rank_size(framework)
    log = print if (verbose and rank == 0) else None
    shape, classes = input_shape(model_name, image_size)
    g = torch.Generator().manual_seed(rank)
    data = torch.randn(batch_size, *shape, generator=g).to(device)
    target = torch.randint(0, classes, (batch_size,), generator=g).to(device)
    out = {"framework": framework, "model": model_name, "batch_size": batch_size, "ranks": size}

    if scaling:
        alone = None
        if rank == 0:
            log and log("One rank alone (plain PyTorch, no communication)...")
            model, opt = wrap(make_model(model_name, device), "none", device)
            alone = statistics.mean(images_per_second(model, opt, data, target, batches_per_iter, iters,
                                                      warmup, device, log))
        _idle_barrier(framework, "alone")
        out["alone"] = _mean_over_ranks(framework, alone if rank == 0 else 0.0, device) * size

    if log:
        log(f"Model: {model_name} on {'x'.join(map(str, shape))}\nBatch size: {batch_size}\nNumber of ranks: {size}\n"
            f"Framework: {framework}{' (fp16 all-reduce)' if fp16_allreduce else ''}\nRunning benchmark...")
    model, opt = wrap(make_model(model_name, device), framework, device, fp16_allreduce)
    rates = images_per_second(model, opt, data, target, batches_per_iter, iters, warmup, device, log)
    mean = statistics.mean(rates)
    ci = 1.96 * (statistics.stdev(rates) if len(rates) > 1 else 0.0)
    out["per_rank"] = _mean_over_ranks(framework, mean, device)
    out["ci"] = _mean_over_ranks(framework, ci, device)
    out["total"] = out["per_rank"] * size
    if scaling:
        out["efficiency"] = out["per_rank"] / out["alone"]
    if log:
        log(f"Img/sec per rank: {out['per_rank']:.1f} +-{out['ci']:.1f}")
        log(f"Total img/sec on {size} rank(s): {out['total']:.1f} +-{out['ci'] * size:.1f}")
        if scaling:
            log(f"One rank alone: {out['alone']:.1f} img/sec; scaling efficiency {out['efficiency']:.2f}")
    return out


def setup(framework: str, threads: int | None):
    """Start the framework in a plain job (mpiexec, srun or horovodrun); returns the device.

    One GPU per rank or, where a node has fewer GPUs than ranks, the CPU for all ranks with a
    note (hpdl.rank.place); torch threads = the rank's own cores (not divided again when
    `srun --cpu-bind` already gave each rank its share).
    """
    from hpdl.rank import place

    if framework == "horovod":
        import horovod.torch as hvd

        hvd.init()
        device, auto_threads, note = place(hvd.allgather_object)
        rank = hvd.rank()
    else:
        from hpdl.rank import init_torch_distributed, world  # ranks from MPI (mpiexec or srun)

        info = world()
        device, auto_threads, note = place()
        rank = info["rank"]
        init_torch_distributed(info["rank"], info["world_size"], device)
    if threads:
        torch.set_num_threads(threads)
    if rank == 0:
        print(f"Device: {device}; torch threads per rank: {torch.get_num_threads()}"
              + (f"\nNote: {note}" if note else ""))
    return device


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["ddp", "horovod"], default="ddp")
    ap.add_argument("--model", choices=list(MODELS), default="digits_cnn")
    ap.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    ap.add_argument("--image-size", type=int, default=None, help="height and width of a ResNet's input images")
    ap.add_argument("--num-warmup-batches", type=int, default=2)
    ap.add_argument("--num-batches-per-iter", type=int, default=5)
    ap.add_argument("--num-iters", type=int, default=5)
    ap.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16 for the all-reduce")
    ap.add_argument("--scaling", action="store_true", help="also time rank 0 alone; print scaling efficiency")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per rank (default: the rank's share of the cores)")
    args = ap.parse_args(argv)
    device = setup(args.framework, args.threads)
    run(args.framework, args.model, args.batch_size, args.num_warmup_batches, args.num_batches_per_iter,
        args.num_iters, args.fp16_allreduce, args.scaling, device, image_size=args.image_size)
    from hpdl.rank import finish

    finish()  # Horovod or the DDP group let go while Python lives; then exit without its shutdown
    return 0


if __name__ == "__main__":
    sys.exit(main())
