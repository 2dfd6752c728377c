#!/usr/bin/env python3
"""DeepSpeed's CPU shared-memory all-reduce over the same sweep and columns as ddp_bench_allreduce.

usage: deepspeed_allreduce.py --np 2 [--via-comm] [--min-bytes B] [--max-bytes B] [--iters N]
                              [--warmup N] [--system NAME] [--csv]

Starts --np ranks on this host (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_SIZE = --np, so that
DeepSpeed's shm op takes its one-host path), initialises deepspeed.comm with the CPU accelerator
(DS_ACCELERATOR=cpu; gloo underneath) and times DeepSpeed's CPU shm op (deepspeed_shm_comm, built
by DeepSpeed itself on first use) on a float32 torch tensor in place: the op itself,
torch.ops.deepspeed.inference_all_reduce_, which deepspeed.comm.inference_all_reduce calls for a
float32 tensor on one host, or with --via-comm that call (its Python layers included). Each rank
checks first that the backend has the op and that deepspeed.comm's call sums correctly. Iteration
and warm-up counts follow bench/common/bench_table.hpp; the time of a size is the slowest rank's
mean over the iterations.
"""
import argparse
import glob
import os
import signal
import socket
import subprocess
import sys
import time


def iterations_for(nbytes, iters):
    if nbytes >= 16 << 20:
        return max(3, iters // 4)
    if nbytes >= 1 << 20:
        return max(5, iters // 2)
    if nbytes >= 64 << 10:
        return iters * 10
    return iters * 100


def sizes(args):
    out, b = [], max(args.min_bytes, 4)
    while b <= args.max_bytes:
        out.append(b)
        b *= 2
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unlink_buffers(port):
    for name in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


def rank_main(args):
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.comm import comm as ds_comm

    torch.set_num_threads(1)
    dist.init_distributed(dist_backend="gloo", verbose=False)
    rank, size = dist.get_rank(), dist.get_world_size()
    backend = ds_comm.cdb  # the backend init_distributed made
    if getattr(backend, "shm_comm_op", None) is None or getattr(backend, "shm_vector_kernel_level", 0) < 1:
        print(f"rank {rank}: DeepSpeed's shm op is not in use (deepspeed {deepspeed.__version__})", file=sys.stderr)
        return 3
    sweep = sizes(args)
    data = torch.zeros(sweep[-1] // 4, dtype=torch.float32)  # pre-touched; zeros stay finite
    probe = torch.full((4,), float(rank + 1))
    dist.inference_all_reduce(probe)
    if float(probe[0]) != size * (size + 1) / 2:
        print(f"rank {rank}: check failed: {float(probe[0])}", file=sys.stderr)
        return 1
    call = dist.inference_all_reduce if args.via_comm else torch.ops.deepspeed.inference_all_reduce_
    # Every rank has mapped the op's shared buffers by now: drop their names, so that nothing stays
    # in /dev/shm however the run ends.
    dist.barrier()
    if rank == 0:
        unlink_buffers(os.environ["MASTER_PORT"])
    timing = torch.zeros(1, dtype=torch.float64)
    if rank == 0 and args.csv:
        print("system,ranks,bytes,count,type,time_us,algbw_gbs,busbw_gbs", flush=True)
    for nbytes in sweep:
        view = data[: nbytes // 4]
        iters = iterations_for(nbytes, args.iters)
        warmup = args.warmup + (iters if nbytes == sweep[0] else 0)
        for _ in range(warmup):
            call(view)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call(view)
        timing[0] = (time.perf_counter() - start) / iters
        dist.all_reduce(timing, op=dist.ReduceOp.MAX)
        if rank == 0:
            seconds = float(timing[0])
            algbw = nbytes / seconds / 1e9
            busbw = algbw * 2 * (size - 1) / size
            if args.csv:
                print(f"{args.system},{size},{nbytes},{nbytes // 4},float,{seconds * 1e6:.3f},{algbw:.4f},{busbw:.4f}", flush=True)
            else:
                print(f"{nbytes:12d} {nbytes // 4:12d} {'float':>8} {seconds * 1e6:12.2f} {algbw:10.3f} {busbw:10.3f}", flush=True)
    dist.barrier()
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--min-bytes", type=int, default=4)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--via-comm", action="store_true")
    parser.add_argument("--system", default="deepspeed")
    parser.add_argument("--csv", action="store_true")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return rank_main(args)
    if not args.csv:
        print(f"# DeepSpeed inference_all_reduce (CPU shm op), {args.np} ranks")
        print(f"{'size(B)':>12} {'count':>12} {'type':>8} {'time(us)':>12} {'algbw(GB/s)':>10} {'busbw(GB/s)':>10}", flush=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(args.np), LOCAL_SIZE=str(args.np), OMP_NUM_THREADS="1")
    children = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # timeout(1): still unlink below
    try:
        for rank in range(args.np):
            env_rank = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            children.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(rank)], env=env_rank))
        failed = sum(1 for c in children if c.wait() != 0)
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
        # The op leaves its shared buffers (named after MASTER_ADDR and MASTER_PORT) in /dev/shm
        # when a run ends before rank 0 drops them.
        unlink_buffers(env["MASTER_PORT"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
