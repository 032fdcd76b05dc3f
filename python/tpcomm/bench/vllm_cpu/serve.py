"""python -m tpcomm.bench vllm-cpu --serve: vLLM's OpenAI server
(vllm.entrypoints.openai.api_server) with tensor parallelism 2 on CPU, as a
server runs it: the API server and the engine core share the machine with
the two workers, and concurrent clients send completions.

Each way (vLLM's own shared-memory path, Gloo, tpcomm; as in the offline
benchmark, offline.py) is a server of its own. Every way's server is up at
once, all idle but the one the clients load, and the rounds alternate
between them (--starts brings them all up again that many times).
The model is the offline benchmark's random Llama, prompts are token ids
(--skip-tokenizer-init) and every completion returns its token ids
(`return_token_ids`), greedy and `ignore_eos`, so every way must give the
same tokens. Printed per way: the median tokens/s over rounds, its
spread (max/min) and the median of its rounds' ratios to vLLM's own
round beside them ("paired"), p50 and p99 request latency (over every request of every
round), the workers' share of model-step time in the tensor-parallel
all-reduce, whether its tokens equal vLLM's own path's, and how many cores
its API server, engine core and workers kept busy while the clients ran
(their CPU time from /proc over the round's seconds: where the machine went).

`--serve --check` is the end-to-end test of the server: vLLM's own path and
tpcomm, one round, the same tokens, and the tpcomm server's workers say
their group runs on tpcomm and count its collectives.
"""

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from tpcomm.bench.vllm_cpu.offline import (_process_tree, _prompts, _read_profile, _tokens_match,
                                           _vllm_kernels, _vllm_version, _way_env,
                                           plugin_problems)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """One vLLM OpenAI server in its own process group, its output in `log`."""

    def __init__(self, way, model, args, log):
        self.way, self.port = way, _free_port()
        self.env, self.profile = _way_env(way, 2, args)
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
                   "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
                   "--skip-tokenizer-init", "--dtype", args.dtype, "--seed", "0",
                   "--max-model-len", str(args.prompt_len + args.tokens + 16),
                   "--max-num-seqs", str(max(args.clients, 1))]
        if args.eager:
            command.append("--enforce-eager")
        self.model = model
        self.log_path = log
        self.final = None  # the whole output, once the server is stopped
        self.out = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(command, env=self.env, stdout=self.out,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def output(self):
        """What the server printed; read while it runs only for an error
        message (its processes write through the same file position)."""
        if self.final is not None:
            return self.final
        self.out.flush()
        self.out.seek(0)
        return self.out.read()

    def wait_ready(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.way}: the server exited with {self.proc.returncode} "
                                   f"before it was ready; its output ends:\n"
                                   f"{self.output()[-4000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.way}: the server was not ready within {timeout_s:.0f} s; its "
                           f"output ends:\n{self.output()[-4000:]}")

    def complete(self, prompt, tokens, timeout_s):
        """One completion: (its token ids, seconds)."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": tokens,
                           "temperature": 0.0, "ignore_eos": True,
                           "return_token_ids": True})
        start = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        seconds = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"{self.way}: completion answered {response.status}: "
                               f"{data[:2000]!r}")
        choice = json.loads(data)["choices"][0]
        if choice.get("token_ids") is None:
            raise RuntimeError(f"{self.way}: the completion returned no token ids: {choice}")
        return list(choice["token_ids"]), seconds

    def stop(self):
        """SIGINT (vLLM's own shutdown: engine core and workers), then the
        whole process group."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass  # reported by the caller's error, if any; the log is kept
        finally:
            import shutil

            self.final = self.output()
            with open(self.log_path, "a") as f:
                f.write(f"===== server {self.way}\n{self.final}\n")
            self.out.close()
            shutil.rmtree(self.profile, ignore_errors=True)


def _clients(server, prompts, tokens, clients, timeout_s):
    """`clients` threads send every prompt, each taking the next one not
    yet sent: (token ids per prompt, latency per prompt, seconds in all)."""
    results, latencies, errors = [None] * len(prompts), [None] * len(prompts), []
    lock, next_index = threading.Lock(), [0]

    def client():
        while not errors:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(prompts):
                return
            try:
                results[i], latencies[i] = server.complete(prompts[i], tokens, timeout_s)
            except Exception as e:  # reported by the caller
                errors.append(e)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, start + timeout_s - time.perf_counter()))
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{server.way}: the clients did not finish within {timeout_s:.0f} s")
    return results, latencies, seconds


def _busy(count):
    """`count` processes that keep a core busy each (other work on the
    machine: the server's collectives must not depend on having it alone)."""
    # Each ends by itself once this process is gone (killed before its
    # finally ran).
    busy = f"import os\nwhile os.getppid() == {os.getpid()}: pass\n"
    return [subprocess.Popen([sys.executable, "-c", busy],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(count)]


_TICK = os.sysconf("SC_CLK_TCK")
# A server's processes by their name (/proc/PID/stat; vLLM names its own).
_KINDS = (("VLLM::Worker", "workers"), ("VLLM::EngineCor", "engine core"))


def _cpu_by_kind(server_pid):
    """{kind: (processes, CPU seconds so far)} of the server's processes (the
    API server, its engine core and workers): user + system time of every
    thread, from /proc."""
    out = {}
    for pid, (name, fields) in _process_tree(server_pid).items():
        kind = "API server" if pid == server_pid else next(
            (k for prefix, k in _KINDS if name.startswith(prefix)), "others")
        n, cpu = out.get(kind, (0, 0.0))
        out[kind] = (n + 1, cpu + (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def _start(way, model, args, log):
    """A ready server of `way`, warmed up: a full batch of concurrent
    requests (first allocations, every batch size the rounds see)."""
    server = _Server(way, model, args, log)
    try:
        server.wait_ready(args.timeout)
        prompts = _prompts(args.clients, args.prompt_len)
        _clients(server, prompts, 4, args.clients, args.timeout)
    except BaseException:
        server.stop()
        raise
    return server


def _idle_cpu(servers):
    """CPU seconds so far of every process of the idle `servers`."""
    return sum(cpu for x in servers for _, cpu in _cpu_by_kind(x.proc.pid).values())


def _one_round(server, args, idle=()):
    """One measured round on a running server: every prompt from the
    clients, with the server's CPU and its workers' totals read before and
    after, and the CPU the `idle` servers took meanwhile."""
    load = _busy(getattr(args, "load", 0))
    try:
        prompts = _prompts(args.requests, args.prompt_len)
        before, cpu_before = _read_profile(server.profile), _cpu_by_kind(server.proc.pid)
        idle_before = _idle_cpu(idle)
        tokens, latencies, seconds = _clients(server, prompts, args.tokens, args.clients,
                                              args.timeout)
        cpu_after = _cpu_by_kind(server.proc.pid)
        idle_cores = (_idle_cpu(idle) - idle_before) / seconds
        time.sleep(0.2)  # the workers write their totals after each step
        after = _read_profile(server.profile)
        kernels = _vllm_kernels(server.proc.pid)
    finally:
        for p in load:
            p.kill()
            p.wait()

    def delta(r, key):
        return after[r][key] - before.get(r, {}).get(key, 0.0)

    shares = [delta(r, "all_reduce_s") / delta(r, "step_s") for r in after
              if delta(r, "step_s") > 0 and delta(r, "calls") > 0]
    waits = {k: sum(delta(r, "wait_" + k) for r in after if "wait_" + k in after[r])
             for k in ("waits", "at_once", "met_polling", "slept", "poll_us", "sleep_us")}

    def buckets(totals):
        return [int(x) for x in str(totals.get("wait_late", "")).split(",") if x]

    waits["late"] = [0] * 17
    for r in after:
        for b, (now, then) in enumerate(zip(buckets(after[r]),
                                            buckets(before.get(r, {})) or [0] * 17)):
            waits["late"][b] += now - then
    return {"tokens": tokens, "latencies": latencies, "seconds": seconds,
            "waits": waits, "steps": sum(delta(r, "steps") for r in after),
            "placement": _placement(server.env, after),
            "tokens_per_s": sum(map(len, tokens)) / seconds,
            "all_reduce_share": sum(shares) / len(shares) if shares else None,
            "tpcomm_calls": sum(delta(r, "tpcomm_calls") for r in after),
            # A worker's model step (execute_model), averaged over the workers.
            "step_s": statistics.mean(delta(r, "step_s") / delta(r, "steps") for r in after
                                      if delta(r, "steps") > 0) if after else None,
            "worker_steps": statistics.mean(delta(r, "steps") for r in after) if after else 0,
            # Cores each kind of process kept busy while the clients ran.
            "cpu": {k: (n, (cpu - cpu_before.get(k, (0, 0.0))[1]) / seconds)
                    for k, (n, cpu) in cpu_after.items()},
            "idle_cores": idle_cores,
            "kernels": kernels}


def _cpu_set(text):
    """{0, 2, 3} of "0,2-3" (as the plugin reads a worker's OpenMP list);
    None for what is not a list of CPUs (VLLM_CPU_OMP_THREADS_BIND=auto)."""
    from _tpcomm_autoload.vllm import _cpu_items

    return set(_cpu_items(str(text))) or None


def _placement(env, profile):
    """[(rank, the CPUs tpcomm's path says the worker has, its share of
    VLLM_CPU_OMP_THREADS_BIND)] of the workers whose profile says where
    tpcomm placed them (tpcomm's servers only)."""
    binds = env.get("VLLM_CPU_OMP_THREADS_BIND", "").split("|")
    out = []
    for name, totals in sorted(profile.items()):
        if "shm_cpus" in totals and name.startswith("rank"):
            rank = int(name[len("rank"):-len(".txt")])
            want = _cpu_set(binds[rank]) if rank < len(binds) else None
            out.append((rank, _cpu_set(totals["shm_cpus"]), want))
    return out


def _waits_line(runs):
    """How the tpcomm workers' waits for their peer went, over every round."""
    w = {k: sum(x["waits"][k] for x in runs) for k in runs[0]["waits"] if k != "late"}
    by_time = [sum(x["waits"]["late"][b] for x in runs) for b in range(17)]
    steps = sum(x["steps"] for x in runs)
    if not w["waits"]:
        return None
    late = w["met_polling"] + w["slept"]
    return (f"{w['waits'] / max(steps, 1):.0f} waits a model step; "
            f"{100 * w['at_once'] / w['waits']:.0f}% found the peer there, {100 * w['met_polling'] / w['waits']:.1f}% met it polling, "
            f"{100 * w['slept'] / w['waits']:.1f}% slept first; a late peer cost "
            f"{(w['poll_us'] + w['sleep_us']) / max(late, 1):.0f} us on average "
            f"({w['sleep_us'] / max(w['slept'], 1):.0f} us asleep a sleep); late waits by "
            "time: " + ", ".join(f"{'<2' if b == 0 else f'>={1 << b}'} us: {n}"
                                  for b, n in enumerate(by_time) if n))


def _percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


_SERVER_GIB = 6  # what a server of the benchmark's model holds, its KV cache included


def _available_gib():
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) / (1 << 20)


def _start_all(ways, model, args, log):
    """One running server per way, brought up one after another."""
    servers = {}
    try:
        for way in ways:
            free = _available_gib()
            if free < _SERVER_GIB:
                raise RuntimeError(
                    f"--serve keeps a server of every way up at once: {len(servers)} are up and "
                    f"{free:.1f} GiB of memory is left, under the {_SERVER_GIB} GiB one more "
                    f"needs; run fewer --ways at a time, or --apart (a fresh server per way "
                    f"and round, one at a time)")
            servers[way] = _start(way, model, args, log)
    except BaseException:
        _stop_all(servers)
        raise
    return servers


def _stop_all(servers):
    for server in servers.values():
        server.stop()


def _show(label, way, x):
    print(f"  {label} {way:>11}: {x['tokens_per_s']:8.1f} tok/s, "
          f"p50 {1e3 * _percentile(x['latencies'], 0.5):.0f} ms, "
          f"p99 {1e3 * _percentile(x['latencies'], 0.99):.0f} ms", flush=True)


def _rounds_apart(args, model, log, rounds):
    """Each round a fresh server per way, one at a time."""
    for r in range(args.rounds):
        for way in args.ways if r % 2 == 0 else tuple(reversed(args.ways)):
            server = _start(way, model, args, log)
            try:
                x = _one_round(server, args)
            finally:
                server.stop()
            x["log"] = server.output()
            rounds[way].append(x)
            _show(f"round {r + 1}", way, x)


def _rounds_together(args, model, log, rounds, start):
    """Every way's server up at once, the rounds alternating between them."""
    servers = _start_all(args.ways, model, args, log)
    try:
        for r in range(args.rounds):
            n = start * args.rounds + r
            for way in args.ways if n % 2 == 0 else tuple(reversed(args.ways)):
                idle = [v for w, v in servers.items() if w != way]
                rounds[way].append(_one_round(servers[way], args, idle))
                _show(f"start {start + 1} round {r + 1}", way, rounds[way][-1])
    finally:
        _stop_all(servers)
    for way, server in servers.items():
        for x in rounds[way][start * args.rounds:]:
            x["log"] = server.output()


def serve(args, model, log):
    """Every way's server up at once, idle but one: the rounds alternate the
    clients' load between running servers, seconds apart, so that a slow
    spell of the machine falls on every way alike (a fresh server per round
    put a minute between two ways' rounds). --starts brings them all up
    again that many times (a server's start moved its rate by up to 20%).
    With `args.apart` (--apart, and the check) a fresh server per way and
    round instead, one at a time."""
    rounds = {w: [] for w in args.ways}
    apart = getattr(args, "apart", False)
    starts = 1 if apart else getattr(args, "starts", 1)
    for start in range(starts):
        if apart:
            _rounds_apart(args, model, log, rounds)
        else:
            _rounds_together(args, model, log, rounds, start)
    first = next(iter(rounds.values()))[0]
    level = getattr(args, "cpu_level", None)
    print(f"\n{'as on a CPU with ' + level + ' and no AVX-512 (--cpu-level): ' if level else ''}"
          f"vLLM's servers loaded {first['kernels']}" + (
              "" if "_C_AVX2" not in first["kernels"] else
              ", which has no shared-memory all-reduce: vLLM's own path is Gloo there"))
    print(f"vLLM {_vllm_version()} OpenAI server on CPU ({os.cpu_count()} cores), TP=2, "
          f"{args.requests} completions from {args.clients} concurrent clients x {args.tokens} "
          f"new tokens, {args.layers} layers of width {args.hidden}, {args.dtype}, greedy; "
          f"{args.rounds} alternated rounds"
          + (", a fresh server each" if apart else
             " on running servers" + (f", {starts} starts" if starts > 1 else ""))
          + (f"; {args.load} busy processes beside the server"
             if getattr(args, "load", 0) else ""))
    reference = rounds.get("vllm-shm")
    ref_median = statistics.median(x["tokens_per_s"] for x in reference) if reference else None
    head = (f"{'way':>11} | {'median tok/s':>12} | {'x vLLM shm':>10} | {'spread':>6} | "
            f"{'paired':>6} | {'p50 ms':>7} | {'p99 ms':>7} | {'all-reduce share':>16} | "
            f"{'= vLLM shm':>10} | rounds (tok/s)")
    print(head)
    print("-" * len(head))
    for way in args.ways:
        runs = rounds[way]
        rates = [x["tokens_per_s"] for x in runs]
        median = statistics.median(rates)
        latencies = [s for x in runs for s in x["latencies"]]
        shares = [x["all_reduce_share"] for x in runs if x["all_reduce_share"] is not None]
        share = f"{100 * min(shares):.1f}-{100 * max(shares):.1f}%" if shares else "-"
        same = (all(x["tokens"] == reference[0]["tokens"] for x in runs) if reference else "-")
        ratio = f"{median / ref_median:.2f}" if ref_median else "-"
        # The median of each round's rate over vLLM's own in the same round
        # (seconds apart): what a slow spell of the machine moves least.
        paired = "-"
        if reference:
            ratios = [x['tokens_per_s'] / y['tokens_per_s'] for x, y in zip(runs, reference)]
            paired = f"{statistics.median(ratios):.2f}"
        print(f"{way:>11} | {median:12.1f} | {ratio:>10} | {max(rates) / min(rates):6.2f} | "
              f"{paired:>6} | "
              f"{1e3 * _percentile(latencies, 0.5):7.0f} | "
              f"{1e3 * _percentile(latencies, 0.99):7.0f} | {share:>16} | {str(same):>10} | "
              + ", ".join(f"{x:.0f}" for x in rates))
    for way in args.ways:
        line = _waits_line(rounds[way])
        if line:
            print(f"{way}'s waits: {line}")
    print(f"Cores kept busy while the clients ran ({os.cpu_count()} online), median over rounds, "
          "by the server's processes (/proc):")
    for way in args.ways:
        kinds = sorted({k for x in rounds[way] for k in x["cpu"]})
        line = f"{way:>11}: " + ", ".join(
            f"{k} {statistics.median(x['cpu'].get(k, (0, 0.0))[1] for x in rounds[way]):.2f}"
            for k in kinds)
        steps = [x["step_s"] for x in rounds[way] if x["step_s"]]
        if steps:
            count = statistics.median(x["worker_steps"] for x in rounds[way])
            line += (f"; a worker's model step {1e3 * statistics.median(steps):.2f} ms, "
                     f"{count:.0f} steps a round")
        idle = [x["idle_cores"] for x in rounds[way] if x.get("idle_cores") is not None]
        if len(args.ways) > 1 and not apart and idle:
            line += f"; the idle servers meanwhile {statistics.median(idle):.3f}"
        print(line)
    print(f"The servers' output: {log}")
    return rounds


def check(args, model, log):
    """vLLM's own path and tpcomm, one round each: the same tokens, the
    tpcomm server's tensor-parallel group on tpcomm, and each server's two
    workers found busy in its CPU account."""
    args.rounds, args.starts, args.apart, args.ways = 1, 1, True, ["vllm-shm", "tpcomm"]
    rounds = serve(args, model, log)
    own, ours = rounds["vllm-shm"][0], rounds["tpcomm"][0]
    problems = plugin_problems(own, ours, "server")
    if not ours["placement"]:
        problems.append("the tpcomm server's workers did not say where tpcomm placed them "
                        "(describe()['cpu_shm'] read in the worker)")
    for rank, cpus, want in ours["placement"]:
        if want is not None and cpus != want:
            problems.append(f"the tpcomm server's worker {rank}: tpcomm's path runs on CPUs "
                            f"{sorted(cpus)}, its OpenMP threads on {sorted(want)} "
                            "(VLLM_CPU_OMP_THREADS_BIND)")
    for name, run in (("vLLM's own", own), ("tpcomm", ours)):
        workers, busy = run["cpu"].get("workers", (0, 0.0))
        if workers != 2 or busy <= 0:
            problems.append(f"{name} server: {workers} worker processes found below it "
                            f"(/proc), busy {busy:.2f} cores: TP=2 has two")
    total = sum(map(len, own["tokens"]))
    if total != args.requests * args.tokens:
        problems.append(f"vLLM's own server generated {total} tokens, not "
                        f"{args.requests} x {args.tokens}")
    equal, differ = _tokens_match(own["tokens"], ours["tokens"])
    if not equal:
        problems.append(f"the tpcomm server: {differ} of {total} tokens differ from vLLM's own")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    print(f"OK: the OpenAI server on tpcomm answers {args.requests} concurrent completions with "
          f"vLLM's own server's tokens; tpcomm's counters saw {ours['tpcomm_calls']:.0f} "
          "collectives of its tensor-parallel group; each worker's shared-memory path runs on "
          "its OpenMP CPUs (" + ", ".join(f"worker {r}: {sorted(c)}"
                                          for r, c, _ in ours["placement"]) + ")")
    return 0
