#!/usr/bin/env python3
"""train_ddp --checkpoint-dir under SIGKILL and preemption, against uninterrupted runs.

For W = 1, 2, 4 and --backend shm and tcp, an uninterrupted run (no checkpoint options) is the
reference. Each trial starts the same job with --checkpoint-dir under ddprun, interrupts it, runs
the same command again (as ddprun --max-restarts would; some trials use --max-restarts=1 and let
ddprun do it), and checks that the run that finishes prints exactly the reference's lines from
where it resumed, writes the reference's printed lines, loss sums, step losses and final
parameter bits in its report, and that what the interrupted run printed is a prefix of them.

Kinds of trial (each waits on a file or an output line, never on a timer):
  kill       (b) rank P stops right after checkpoint k is complete (DDP_CHECKPOINT_TEST_HOOK
             pause), then a random rank is SIGKILLed while the others wait in a collective;
  kill-line  (b) a random rank is SIGKILLed as soon as rank 0 has printed epoch line E (a run that
             finished before the kill landed is not counted);
  save       (c) rank P stops inside the save of checkpoint k, its file fsynced under a temporary
             name (or rank 0 with index.json written and no DONE yet); a random rank is SIGKILLed;
             the previous checkpoint must stay byte for byte what it was and be the one resumed;
  preempt    (4) rank P stops right after checkpoint k; SIGUSR1 or SIGTERM goes to a random rank,
             then P goes on: every rank must save step k + 1 (the next step boundary) and the job
             exit 75; the rerun (or ddprun --max-restarts=1) resumes from k + 1.
Prints per kind: trials / right. Exit 0 when every counted trial was right and each kind reached
its minimum count.
"""

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

REQUEUE = 75
WAIT_S = 120


class Run:
    """A job under ddprun; stdout lines collected as they come."""

    def __init__(self, cmd, env):
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        self.lines, self.err = [], []
        self.cv = threading.Condition()
        self.t_out = threading.Thread(target=self._pump, args=(self.p.stdout, self.lines), daemon=True)
        self.t_err = threading.Thread(target=self._pump, args=(self.p.stderr, self.err), daemon=True)
        self.t_out.start()
        self.t_err.start()

    def _pump(self, stream, into):
        for line in stream:
            with self.cv:
                into.append(line.rstrip("\n"))
                self.cv.notify_all()
        with self.cv:
            self.cv.notify_all()

    def wait_line(self, count):
        """True once `count` stdout lines arrived; False when the job ended first."""
        with self.cv:
            end = time.monotonic() + WAIT_S
            while len(self.lines) < count:
                if self.p.poll() is not None and not self.t_out.is_alive():
                    return False
                if not self.cv.wait(timeout=max(0.0, min(0.05, end - time.monotonic()))) and time.monotonic() > end:
                    raise RuntimeError("no line %d within %d s" % (count, WAIT_S))
            return True

    def finish(self):
        rc = self.p.wait(timeout=WAIT_S)
        self.t_out.join()
        self.t_err.join()
        return rc


def wait_file(path, run):
    """Polls for a file the job creates (the hook's marker): the job tells us where it is."""
    end = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if run.p.poll() is not None:
            return False
        if time.monotonic() > end:
            raise RuntimeError("%s did not appear within %d s" % (path, WAIT_S))
        time.sleep(0.001)
    return True


def rank_pids(launcher):
    """{rank: pid} of ddprun's workers (its children, RANK from their environment)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            with open("/proc/%s/environ" % d, "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            out[int(env[b"RANK"])] = int(d)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return out


def wait_ranks(run, world):
    end = time.monotonic() + WAIT_S
    while True:
        pids = rank_pids(run.p.pid)
        if len(pids) == world:
            return pids
        if run.p.poll() is not None or time.monotonic() > end:
            return pids
        time.sleep(0.001)


def safetensors_step(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return int(json.loads(f.read(n))["__metadata__"]["step"])


def tree_digest(path):
    h = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            h[name] = hashlib.sha256(f.read()).hexdigest()
    return h


def complete_steps(ckdir):
    if not os.path.isdir(ckdir):
        return []
    return sorted(int(n[5:]) for n in os.listdir(ckdir)
                  if n.startswith("step-") and os.path.exists(os.path.join(ckdir, n, "DONE")))


def step_dir(ckdir, step):
    return os.path.join(ckdir, "step-%09d" % step)


def covers(before, after, ref):
    """before: what the interrupted attempt printed; after: the finishing run's lines."""
    if before != ref[:len(before)]:
        return "interrupted run printed %r, not a prefix of the reference" % (before,)
    if after and after != ref[len(ref) - len(after):]:
        return "resumed run printed %r, not a suffix of the reference" % (after,)
    if len(before) + len(after) < len(ref):
        return "lines missing: %r + %r" % (before, after)
    return ""


def split_restarted(lines, ref):
    """ddprun --max-restarts: both attempts' lines in one stream; find a split that works."""
    for i in range(len(lines) + 1):
        if not covers(lines[:i], lines[i:], ref):
            return ""
    return "lines %r are not a prefix + suffix of the reference" % (lines,)


def compare_report(path, ref):
    with open(path) as f:
        got = json.load(f)
    for key in ("printed_lines", "final_params_bits", "epoch_loss_sums_by_rank", "step_losses_rank0",
                "final_accuracy", "final_mean_loss"):
        if got[key] != ref[key]:
            return "report's %s differs from the uninterrupted run's" % key
    return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-ddp", required=True)
    ap.add_argument("--ddprun", required=True)
    ap.add_argument("--trials", type=int, default=12, help="trials per kind (kill, save); preempt gets half")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--keep-dir", action="store_true", help="leave the work directory")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    print("checkpoint_resume: seed %d (rerun with --seed %d)" % (seed, seed), flush=True)
    work = tempfile.mkdtemp(prefix="ddp_checkpoint_resume.")
    combos = [(1, "shm"), (2, "shm"), (2, "tcp"), (4, "shm"), (4, "tcp"), (1, "tcp")]
    job = ["--init-seed", "0", "--samples", str(a.samples), "--epochs", "3"]
    base_env = dict(os.environ)
    base_env.pop("DDP_CHECKPOINT_TEST_HOOK", None)

    def ddprun(world, extra=()):
        return [a.ddprun, "--standalone", "--nnodes=1", "--nproc-per-node=%d" % world, "--grace-period", "2", *extra,
                a.train_ddp]

    refs = {}
    for world, backend in combos:
        report = os.path.join(work, "ref-%d-%s.json" % (world, backend))
        r = Run(ddprun(world) + ["--backend", backend, *job, "--report", report], base_env)
        rc = r.finish()
        if rc != 0:
            print("reference run W=%d %s failed (%d): %s" % (world, backend, rc, "\n".join(r.err)))
            return 1
        with open(report) as f:
            refs[(world, backend)] = (r.lines, json.load(f))

    counts = {k: [0, 0, 0] for k in ("kill", "kill-line", "save", "preempt")}  # trials, right, not counted
    failures = []
    minimum = {"kill": 1, "kill-line": 0, "save": 1, "preempt": 1}
    plan = []
    for i in range(a.trials):
        plan.append("kill" if i % 3 else "kill-line")
        plan.append("save")
    plan += ["preempt"] * max(1, a.trials // 2)
    # At least 10 trials that certainly interrupt (kill + save each count); kill-line may not land.
    minimum["kill"] = sum(1 for k in plan if k == "kill")
    minimum["save"] = sum(1 for k in plan if k == "save")
    minimum["preempt"] = sum(1 for k in plan if k == "preempt")
    rng.shuffle(plan)

    for n, kind in enumerate(plan):
        world, backend = combos[n % len(combos)]
        ref_lines, ref = refs[(world, backend)]
        steps_per_epoch = (a.samples // world + 31) // 32
        total = 3 * steps_per_epoch
        every = rng.randint(3, 9)
        restarts = kind in ("kill", "save", "preempt") and rng.random() < 0.3
        tag = "%03d" % n
        ckdir = os.path.join(work, "ck-" + tag)
        report = os.path.join(work, "r-" + tag + ".json")
        marker = os.path.join(work, "hook-" + tag)
        cmd = ddprun(world, ["--max-restarts=1"] if restarts else []) + [
            "--backend", backend, *job, "--checkpoint-dir", ckdir, "--checkpoint-every",
            str(every), "--keep", "3", "--report", report]
        env = dict(base_env)
        k = rng.randint(1, total // every - 1) * every if total // every > 1 else every
        victim = rng.randrange(world)
        where = ""
        expect_resume = None
        if kind == "kill":
            env["DDP_CHECKPOINT_TEST_HOOK"] = "pause:%d:%d:after:%s" % (k, rng.randrange(world), marker)
            expect_resume = k
            where = "rank %d SIGKILLed after checkpoint %d (every %d)" % (victim, k, every)
        elif kind == "save":
            point = rng.choice(["tmp", "tmp", "done"])
            paused = rng.randrange(world) if point == "tmp" else 0
            env["DDP_CHECKPOINT_TEST_HOOK"] = "pause:%d:%d:%s:%s" % (k, paused, point, marker)
            expect_resume = k - every if k > every else None
            where = "rank %d SIGKILLed while rank %d saves checkpoint %d at '%s' (every %d)" % (
                victim, paused, k, point, every)
        elif kind == "kill-line":
            line = rng.randint(1, 2)
            where = "rank %d SIGKILLed after epoch line %d (every %d)" % (victim, line, every)
        else:
            # A paused rank takes SIGTERM's default action (so that a launcher can stop it in the
            # kill trials): SIGTERM goes to another rank, and at W = 1 the signal is SIGUSR1.
            sig = rng.choice([signal.SIGUSR1, signal.SIGTERM]) if world > 1 else signal.SIGUSR1
            paused = rng.choice([r for r in range(world) if r != victim] if sig == signal.SIGTERM else range(world))
            env["DDP_CHECKPOINT_TEST_HOOK"] = "pause:%d:%d:after:%s" % (k, paused, marker)
            expect_resume = k + 1
            where = "%s to rank %d after checkpoint %d (every %d)" % (signal.Signals(sig).name, victim, k, every)
        if restarts:
            where += ", ddprun --max-restarts=1"

        first = Run(cmd, env)
        landed = True
        before_digest = None
        try:
            if kind in ("kill", "save"):
                if not wait_file(marker, first):
                    raise RuntimeError("the job ended before the hook fired: " + "\n".join(first.err[-5:]))
                pids = wait_ranks(first, world)
                if kind == "save":
                    sd = step_dir(ckdir, k)
                    tmp = [f for f in os.listdir(sd) if ".tmp." in f] if os.path.isdir(sd) else []
                    if "'tmp'" in where and not tmp:
                        raise RuntimeError("no temporary file in %s while paused in the save" % sd)
                    if "'done'" in where and (not os.path.exists(os.path.join(sd, "index.json"))
                                              or os.path.exists(os.path.join(sd, "DONE"))):
                        raise RuntimeError("paused before DONE, but %s has %r" % (sd, os.listdir(sd)))
                    prev = [s for s in complete_steps(ckdir) if s < k]
                    if prev and prev[-1] != expect_resume:
                        raise RuntimeError("newest complete checkpoint is %d, expected %s" % (prev[-1], expect_resume))
                    if prev:
                        before_digest = (prev[-1], tree_digest(step_dir(ckdir, prev[-1])))
                os.kill(pids[victim], signal.SIGKILL)
            elif kind == "preempt":
                if not wait_file(marker, first):
                    raise RuntimeError("the job ended before the hook fired: " + "\n".join(first.err[-5:]))
                pids = wait_ranks(first, world)
                os.kill(pids[victim], sig)
                open(marker + ".go", "w").close()
            else:
                line = int(where.split("epoch line ")[1].split()[0])
                if first.wait_line(line):
                    pids = rank_pids(first.p.pid)
                    if victim in pids:
                        os.kill(pids[victim], signal.SIGUSR1 if kind == "preempt" else signal.SIGKILL)
                    else:
                        landed = False
                else:
                    landed = False
            rc1 = first.finish()
        except Exception:
            first.p.kill()
            first.finish()
            raise
        before_lines = list(first.lines)

        problem = ""
        if kind == "preempt" and restarts:
            said = [l for l in first.err if "preempted: saved checkpoint" in l]
            if rc1 != 0 or not said or ("step-%09d" % (k + 1)) not in said[0]:
                problem = "ddprun --max-restarts=1 exited %d; preemption lines %r" % (rc1, said)
        elif kind == "preempt":
            if rc1 != REQUEUE:
                problem = "preempted job exited %d, expected %d: %s" % (rc1, REQUEUE, " | ".join(first.err[-4:]))
            else:
                said = [l for l in first.err if "preempted: saved checkpoint" in l]
                steps = complete_steps(ckdir)
                if not said or not steps or steps[-1] != k + 1 or ("step-%09d" % steps[-1]) not in said[0]:
                    problem = "no agreed save of step %d: %r, complete %r" % (k + 1, said, steps)
                else:
                    with open(os.path.join(step_dir(ckdir, steps[-1]), "index.json")) as f:
                        idx = json.load(f)
                    if idx["world_size"] != world or len(idx["files"]) != world + 1:
                        problem = "index of the preemption checkpoint: %r" % idx["files"]
                    # Every rank wrote its own file while saving that same step.
                    for r in range(world):
                        if safetensors_step(os.path.join(step_dir(ckdir, k + 1), "rank-%05d.safetensors" % r)) != k + 1:
                            problem = "rank %d's file of checkpoint %d was saved at another step" % (r, k + 1)
        elif kind == "kill-line" and rc1 == 0:
            landed = False
        elif restarts:
            if rc1 != 0:
                problem = "ddprun --max-restarts=1 exited %d: %s" % (rc1, " | ".join(first.err[-4:]))
        elif rc1 == 0:
            problem = "the killed job exited 0"
        if not landed:
            counts[kind][2] += 1
            print("  %s %-9s W=%d %-3s %s: finished before the signal landed (not counted)" % (
                tag, kind, world, backend, where), flush=True)
            continue
        # (Under --max-restarts the restarted run may already have pruned it: its resume step says enough.)
        if not problem and before_digest is not None and not restarts:
            step, digest = before_digest
            if tree_digest(step_dir(ckdir, step)) != digest:
                problem = "checkpoint %d changed while a later save was killed" % step

        if restarts:
            final_lines, final_err, rc2 = before_lines, first.err, rc1
            problem = problem or split_restarted(final_lines, ref_lines)
        else:
            second = Run(cmd, env)
            rc2 = second.finish()
            final_lines, final_err = second.lines, second.err
            if not problem and rc2 != 0:
                problem = "rerun exited %d: %s" % (rc2, " | ".join(second.err[-4:]))
            problem = problem or covers(before_lines, final_lines, ref_lines)
        if not problem:
            problem = compare_report(report, ref)
        if not problem:
            with open(report) as f:
                got = json.load(f)
            resumed = [l for l in final_err if "resumed from checkpoint" in l]
            if kind != "kill-line" and got["resumed_from_step"] != expect_resume:
                problem = "resumed from step %r, expected %r (%r)" % (got["resumed_from_step"], expect_resume, resumed)
            elif got["resumed_from_step"] is not None and not resumed:
                problem = "no 'resumed from checkpoint' line on stderr"
        counts[kind][0] += 1
        if not problem:
            counts[kind][1] += 1
        else:
            failures.append("%s %s W=%d %s: %s: %s" % (tag, kind, world, backend, where, problem))
        with open(report) as f:
            resumed_from = json.load(f).get("resumed_from_step") if os.path.exists(report) else None
        print("  %s %-9s W=%d %-3s %s: resumed from %s: %s" % (
            tag, kind, world, backend, where, resumed_from, "right" if not problem else "WRONG: " + problem), flush=True)
        shutil.rmtree(ckdir, ignore_errors=True)

    ok = not failures
    for kind, (trials, right, skipped) in counts.items():
        print("checkpoint_resume: %-9s trials %d, right %d%s" % (
            kind, trials, right, ", %d not counted (finished first)" % skipped if skipped else ""))
        if trials < minimum[kind]:
            ok = False
            print("checkpoint_resume: too few %s trials (%d < %d)" % (kind, trials, minimum[kind]))
    for f in failures:
        print("FAILED " + f)
    if a.keep_dir or not ok:
        print("checkpoint_resume: work directory " + work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
