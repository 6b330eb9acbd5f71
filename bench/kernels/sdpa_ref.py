"""Outside reference for the decode kernel benchmark: torch scaled_dot_product_attention on
dense BF16 KV (cuDNN backend, enable_gqa=True), the same shapes as bench_kernels.c.

One decode step: q [B, Hq, 1, d], k and v [B, Hkv, N, d], BF16. CUDA events around each call,
back-to-back calls between events (time per call),
median of the repeats, rotating over several KV copies when one copy is small
enough to sit in L2. Prints markdown rows: time and the bandwidth of the K and V bytes read.

usage: python3 sdpa_ref.py [--B 1,8,64] [--N 8192,32768,131072] [--hq 32] [--hkv 8] [--d 128]
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from timing import ints, median_ms, shape_args


def bench(B, N, hq, hkv, d, reps):
    kv_bytes = 2 * B * hkv * N * d * 2
    copies = max(1, min(16, (512 << 20) // kv_bytes))
    g = torch.Generator(device="cuda").manual_seed(B * 1000 + N)
    q = torch.randn(B, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kvs = [(torch.randn(B, hkv, N, d, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(B, hkv, N, d, device="cuda", dtype=torch.bfloat16, generator=g))
           for _ in range(copies)]
    # validate against FP32 math on one copy
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(q, kvs[0][0], kvs[0][1], enable_gqa=True)
    rep = hq // hkv
    k32 = kvs[0][0][:1].float().repeat_interleave(rep, dim=1)
    v32 = kvs[0][1][:1].float().repeat_interleave(rep, dim=1)
    ref = torch.softmax((q[:1].float() @ k32.transpose(-1, -2)) / d ** 0.5, dim=-1) @ v32
    rel = ((o[:1].float() - ref).norm() / ref.norm()).item()
    # back-to-back calls between two events (a torch CUDA graph of cuDNN SDPA captured nothing
    # here); at these sizes the GPU work per call exceeds the host's dispatch time
    runs = max(8, copies)

    def call(j):
        k, v = kvs[j % copies]
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms = median_ms(call, runs, reps)
    mode = "loop"
    del kvs
    torch.cuda.empty_cache()
    return ms, kv_bytes, rel, mode


def main():
    a = shape_args(__doc__).parse_args()
    print(f"# torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}")
    print("| kernel | B | N | time (us) | GB read (K, V) | GB/s | check rel err vs FP32 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for N in ints(a.N):
        for B in ints(a.B):
            ms, nbytes, rel, mode = bench(B, N, a.hq, a.hkv, a.d, a.reps)
            print(f"| cudnn-sdpa-bf16 ({mode}) | {B} | {N} | {ms * 1e3:.1f} | {nbytes / 1e9:.3f} | "
                  f"{nbytes / (ms * 1e-3) / 1e9:.0f} | {rel:.2e} |", flush=True)


if __name__ == "__main__":
    main()
