"""One table from the logs of one anchors run (bench/kernels/anchors.sh): bdfp4's kernels
(bench_kernels), cuDNN BF16 (sdpa_ref.py) and FlashInfer BF16 / FP8 (flashinfer_ref.py) at the
same shapes, with the bytes floors of FP8 and of bdfp4's FP4 pages at the measured copy
bandwidth, and the full recipe's speed-up over the best FP8 and the best BF16 kernel.

usage: python3 anchors_table.py LOGDIR HKV     (reads bench_hkvH.log, sdpa_hkvH.log, fi_hkvH.log)
"""
import sys


def rows(path):
    out = []
    for line in open(path):
        if line.startswith("| ") and not line.startswith(("| ---", "| kernel")):
            out.append([c.strip() for c in line.strip().strip("|").split("|")])
    return out


def main():
    d, hkv = sys.argv[1], sys.argv[2]
    ours, cudnn, fi, floor = {}, {}, {}, {}
    for r in rows(f"{d}/bench_hkv{hkv}.log"):
        ours[(r[0], int(r[1]), int(r[2]))] = float(r[4])
    for r in rows(f"{d}/sdpa_hkv{hkv}.log"):
        cudnn[(int(r[1]), int(r[2]))] = float(r[3])
    for r in rows(f"{d}/fi_hkv{hkv}.log"):
        key = (int(r[1]), int(r[2]))
        if r[0].startswith("floor"):
            floor[("fp4",) + key] = float(r[6])
            continue
        if r[3] != "n/a":
            fi[(r[0],) + key] = float(r[3])
        if r[0] == "flashinfer-fp8-e4m3":
            floor[("fp8",) + key] = float(r[6])
    shapes = sorted({(n, b) for (_, b, n) in ours})
    print("| B | N | FP4 full | MXFP4 | BF16 ours | cuDNN BF16 | FI BF16 (cores / TC) | "
          "FI FP8 (cores / TC) | FP8 floor | FP4 floor | full vs best FP8 | full vs cuDNN | "
          "full vs best BF16 |")
    print("| --- " * 13 + "|")

    def get(t, *k):
        return t.get(k, float("nan"))

    for n, b in shapes:
        f = get(ours, "bitdecoding-nvfp4", b, n)
        bf = [get(ours, "bf16", b, n), get(cudnn, b, n), get(fi, "flashinfer-bf16", b, n),
              get(fi, "flashinfer-bf16-tc", b, n)]
        f8 = [get(fi, "flashinfer-fp8-e4m3", b, n), get(fi, "flashinfer-fp8-e4m3-tc", b, n)]
        best8 = min(x for x in f8 if x == x) if any(x == x for x in f8) else float("nan")
        bestb = min(x for x in bf if x == x)
        print(f"| {b} | {n} | {f:.1f} | {get(ours, 'bitdecoding-mxfp4', b, n):.1f} | "
              f"{bf[0]:.1f} | {bf[1]:.1f} | {bf[2]:.1f} / {bf[3]:.1f} | {f8[0]:.1f} / {f8[1]:.1f} | "
              f"{get(floor, 'fp8', b, n):.1f} | {get(floor, 'fp4', b, n):.1f} | "
              f"{best8 / f:.2f}× | {bf[1] / f:.2f}× | {bestb / f:.2f}× |")


if __name__ == "__main__":
    main()
