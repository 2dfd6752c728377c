#!/usr/bin/env python3
"""Two jobs on one node with the same MASTER_PORT, started together, TRIALS times.

    two_jobs_one_port.py --train-ddp BIN --golden tests/data/training.json [--trials 30] [--ranks 2] [--derived]

Each job is started the way `srun -n2 --kill-on-bad-exit=1 train_ddp --init-seed 0` starts it: every
rank gets srun's variables (SLURM_JOB_ID, SLURM_STEP_ID, SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
SLURM_NNODES, SLURM_NODELIST...) and the same MASTER_ADDR/MASTER_PORT as the other job; when a rank
fails, the rest of its job is killed, as srun --kill-on-bad-exit does. A trial is right when

  - no group is mixed: a job that completes printed exactly PyTorch's lines for its world size, and
    every rank of it exited 0 (a rank that joined the other job would change the lines or hang);
  - at most one job completes; the other is refused: its first failing rank says
    "... job slurm:A ... job slurm:B ..." (both identities) within 2 s of the start.

With --derived no rank gets MASTER_PORT, and the two job ids are 12768 apart, so both derive
the same port (20000 + SLURM_JOB_ID % 12768, include/ddp/core/env.hpp); in every other trial a
silent listener (a program that is not a ddp store) holds that port from before the start. Then a
trial is right when both jobs complete with exactly PyTorch's lines, every rank exiting 0: the
stores move to the port's alternates and each rank finds its own job's.

Prints one line per trial and a summary; exits 1 when any trial was wrong.
"""
import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

LINE = re.compile(r"^Epoch \d+: Rank 0 local loss sum = \S+$")
MOVED = re.compile(r"serving on (\d+), alternate (\d+) of the job's derived port")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DERIVED_FIRST, DERIVED_COUNT = 20000, 12768  # the derived ports: 20000 + job % 12768 for step 0


def rank_env(job_id, rank, ranks, port):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_", "DDP_")) and
           k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
                "SLURM_NTASKS": str(ranks), "SLURM_STEP_NUM_TASKS": str(ranks), "SLURM_LOCALID": str(rank),
                "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": str(ranks),
                "SLURM_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost",
                "MASTER_ADDR": "127.0.0.1", "DDP_TIMEOUT": "60", "OMP_NUM_THREADS": "1"})
    if port is not None:
        env["MASTER_PORT"] = str(port)
    return env


def trial(a, n, golden):
    port = free_port()
    jobs = {1000 + 2 * n: [], 1001 + 2 * n: []}
    holder = None
    if a.derived:
        first = random.randrange(1000, 1000000)
        jobs = {first: [], first + DERIVED_COUNT: []}
        port = None
        if n % 2 == 1:
            holder = socket.socket()
            try:
                holder.bind(("127.0.0.1", DERIVED_FIRST + first % DERIVED_COUNT))
                holder.listen(8)
            except OSError:
                pass  # something else holds it already: as good for this trial
    try:
        return run_jobs(a, jobs, port, golden, n)
    finally:
        if holder is not None:
            holder.close()


def run_jobs(a, jobs, port, golden, n):
    start = time.monotonic()
    for job_id, procs in jobs.items():
        for r in range(a.ranks):
            procs.append(subprocess.Popen([a.train_ddp, "--init-seed", "0"], env=rank_env(job_id, r, a.ranks, port),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    # Supervise like srun --kill-on-bad-exit=1: the first failure of a job kills its other ranks.
    ended = {}  # pid -> (exit code, seconds since start)
    failed_job = {}
    deadline = start + 90
    while len(ended) < 2 * a.ranks:
        if time.monotonic() > deadline:
            for procs in jobs.values():
                for p in procs:
                    p.kill()
            return False, "a rank was still running after 90 s (hang)"
        # Block until some child can be reaped (without reaping it), then let Popen reap.
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        now = time.monotonic() - start
        for job_id, procs in jobs.items():
            for p in procs:
                if p.pid in ended or p.poll() is None:
                    continue
                ended[p.pid] = (p.returncode, now)
                if p.returncode != 0 and job_id not in failed_job:
                    failed_job[job_id] = p.pid
                    for q in procs:
                        if q.poll() is None:
                            q.send_signal(signal.SIGTERM)
    completed, refused, moves = [], [], []
    for job_id, procs in jobs.items():
        outs = [p.communicate() for p in procs]
        if a.derived:
            if any(p.returncode != 0 for p in procs):
                i = [p.returncode != 0 for p in procs].index(True)
                return False, f"job {job_id} failed on a derived port: rank {i}: {outs[i][1].strip()[-300:]}"
            lines = [l for l in outs[0][0].splitlines() if LINE.match(l)]
            if lines != golden:
                return False, f"job {job_id} completed with other lines (mixed group?): {lines}"
            moved = MOVED.search(outs[0][1])
            if moved:
                moves.append(f"job {job_id} to alternate {moved.group(2)} (port {moved.group(1)})")
            completed.append(job_id)
            continue
        if all(p.returncode == 0 for p in procs):
            lines = [l for l in outs[0][0].splitlines() if LINE.match(l)]
            if lines != golden:
                return False, f"job {job_id} completed with other lines (mixed group?): {lines}"
            completed.append(job_id)
        else:
            first = failed_job.get(job_id)
            i = [p.pid for p in procs].index(first)
            err = outs[i][1]
            t = ended[first][1]
            other = [j for j in jobs if j != job_id][0]
            names_both = f"slurm:{job_id}.0" in err and f"slurm:{other}.0" in err
            if not names_both:
                return False, f"job {job_id}: rank {i} failed without naming both jobs: {err.strip()[-300:]}"
            if t > 2.0:
                return False, f"job {job_id}: refused after {t:.2f} s (limit 2 s)"
            refused.append((job_id, i, t, err.strip().splitlines()[-1]))
    if a.derived:
        held = " (its derived port held by a silent listener)" if n % 2 == 1 else ""
        # One port for two stores: at least one moved, and said so.
        if not moves:
            return False, f"both jobs completed{held}, but no store says it moved to an alternate port"
        return True, f"both jobs {completed} completed with PyTorch's lines{held}; moved: " + ", ".join(moves)
    if len(completed) > 1:
        return False, "both jobs completed on one port (impossible unless they shared a store)"
    detail = f"completed {completed}, refused " + ", ".join(f"job {j} rank {r} after {t:.3f} s" for j, r, t, _ in refused)
    if refused and n == 0:
        detail += f"\n      e.g.: {refused[0][3]}"
    return True, detail


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-ddp", required=True)
    p.add_argument("--golden", required=True)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--ranks", type=int, default=2, choices=(1, 2))
    p.add_argument("--derived", action="store_true", help="no MASTER_PORT: two job ids that derive one port")
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args()
    random.seed(a.seed)
    with open(a.golden) as f:
        golden = json.load(f)[f"W{a.ranks}_simulated"]["tutorial_print_lines"]
    right = 0
    for n in range(a.trials):
        ok, detail = trial(a, n, golden)
        right += ok
        print(f"trial {n + 1:2d}/{a.trials}: {'ok  ' if ok else 'FAIL'} {detail}", flush=True)
    wrong = "failures, mixed groups or hangs" if a.derived else "mixed groups, hangs, or refusals without both jobs named"
    print(f"{a.trials} trials, {right} right, {a.trials - right} wrong ({wrong})")
    sys.exit(0 if right == a.trials else 1)


if __name__ == "__main__":
    main()
