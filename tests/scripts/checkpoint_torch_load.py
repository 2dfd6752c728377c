#!/usr/bin/env python3
"""tools/load_checkpoint.py on a checkpoint that train_ddp writes at its last step.

Runs train_ddp --nproc-per-node 2 --init-seed 0 with --checkpoint-dir and --checkpoint-every equal
to the job's step count, so its last checkpoint holds the final parameters, and --report. Then the
PyTorch of build/torch-venv loads the checkpoint into the tutorial model with load_checkpoint.py,
which must find the report's final_params_bits (train_ddp's own memory, written by another path)
bit for bit. Exit 77 (SKIPPED) when the venv's python is missing.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-ddp", required=True)
    ap.add_argument("--python", required=True, help="a python with torch (build/torch-venv/bin/python)")
    ap.add_argument("--tool", required=True)
    a = ap.parse_args()
    if not os.path.exists(a.python):
        print("SKIPPED: %s not found (CI installs PyTorch there)" % a.python)
        return 77
    if subprocess.run([a.python, "-c", "import torch"], capture_output=True).returncode != 0:
        print("SKIPPED: %s has no torch" % a.python)
        return 77
    work = tempfile.mkdtemp(prefix="ddp_checkpoint_torch.")
    try:
        ck, report = os.path.join(work, "ck"), os.path.join(work, "report.json")
        # 1024 samples, 2 ranks, batch 32: 16 steps per epoch, 48 in 3 epochs.
        subprocess.run([a.train_ddp, "--nproc-per-node", "2", "--init-seed", "0", "--checkpoint-dir", ck,
                        "--checkpoint-every", "48", "--report", report], check=True)
        r = subprocess.run([a.python, a.tool, ck, "--expect-report", report])
        return r.returncode
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
