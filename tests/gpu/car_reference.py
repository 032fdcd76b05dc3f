"""What the custom allreduce must produce, computed by torch, for the GPU
tests: random per-rank inputs and the float32 sum in rank order 0..N-1 (the
kernel's arithmetic, so results compare bit for bit)."""

import torch


def inputs(n, count, seed, dtype=torch.float32):
    """n random CUDA tensors of `count` elements (drawn in float32, cast)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(count, generator=g, device="cuda", dtype=torch.float32).to(dtype)
            for _ in range(n)]


def rank_order_sum(xs):
    """The float32 sum of xs in rank order, cast back to their dtype."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)
