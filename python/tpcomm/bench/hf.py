"""python -m tpcomm.bench hf: transformers' own tensor parallelism
(DistributedConfig(tp_plan="auto")) at TP=2 on CPU, greedy decoding of a
random Llama built from a config, tokens/s over tpcomm and over Gloo.

Each round runs one torchrun-style job per backend, alternating, on the same
model and prompts; the best round of each is kept, and both are printed with
their ratio. Needs transformers and accelerate (the test command installs
them)."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from tpcomm._net import free_port


def _worker(backend, tokens, batch):
    import torch
    import torch.distributed as dist
    from transformers import DistributedConfig, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=512)
    shared = [tempfile.mkdtemp(prefix="tpcomm-hf-bench-") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    path = os.path.join(shared[0], "model")
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32)
    prompts = torch.randint(0, config.vocab_size, (batch, 16),
                            generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.generate(prompts, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        dist.barrier()
        start = time.perf_counter()
        out = model.generate(prompts, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False)
        elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"tokens/s {batch * tokens / elapsed:.1f} tokens {out[0, -4:].tolist()}", flush=True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
    dist.destroy_process_group()


def _job(backend, tokens, batch):
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
         "-m", "tpcomm.bench.hf", "--worker", backend, str(tokens), str(batch)],
        capture_output=True, text=True, timeout=1200)
    found = re.search(r"tokens/s (\S+) tokens (\[.*\])", done.stdout)
    if done.returncode != 0 or not found:
        print(f"{backend} job failed:\n{done.stderr[-3000:]}")
        return None, None
    return float(found.group(1)), found.group(2)


def run(rounds=3, tokens=32, batch=4):
    print(f"transformers TP=2 (tp_plan='auto') greedy decoding on CPU: Llama 4 layers, hidden "
          f"512, batch {batch}, {tokens} new tokens; best of {rounds} alternating rounds")
    best = {"tpcomm": 0.0, "gloo": 0.0}
    last = {}
    for r in range(rounds):
        for backend in ("tpcomm", "gloo"):
            speed, tail = _job(backend, tokens, batch)
            if speed is None:
                return 1
            best[backend] = max(best[backend], speed)
            last[backend] = tail
            print(f"  round {r + 1}: {backend:6s} {speed:8.1f} tokens/s")
    same = last["tpcomm"] == last["gloo"]
    print(f"tpcomm {best['tpcomm']:.1f} tokens/s, gloo {best['gloo']:.1f} tokens/s: "
          f"{best['tpcomm'] / best['gloo']:.2f}x; last tokens equal across backends: {same}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(run())
