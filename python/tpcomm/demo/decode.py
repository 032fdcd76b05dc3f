"""The main job: tensor-parallel decoding over tpcomm.

    python -m tpcomm.demo [--tp 2] [--steps 32] [--device auto|cpu|cuda] [--compare-tp1]
    python -m tpcomm.demo --hosts 2 [--tp 2]   (a replica per simulated host; tpcomm.demo.hosts)

Starts --tp local processes (on GPUs when there are at least that many, else
on CPU), builds a small transformer with column- and row-parallel layers from
seeded random weights, and decodes --steps tokens for a batch of sequences.
Each step the driver rank broadcasts the step's inputs as a tensor dict
through the tensor-parallel group's shared-memory message queue; every rank
runs the step (two allreduces per layer, each fused with the residual add
and RMSNorm after it; on GPU replayed from a CUDA graph);
the driver picks the next tokens. Prints tokens/s and the collectives per
route, then checks every step's logits and tokens against a single-process
float64 run of the same model. Exits non-zero if the check fails.
"""

import argparse
import queue
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpcomm._net import free_port
from tpcomm.demo.tp_model import Config, DecodeStep, check, full_weights, prompts


def _choose_device(requested, tp):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda" and gpus < tp:
        raise SystemExit(f"--device cuda needs {tp} GPUs (one per rank); this machine has {gpus}")
    if requested == "auto":
        if 0 < gpus < tp:
            print(f"note: {gpus} GPU(s) for {tp} ranks; running on CPU", flush=True)
        return "cuda" if gpus >= tp else "cpu"
    return requested


class _Runner:
    """Runs decode steps eagerly, or (CUDA) by replaying a captured graph."""

    def __init__(self, model, tp, device, use_graph):
        self.model = model
        self.ids = torch.zeros(model.cfg.batch, dtype=torch.int64, device=device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)
        self.graph = None
        if use_graph:
            with tp.graph_capture() as ctx:
                # Warm up on the capture stream (creates the communicators),
                # writing cache slot 0, which step 0 overwrites.
                for _ in range(2):
                    model(self.ids, self.pos)
                torch.cuda.current_stream().synchronize()
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=ctx.stream):
                    self.logits = model(self.ids, self.pos)
            torch.cuda.synchronize()

    def __call__(self, ids, pos):
        if self.graph is None:
            return self.model(ids.to(self.ids.device), pos.to(self.pos.device))
        self.ids.copy_(ids, non_blocking=True)
        self.pos.copy_(pos, non_blocking=True)
        self.graph.replay()
        return self.logits


def _worker(rank, tp, port, steps, device_kind, result):
    import tpcomm

    torch.set_num_threads(1)
    try:
        if device_kind == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=tp, timeout=timedelta(seconds=120))
        tpcomm.init_distributed_environment(local_rank=rank)
        device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
        tpcomm.initialize_model_parallel(tp, 1, device=device)
        group = tpcomm.get_tp_group()
        cfg = Config()
        model = DecodeStep(cfg, full_weights(cfg), group.rank_in_group, tp, group, steps,
                           device, torch.float32)
        runner = _Runner(model, group, device, use_graph=device_kind == "cuda")
        driver = group.rank_in_group == 0
        prompt = prompts(cfg)
        inputs, logits, broadcasts = [], [], 0
        next_ids = prompt[:, 0]
        if group.world_size > 1:
            tpcomm.reset_stats(group)
        start = time.perf_counter()
        for step in range(steps):
            if driver:
                ids = prompt[:, step] if step < cfg.prompt else next_ids
                message = {"input_ids": ids, "positions": torch.tensor([step]), "step": step}
            else:
                message = None
            message = group.broadcast_tensor_dict(message)
            broadcasts += group.world_size > 1
            out = runner(message["input_ids"], message["positions"])
            if driver:
                host = out.cpu()
                next_ids = host.argmax(-1)
                inputs.append(message["input_ids"].clone())
                logits.append(host.clone())
        if device_kind == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        routes = tpcomm.stats(group) if group.world_size > 1 else {}
        if driver:
            # numpy arrays pickle by value (a tensor would be shared through
            # a file descriptor that dies with this process)
            result.put(("ok", torch.stack(inputs).numpy(), torch.stack(logits).numpy(), elapsed,
                        routes, broadcasts, runner.graph is not None))
        tpcomm.destroy_distributed_environment()
        dist.destroy_process_group()
    except BaseException as e:  # reported by the parent, which exits non-zero
        import traceback

        result.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def _collect(procs, result, timeout_s):
    """Reads the ranks' reports while they run (a large report blocks its
    sender until read), until every rank exited or the deadline passed."""
    messages = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            messages.append(result.get(timeout=0.2))
            continue
        except queue.Empty:
            pass
        if not any(p.is_alive() for p in procs):
            break
    for p in procs:
        p.join(timeout=5)
    while True:
        try:
            messages.append(result.get(timeout=0.2))
        except queue.Empty:
            return messages


def _routes_line(routes):
    if not routes:
        return "no collectives (one rank)"
    parts = []
    for name, c in routes.items():
        parts.append(f"{name} {c['calls']} calls ({c['bytes'] / 1e6:.2f} MB)")
    return ", ".join(parts)


def _launch(tp, steps, device):
    """Runs one decode job on `tp` local processes; returns the driver's
    report, or None (after printing why) when a rank failed or hung."""
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, tp, port, steps, device, result))
             for r in range(tp)]
    for p in procs:
        p.start()
    messages = _collect(procs, result, timeout_s=600)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = [m for m in messages if m[0] == "error"]
    done = [m for m in messages if m[0] == "ok"]
    if errors or hung or not done:
        for _, rank, text in errors:
            print(f"rank {rank} failed: {text}", file=sys.stderr)
        if hung:
            print(f"FAILED: ranks {hung} did not finish within 600 s", file=sys.stderr)
        print("FAILED: the run did not complete", file=sys.stderr)
        return None
    return done[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps (default 32)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--compare-tp1", action="store_true",
                        help="first run the same job at TP=1 and print both speeds")
    parser.add_argument("--hosts", type=int, default=0,
                        help="a TP=--tp replica on each of this many simulated hosts, data "
                             "parallel across them (root: Linux namespaces; see "
                             "tpcomm.demo.hosts)")
    args = parser.parse_args(argv)
    cfg = Config()
    if args.tp < 1 or not 1 <= args.steps <= 4096:
        parser.error("--tp must be positive and --steps within 1..4096")
    try:
        cfg.check_tp(args.tp)
    except ValueError as e:
        parser.error(str(e))
    if args.hosts:
        if args.hosts < 2 or args.device == "cuda":
            parser.error("--hosts needs 2 or more hosts and runs on CPU")
        from tpcomm.demo.hosts import run as run_across_hosts

        return run_across_hosts(args.hosts, args.tp, args.steps)
    device = _choose_device(args.device, args.tp)
    print(f"tpcomm demo: tensor-parallel decoding, TP={args.tp} on {device.upper()}, "
          f"{cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, vocab {cfg.vocab}, "
          f"batch {cfg.batch}, {args.steps} steps (prompt {cfg.prompt})", flush=True)

    baseline = None
    if args.compare_tp1 and args.tp > 1:
        done = _launch(1, args.steps, device)
        if done is None:
            return 1
        baseline = cfg.batch * args.steps / done[3]
        print(f"TP=1 in the same run: {baseline:.0f} tokens/s, "
              f"{1e3 * done[3] / args.steps:.2f} ms/step")
    done = _launch(args.tp, args.steps, device)
    if done is None:
        return 1
    _, inputs, logits, elapsed, routes, broadcasts, graphed = done
    inputs, logits = torch.from_numpy(inputs), torch.from_numpy(logits)
    tokens = cfg.batch * args.steps
    mode = "CUDA graph replays" if graphed else "eager"
    print(f"decoded {args.steps} steps x {cfg.batch} sequences in {elapsed:.3f} s ({mode}): "
          f"{tokens / elapsed:.0f} tokens/s, {1e3 * elapsed / args.steps:.2f} ms/step")
    if baseline is not None:
        print(f"TP={args.tp} vs TP=1: {tokens / elapsed / baseline:.2f}x the tokens/s")
    print(f"collectives per route on the driver: {_routes_line(routes)}")
    print(f"message-queue broadcasts of step inputs: {broadcasts}")
    ok, diff, exact, generated, why = check(cfg, inputs, logits)
    print(f"check against a single-process float64 run: max |logit diff| {diff:.2e}; "
          f"generated tokens equal to its argmax: {exact}/{generated}")
    if not ok:
        print(f"FAILED: {why}", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
