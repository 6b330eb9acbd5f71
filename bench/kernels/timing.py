"""What the Python references of the kernel benchmark share: the shape flags, and the timing
method (CUDA events around back-to-back calls, median of the repeats), so that cuDNN and
FlashInfer are timed exactly alike."""
import argparse
import statistics

import torch


def shape_args(doc):
    """The flags of bench_kernels.c's shapes: --B, --N (comma lists), --hq, --hkv, --d, --reps."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--B", default="1,8,64")
    ap.add_argument("--N", default="8192,32768,131072")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    return ap


def ints(s):
    return [int(x) for x in s.split(",")]


def median_ms(call, runs, reps, warmup=2):
    """Median over reps of the time per call (ms) of runs back-to-back call(j), j = 0..runs-1,
    between two CUDA events, after warmup untimed repeats."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    torch.cuda.synchronize()
    for i in range(warmup + reps):
        start.record()
        for j in range(runs):
            call(j)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / runs)
    return statistics.median(times)
