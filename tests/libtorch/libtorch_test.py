#!/usr/bin/env python3
"""examples/libtorch_ddp and the libtorch adapter, checked against PyTorch.

    libtorch_test.py --example BIN --adapter-test BIN --ddprun BIN --source DIR --venv DIR CASE

CASE is one of
  adapter_w1, adapter_w2   libtorch_adapter_test alone, and under ddprun with 2 ranks;
  golden_w1, golden_w2     libtorch_ddp --init-seed 0 alone (a world of one) and under ddprun with
                           2 ranks: the printed lines must be the golden data's
                           (tests/data/training.json, made with PyTorch on another CPU); step
                           losses and final parameters against it are reported in ulps. With the
                           venv, also PyTorch's own tutorial script (bench/torch/train_ddp_cpu.py)
                           under its torchrun at the same W: step losses and final parameters must
                           then be bit for bit equal (same kernels, same CPU; W = 2 averages as
                           g0 / 2 + g1 / 2 = (g0 + g1) / 2 exactly);
  mpirun_w2                libtorch_ddp under Open MPI's mpirun (ring backend, ddp's store):
                           lines equal to the golden data's (SKIPPED without mpirun);
  torchrun_w2, torchrun_w3 libtorch_ddp under the venv's torchrun (--no-python), against the
                           Python script under the same torchrun: lines equal; at W = 2 also the
                           bits (at W = 3 gloo's sum order and DDP's pre-division by 3 differ
                           from ddp's ring in the last bit, so lines only).
PyTorch's gloo workers sometimes abort at exit ("terminate called without an active exception",
after printing every line): such a reference run is retried, up to five times.
"""
import argparse
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

DEADLINE_S = 120


def clean_env():
    """The caller's launcher variables must not leak into the runs."""
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "DDP_", "FLUX_", "PALS_", "JSM_")) or k in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "GROUP_WORLD_SIZE"):
            del env[k]
    env["OMP_NUM_THREADS"] = "1"
    return env


def run(cmd, what):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise SystemExit(f"FAIL: {what}: not finished within {DEADLINE_S} s")
    return p.returncode, out, err


def lines_of(text):
    return [l for l in text.splitlines() if l.startswith("Epoch ") and "local loss sum" in l]


def f2u(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def h2u(h):
    return struct.unpack("<I", bytes.fromhex(h))[0]


def ulps(a, b):
    key = lambda u: u if u < 0x80000000 else 0x80000000 - u  # noqa: E731 (monotone over signs)
    return abs(key(a) - key(b))


def compare(what, mine, ref):
    """(identical, total, max ulp) over two lists of float32 bit patterns."""
    if len(mine) != len(ref):
        raise SystemExit(f"FAIL: {what}: {len(mine)} values here, {len(ref)} in the reference")
    same = sum(a == b for a, b in zip(mine, ref))
    return same, len(ref), max((ulps(a, b) for a, b in zip(mine, ref)), default=0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(a, w):
    return [os.path.join(a.venv, "bin", "torchrun"), "--nnodes=1", f"--nproc-per-node={w}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}"]


def have_venv(a):
    return os.access(os.path.join(a.venv, "bin", "torchrun"), os.X_OK)


def python_reference(a, w, d):
    """PyTorch's tutorial script under the venv's torchrun: (lines, report)."""
    report = os.path.join(d, f"python_w{w}.json")
    script = os.path.join(a.source, "bench", "torch", "train_ddp_cpu.py")
    for attempt in range(5):
        rc, out, err = run(torchrun(a, w) + [script, "--init-seed", "0", "--report", report], f"PyTorch W={w}")
        if rc == 0 and len(lines_of(out)) == 3 and os.path.exists(report):
            if attempt:
                print(f"      (PyTorch reference: attempt {attempt + 1}, the earlier ones aborted at exit)")
            with open(report) as f:
                return lines_of(out), json.load(f)
    raise SystemExit(f"FAIL: the PyTorch reference run (W={w}) failed five times (exit {rc}):\n{err[-2000:]}")


def run_example(a, w, launcher, d, extra=()):
    report = os.path.join(d, f"libtorch_w{w}_{launcher}.json")
    args = [a.example, "--init-seed", "0", "--report", report] + list(extra)
    if launcher == "none":
        cmd = args
    elif launcher == "mpirun":
        cmd = [shutil.which("mpirun"), "-n", str(w), "--oversubscribe", "--bind-to", "none"] + (
            ["--allow-run-as-root"] if os.geteuid() == 0 else []) + args
    elif launcher == "ddprun":
        cmd = [a.ddprun, "--standalone", "--nnodes=1", f"--nproc-per-node={w}"] + args
    else:
        cmd = torchrun(a, w) + ["--no-python"] + args
    rc, out, err = run(cmd, f"libtorch_ddp W={w} ({launcher})")
    if rc != 0 or not os.path.exists(report):
        raise SystemExit(f"FAIL: libtorch_ddp W={w} under {launcher}: exit {rc}\n{err[-3000:]}")
    with open(report) as f:
        return lines_of(out), json.load(f)


def check_lines(what, got, expected):
    if got != expected:
        print(f"FAIL: {what}:\n  expected: {expected}\n  printed:  {got}")
        return False
    print(f"ok    {what}: {len(got)} lines equal")
    return True


def check_bits(what, mine, ref, strict):
    s = compare(f"{what} step losses", [f2u(x) for x in mine["step_losses_rank0"]], [f2u(x) for x in ref["step_losses_rank0"]])
    p = compare(f"{what} final parameters", mine["final_params_bits"], ref["final_params_bits"])
    text = (f"{what}: step losses {s[0]}/{s[1]} bit-identical (max {s[2]} ulp), "
            f"final parameters {p[0]}/{p[1]} (max {p[2]} ulp)")
    ok = s[0] == s[1] and p[0] == p[1]
    print(("ok    " if ok or not strict else "FAIL: ") + text)
    return ok or not strict


def golden_bits(w, mine, source):
    with open(os.path.join(source, "tests", "data", "training.json")) as f:
        g = json.load(f)[f"W{w}_simulated"]
    steps = [h2u(h) for epoch in g["step_losses_by_rank"][0] for h in epoch["hex"]]
    params = [h2u(h) for name in g["final_params"] for h in g["final_params"][name]["hex"]]
    s = compare("golden step losses", [f2u(x) for x in mine["step_losses_rank0"]], steps)
    p = compare("golden final parameters", mine["final_params_bits"], params)
    print(f"info  against the golden data (made on another CPU): step losses {s[0]}/{s[1]} bit-identical "
          f"(max {s[2]} ulp), final parameters {p[0]}/{p[1]} (max {p[2]} ulp)")
    return g["tutorial_print_lines"]


def case_adapter(a, w):
    cmd = [a.adapter_test] if w == 1 else [a.ddprun, "--standalone", "--nnodes=1", f"--nproc-per-node={w}", a.adapter_test]
    rc, out, err = run(cmd, f"adapter W={w}")
    print(out + err)
    return rc == 0


def case_golden(a, w, d):
    lines, mine = run_example(a, w, "none" if w == 1 else "ddprun", d)
    ok = check_lines(f"libtorch_ddp W={w} ({'alone' if w == 1 else 'ddprun'}) vs golden data", lines, golden_bits(w, mine, a.source))
    if have_venv(a):
        _, ref = python_reference(a, w, d)
        ok &= check_bits(f"W={w} vs PyTorch DDP on this CPU", mine, ref, strict=True)
    else:
        print("      (no venv: the bit-for-bit comparison with live PyTorch is skipped)")
    return ok


def case_mpirun(a, w, d):
    if not shutil.which("mpirun"):
        print("SKIPPED: no mpirun")
        sys.exit(77)
    lines, mine = run_example(a, w, "mpirun", d)
    return check_lines(f"libtorch_ddp under mpirun -n {w} vs golden data", lines, golden_bits(w, mine, a.source))


def case_torchrun(a, w, d):
    ref_lines, ref = python_reference(a, w, d)
    lines, mine = run_example(a, w, "torchrun", d)
    ok = check_lines(f"libtorch_ddp under torchrun W={w} vs PyTorch's lines", lines, ref_lines)
    ok &= check_bits(f"W={w} under torchrun vs PyTorch DDP", mine, ref, strict=(w <= 2))
    return ok


def case_cuda(a, w, d):
    """The CUDA build on GPUs (nccl backend): the golden lines within 2e-3 (GPU kernels sum in
    another order than the CPU's, so not bit for bit)."""
    rc, out, err = run([a.example, "--device", "cuda", "--epochs", "0"], "libtorch_ddp --device cuda")
    for reason in ("needs the CUDA build", "sees no CUDA device"):
        if rc != 0 and reason in err:
            print(f"SKIPPED: {err.strip().splitlines()[-1]}")
            sys.exit(77)
    if rc != 0:
        raise SystemExit(f"FAIL: libtorch_ddp --device cuda --epochs 0: exit {rc}\n{err[-2000:]}")
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ") if shutil.which("nvidia-smi") else 0
    if gpus < w:
        print(f"SKIPPED: {w} ranks need {w} GPUs, this machine has {gpus}")
        sys.exit(77)
    lines, mine = run_example(a, w, "none" if w == 1 else "ddprun", d, ["--device", "cuda"])
    with open(os.path.join(a.source, "tests", "data", "training.json")) as f:
        golden = json.load(f)[f"W{w}_simulated"]["tutorial_print_lines"]
    value = lambda l: float(l.rsplit("=", 1)[1])
    ok = len(lines) == len(golden) and all(abs(value(x) - value(y)) <= 2e-3 for x, y in zip(lines, golden))
    print(("ok    " if ok else "FAIL: ") + f"libtorch_ddp --device cuda W={w}: {lines} vs golden {golden} (within 2e-3)")
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--example", required=True)
    p.add_argument("--adapter-test", required=True)
    p.add_argument("--ddprun", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--venv", required=True)
    p.add_argument("case")
    a = p.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddp-libtorch-") as d:
        kind, w = a.case.rsplit("_w", 1)
        w = int(w)
        if kind == "adapter":
            ok = case_adapter(a, w)
        elif kind == "golden":
            ok = case_golden(a, w, d)
        elif kind == "mpirun":
            ok = case_mpirun(a, w, d)
        elif kind == "torchrun":
            ok = case_torchrun(a, w, d)
        elif kind == "cuda":
            ok = case_cuda(a, w, d)
        else:
            raise SystemExit(f"unknown case {a.case}")
    print(f"{'PASS' if ok else 'FAIL'} {a.case} ({time.monotonic() - start:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
