"""transformers' 2-D parallelism on tpcomm: tensor parallelism inside pairs of
ranks, FSDP2 across them (a DeviceMesh of 2 x 2), one training step, under
torchrun with no tpcomm import:

    torchrun --standalone --nproc-per-node 4 examples/hf_fsdp_tp.py

A small Llama from a config (random weights, seeded; no download) is loaded
with DistributedConfig(tp_size=2, fsdp_size=2); each data-parallel replica
trains on its own batch. The same step in one process on both batches (the
mean of their losses) gives the reference. Prints the largest parameter
difference after the step."""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from transformers import DistributedConfig, LlamaConfig, LlamaForCausalLM


def batch(replica, vocab):
    return torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(10 + replica))


def main():
    dist.init_process_group("tpcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
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
    tp = 2
    model = LlamaForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=tp, fsdp_size=world // tp),
        dtype=torch.float32)
    ids = batch(rank // tp, config.vocab_size)  # a tensor-parallel pair shares its batch
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    trained = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
               for name, p in model.named_parameters()}

    reference = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    replicas = world // tp
    total = sum(reference(b, labels=b).loss for b in
                (batch(r, config.vocab_size) for r in range(replicas))) / replicas
    total.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    diff = max((trained[name] - p.detach()).abs().max().item()
               for name, p in reference.named_parameters())
    print(f"rank {rank}: loss {loss.item():.4f}, max |parameter diff| vs one process after a "
          f"step {diff:.1e}", flush=True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
