"""GroupCoordinator: one process group as a tensor-parallel inference server
sees it, with the method surface of vLLM's GroupCoordinator.

Every rank list in `group_ranks` becomes a group (every process calls
`new_group` for each, in the same order); each process keeps the one it
belongs to. Ranks passed as `src`/`dst` are ranks within the group; results
are new tensors (out of place) unless a method says otherwise; at world size 1
every collective returns its input unchanged.

With backend "tpcomm" one group serves both CPU and CUDA tensors, so
`cpu_group` and `device_group` are the same group; any other backend gets a
separate Gloo group for `cpu_group`.

Each method is short and delegates its protocol to a module of its own
(_tensor_dict, _expert_parallel, message_queue); the point-to-point methods
and the expert-parallel ones are classes of their own
(_coordinator_p2p.PointToPointMethods, _coordinator_ep.ExpertParallelMethods)
that GroupCoordinator takes its methods from.
"""

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpcomm import _C, _graphs, _ops, _tensor_dict
from tpcomm._coordinator_ep import ExpertParallelMethods
from tpcomm._coordinator_p2p import PointToPointMethods
from tpcomm._registration import BACKEND_NAME
from tpcomm._tensor_dict import TensorMetadata  # noqa: F401  (re-exported)
from tpcomm.message_queue import MessageQueue

_is_compiling = torch.compiler.is_compiling
_fast_all_reduce_out = _C._fast_all_reduce_out


@dataclass
class GraphCaptureContext:
    stream: "torch.cuda.Stream"


def _check_dim(tensor, dim, what):
    if not -tensor.dim() <= dim < tensor.dim():
        raise IndexError(f"{what}: dim {dim} is out of range for a tensor of shape "
                         f"{tuple(tensor.shape)}")
    return dim % tensor.dim()


# vLLM's switch (parallel_state.set_custom_all_reduce), read when a
# coordinator is made: False sends its CUDA allreduces to NCCL alone.
custom_all_reduce_enabled = True


def default_group_timeout():
    """The timeout the default process group was created with (None when its
    backends do not say)."""
    pg = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


class GroupCoordinator(PointToPointMethods, ExpertParallelMethods):
    def __init__(self, group_ranks, local_rank, torch_distributed_backend=BACKEND_NAME,
                 use_device_communicator=True, use_message_queue_broadcaster=False,
                 group_name=None, device=None, timeout=None):
        if not dist.is_initialized():
            raise RuntimeError("GroupCoordinator needs torch.distributed to be initialised "
                               "(init_process_group or tpcomm.init_distributed_environment)")
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        self._check_group_ranks(group_ranks)
        self.group_ranks = [list(r) for r in group_ranks]
        backend = str(torch_distributed_backend).lower()
        self.cpu_group = self.device_group = None
        # Subgroups wait as long as the job told init_process_group, not
        # torch's 30-minute new_group default.
        timeout = default_group_timeout() if timeout is None else timeout
        for ranks in group_ranks:
            device_group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
            cpu_group = (device_group if backend == BACKEND_NAME
                         else dist.new_group(list(ranks), backend="gloo", timeout=timeout))
            if self.rank in ranks:
                self.ranks = list(ranks)
                self.timeout = timeout
                self.world_size = len(ranks)
                self.rank_in_group = self.ranks.index(self.rank)
                self.device_group, self.cpu_group = device_group, cpu_group
        if self.device_group is None:  # after every new_group call, which all ranks make
            raise ValueError(f"rank {self.rank} is in none of group_ranks {group_ranks}")
        self.unique_name = _ops.unique_name(group_name or "anonymous")
        _ops.register_coordinator(self)
        self.backend = backend
        self._tpcomm = backend == BACKEND_NAME
        # The direct route of all_reduce on CPU tensors (a handle on the
        # group's tpcomm backend), taken outside torch.compile's tracing.
        self._direct = _C._fast_handle(self.device_group) if self._tpcomm else None
        self.device = self._choose_device(device)
        self.use_device_communicator = use_device_communicator
        self.mq_broadcaster = None
        if use_message_queue_broadcaster and self.world_size > 1:
            self.mq_broadcaster = MessageQueue.create_from_process_group(
                self.cpu_group, 1 << 22, 6, device_group=self.device_group)
        self.communication_buffer_bytes = 0
        if self._tpcomm and not custom_all_reduce_enabled:
            self._tpcomm_backend().set_route_mode("nccl")

        self._ep_plans = deque()
        # isend_tensor_dict's handles, kept until their sends complete (a
        # caller may drop them): reaped oldest first on the next isend.
        self._pending_isends = deque()

    def _check_group_ranks(self, group_ranks):
        world = dist.get_world_size()
        seen = set()
        for ranks in group_ranks:
            if not ranks:
                raise ValueError("group_ranks holds an empty rank list")
            for r in ranks:
                if not isinstance(r, int) or not 0 <= r < world:
                    raise ValueError(f"group_ranks: {r!r} is not a rank of a world of {world}")
                if r in seen:
                    raise ValueError(f"group_ranks: rank {r} appears in more than one place")
                seen.add(r)

    def _choose_device(self, device):
        if device is not None:
            return torch.device(device)
        if self.backend != "gloo" and torch.cuda.is_available():
            if self.local_rank >= torch.cuda.device_count():
                raise ValueError(f"local_rank {self.local_rank} has no GPU (this machine has "
                                 f"{torch.cuda.device_count()}); pass device='cpu' or a device")
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    # -------------------------------------------------------------- ranks
    @property
    def first_rank(self):
        return self.ranks[0]

    @property
    def last_rank(self):
        return self.ranks[-1]

    @property
    def is_first_rank(self):
        return self.rank == self.first_rank

    @property
    def is_last_rank(self):
        return self.rank == self.last_rank

    @property
    def next_rank(self):
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self):
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def _global(self, group_rank, what):
        if not isinstance(group_rank, int) or not 0 <= group_rank < self.world_size:
            raise ValueError(f"{what} {group_rank!r} is not a rank of group {self.unique_name} "
                             f"(size {self.world_size}; ranks are group-local)")
        return self.ranks[group_rank]

    # -------------------------------------------------------------- reductions
    def all_reduce(self, input_):
        """Sum over the group; a new tensor (torch.ops.tpcomm.all_reduce)."""
        if self.world_size == 1:
            return input_
        return self._all_reduce_op(input_)

    def _all_reduce_op(self, input_):
        """torch.ops.tpcomm.all_reduce, whatever the group's size. Outside
        torch.compile's tracing a plain CPU tensor goes straight to the backend
        call of the op's CPU kernel (no dispatcher: about 1 us less a call),
        and a plain CUDA tensor to the backend call its CUDA kernel makes;
        what _C._fast_all_reduce_out does not take, the op does."""
        if self._direct is not None and not _is_compiling():
            out = _fast_all_reduce_out(self._direct, input_)
            if out is not None:
                return out
        return torch.ops.tpcomm.all_reduce(input_, self.unique_name)

    def _all_reduce_out_place(self, input_):
        if input_.is_cuda and self._tpcomm:
            # Out of place down to the kernel, which can then read the input
            # where it lies inside graph_capture().
            out = torch.empty_like(input_, memory_format=torch.contiguous_format)
            return _graphs.all_reduce_into(input_.contiguous(), out, self.device_group)
        out = input_.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=self.device_group)
        return out

    def all_reduce_add_rms_norm(self, input_, residual, weight, eps=1e-6):
        """The row-parallel output's allreduce fused with the residual add and
        RMSNorm that follow it in a transformer layer:

            residual_out = all_reduce(input_) + residual
            normed = rms_norm(residual_out) * weight   (last dim, float32 statistics)

        Returns (normed, residual_out), new tensors
        (torch.ops.tpcomm.all_reduce_add_rms_norm). Fused on the custom CUDA
        kernel and the CPU shared-memory path; composed elsewhere."""
        return torch.ops.tpcomm.all_reduce_add_rms_norm(input_, residual, weight, float(eps),
                                                        self.unique_name)

    def all_reduce_add_rms_norm_(self, input_, residual, weight, eps=1e-6):
        """all_reduce_add_rms_norm writing residual_out into `residual`;
        returns (normed, residual)."""
        normed = torch.ops.tpcomm.all_reduce_add_rms_norm_(input_, residual, weight, float(eps),
                                                           self.unique_name)
        return normed, residual

    @property
    def last_fused_path(self):
        """The path all_reduce_add_rms_norm last took (None before the first)."""
        return _C.op_group_fused_path(self.unique_name) or None

    def _all_reduce_add_rms_norm_out(self, input_, residual, weight, eps, residual_out):
        """The ops' implementation: residual_out None makes a new tensor."""
        if residual_out is None:
            residual_out = torch.empty_like(residual, memory_format=torch.contiguous_format)
        normed = torch.empty_like(input_, memory_format=torch.contiguous_format)
        out = residual_out if residual_out.is_contiguous() else torch.empty_like(
            residual_out, memory_format=torch.contiguous_format)
        res = residual.contiguous()  # residual itself when contiguous (then in place)
        if self._tpcomm and self.device_group is not None:
            backend = self._tpcomm_backend()
            path = backend.all_reduce_add_rms_norm(
                input_.contiguous(), res, weight.contiguous(), eps, normed, out)
        else:
            reduced = input_.clone(memory_format=torch.contiguous_format)
            if self.world_size > 1:
                dist.all_reduce(reduced, group=self.device_group)
            torch.add(reduced, res, out=out)
            stats = torch.float64 if out.dtype == torch.float64 else torch.float32
            normed.copy_(torch.nn.functional.rms_norm(out.to(stats), (weight.numel(),),
                                                      weight.to(stats), eps))
            path = "composed"
        _C.set_op_group_fused_path(self.unique_name, path)
        if out is not residual_out:
            residual_out.copy_(out)
        return normed, residual_out

    def all_gather(self, input_, dim=-1):
        """Concatenation of every rank's `input_` along `dim`, in rank order."""
        if self.world_size == 1:
            return input_
        dim = _check_dim(input_, dim, "all_gather")
        return torch.ops.tpcomm.all_gather(input_, dim, self.world_size, self.unique_name)

    def _all_gather_out_place(self, input_, dim):
        n = self.world_size
        shape = tuple(input_.shape)
        out = input_.new_empty((n * shape[0],) + shape[1:])
        dist.all_gather_into_tensor(out, input_.contiguous(), group=self.device_group)
        out = out.reshape((n,) + shape).movedim(0, dim)
        return out.reshape(shape[:dim] + (n * shape[dim],) + shape[dim + 1:])

    def reduce_scatter(self, input_, dim=-1):
        """Sum over the group, split along `dim`; this rank keeps its chunk."""
        if self.world_size == 1:
            return input_
        dim = _check_dim(input_, dim, "reduce_scatter")
        if input_.shape[dim] % self.world_size:
            raise ValueError(f"reduce_scatter: size {input_.shape[dim]} of dim {dim} does not "
                             f"divide by the group size {self.world_size}")
        return torch.ops.tpcomm.reduce_scatter(input_, dim, self.world_size, self.unique_name)

    def _reduce_scatter_out_place(self, input_, dim):
        source = input_.movedim(dim, 0).contiguous()
        out = source.new_empty((source.shape[0] // self.world_size,) + tuple(source.shape[1:]))
        dist.reduce_scatter_tensor(out, source, group=self.device_group)
        return out.movedim(0, dim).contiguous()

    def _sizes(self, local, sizes, what):
        """Every rank's size; exchanged over the CPU group when not given."""
        if sizes is None:
            mine = torch.tensor([local], dtype=torch.int64)
            every = torch.empty(self.world_size, dtype=torch.int64)
            dist.all_gather_into_tensor(every, mine, group=self.cpu_group)
            return every.tolist()
        sizes = [int(s) for s in sizes]
        if len(sizes) != self.world_size or min(sizes) < 0:
            raise ValueError(f"{what}: sizes {sizes} must be {self.world_size} non-negative "
                             "integers, one per rank")
        return sizes

    def all_gatherv(self, input_, dim=0, sizes=None):
        """all_gather where ranks contribute different sizes along `dim`
        (`sizes[r]` from rank r; exchanged when None). `input_` may be a list
        of tensors, gathered alike."""
        if isinstance(input_, (list, tuple)):
            return [self.all_gatherv(t, dim, sizes) for t in input_]
        if self.world_size == 1:
            return input_
        dim = _check_dim(input_, dim, "all_gatherv")
        sizes = self._sizes(input_.shape[dim], sizes, "all_gatherv")
        if sizes[self.rank_in_group] != input_.shape[dim]:
            raise ValueError(f"all_gatherv: sizes[{self.rank_in_group}] = "
                             f"{sizes[self.rank_in_group]} but this rank's input has "
                             f"{input_.shape[dim]} along dim {dim}")
        x = input_.movedim(dim, 0)
        width = max(sizes)
        padded = x.new_zeros((width,) + tuple(x.shape[1:]))
        padded[:x.shape[0]] = x
        out = x.new_empty((self.world_size * width,) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=self.device_group)
        parts = [out[r * width:r * width + s] for r, s in enumerate(sizes)]
        return torch.cat(parts).movedim(0, dim).contiguous()

    def reduce_scatterv(self, input_, dim=-1, sizes=None):
        """reduce_scatter where rank r keeps `sizes[r]` rows along `dim`
        (even split when None)."""
        if self.world_size == 1:
            return input_
        dim = _check_dim(input_, dim, "reduce_scatterv")
        total = input_.shape[dim]
        if sizes is None:
            return self.reduce_scatter(input_, dim)
        sizes = self._sizes(None, sizes, "reduce_scatterv")
        if sum(sizes) != total:
            raise ValueError(f"reduce_scatterv: sizes {sizes} sum to {sum(sizes)}, not to the "
                             f"input's {total} along dim {dim}")
        x = input_.movedim(dim, 0)
        width = max(sizes)
        padded = x.new_zeros((self.world_size * width,) + tuple(x.shape[1:]))
        start = 0
        for r, s in enumerate(sizes):
            padded[r * width:r * width + s] = x[start:start + s]
            start += s
        out = x.new_empty((width,) + tuple(x.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=self.device_group)
        return out[:sizes[self.rank_in_group]].movedim(0, dim).contiguous()

    def reduce_scatterv_into_output(self, input_, output, dim=-1, sizes=None):
        """reduce_scatterv written into `output` (checked before any
        communication), which is returned."""
        if self.world_size > 1:
            d = _check_dim(input_, dim, "reduce_scatterv_into_output")
            mine = (input_.shape[d] // self.world_size if sizes is None
                    else self._sizes(None, sizes, "reduce_scatterv_into_output")[
                        self.rank_in_group])
            want = input_.shape[:d] + (mine,) + input_.shape[d + 1:]
        else:
            want = input_.shape
        if tuple(output.shape) != tuple(want):
            raise ValueError(f"reduce_scatterv_into_output: output has shape "
                             f"{tuple(output.shape)}, this rank's part is {tuple(want)}")
        return output.copy_(self.reduce_scatterv(input_, dim, sizes))

    def cpu_all_reduce_(self, tensor):
        """In-place SUM of a small CPU tensor over the CPU group (the same
        result on every rank); returns it."""
        if tensor.device.type != "cpu":
            raise ValueError(f"cpu_all_reduce_ takes a CPU tensor, got one on {tensor.device}")
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.cpu_group)
        return tensor

    def gather(self, input_, dst=0, dim=-1):
        """Concatenation along `dim` on group rank `dst`; None elsewhere."""
        root = self._global(dst, "gather: dst")
        if self.world_size == 1:
            return input_
        dim = _check_dim(input_, dim, "gather")
        parts = ([torch.empty_like(input_, memory_format=torch.contiguous_format)
                  for _ in range(self.world_size)] if self.rank == root else None)
        dist.gather(input_.contiguous(), parts, dst=root, group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    # -------------------------------------------------------------- broadcasts
    def broadcast(self, input_, src=0):
        """In place: every rank's `input_` becomes group rank `src`'s."""
        root = self._global(src, "broadcast: src")
        if self.world_size == 1:
            return input_
        dist.broadcast(input_, src=root, group=self.device_group)
        return input_

    def broadcast_object(self, obj=None, src=0):
        """Group rank `src`'s `obj` on every rank (through the message queue
        when this group has one and `src` is its writer)."""
        root = self._global(src, "broadcast_object: src")
        if self.world_size == 1:
            return obj
        if self.mq_broadcaster is not None and src == self.mq_broadcaster.writer_rank:
            return self.mq_broadcaster.broadcast_object(obj)
        box = [obj if self.rank == root else None]
        dist.broadcast_object_list(box, src=root, group=self.cpu_group)
        return box[0]

    def broadcast_object_list(self, obj_list, src=0, group=None):
        """In place: `obj_list` becomes group rank `src`'s on every rank."""
        root = self._global(src, "broadcast_object_list: src")
        if self.world_size == 1:
            return obj_list
        dist.broadcast_object_list(obj_list, src=root, group=self.cpu_group)
        return obj_list

    def broadcast_tensor_dict(self, tensor_dict=None, src=0, group=None, metadata_group=None):
        """Group rank `src`'s dict of str -> tensor | picklable on every rank.
        Through the message queue when `src` is its writer (CPU tensor bytes
        raw, CUDA tensors over the device group); otherwise the metadata goes
        as an object and the tensors by broadcast."""
        root = self._global(src, "broadcast_tensor_dict: src")
        if self.world_size == 1:
            return tensor_dict
        if self.mq_broadcaster is not None and src == self.mq_broadcaster.writer_rank:
            return self.mq_broadcaster.broadcast_tensor_dict(
                tensor_dict if self.rank == root else None)
        return _tensor_dict.broadcast(self, tensor_dict, src, root)

    def barrier(self):
        """Every rank of the group arrives (on the CPU group: no device work)."""
        dist.barrier(group=self.cpu_group)

    def make_sibling_device_group(self, group_desc=None):
        """A new process group with this group's members and backend but a
        communicator of its own (work on it may run beside this group's).
        Every rank of the world calls it, as the constructor."""
        sibling = None
        for ranks in self.group_ranks:
            pg = dist.new_group(ranks, backend=self.backend, timeout=self.timeout,
                                group_desc=group_desc)
            if self.rank in ranks:
                sibling = pg
        return sibling

    # -------------------------------------------------------------- graphs, queues
    @contextmanager
    def graph_capture(self, graph_capture_context=None):
        """Context for capturing CUDA graphs: work runs on a side stream that
        first waits for the current one; collectives inside are captured, and
        with backend tpcomm the custom allreduces captured inside read their
        inputs in place after the context exits (tpcomm.graph_capture)."""
        if not torch.cuda.is_available():
            raise RuntimeError("graph_capture needs CUDA; this process has no GPU")
        if graph_capture_context is None:
            graph_capture_context = GraphCaptureContext(torch.cuda.Stream(device=self.device))
        stream = graph_capture_context.stream
        current = torch.cuda.current_stream(device=self.device)
        if current != stream:
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            if self._tpcomm and self.world_size > 1:
                with _graphs.graph_capture(self.device_group):
                    yield graph_capture_context
            else:
                yield graph_capture_context

    def create_mq_broadcaster(self, writer_rank=0, external_writer_handle=None, blocking=True):
        """A message queue over this group with group rank `writer_rank` as
        its writer. Every rank of the group calls it."""
        if external_writer_handle is not None:
            raise ValueError("external_writer_handle is not supported: tpcomm queues are made "
                             "by the group's members")
        self._global(writer_rank, "create_mq_broadcaster: writer_rank")
        return MessageQueue.create_from_process_group(
            self.cpu_group, 1 << 22, 6, writer_rank=writer_rank, blocking=blocking,
            device_group=self.device_group)

    def create_single_reader_mq_broadcasters(self, reader_rank_in_group=0, blocking=False):
        """Queues from every other rank to group rank `reader_rank_in_group`:
        (this rank's writer queue, []) on writers, (None, one reader queue per
        other rank in group order) on the reader."""
        self._global(reader_rank_in_group, "create_single_reader_mq_broadcasters: reader")
        if self.world_size == 1:
            return None, []
        return MessageQueue.create_single_reader(
            self.cpu_group, reader_rank_in_group, 1 << 22, 6, blocking=blocking,
            device_group=self.device_group)

    def prepare_communication_buffer_for_model(self, model, max_tokens=None):
        """Sizes the allreduce staging buffers for `model`: its widest
        activation (largest Linear out_features or Embedding dim) times
        `max_tokens` (default: model.max_num_tokens, else 8192) in the
        parameters' dtype. Returns the bytes; applied to the group's device
        backend when it takes a size."""
        width = 0
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                width = max(width, module.out_features)
            elif isinstance(module, torch.nn.Embedding):
                width = max(width, module.embedding_dim)
            else:
                width = max(width, int(getattr(module, "output_size", 0) or 0))
        weight = next((p for p in model.parameters() if p.is_floating_point()), None)
        itemsize = weight.element_size() if weight is not None else 4
        tokens = max_tokens or getattr(model, "max_num_tokens", None) or 8192
        self.communication_buffer_bytes = int(width * tokens * itemsize)
        backend = self._tpcomm_backend()
        if backend is not None and hasattr(backend, "set_communication_buffer_bytes"):
            backend.set_communication_buffer_bytes(self.communication_buffer_bytes)
        return self.communication_buffer_bytes

    def _tpcomm_backend(self):
        if self.backend != BACKEND_NAME or self.device_group is None:
            return None
        return self.device_group._get_backend(torch.device("cpu"))

    def destroy(self):
        """Shuts the message queue and destroys this coordinator's groups."""
        if self.mq_broadcaster is not None:
            self.mq_broadcaster.shutdown()
            self.mq_broadcaster = None
        for pg in {id(g): g for g in (self.device_group, self.cpu_group) if g}.values():
            dist.destroy_process_group(pg)
        self.device_group = self.cpu_group = None
        self._direct = None
        _ops.unregister_coordinator(self.unique_name)

    def __repr__(self):
        return (f"GroupCoordinator({self.unique_name}, ranks={self.ranks}, "
                f"rank_in_group={self.rank_in_group}, device={self.device})")
