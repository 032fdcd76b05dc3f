"""Hugging Face transformers' own tensor parallelism on tpcomm, under torchrun,
with no tpcomm import (the backend registers itself at `import torch`):

    torchrun --standalone --nproc-per-node 2 examples/hf_tensor_parallel.py

A small Llama from a config (random weights, seeded; no download) is saved
once, loaded sharded with DistributedConfig(tp_plan="auto") on every rank
and whole in the same process; both decode the same prompts greedily. Prints
the largest logit difference, whether the tokens are equal, and the
collectives per route."""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from transformers import DistributedConfig, LlamaConfig, LlamaForCausalLM


def main():
    dist.init_process_group("tpcomm")
    rank = dist.get_rank()
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    shared = [tempfile.mkdtemp(prefix="tpcomm-hf-") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    path = os.path.join(shared[0], "model")
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()
    sharded = LlamaForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32)
    whole = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (sharded(prompts).logits - whole(prompts).logits).abs().max().item()
        tokens = sharded.generate(prompts, max_new_tokens=8, do_sample=False)
        reference = whole.generate(prompts, max_new_tokens=8, do_sample=False)
    import tpcomm  # only for its counters

    used = {name: c["calls"] for name, c in tpcomm.stats().items() if c["calls"]}
    print(f"rank {rank}: max |logit diff| vs one process {diff:.1e}, greedy tokens equal: "
          f"{torch.equal(tokens, reference)}, collectives {used}", flush=True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
