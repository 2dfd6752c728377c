#!/usr/bin/env python3
"""Converts scikit-learn's copy of the UCI optical handwritten digits into examples/data/digits.csv.

Run once; the CSV is committed and train_ddp --dataset digits (and bench/torch/train_ddp_cpu.py)
read it, so nothing is fetched at run time.

    $(tools/torch-venv.sh)/bin/pip install scikit-learn
    $(tools/torch-venv.sh)/bin/python tools/make_digits.py            # rewrites examples/data/digits.csv

Source: sklearn/datasets/data/digits.csv.gz inside the scikit-learn package: 1,797 rows of 64
pixel counts (8x8, integers 0..16, row-major) and the digit (0..9) as the last column, in the
order of the UCI file. Licence CC BY 4.0 (examples/data/README.md).

Split: perm = torch.randperm(1797, generator=torch.Generator().manual_seed(0)); the rows perm[:1437]
are the training split, perm[1437:] (360) the held-out split. torch is used when it imports; else
the same permutation is made here from MT19937 (torch's CPU generator: manual_seed(s) =
init_genrand(s), randperm(n) = for i in 0..n-2: swap(a[i], a[i + random() % (n - i)])), and
when both are there they are checked against each other.

Output, one row per image in the source's order: split (train | heldout), index (row in the
source), label, p0..p63. Lines starting with '#' are comments.
"""
import argparse
import csv
import gzip
import io
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, TRAIN, SEED = 1797, 1437, 0


def mt19937_words(seed):
    """Python's random.Random is MT19937 too, but seeds through init_by_array; this is init_genrand."""
    mt = [0] * 624
    mt[0] = seed & 0xFFFFFFFF
    for i in range(1, 624):
        mt[i] = (1812433253 * (mt[i - 1] ^ (mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
    index = 624
    while True:
        if index == 624:
            for i in range(624):
                y = (mt[i] & 0x80000000) | (mt[(i + 1) % 624] & 0x7FFFFFFF)
                mt[i] = mt[(i + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            index = 0
        y = mt[index]
        index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        yield y


def randperm(n, seed):
    words = mt19937_words(seed)
    a = list(range(n))
    for i in range(n - 1):
        j = i + next(words) % (n - i)
        a[i], a[j] = a[j], a[i]
    return a


def split_permutation():
    perm = randperm(N, SEED)
    try:
        import torch
    except ImportError:
        return perm
    t = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()
    if t != perm:
        raise SystemExit("torch.randperm disagrees with the MT19937 port")
    return t


def sklearn_csv():
    import sklearn  # only to find the file inside the package

    return os.path.join(os.path.dirname(sklearn.__file__), "datasets", "data", "digits.csv.gz")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default=None, help="digits.csv.gz (default: the one in the installed scikit-learn)")
    p.add_argument("--out", default=os.path.join(ROOT, "examples", "data", "digits.csv"))
    a = p.parse_args()
    source = a.source or sklearn_csv()
    with gzip.open(source, "rt") as f:
        rows = [[int(v) for v in r] for r in csv.reader(f) if r]
    if len(rows) != N or any(len(r) != 65 for r in rows):
        raise SystemExit(f"{source}: expected {N} rows of 64 pixels + label")
    if any(not 0 <= v <= 16 for r in rows for v in r[:64]) or any(not 0 <= r[64] <= 9 for r in rows):
        raise SystemExit(f"{source}: pixel outside 0..16 or label outside 0..9")
    perm = split_permutation()
    train = set(perm[:TRAIN])
    out = io.StringIO()
    out.write("# UCI optical recognition of handwritten digits, scikit-learn's copy (sklearn/datasets/data/digits.csv.gz)\n")
    out.write("# E. Alpaydin, C. Kaynak (1998), https://archive.ics.uci.edu/dataset/80, licence CC BY 4.0. Made by tools/make_digits.py.\n")
    out.write(f"# split: perm = torch.randperm({N}, generator=torch.Generator().manual_seed({SEED})); "
              f"train = perm[:{TRAIN}], heldout = perm[{TRAIN}:]\n")
    out.write("split,index,label," + ",".join(f"p{i}" for i in range(64)) + "\n")
    for i, r in enumerate(rows):
        out.write(("train" if i in train else "heldout") + f",{i},{r[64]}," + ",".join(map(str, r[:64])) + "\n")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", newline="") as f:
        f.write(out.getvalue())
    print(f"wrote {a.out}: {len(train)} train, {N - len(train)} held out, {len(out.getvalue())} bytes")


if __name__ == "__main__":
    main()
