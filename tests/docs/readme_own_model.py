#!/usr/bin/env python3
"""The README's "DDP on your own model" program, compiled and run as the README shows it.

The C++ block after the README's `<!-- tested: own_model -->` line is written to a file as it
stands, compiled against include/, and run alone (a world of one) and under ddprun with 2 and 3
ranks. Rank 0 prints the parameters after every epoch. They are checked against an independent
computation in float64: plain minibatch SGD on the same data, in the order PyTorch's
DistributedSampler gives (torch.randperm from an MT19937 written here, itself checked against the
permutations recorded from PyTorch in tests/data/sampler.json), each step's gradient being the mean
over ranks of each rank's batch-mean gradient. The `# epoch ...` lines the README shows as the
2-rank output are checked against the same computation.

The check has teeth: for W > 1 the script also computes what a run would print if the ranks did
not shard the data (each trained on rank 0's batches) or summed the gradients instead of averaging
them, and requires both to be far outside the tolerance.
"""
import argparse
import json
import os
import re
import subprocess
import sys

TOL = 2e-4  # the program computes in float32 and prints 6 significant digits


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


# --- the README ---------------------------------------------------------------------------------

def readme_blocks(path, marker="<!-- tested: own_model -->"):
    """The fenced code block right after the marker, and the fenced block after that one."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == marker)
    except StopIteration:
        fail(f"{path} has no line '{marker}'")
    blocks = []
    i = start + 1
    while len(blocks) < 2 and i < len(lines):
        if lines[i].startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                fail(f"{path}: unterminated code block at line {i + 1}")
            blocks.append((lines[i][3:].strip(), "\n".join(lines[i + 1:end]) + "\n"))
            i = end + 1
        else:
            i += 1
    if len(blocks) < 2 or blocks[0][0] != "cpp":
        fail(f"{path}: expected a ```cpp block and then the block with the commands after '{marker}'")
    return blocks[0][1], blocks[1][1]


EPOCH_LINE = re.compile(r"epoch (\d+): w = (\S+) (\S+) (\S+) (\S+), b = (\S+)")


def epoch_lines(text):
    """{epoch: [w0, w1, w2, w3, b]} from the program's (or the README's) output lines."""
    out = {}
    for m in EPOCH_LINE.finditer(text):
        out[int(m.group(1))] = [float(v) for v in m.groups()[1:]]
    return out


# --- PyTorch's DistributedSampler, independently --------------------------------------------------

class MT19937:
    """The standard 32-bit Mersenne Twister, seeded with init_genrand as torch.Generator.manual_seed."""

    def __init__(self, seed):
        self.mt = [0] * 624
        self.mt[0] = seed & 0xFFFFFFFF
        for i in range(1, 624):
            self.mt[i] = (1812433253 * (self.mt[i - 1] ^ (self.mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
        self.index = 624

    def random(self):
        if self.index >= 624:
            mt = self.mt
            for i in range(624):
                y = (mt[i] & 0x80000000) | (mt[(i + 1) % 624] & 0x7FFFFFFF)
                mt[i] = mt[(i + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.index = 0
        y = self.mt[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)


def randperm(n, seed):
    """torch.randperm(n, generator=torch.Generator().manual_seed(seed)) for small n."""
    gen = MT19937(seed)
    a = list(range(n))
    for i in range(n - 1):
        z = gen.random() % (n - i)
        a[i], a[i + z] = a[i + z], a[i]
    return a


def sampler_indices(n, world, rank, epoch, seed=0):
    """DistributedSampler(shuffle=True, drop_last=False) after set_epoch(epoch)."""
    order = randperm(n, seed + epoch)
    num_samples = -(-n // world)
    total = num_samples * world
    padded = [order[p % n] for p in range(total)]
    return padded[rank:total:world]


def check_sampler_against_pytorch(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    checked = 0
    for case in data["randperm"]:
        if randperm(case["n"], case["seed"]) != case["perm"]:
            fail(f"the reference randperm({case['n']}, seed {case['seed']}) is not PyTorch's")
        checked += 1
    for case in data["cases"]:
        if case["shuffle"] and not case["drop_last"]:
            got = sampler_indices(case["n"], case["num_replicas"], case["rank"], case["epoch"], case["seed"])
            if got != case["indices"]:
                fail(f"the reference sampler differs from PyTorch's for {case}")
            checked += 1
    print(f"reference sampler: equal to PyTorch's in {checked} recorded cases")


# --- the model's math, in float64 -----------------------------------------------------------------

def feature(i, k):
    return ((i * (k + 3) + k) % 16) / 8 - 1


def target(i):
    return 1 + 2 * feature(i, 0) - 3 * feature(i, 1) + feature(i, 2) - feature(i, 3) / 2


def batch_gradient(w, b, batch):
    """Mean over the batch of the gradient of (w.x + b - y)^2."""
    dw = [0.0] * 4
    db = 0.0
    for i in batch:
        err = b - target(i) + sum(w[k] * feature(i, k) for k in range(4))
        for k in range(4):
            dw[k] += 2 * err * feature(i, k) / len(batch)
        db += 2 * err / len(batch)
    return dw, db


def expected(world, n=256, batch=16, epochs=4, lr=0.05, variant="ddp"):
    """What rank 0 prints after each epoch: SGD whose step gradient is the mean over ranks of each
    rank's batch-mean gradient. variant 'unsharded': every rank trains on rank 0's batches;
    'summed': the ranks' gradients are summed instead of averaged."""
    w = [0.0] * 4
    b = 0.0
    out = {}
    for epoch in range(epochs):
        shards = [sampler_indices(n, world, 0 if variant == "unsharded" else r, epoch) for r in range(world)]
        steps = -(-len(shards[0]) // batch)
        for s in range(steps):
            grads = [batch_gradient(w, b, shard[s * batch:(s + 1) * batch]) for shard in shards]
            scale = 1.0 if variant == "summed" else 1.0 / world
            for k in range(4):
                w[k] -= lr * scale * sum(g[0][k] for g in grads)
            b -= lr * scale * sum(g[1] for g in grads)
        out[epoch] = w + [b]
    return out


def distance(a, b):
    """Largest difference relative to max(1, |value|) over every epoch's parameters."""
    if sorted(a) != sorted(b):
        return float("inf")
    return max(abs(x - y) / max(1.0, abs(y)) for e in a for x, y in zip(a[e], b[e]))


def show(lines):
    return "\n".join(f"  epoch {e}: " + " ".join(f"{v:.6g}" for v in lines[e]) for e in sorted(lines))


# --- the test -----------------------------------------------------------------------------------

def clean_environment():
    """This process's environment without any launcher's variables: alone, the program is a world of one."""
    prefixes = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "FLUX_", "PALS_", "JSM_", "LSB_", "TORCHELASTIC_",
                "PET_", "DDP_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "ROLE_RANK", "ROLE_WORLD_SIZE"}
    return {k: v for k, v in os.environ.items() if k not in names and not k.startswith(prefixes)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readme", required=True)
    ap.add_argument("--include", required=True, help="the library's include/ folder")
    ap.add_argument("--cxx", required=True, help="the C++ compiler")
    ap.add_argument("--cxx-flags", default="", help="extra compiler flags, ';'-separated (CMake list)")
    ap.add_argument("--libs", default="", help="libraries to link, ';'-separated (CMake list)")
    ap.add_argument("--ddprun", required=True)
    ap.add_argument("--sampler-data", required=True, help="tests/data/sampler.json")
    ap.add_argument("--work", required=True, help="a folder for the extracted source and the program")
    args = ap.parse_args()

    check_sampler_against_pytorch(args.sampler_data)

    source, commands = readme_blocks(args.readme)
    os.makedirs(args.work, exist_ok=True)
    cpp = os.path.join(args.work, "own_model.cpp")
    exe = os.path.join(args.work, "own_model")
    with open(cpp, "w", encoding="utf-8") as f:
        f.write(source)
    # -O1: the math is tiny, and the ring backend the program instantiates compiles in half the time of -O2.
    cmd = [args.cxx, "-std=c++20", "-O1", "-Wall", "-Wextra", "-Wpedantic", "-Wshadow", "-Werror",
           "-Wno-missing-field-initializers", *[f for f in args.cxx_flags.split(";") if f],
           "-I", args.include, cpp, "-o", exe, "-pthread", *[lib for lib in args.libs.split(";") if lib]]
    print("compiling the README's program:", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout)
        fail("the README's program does not compile")

    # What the README says of the math: 2 ranks of batches(16) take the steps of one process with batches(32).
    d = distance(expected(2), expected(1, batch=32))
    if d > 1e-12:
        fail(f"2 ranks of 16 samples and 1 rank of 32 differ by {d:.2e} in the reference")

    env = clean_environment()
    env["DDP_TIMEOUT"] = "60"
    shown = epoch_lines(commands)
    failures = []
    for world in (1, 2, 3):
        if world == 1:
            run = [exe]
        else:
            run = [args.ddprun, "--standalone", "--nnodes=1", f"--nproc-per-node={world}", exe]
        r = subprocess.run(run, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
        got = epoch_lines(r.stdout)
        want = expected(world)
        d = distance(got, want)
        how = "alone" if world == 1 else f"under ddprun with {world} ranks"
        print(f"W={world} ({how}): rc {r.returncode}, largest difference from the float64 reference {d:.2e}")
        if r.returncode != 0 or d > TOL:
            failures.append(f"W={world}: rc {r.returncode}, difference {d:.2e} > {TOL}\n"
                            f" printed:\n{show(got) or '  (nothing)'}\n expected:\n{show(want)}\n"
                            f" stdout:\n{r.stdout}\n stderr:\n{r.stderr}")
        if world > 1:
            for variant in ("unsharded", "summed"):
                wrong = distance(expected(world, variant=variant), want)
                if wrong < 50 * TOL:
                    failures.append(f"W={world}: a run with {variant} gradients would differ by only {wrong:.2e}: "
                                    "the check cannot tell it from a correct one")
            if world == 2:
                d = distance(shown, want)
                print(f"the README's 2-rank output lines: largest difference from the reference {d:.2e}")
                if d > TOL:
                    failures.append(f"the README shows for 2 ranks:\n{show(shown) or '  (no epoch lines)'}\n"
                                    f" the reference gives:\n{show(want)}")
    if failures:
        fail("\n".join(failures))
    print("PASS")


if __name__ == "__main__":
    main()
