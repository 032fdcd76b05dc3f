"""A small decoder-only transformer split the way tensor-parallel inference
servers split one, for the demo.

Per layer (pre-norm, RMSNorm, as Llama): attention whose heads are divided
over the ranks (the fused QKV projection is column-parallel, the output
projection row-parallel: one allreduce) and an MLP (up column-parallel, down
row-parallel: one allreduce). The embedding is vocab-parallel (each rank
holds a slice of the rows: one allreduce), the LM head column-parallel over
the vocabulary (one all-gather). Every allreduce is followed by the residual
add and the next RMSNorm, so each is one all_reduce_add_rms_norm: a decode
step makes 2 x layers + 1 of them and one all-gather.

The same code with one rank and no communicator is the single-process
reference. Weights are drawn from a seeded generator in float64 (no
downloads); each rank keeps its shard. A decode step is one token per
sequence at one position; the key/value cache and the position are tensors,
so a step can be captured in a CUDA graph and replayed.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

EPS = 1e-5  # RMSNorm's


@dataclass(frozen=True)
class Config:
    vocab: int = 3072
    hidden: int = 384
    heads: int = 12
    layers: int = 4
    ffn: int = 1536
    batch: int = 8
    prompt: int = 4
    seed: int = 2024

    @property
    def head_dim(self):
        return self.hidden // self.heads

    def check_tp(self, tp):
        for name, size in (("heads", self.heads), ("vocab", self.vocab), ("ffn", self.ffn)):
            if size % tp:
                divisors = [d for d in range(1, self.heads + 1) if self.heads % d == 0]
                raise ValueError(f"--tp {tp} does not divide the model's {name} ({size}); "
                                 f"use one of {divisors}")


def full_weights(cfg):
    """Every weight of the model, float64 on CPU, from cfg.seed."""
    g = torch.Generator().manual_seed(cfg.seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    h, f = cfg.hidden, cfg.ffn
    w = {"embed": randn(cfg.vocab, h), "pos": randn(4096, h, scale=0.1)}
    for i in range(cfg.layers):
        w.update({
            f"{i}.ln1.w": 1 + randn(h, scale=0.1),
            f"{i}.qkv.w": randn(3 * h, h, scale=h ** -0.5), f"{i}.qkv.b": randn(3 * h, scale=0.1),
            f"{i}.o.w": randn(h, h, scale=h ** -0.5),
            f"{i}.ln2.w": 1 + randn(h, scale=0.1),
            f"{i}.up.w": randn(f, h, scale=h ** -0.5), f"{i}.up.b": randn(f, scale=0.1),
            f"{i}.down.w": randn(h, f, scale=f ** -0.5),
        })
    w.update({"lnf.w": 1 + randn(h, scale=0.1), "head": randn(cfg.vocab, h, scale=2 * h ** -0.5)})
    return w


def prompts(cfg):
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randint(0, cfg.vocab, (cfg.batch, cfg.prompt), generator=g)


def shard(weights, cfg, rank, size):
    """This rank's slice of every weight (rows of column-parallel layers,
    columns of row-parallel ones; norm weights whole)."""
    def rows(t, n):
        return t.reshape(size, n // size, *t.shape[1:])[rank]

    h = cfg.hidden
    out = {"embed": rows(weights["embed"], cfg.vocab), "pos": weights["pos"],
           "head": rows(weights["head"], cfg.vocab), "lnf.w": weights["lnf.w"]}
    for i in range(cfg.layers):
        qkv_w = weights[f"{i}.qkv.w"].reshape(3, h, h)
        qkv_b = weights[f"{i}.qkv.b"].reshape(3, h)
        out.update({
            # q, k and v each keep this rank's heads
            f"{i}.qkv.w": torch.stack([rows(qkv_w[j], h) for j in range(3)]).reshape(-1, h),
            f"{i}.qkv.b": torch.stack([rows(qkv_b[j], h) for j in range(3)]).reshape(-1),
            f"{i}.o.w": rows(weights[f"{i}.o.w"].t(), h).t(),
            f"{i}.up.w": rows(weights[f"{i}.up.w"], cfg.ffn),
            f"{i}.up.b": rows(weights[f"{i}.up.b"], cfg.ffn),
            f"{i}.down.w": rows(weights[f"{i}.down.w"].t(), cfg.ffn).t(),
        })
        for name in ("ln1.w", "ln2.w"):
            out[f"{i}.{name}"] = weights[f"{i}.{name}"]
    return out


class DecodeStep:
    """One decode step: token ids [batch] at position `pos` ([1] int64) ->
    logits [batch, vocab]. `comm` is a GroupCoordinator (None: one rank)."""

    def __init__(self, cfg, weights, rank, size, comm, max_len, device, dtype):
        self.cfg, self.comm, self.size = cfg, comm, size
        local = shard(weights, cfg, rank, size) if size > 1 else dict(weights)
        self.w = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in local.items()}
        self.vocab_start = rank * cfg.vocab // size
        self.heads = cfg.heads // size
        cache = (cfg.batch, self.heads, max_len, cfg.head_dim)
        self.k_cache = [torch.zeros(cache, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.v_cache = [torch.zeros(cache, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.slots = torch.arange(max_len, device=device)

    def _all_reduce_add_rms_norm(self, partial, residual, weight):
        """(normed, residual_out): the rank's partial sum allreduced, added to
        the residual stream and RMS-normalised for the next block."""
        if self.comm is not None:
            return self.comm.all_reduce_add_rms_norm(partial, residual, weight, EPS)
        residual = partial + residual
        return F.rms_norm(residual, (residual.shape[-1],), weight, EPS), residual

    def _all_gather(self, x):
        return self.comm.all_gather(x, dim=-1) if self.comm is not None else x

    def _embed(self, ids):
        rows = self.w["embed"].shape[0]
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < rows)
        return self.w["embed"][local.clamp(0, rows - 1)] * mine.unsqueeze(-1).to(self.w["embed"])

    def _attention(self, i, x, pos):
        cfg, w = self.cfg, self.w
        b, d = cfg.batch, cfg.head_dim
        qkv = F.linear(x, w[f"{i}.qkv.w"], w[f"{i}.qkv.b"]).reshape(b, 3, self.heads, d)
        q, k, v = qkv.unbind(1)
        self.k_cache[i].index_copy_(2, pos, k.unsqueeze(2))
        self.v_cache[i].index_copy_(2, pos, v.unsqueeze(2))
        scores = (q.unsqueeze(2) @ self.k_cache[i].transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(self.slots > pos, float("-inf"))
        heads = (scores.softmax(-1) @ self.v_cache[i]).reshape(b, self.heads * d)
        return F.linear(heads, w[f"{i}.o.w"])  # this rank's partial sum

    def _mlp(self, i, x):
        w = self.w
        up = F.gelu(F.linear(x, w[f"{i}.up.w"], w[f"{i}.up.b"]))
        return F.linear(up, w[f"{i}.down.w"])  # this rank's partial sum

    def __call__(self, ids, pos):
        w, layers = self.w, self.cfg.layers
        residual = w["pos"][pos].expand(self.cfg.batch, -1)
        x, residual = self._all_reduce_add_rms_norm(self._embed(ids), residual, w["0.ln1.w"])
        for i in range(layers):
            x, residual = self._all_reduce_add_rms_norm(self._attention(i, x, pos), residual,
                                                        w[f"{i}.ln2.w"])
            after = w[f"{i + 1}.ln1.w"] if i + 1 < layers else w["lnf.w"]
            x, residual = self._all_reduce_add_rms_norm(self._mlp(i, x), residual, after)
        return self._all_gather(F.linear(x, w["head"]))


def reference_logits(cfg, inputs):
    """The single-process float64 model fed the same tokens: [steps, batch, vocab]."""
    steps = inputs.shape[0]
    model = DecodeStep(cfg, full_weights(cfg), 0, 1, None, steps, "cpu", torch.float64)
    return torch.stack([model(inputs[s], torch.tensor([s])) for s in range(steps)])


def check(cfg, inputs, logits, tolerance=2e-3):
    """Compares a run (inputs [steps, batch], logits [steps, batch, vocab])
    with the reference. A step's chosen token (the next input) must be the
    reference's argmax, or tie with it within `tolerance`. Returns
    (ok, max |logit difference|, tokens matching the reference argmax, tokens, message)."""
    ref = reference_logits(cfg, inputs)
    diff = (logits.double() - ref).abs().max().item() if logits.numel() else 0.0
    chosen = inputs[cfg.prompt:]  # tokens the run generated (steps prompt-1 ... last-1)
    ref_steps = ref[cfg.prompt - 1:-1]
    best = ref_steps.max(-1).values
    picked = ref_steps.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    exact = int((ref_steps.argmax(-1) == chosen).sum())
    near = bool(((best - picked) <= tolerance).all())
    ok = diff <= tolerance and near
    msg = "" if ok else (f"max |logit diff| {diff:.3g} (tolerance {tolerance:g}); "
                         f"generated tokens off the reference argmax: "
                         f"{int(((best - picked) > tolerance).sum())}")
    return ok, diff, exact, chosen.numel(), msg
