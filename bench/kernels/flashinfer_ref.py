"""Outside anchors for the decode kernel benchmark: FlashInfer's paged batch decode
(BatchDecodeWithPagedKVCacheWrapper) with BF16 KV and with FP8 (E4M3) KV, the shapes of
bench_kernels.c, plus the device's copy bandwidth and the bytes floors of FP8 and of bdfp4's
FP4 pages at that bandwidth.

One decode step: q [B, Hq, d] BF16, a paged KV cache of page_size tokens per page (NHD), every
request N tokens long, its pages scattered over the cache in a shuffled order. FP8 KV is E4M3
with k_scale = v_scale = 1 (the random KV is N(0, 1), inside E4M3's range). Each variant runs
with FlashInfer's CUDA-core decode kernel and, where it has one for the dtype, its tensor-core
path (use_tensor_cores=True). CUDA events around back-to-back calls, median of the repeats,
rotating over several caches when one is small enough to sit in L2. Each variant is first checked
against FP32 attention on the first request (relative error).

The bytes floor of a configuration is its KV bytes read once over the measured copy bandwidth
(device-to-device copy, read + write counted): FP8 reads 1 byte per element; bdfp4's NVFP4 page
reads 18 KiB per KV head of 128 tokens at d = 128 (codes, E4M3 block scales, decode scales),
i.e. 144 bytes per token and KV head (K and V together), lib/quant/bd_layout.h.

usage: python3 flashinfer_ref.py [--B 1,8,64] [--N 8192,32768,131072] [--hq 32] [--hkv 8]
                                 [--d 128] [--page 16] [--reps 20]
"""
import torch

from timing import ints, median_ms, shape_args


def copy_bandwidth():
    """Device-to-device copy of 4 GiB, read + write bytes over the median time (GB/s)."""
    n = 1 << 31
    a = torch.empty(n, dtype=torch.float16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = median_ms(lambda j: b.copy_(a), 1, 10)
    gbs = 2 * a.numel() * a.element_size() / (ms * 1e-3) / 1e9
    del a, b
    torch.cuda.empty_cache()
    return gbs


def fp4_bytes(B, N, hkv, d):
    """bdfp4 NVFP4 bytes read by one decode step: full pages of K and V (codes d/2 + scales
    d/16 per token each) plus the page decode scales; the BF16 sink/recent rows are left out
    (they are under 1 % at N >= 8K)."""
    per_token_head = 2 * (d // 2 + d // 16)
    return B * N * hkv * per_token_head


def make_cache(B, N, hkv, d, page, dtype, g):
    pages_per_req = (N + page - 1) // page
    total = B * pages_per_req
    k = torch.randn(total, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(total, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    if dtype != torch.bfloat16:
        k, v = k.to(dtype), v.to(dtype)
    perm = torch.randperm(total, device="cuda", generator=g).to(torch.int32)
    indptr = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * pages_per_req
    last = torch.full((B,), N - (pages_per_req - 1) * page, device="cuda", dtype=torch.int32)
    return (k, v), perm, indptr, last


def reference(q, kv, perm, indptr, last, page, hq, hkv, d):
    """FP32 attention of request 0 over its pages in block-table order."""
    k, v = kv
    ids = perm[indptr[0]:indptr[1]].long()
    n = (ids.numel() - 1) * page + int(last[0])
    k0 = k[ids].reshape(-1, hkv, d)[:n].float()
    v0 = v[ids].reshape(-1, hkv, d)[:n].float()
    rep = hq // hkv
    kq = k0.repeat_interleave(rep, dim=1).permute(1, 0, 2)  # [hq, n, d]
    vq = v0.repeat_interleave(rep, dim=1).permute(1, 0, 2)
    s = (q[0].float().unsqueeze(1) @ kq.transpose(-1, -2)) / d ** 0.5  # [hq, 1, n]
    return (torch.softmax(s, dim=-1) @ vq).squeeze(1)  # [hq, d]


def bench(fi, B, N, hq, hkv, d, page, dtype, tensor_cores, reps):
    elem = 1 if dtype != torch.bfloat16 else 2
    kv_bytes = 2 * B * N * hkv * d * elem
    copies = max(1, min(8, (512 << 20) // kv_bytes))
    g = torch.Generator(device="cuda").manual_seed(B * 1000 + N)
    q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    caches = [make_cache(B, N, hkv, d, page, dtype, g) for _ in range(copies)]
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    wrappers = []
    for kv, perm, indptr, last in caches:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
        w.plan(indptr, perm, last, hq, hkv, d, page, pos_encoding_mode="NONE",
               q_data_type=torch.bfloat16, kv_data_type=dtype)
        wrappers.append(w)
    kv, perm, indptr, last = caches[0]
    o = wrappers[0].run(q, kv, k_scale=1.0, v_scale=1.0)
    ref = reference(q, kv, perm, indptr, last, page, hq, hkv, d)
    rel = ((o[0].float() - ref).norm() / ref.norm()).item()
    runs = max(8, copies)
    ms = median_ms(lambda j: wrappers[j % copies].run(q, caches[j % copies][0], k_scale=1.0,
                                                      v_scale=1.0), runs, reps)
    del caches, wrappers, ws
    torch.cuda.empty_cache()
    return ms, kv_bytes, rel


def main():
    ap = shape_args(__doc__)
    ap.add_argument("--page", type=int, default=16)
    a = ap.parse_args()
    import flashinfer as fi

    bw = copy_bandwidth()
    print(f"# flashinfer {fi.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s (read + write)")
    print(f"# Hq {a.hq}, Hkv {a.hkv}, d {a.d}, page {a.page} tokens")
    print("| kernel | B | N | time (us) | GB read (K, V) | GB/s | bytes floor (us) | "
          "check rel err vs FP32 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    variants = [("bf16", torch.bfloat16, False), ("bf16", torch.bfloat16, True),
                ("fp8-e4m3", torch.float8_e4m3fn, False), ("fp8-e4m3", torch.float8_e4m3fn, True)]
    for N in ints(a.N):
        for B in ints(a.B):
            for name, dtype, tc in variants:
                label = f"flashinfer-{name}{'-tc' if tc else ''}"
                try:
                    ms, nbytes, rel = bench(fi, B, N, a.hq, a.hkv, a.d, a.page, dtype, tc,
                                            a.reps)
                except Exception as e:  # a path FlashInfer lacks for this dtype: say so
                    print(f"| {label} | {B} | {N} | n/a | | | | {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:80]} |", flush=True)
                    torch.cuda.empty_cache()
                    continue
                floor = nbytes / (bw * 1e9) * 1e6
                print(f"| {label} | {B} | {N} | {ms * 1e3:.1f} | {nbytes / 1e9:.3f} | "
                      f"{nbytes / (ms * 1e-3) / 1e9:.0f} | {floor:.1f} | {rel:.2e} |",
                      flush=True)
            fb = fp4_bytes(B, N, a.hkv, a.d)
            print(f"| floor: bdfp4 nvfp4 pages | {B} | {N} | | {fb / 1e9:.3f} | | "
                  f"{fb / (bw * 1e9) * 1e6:.1f} | |", flush=True)


if __name__ == "__main__":
    main()
