"""The custom peer-to-peer allreduce, driven directly (without a process group
backend): for tests, benchmarks and the routing that builds on it.

    group = LocalGroup(4)                       # 4 ranks on 4 streams of this GPU
    outs = group.all_reduce([x0, x1, x2, x3])   # sums, one kernel per rank

    comm = IpcCommunicator.create(pg)           # one rank per process, IPC buffers
    if comm.eligible:
        y = comm.all_reduce(x)

Sums float32, float16 and bfloat16 tensors of up to `max_bytes` (default
TPCOMM_CAR_MAX_BYTES), 16-byte aligned, at world sizes 2 to 8. Every rank gets
the same bits. A peer that does not arrive within `timeout_ms` (default
TPCOMM_CAR_TIMEOUT_MS, or 10 minutes when that is 0) makes the kernel stop
and poisons the group (every rank's later kernels stop at once with the same
cause); check() then raises TimeoutError naming it, and reset() (on every
rank) makes the group usable again.
"""

import torch
import torch.distributed as dist

from tpcomm import _C


def _defaults(max_bytes, timeout_ms):
    d = _C.car_defaults()
    return (d["max_bytes"] if max_bytes is None else int(max_bytes),
            d["timeout_ms"] if timeout_ms is None else float(timeout_ms))


def _algorithm(name):
    if name in (None, "", "auto"):
        return ""
    if name not in ("push", "oneshot", "twoshot"):
        raise ValueError(
            f"algorithm {name!r} is not one of 'push', 'oneshot', 'twoshot', 'auto'")
    return name


class LocalGroup:
    """N ranks driven by this process on N streams of the current GPU (a
    process cannot open its own IPC handles, so the buffers are shared
    directly). The kernels of all ranks must run at once, so N x blocks must
    fit on the GPU. `graph_order` ("stream" or "event", default
    TPCOMM_CAR_GRAPH_ORDER): how captured calls order against calls outside
    their graph."""

    def __init__(self, world_size, max_bytes=None, timeout_ms=None, graph_order=None):
        if not torch.cuda.is_available():
            raise RuntimeError("the custom allreduce needs a CUDA GPU")
        self.world_size = world_size
        self.max_bytes, self.timeout_ms = _defaults(max_bytes, timeout_ms)
        self.buffers = [_C.CarBuffer(self.max_bytes) for _ in range(world_size)]
        bases = [b.base for b in self.buffers]
        self.ranks = [_C.CarRank(r, world_size, self.buffers[r], bases, self.timeout_ms)
                      for r in range(world_size)]
        self.streams = [torch.cuda.Stream() for _ in range(world_size)]
        if graph_order is not None:  # else TPCOMM_CAR_GRAPH_ORDER
            if graph_order not in ("stream", "event"):
                raise ValueError(f"graph_order {graph_order!r} is not 'stream' or 'event'")
            for rank in self.ranks:
                rank.capture_events = graph_order == "event"
        self._resident = {}  # (dtype, algorithm) -> blocks the GPU holds at once
        self._default_blocks = _C.car_defaults()["blocks"]  # TPCOMM_CAR_BLOCKS

    def register(self, inputs):
        """A zero-copy table of these inputs (one per rank, in rank order) for
        all_reduce(..., registered=table): every rank's kernel then reads the
        peers' inputs where they lie instead of staging its own. The inputs
        must stay alive and unmoved while the table is used. Every rank of a
        call gets the table or none does (a one-shot call waits at its end
        barrier only with a table)."""
        if len(inputs) != self.world_size:
            raise ValueError(f"{len(inputs)} inputs for {self.world_size} ranks")
        entries = [x.data_ptr() for x in inputs] + [0] * (8 - self.world_size)
        # RegisteredInputs: 8 pointers, then `ready` (1) and padding: 80 bytes.
        return torch.tensor(entries + [1, 0], dtype=torch.int64, device="cuda")

    def all_reduce(self, inputs, outputs=None, algorithm=None, blocks=0, ranks=None, streams=None,
                   registered=None):
        """Rank r's result into outputs[r] (new tensors when None), each rank's
        kernel on its own stream (`streams[r]`, default the group's), ordered
        after the current stream and joined back into it. `ranks` launches
        only those ranks (the others withheld). `blocks` more than the GPU
        holds for every rank at once raises ValueError. `registered`: a table
        from register(inputs) (zero-copy)."""
        if len(inputs) != self.world_size:
            raise ValueError(f"{len(inputs)} inputs for {self.world_size} ranks")
        if outputs is None:
            outputs = [torch.empty_like(x) for x in inputs]
        current = torch.cuda.current_stream()
        algo = _algorithm(algorithm)
        # Every rank's kernel must be resident at once (they wait for each
        # other): an explicit block count that cannot be is refused, a chosen
        # one is capped.
        nbytes = inputs[0].numel() * inputs[0].element_size()
        chosen_algo = algo or _C.car_choose_algorithm(self.world_size, nbytes, self.max_bytes)
        dtype = str(inputs[0].dtype).replace("torch.", "")
        key = (dtype, chosen_algo)
        if key not in self._resident:
            self._resident[key] = _C.car_max_resident_blocks(dtype, chosen_algo, self.world_size)
        requested = int(blocks) or self._default_blocks
        # With dependent launches a rank's next kernel may be resident beside
        # this one: each may have half of what fits.
        resident = self._resident[key] // 2 if self.pdl else self._resident[key]
        blocks = _C.car_shared_gpu_blocks(
            self.world_size, requested, _C.car_choose_blocks(chosen_algo, self.world_size, nbytes, 0),
            resident)
        streams = self.streams if streams is None else streams
        for r in (range(self.world_size) if ranks is None else ranks):
            s = streams[r]
            s.wait_stream(current)
            self.ranks[r].all_reduce(inputs[r], outputs[r], algo, blocks, s.cuda_stream,
                                     0 if registered is None else registered.data_ptr())
        for r in (range(self.world_size) if ranks is None else ranks):
            current.wait_stream(streams[r])
        return outputs

    def barrier_only(self, blocks=1):
        """Every rank's call that moves no data: the start barrier alone (one
        flag round trip per block), ordered like all_reduce."""
        key = ("float32", "oneshot")
        if key not in self._resident:
            self._resident[key] = _C.car_max_resident_blocks(*key, self.world_size)
        blocks = _C.car_shared_gpu_blocks(self.world_size, int(blocks), int(blocks),
                                          self._resident[key])
        current = torch.cuda.current_stream()
        for r in range(self.world_size):
            s = self.streams[r]
            s.wait_stream(current)
            self.ranks[r].barrier_only(blocks, s.cuda_stream)
        for s in self.streams:
            current.wait_stream(s)

    @property
    def pdl(self):
        """Whether the kernels are launched with programmatic dependent launch
        (TPCOMM_CAR_PDL=on; off by default here, as the ranks share a GPU):
        settable, for calls made afterwards."""
        return self.ranks[0].pdl

    @pdl.setter
    def pdl(self, on):
        for rank in self.ranks:
            rank.pdl = bool(on)

    @property
    def device_scope(self):
        """Whether the kernels' flags are at GPU scope (TPCOMM_CAR_FLAG_SCOPE)."""
        return self.ranks[0].device_scope

    def all_reduce_add_rms_norm(self, inputs, residuals, weights, eps=1e-6, algorithm=None,
                                blocks=0, in_place=False):
        """The fused kernel on every rank: returns (normed, residual_out) lists,
        residual_out = sum of inputs + residuals[r], normed = RMSNorm of it x
        weights[r]; `in_place` writes residual_out into residuals. Ordered
        like all_reduce."""
        current = torch.cuda.current_stream()
        algo = _algorithm(algorithm)
        nbytes = inputs[0].numel() * inputs[0].element_size()
        chosen_algo = algo or _C.car_choose_algorithm(self.world_size, nbytes, self.max_bytes)
        dtype = str(inputs[0].dtype).replace("torch.", "")
        key = (dtype, chosen_algo, "fused")
        if key not in self._resident:
            self._resident[key] = _C.car_max_resident_blocks(dtype, chosen_algo, self.world_size,
                                                             True)
        blocks = _C.car_shared_gpu_blocks(
            self.world_size, int(blocks) or self._default_blocks,
            _C.car_choose_blocks(chosen_algo, self.world_size, nbytes, 0), self._resident[key])
        normed = [torch.empty_like(x) for x in inputs]
        outs = residuals if in_place else [torch.empty_like(r) for r in residuals]
        for r in range(self.world_size):
            s = self.streams[r]
            s.wait_stream(current)
            self.ranks[r].all_reduce_add_rms_norm(inputs[r], residuals[r], weights[r], eps,
                                                  normed[r], outs[r], algo or "", blocks,
                                                  s.cuda_stream)
        for s in self.streams:
            current.wait_stream(s)
        return normed, outs

    def check(self):
        """Raises TimeoutError naming the peer a kernel waited for in vain."""
        torch.cuda.synchronize()
        for rank in self.ranks:
            rank.check_error()

    def reset(self):
        """After a failure: zeroes every rank's flags, poison and errors. The
        ranks share this process, so the collective reset's barrier is the
        device synchronisation first: no rank's kernel is in flight while any
        rank zeroes, and none launches before all have."""
        torch.cuda.synchronize()
        for rank in self.ranks:
            rank.reset(lambda: None)


class IpcCommunicator:
    """One rank per process; buffers exchanged as CUDA IPC handles over the
    group's CPU path, by the same set-up the backend uses. Use `create`; every
    member of `pg` calls it."""

    def __init__(self, pg, rank, world_size, car_rank, eligible, reason, max_bytes):
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self._rank = car_rank
        self.eligible = eligible
        self.reason = reason
        self.max_bytes = max_bytes

    @classmethod
    def create(cls, pg=None, max_bytes=None, timeout_ms=None, device=None):
        """Allocates this rank's buffer on `device` (default: the current GPU),
        exchanges handles over `pg`'s CPU backend, opens the peers' buffers,
        runs the write probe and decides eligibility (`eligible`, `reason`),
        the same on every rank."""
        pg = dist.group.WORLD if pg is None else pg
        rank, n = dist.get_rank(pg), dist.get_world_size(pg)
        max_bytes, timeout_ms = _defaults(max_bytes, timeout_ms)
        device = torch.cuda.current_device() if device is None else torch.device(device).index
        cpu = pg._get_backend(torch.device("cpu"))
        ok, reason, car_rank = _C.car_set_up(cpu, rank, n, device, max_bytes, timeout_ms)
        return cls(pg, rank, n, car_rank, ok, reason, max_bytes)

    def _check_usable(self):
        if not self.eligible:
            raise RuntimeError(f"the custom allreduce is not available for this group: "
                               f"{self.reason}")

    def all_reduce(self, tensor, out=None, algorithm=None, blocks=0):
        """Sum over the group into `out` (a new tensor when None; `out` may be
        `tensor`), on the current stream. Capturable in a CUDA graph."""
        self._check_usable()
        out = torch.empty_like(tensor) if out is None else out
        self._rank.all_reduce(tensor, out, _algorithm(algorithm), blocks)
        return out

    def call_eligibility(self, tensor):
        """(eligible, reason) for one tensor."""
        if not self.eligible:
            return False, self.reason
        dtype = str(tensor.dtype).replace("torch.", "")
        if not tensor.is_cuda or not tensor.is_contiguous():
            return False, "a tensor that is not a contiguous CUDA tensor"
        nbytes = tensor.numel() * tensor.element_size()
        return _C.car_call_eligibility(dtype, nbytes, tensor.data_ptr(), tensor.data_ptr(),
                                       self.max_bytes)

    def check(self):
        """After the stream's work: raises TimeoutError naming a missing peer."""
        self._check_usable()
        torch.cuda.current_stream().synchronize()
        self._rank.check_error()

    def reset(self):
        """After a failure: every rank calls it. Synchronises the device,
        barrier, zeroes this rank's flags, poison and errors, barrier (no
        late flag write of the failed call can survive it, and no rank starts
        before every rank has zeroed)."""
        self._check_usable()
        self._rank.reset(lambda: dist.barrier(group=self.pg))
