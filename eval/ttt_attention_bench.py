"""The training-time test's attention: the linear-memory path (drafters.layers.ttt_attention) against the dense
(T, (i+1)T) mask it replaced, forward + backward of every TTT step, alternating A B A B in one process:

    python eval/ttt_attention_bench.py                        # SmolLM2's drafter shape, T 512, batch 4, TTT 7
    python eval/ttt_attention_bench.py --seq-len 2048 --batch 1 --threads 2

Prints the median ms of each path per dtype (a benchmark, not a test; tests/test_eagle3.py checks they agree).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from drafters.layers import ttt_attention, ttt_attention_mask


def dense(q, keys, values, step):
    mask = ttt_attention_mask(q.shape[2], step, q.device)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def seconds(attend, shape: dict, steps: int, dtype) -> float:
    b, hq, hkv, t, d = (shape[k] for k in ("batch", "heads", "kv_heads", "seq_len", "head_dim"))
    inputs = [[torch.randn(*size, dtype=dtype, requires_grad=True) for size in
               ((b, hq, t, d), (b, hkv, (i + 1) * t, d), (b, hkv, (i + 1) * t, d))] for i in range(steps)]
    start = time.perf_counter()
    for i, (q, keys, values) in enumerate(inputs):
        attend(q, keys, values, i).sum().backward()
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2: 9 of head_dim 64, 3 KV heads)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "seq_len": args.seq_len,
             "head_dim": args.head_dim}
    for dtype in (torch.float32, torch.bfloat16):
        times = {"dense mask": [], "linear": []}
        for _ in range(args.repeats):  # A B A B
            times["dense mask"].append(seconds(dense, shape, args.ttt_steps, dtype))
            times["linear"].append(seconds(ttt_attention, shape, args.ttt_steps, dtype))
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(f"{str(dtype).removeprefix('torch.'):9s} {args.ttt_steps} TTT steps fwd+bwd, {shape}: "
              f"dense mask {ms['dense mask']:.0f} ms, linear {ms['linear']:.0f} ms "
              f"({ms['dense mask'] / ms['linear']:.2f}x), {args.threads} thread(s)")


if __name__ == "__main__":
    main()
