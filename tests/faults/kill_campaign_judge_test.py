#!/usr/bin/env python3
"""How kill_campaign.py judges a trial, on constructed output: a rank that prints a wrong result
fails the trial; under mpirun or torchrun a survivor may name a rank the launcher ended only when
that rank's SIGTERM (from the launcher) is stamped before the survivor's error, whatever order the
launcher relayed the lines in. Exits 1 on any case judged otherwise."""
import os
import sys
import time
import types

sys.dont_write_bytecode = True  # importing the campaign leaves no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kill_campaign as campaign  # noqa: E402

LAUNCHER = 100


class Job:
    """The parts of kill_campaign.Job that evaluate() reads: ranks 0-3 are pids 10-13."""

    def __init__(self, lines):
        now = time.monotonic()
        self.lines = [(now, "mpirun.err", line) for line in lines]
        self.exits = {}
        self.ranks_gone = {rank: now for rank in range(4)}
        self.workers = {rank: 10 + rank for rank in range(4)}
        self.launcher = LAUNCHER
        self.started = []
        self.tag = "kill-campaign-judge-%d" % os.getpid()

    def marker_time(self, rank, phase):
        return None

    def kill_everything(self):
        pass


# The victim, rank 1, was killed during its steps; mpirun's own report is judged elsewhere.
campaign.victim_ended_anyway = lambda job, victim, pid: False
campaign.check_mpirun_report = lambda *unused: None


def judge(lines):
    args = types.SimpleNamespace(end_bound=3.0, keep_shm=False)
    trial = {"victim": 1, "mode": "mpirun", "phase": "step", "watch": 1, "index": 0, "notes": []}
    r = campaign.evaluate(args, trial, Job(lines), 0.0, time.monotonic() - 0.01, 11, campaign.shm_entries(),
                          campaign.own_fds())
    return sorted(r["fail"])


def line(rank, t, text):
    return "fault_worker rank=%d pid=%d t=%d %s" % (rank, 10 + rank, t, text)


CASES = [
    ("a survivor names the victim", [line(3, 200, "error: ddp: rank 3: rank 1 closed the connection")], []),
    ("a wrong all_reduce result", [line(2, 5, "wrong result: element 3 is 1, expected 2")], ["wrong_result"]),
    ("names a rank the launcher ended before, relayed after the error",
     [line(3, 200, "error: ddp: rank 3: rank 0 closed the connection"),
      line(0, 100, "terminated: SIGTERM from pid %d" % LAUNCHER)], []),
    ("names a rank the launcher ended only after the error",
     [line(3, 200, "error: ddp: rank 3: rank 0 closed the connection"),
      line(0, 300, "terminated: SIGTERM from pid %d" % LAUNCHER)], ["wrong_rank"]),
    ("names a rank someone else ended",
     [line(0, 100, "terminated: SIGTERM from pid 999"),
      line(3, 200, "error: ddp: rank 3: rank 0 closed the connection")], ["wrong_rank"]),
    ("names a rank nobody ended", [line(3, 200, "error: ddp: rank 3: rank 2 closed the connection")], ["wrong_rank"]),
]

failed = 0
for name, lines, expected in CASES:
    got = judge(lines)
    ok = got == expected
    failed += 0 if ok else 1
    print("%-70s %s" % (name, "ok" if ok else "WRONG: judged %s, expected %s" % (got, expected)))
print("%d of %d cases judged right" % (len(CASES) - failed, len(CASES)))
sys.exit(1 if failed else 0)
