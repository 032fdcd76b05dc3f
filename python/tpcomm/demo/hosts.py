"""The demo across hosts: `python -m tpcomm.demo --hosts 2 [--tp 2]` (root).

Two simulated hosts (tpcomm.simhosts: their own network, host name,
/dev/shm and pids), a TP=--tp replica of the demo's model on each, data
parallelism across them: each replica decodes its own batch (its own
prompts), its driver broadcasting the step's inputs through the replica's
message queue, its ranks reducing through the host's shared memory; every
step the replicas agree over the world group how many sequences are still
unfinished (as data-parallel inference servers coordinate their engines
each step: a small allreduce across hosts, here the hierarchical route).

Data parallelism rather than pipeline parallelism: across hosts, the link
is the slow part, and replicas cross it with one small message per step,
where pipeline stages would send every step's activations over it; inference
servers run a tensor-parallel replica per host for that reason.

Prints each replica's tokens/s and check against a single-process float64
run, and the collectives per route of both groups."""

import os
import sys
import tempfile
import time
from datetime import timedelta

import torch


def _replica_prompts(cfg, replica):
    from tpcomm.demo.tp_model import prompts

    return (prompts(cfg) + 7 * replica) % cfg.vocab


def _worker(tp, steps, outdir):
    import torch.distributed as dist

    import tpcomm
    from tpcomm.demo.tp_model import Config, DecodeStep, full_weights

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("tpcomm", init_method="env://", timeout=timedelta(seconds=120))
    tpcomm.init_distributed_environment(local_rank=int(os.environ["LOCAL_RANK"]))
    world_size = dist.get_world_size()
    tpcomm.initialize_model_parallel(tp, 1, data_parallel_size=world_size // tp,
                                     device=torch.device("cpu"))
    group = tpcomm.get_tp_group()
    world = tpcomm.get_world_group()
    replica = rank // tp
    cfg = Config()
    model = DecodeStep(cfg, full_weights(cfg), group.rank_in_group, tp, group, steps,
                       torch.device("cpu"), torch.float32)
    driver = group.rank_in_group == 0
    prompt = _replica_prompts(cfg, replica)
    inputs, logits = [], []
    next_ids = prompt[:, 0]
    tpcomm.reset_stats(group)
    tpcomm.reset_stats(world)
    unfinished = torch.zeros(1, dtype=torch.int64)
    start = time.perf_counter()
    for step in range(steps):
        if driver:
            ids = prompt[:, step] if step < cfg.prompt else next_ids
            message = {"input_ids": ids, "positions": torch.tensor([step]), "step": step}
        else:
            message = None
        message = group.broadcast_tensor_dict(message)
        out = model(message["input_ids"], message["positions"])
        if driver:
            next_ids = out.argmax(-1)
            inputs.append(message["input_ids"].clone())
            logits.append(out.clone())
        # The replicas' step agreement: sequences still running on all hosts.
        unfinished.fill_(cfg.batch if step + 1 < steps else 0)
        world.all_reduce(unfinished)
    elapsed = time.perf_counter() - start
    if driver:
        torch.save({"replica": replica, "host": tpcomm._C.host_name(),
                    "inputs": torch.stack(inputs), "logits": torch.stack(logits),
                    "elapsed": elapsed, "tp_routes": tpcomm.stats(group),
                    "world_routes": tpcomm.stats(world),
                    "world": tpcomm.describe(world)["cpu_shm"]["across_hosts"]},
                   os.path.join(outdir, f"replica{replica}.pt"))
    tpcomm.destroy_distributed_environment()
    dist.destroy_process_group()


def _routes(routes):
    used = [f"{name} {c['calls']} calls" for name, c in routes.items() if c["calls"]]
    return ", ".join(used) or "none"


def run(hosts, tp, steps):
    from tpcomm import simhosts
    from tpcomm.demo.tp_model import Config, check

    reason = simhosts.unavailable_reason()
    if reason is not None:
        print(f"cannot run across simulated hosts: {reason}", file=sys.stderr)
        return 1
    cfg = Config()
    print(f"tpcomm demo across hosts: {hosts} simulated hosts, a TP={tp} replica on each "
          f"(data parallel), {cfg.layers} layers, hidden {cfg.hidden}, batch {cfg.batch} per "
          f"replica, {steps} steps", flush=True)
    layout = [list(range(h * tp, (h + 1) * tp)) for h in range(hosts)]
    with tempfile.TemporaryDirectory() as outdir, simhosts.SimulatedHosts(hosts) as sim:
        argv = [sys.executable, "-m", "tpcomm.demo.hosts", str(tp), str(steps), outdir]
        procs = sim.launch_ranks(layout, argv, port=29655)
        codes = sim.wait(procs, 600)
        if codes != [0] * hosts:
            print(f"FAILED: a host's ranks failed (exit codes {codes})", file=sys.stderr)
            return 1
        reports = [torch.load(os.path.join(outdir, f"replica{r}.pt"), weights_only=False)
                   for r in range(hosts)]
    ok = True
    print(f"world group: {reports[0]['world']['hosts']} -> {reports[0]['world']['reason']}")
    for rep in reports:
        tokens = cfg.batch * steps
        good, diff, exact, generated, why = check(cfg, rep["inputs"], rep["logits"])
        print(f"replica {rep['replica']} on {rep['host']}: {tokens / rep['elapsed']:.0f} "
              f"tokens/s, {1e3 * rep['elapsed'] / steps:.2f} ms/step; TP group routes: "
              f"{_routes(rep['tp_routes'])}; world group routes: "
              f"{_routes(rep['world_routes'])}; max |logit diff| vs float64 {diff:.2e}, "
              f"tokens equal to its argmax {exact}/{generated}")
        if not good:
            print(f"FAILED: replica {rep['replica']}: {why}", file=sys.stderr)
            ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
