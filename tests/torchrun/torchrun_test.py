#!/usr/bin/env python3
"""train_ddp under real torchrun (PyTorch from PyPI), checked against PyTorch's own lines.

    torchrun_test.py --train-ddp BIN --source DIR CASE

CASE is one of
  w1 .. w4    torchrun --no-python with W workers in three modes: --standalone, a c10d rendezvous
              endpoint, and static --master-addr/--master-port; with W > 1 also --backend tcp;
  two_nodes   two torchrun "nodes" on loopback (c10d rendezvous, 2 x 2 workers);
  restart     --max-restarts=1: in the first attempt rank 1 is SIGKILLed mid-run (once rank 0 has
              printed an epoch line), the agent restarts the group and the second attempt completes.
The reference for W = 1, 2 is the golden data made with real PyTorch (tests/data/training.json);
for W = 3, 4 it is the PyTorch tutorial script (bench/torch/train_ddp_cpu.py, gloo) run under the
same torchrun here. Every run must print exactly the reference's epoch lines. Each torchrun has
a deadline; a run past it is killed with its whole process group and the case fails.
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

EPOCH_LINE = re.compile(r"^Epoch \d+: Rank 0 local loss sum = \S+$")
DEADLINE_S = 120


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env():
    """The caller's launcher variables must not leak into torchrun's workers."""
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "DDP_", "FLUX_", "PALS_", "JSM_")) or k in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "GROUP_WORLD_SIZE"):
            del env[k]
    env["OMP_NUM_THREADS"] = "1"
    return env


def run(cmds, what):
    """Starts every command (one per torchrun "node") and waits for all; returns their outputs."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                              start_new_session=True) for c in cmds]
    outs = []
    end = time.monotonic() + DEADLINE_S
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise SystemExit(f"FAIL: {what}: not finished within {DEADLINE_S} s")
        outs.append((p.returncode, out, err))
    return outs


def epoch_lines(text):
    return [l for l in text.splitlines() if EPOCH_LINE.match(l)]


def check(what, rc, out, err, expected):
    got = epoch_lines(out)
    if rc != 0 or got != expected:
        print(f"FAIL: {what}: exit code {rc}")
        print("  expected:", expected)
        print("  printed: ", got)
        print("  stderr (last lines):\n    " + "\n    ".join(err.strip().splitlines()[-15:]))
        return False
    print(f"ok    {what}: exit 0, {len(got)} lines equal to PyTorch's")
    return True


def torchrun_cmd(a, mode, w, extra=()):
    base = [a.torchrun, "--no-python"]
    if mode == "standalone":
        base += ["--standalone", f"--nproc-per-node={w}"]
    elif mode == "c10d":
        base += ["--nnodes=1", f"--nproc-per-node={w}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=ddp-test"]
    elif mode == "static":
        base += ["--nnodes=1", "--node-rank=0", f"--nproc-per-node={w}", "--master-addr=127.0.0.1",
                 f"--master-port={free_port()}"]
    return base + list(extra)


def reference(a, w):
    if w in (1, 2):
        with open(os.path.join(a.source, "tests", "data", "training.json")) as f:
            return json.load(f)[f"W{w}_simulated"]["tutorial_print_lines"], "golden data (tests/data/training.json)"
    script = os.path.join(a.source, "bench", "torch", "train_ddp_cpu.py")
    cmd = [a.torchrun, "--standalone", f"--nproc-per-node={w}", script, "--init-seed", "0"]
    # PyTorch's gloo workers sometimes abort at exit ("terminate called without an active
    # exception", after printing every line): such a run is retried, up to five times.
    for attempt in range(5):
        [(rc, out, err)] = run([cmd], f"PyTorch reference W={w}")
        lines = epoch_lines(out)
        if rc == 0 and len(lines) == 3:
            return lines, "PyTorch's tutorial script under the same torchrun (gloo)" + (
                f", attempt {attempt + 1}: the earlier ones aborted at exit" if attempt else "")
    raise SystemExit(f"FAIL: the PyTorch reference run (W={w}) failed five times (exit {rc}):\n{err[-2000:]}")


def case_world(a, w):
    expected, source = reference(a, w)
    print(f"W={w}: reference from {source}: {expected}")
    ok = True
    for mode in ("standalone", "c10d", "static"):
        [(rc, out, err)] = run([torchrun_cmd(a, mode, w, [a.train_ddp, "--init-seed", "0"])], f"{mode} W={w}")
        ok &= check(f"torchrun {mode} W={w}", rc, out, err, expected)
    if w > 1:
        # The tcp transport keeps its addresses in the agent's store too (the runs above use shm).
        [(rc, out, err)] = run([torchrun_cmd(a, "standalone", w, [a.train_ddp, "--init-seed", "0", "--backend", "tcp"])],
                               f"standalone W={w} tcp")
        ok &= check(f"torchrun standalone W={w} --backend tcp", rc, out, err, expected)
    return ok


def case_two_nodes(a):
    expected, source = reference(a, 4)
    print(f"W=4: reference from {source}: {expected}")
    port = free_port()
    cmds = [[a.torchrun, "--no-python", "--nnodes=2", f"--node-rank={n}", "--nproc-per-node=2",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=ddp-two-nodes",
             a.train_ddp, "--init-seed", "0"] for n in (0, 1)]
    outs = run(cmds, "two torchrun nodes")
    # Rank 0 runs on whichever node the rendezvous made group rank 0; the other node prints nothing.
    printed = [o for o in outs if epoch_lines(o[1])]
    rcs = [o[0] for o in outs]
    if len(printed) != 1 or any(rcs):
        print(f"FAIL: two nodes: exit codes {rcs}, {len(printed)} nodes printed epoch lines")
        for rc, out, err in outs:
            print("  stderr:\n    " + "\n    ".join(err.strip().splitlines()[-10:]))
        return False
    rc, out, err = printed[0]
    return check("two torchrun nodes x 2 workers (c10d rendezvous)", rc, out, err, expected)


def case_restart(a):
    expected, source = reference(a, 2)
    with tempfile.TemporaryDirectory(prefix="ddp-torchrun-") as d:
        marker = os.path.join(d, "rank0.out")
        wrapper = os.path.join(d, "worker.sh")
        # Attempt 0 trains long enough to be killed mid-run: rank 0 copies its lines into a file,
        # rank 1 blocks (tail -f | grep) until the first epoch line is there, then SIGKILLs its own
        # train_ddp. Attempt 1 is the ordinary job, whose lines must be PyTorch's.
        with open(wrapper, "w") as f:
            f.write(f"""#!/usr/bin/env bash
set -u
bin={a.train_ddp!r}
if [ "$TORCHELASTIC_RESTART_COUNT" != 0 ]; then touch {d!r}/attempt_"$TORCHELASTIC_RESTART_COUNT".rank"$RANK"; exec "$bin" --init-seed 0; fi
if [ "$RANK" = 0 ]; then "$bin" --init-seed 0 --epochs 100000 | tee {marker!r}; exit "${{PIPESTATUS[0]}}"; fi
"$bin" --init-seed 0 --epochs 100000 & pid=$!
touch {marker!r}
timeout 60 tail -n +1 -F {marker!r} 2>/dev/null | grep -q -m1 '^Epoch '
kill -9 "$pid"
wait "$pid"
""")
        os.chmod(wrapper, 0o755)
        cmd = torchrun_cmd(a, "standalone", 2) + ["--max-restarts=1", wrapper]
        [(rc, out, err)] = run([cmd], "restart")
        # Attempt 0 printed epoch lines until rank 1 was killed; attempt 1's are the last three.
        lines = epoch_lines(out)
        restarted = all(os.path.exists(os.path.join(d, f"attempt_1.rank{r}")) for r in (0, 1))
        if not restarted or len(lines) <= 3:
            print(f"FAIL: no second attempt (markers of attempt 1: {restarted}, {len(lines)} epoch lines); "
                  f"exit {rc}; stderr:\n" + err[-3000:])
            return False
        print(f"      the agent restarted both workers after rank 1 was killed "
              f"(attempt 0 printed {len(lines) - 3} epoch lines; rank 0's error: "
              f"{next((l for l in err.splitlines() if 'peer rank 1' in l), 'none')})")
        return check("torchrun --max-restarts=1, rank 1 SIGKILLed mid-run", rc, "\n".join(lines[-3:]), err, expected)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-ddp", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--torchrun", required=True)
    p.add_argument("case")
    a = p.parse_args()
    import torch  # noqa: F401  (the venv must have it; the runner checked)
    print(f"torch {torch.__version__}, torchrun {a.torchrun}")
    if a.case.startswith("w"):
        ok = case_world(a, int(a.case[1:]))
    elif a.case == "two_nodes":
        ok = case_two_nodes(a)
    elif a.case == "restart":
        ok = case_restart(a)
    else:
        raise SystemExit(f"unknown case {a.case}")
    print("PASSED" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
