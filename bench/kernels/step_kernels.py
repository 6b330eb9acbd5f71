#!/usr/bin/env python3
"""step_kernels.py — where one decode step's device time goes, from Nsight Compute's CSV.

    BD_GMC_PROFILE=1:131072 ncu --profile-from-start off --clock-control none \\
        --cache-control none --metrics gpu__time_duration.sum --print-units base --csv \\
        build/bin/gmodel_check --no-model > step.csv
    bench/kernels/step_kernels.py step.csv [--step-us 6100] [--gemm-bytes 8.04e9]

Each kernel of the profiled step (gmodel_check's BD_GMC_PROFILE brackets one graph replay) is
timed alone by ncu, so the sum is the step's kernel time without the gaps between kernels;
--step-us (gmodel_check's median device time of the same bucket) gives the gaps as the
difference. Kernels are grouped: the FP4 decode kernel, cuBLASLt's products (every kernel
whose name is not one of ours), and each of our model kernels by name. --gemm-bytes (the weight
bytes one step reads, e.g. 8.04e9 for Qwen3-4B in BF16) turns the products' time into GB/s.
Prints a markdown table.
"""
import argparse
import csv
import glob
import os
import re
import sys

GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(")
ATTENTION = ("fp4_decode_kernel", "fp4_decode_kernel_persist", "bf16_decode_kernel",
             "ch_decode_kernel")


def our_kernels(folder):
    """The names of the __global__ functions in folder/*.cu: every other kernel of a step is
    cuBLASLt's."""
    names = set()
    for p in glob.glob(os.path.join(folder, "*.cu")):
        with open(p) as f:
            names.update(GLOBAL.findall(re.sub(r"\s+", " ", f.read())))
    return names


def short(name):
    """The kernel's name without its template arguments and parameter list."""
    n = name.replace("(anonymous namespace)::", "").split("(")[0]
    depth, out = 0, []
    for ch in n:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    n = "".join(out).strip()
    return n.split(" ")[-1].split("::")[-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--step-us", type=float, default=0.0)
    ap.add_argument("--gemm-bytes", type=float, default=0.0)
    ap.add_argument("--kernels", default="kernels", help="the folder of our .cu files")
    a = ap.parse_args()
    ours = our_kernels(a.kernels)
    if not ours:
        sys.exit("step_kernels: no __global__ functions under " + a.kernels)
    rows = []
    with open(a.csv, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        ns = v * {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}.get(unit, 1.0)
        rows.append((r["Kernel Name"], ns / 1e3))
    if not rows:
        sys.exit("step_kernels: no gpu__time_duration.sum rows in " + a.csv)
    groups = {}
    for name, us in rows:
        s = short(name)
        if s in ATTENTION:
            key = "attention: " + s
        elif s in ours:
            key = "ours: " + s
        else:
            key = "cuBLASLt products"
        c, t = groups.get(key, (0, 0.0))
        groups[key] = (c + 1, t + us)
    total = sum(t for _, t in groups.values())
    print("| kernels | count | total µs | mean µs | share of kernel time |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for key, (c, t) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"| {key} | {c} | {t:.1f} | {t / c:.2f} | {100 * t / total:.1f} % |")
    print(f"| all kernels | {len(rows)} | {total:.1f} | | 100 % |")
    if a.step_us > 0:
        print(f"| gaps (step {a.step_us:.1f} µs − kernels) | | {a.step_us - total:.1f} | | |")
    g = groups.get("cuBLASLt products")
    if g and a.gemm_bytes > 0:
        print(f"\ncuBLASLt products: {a.gemm_bytes / 1e9:.2f} GB of weights in {g[1]:.1f} µs = "
              f"{a.gemm_bytes / (g[1] * 1e-6) / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
