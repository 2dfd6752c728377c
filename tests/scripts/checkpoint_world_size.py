#!/usr/bin/env python3
"""train_ddp: a checkpoint saved by W ranks resumed by W' ranks (elastic resume), against references.

The documented rule (include/ddp/checkpoint.hpp, README "Checkpoints"): with
--allow-world-size-change the parameters load, and the run restarts the interrupted epoch at its
first batch with the new world size; a checkpoint taken at an epoch's last step holds the next
epoch's start, so nothing is repeated then. Per-rank loss sums start anew (rank 0's log is kept).

Cases (tutorial job, 1024 samples, batch 32, 3 epochs: 8 steps per epoch at W = 4, 16 at W = 2):
  4 -> 2 mid-epoch   W = 4 preempted by SIGUSR1 after checkpoint 12 (epoch 2): saves step 13, exits 75
  2 -> 4 mid-epoch   W = 2 preempted after checkpoint 20 (epoch 2): saves step 21, exits 75
  4 -> 2 at a boundary  W = 4 stops after step 8 (--max-steps 8, --checkpoint-every 8): epoch 1's end
Each resumed at W' with --allow-world-size-change, after checking that without it the resume is
refused with a message naming the option.

The reference is independent of the checkpoint code: two plain runs without --checkpoint-dir,
  A: W ranks, --max-steps S (S = the checkpoint's step): its lines and final parameters P_S;
  B: W' ranks, --init-params P_S (the bits of A's report) --first-epoch E (the interrupted epoch).
The interrupted run must print A's lines, the resumed run B's lines, and the resumed run's report
must hold B's final parameter bits, B's per-rank loss sums, A's + B's printed lines and A's + B's
rank-0 step losses. The preemption signal's timing is fixed by DDP_CHECKPOINT_TEST_HOOK (a rank
holds after checkpoint k until the signal reaches it), so no timer decides anything.
"""

import argparse
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

WAIT_S = 120
REQUEUE = 75


def ddprun(a, world):
    return [a.ddprun, "--standalone", "--nnodes=1", "--nproc-per-node=%d" % world, "--grace-period", "2", a.train_ddp,
            "--init-seed", "0", "--epochs", "3"]


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_S, env=env)
    return p.returncode, p.stdout.splitlines(), p.stderr.splitlines()


def report(path):
    with open(path) as f:
        return json.load(f)


def children(pid):
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return out


def preempted_run(cmd, env, marker, world):
    """Starts cmd; once a rank holds after its checkpoint (the marker), SIGUSR1 to every rank, as
    a scheduler would. The hook's hold ends at that signal. Returns rc, stdout lines, stderr lines."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        end = time.monotonic() + WAIT_S
        while not os.path.exists(marker):
            if p.poll() is not None:
                out, err = p.communicate()
                raise RuntimeError("the job ended before the hook held it: " + err)
            if time.monotonic() > end:
                raise RuntimeError("no hold within %d s" % WAIT_S)
            time.sleep(0.001)
        ranks = children(p.pid)
        while len(ranks) < world and time.monotonic() < end:
            time.sleep(0.001)
            ranks = children(p.pid)
        if len(ranks) != world:
            raise RuntimeError("found %d ranks, expected %d" % (len(ranks), world))
        for pid in ranks:
            os.kill(pid, signal.SIGUSR1)
        out, err = p.communicate(timeout=WAIT_S)
        return p.returncode, out.splitlines(), err.splitlines()
    except BaseException:
        p.kill()
        p.communicate()
        raise


def one_case(a, work, name, w_from, w_to, hold_step, max_steps, every):
    """hold_step: preempt after this checkpoint (saves hold_step + 1); or max_steps: stop there."""
    d = os.path.join(work, name)
    os.makedirs(d)
    ck, r1, r2 = os.path.join(d, "ck"), os.path.join(d, "r1.json"), os.path.join(d, "r2.json")
    env = dict(os.environ)
    env.pop("DDP_CHECKPOINT_TEST_HOOK", None)
    problems = []

    # The interrupted run at W.
    first = ddprun(a, w_from) + ["--checkpoint-dir", ck, "--checkpoint-every", str(every), "--report", r1]
    if hold_step:
        marker = os.path.join(d, "hold")
        env_hold = dict(env, DDP_CHECKPOINT_TEST_HOOK="pause:%d:0:after:%s" % (hold_step, marker))
        rc1, out1, err1 = preempted_run(first, env_hold, marker, w_from)
        step = hold_step + 1
        if rc1 != REQUEUE:
            problems.append("preempted run exited %d, not %d: %s" % (rc1, REQUEUE, " | ".join(err1[-3:])))
    else:
        rc1, out1, err1 = run(first + ["--max-steps", str(max_steps)], env)
        step = max_steps
        if rc1 != 0:
            problems.append("run with --max-steps exited %d: %s" % (rc1, " | ".join(err1[-3:])))
    with open(os.path.join(ck, "step-%09d" % step, "index.json")) as f:
        idx = json.load(f)
    epoch = idx["sampler"]["epoch"]  # 0-based: the epoch the resume starts with

    # Reference A: W ranks, plain, stopped at the checkpoint's step.
    ra = os.path.join(d, "ref-a.json")
    rc, out_a, err = run(ddprun(a, w_from) + ["--max-steps", str(step), "--report", ra], env)
    if rc != 0:
        raise RuntimeError("reference A failed: " + "\n".join(err))
    ref_a = report(ra)
    params = os.path.join(d, "p.bin")
    with open(params, "wb") as f:
        f.write(struct.pack("<%dI" % len(ref_a["final_params_bits"]), *ref_a["final_params_bits"]))
    # Reference B: W' ranks from A's parameters, starting with the interrupted epoch.
    rb = os.path.join(d, "ref-b.json")
    rc, out_b, err = run(ddprun(a, w_to) + ["--init-params", params, "--first-epoch", str(epoch + 1), "--report", rb], env)
    if rc != 0:
        raise RuntimeError("reference B failed: " + "\n".join(err))
    ref_b = report(rb)

    if out1 != out_a:
        problems.append("interrupted run printed %r, reference A %r" % (out1, out_a))

    # Without the option: refused, naming it.
    rc, out, err = run(ddprun(a, w_to) + ["--checkpoint-dir", ck], env)
    if rc == 0 or not any("--allow-world-size-change" in l for l in err):
        problems.append("resume at W=%d without --allow-world-size-change: exit %d, %r" % (w_to, rc, err[-3:]))

    rc2, out2, err2 = run(ddprun(a, w_to) + ["--checkpoint-dir", ck, "--allow-world-size-change", "--report", r2], env)
    if rc2 != 0:
        problems.append("resumed run exited %d: %s" % (rc2, " | ".join(err2[-3:])))
    else:
        got = report(r2)
        said = [l for l in err2 if "world size %d -> %d" % (w_from, w_to) in l]
        if not said or "start of epoch %d" % (epoch + 1) not in said[0]:
            problems.append("no 'world size %d -> %d ... start of epoch %d' line: %r" % (w_from, w_to, epoch + 1, err2))
        if out2 != out_b:
            problems.append("resumed run printed %r, reference B %r" % (out2, out_b))
        checks = [("final_params_bits", ref_b["final_params_bits"]),
                  ("epoch_loss_sums_by_rank", ref_b["epoch_loss_sums_by_rank"]),
                  ("printed_lines", ref_a["printed_lines"] + ref_b["printed_lines"]),
                  ("step_losses_rank0", ref_a["step_losses_rank0"] + ref_b["step_losses_rank0"]),
                  ("final_accuracy", ref_b["final_accuracy"]), ("final_mean_loss", ref_b["final_mean_loss"]),
                  ("resumed_from_step", step), ("resumed_from_world_size", w_from)]
        for key, want in checks:
            if got.get(key) != want:
                problems.append("report's %s: %r, expected %r" % (key, got.get(key), want))
    print("  %-22s W=%d -> W'=%d: checkpoint of step %d (epoch %d, %d batches done), resumed at epoch %d: %s" % (
        name, w_from, w_to, step, idx["sampler"]["epoch"] + 1 if idx["sampler"]["batches_done"] else epoch + 1,
        idx["sampler"]["batches_done"], epoch + 1, "right" if not problems else "WRONG"), flush=True)
    for p in problems:
        print("    " + p)
    if not problems:
        print("    lines: %s | %s" % (" / ".join(out_a), " / ".join(out_b)))
    return not problems


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-ddp", required=True)
    ap.add_argument("--ddprun", required=True)
    ap.add_argument("--keep-dir", action="store_true")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ddp_checkpoint_world_size.")
    ok = True
    try:
        ok &= one_case(a, work, "4to2-mid-epoch", 4, 2, hold_step=12, max_steps=0, every=4)
        ok &= one_case(a, work, "2to4-mid-epoch", 2, 4, hold_step=20, max_steps=0, every=4)
        ok &= one_case(a, work, "4to2-epoch-boundary", 4, 2, hold_step=0, max_steps=8, every=8)
    finally:
        if a.keep_dir or not ok:
            print("checkpoint_world_size: work directory " + work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("checkpoint_world_size: %s" % ("all cases right" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
