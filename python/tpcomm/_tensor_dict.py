"""Tensor dicts between GroupCoordinator ranks without a message queue:
metadata first (as an object), then each tensor, over the CPU group for CPU
tensors and the device group for CUDA tensors."""

from collections import namedtuple

import torch
import torch.distributed as dist

# What travels ahead of a tensor.
TensorMetadata = namedtuple("TensorMetadata", ["device", "dtype", "size"])


def check_dense(key, value):
    """Tensor dicts carry dense (strided) tensors; a sparse or otherwise laid
    out tensor is refused naming its key and layout."""
    if value.layout != torch.strided:
        raise ValueError(f"tensor dict entry {key!r} is a {value.layout} tensor; tensor dicts "
                         "carry dense tensors: pass value.to_dense(), or its indices and "
                         "values as two entries")


def split(tensor_dict):
    """(metadata list, tensors) where each tensor is replaced by its metadata."""
    if not isinstance(tensor_dict, dict):
        raise TypeError(f"a tensor dict must be a dict, got {type(tensor_dict).__name__}")
    metadata, tensors = [], []
    for key, value in tensor_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"tensor dict keys must be str, got {key!r}")
        if isinstance(value, torch.Tensor):
            check_dense(key, value)
            metadata.append((key, TensorMetadata(value.device.type, value.dtype, value.size())))
            tensors.append(value)
        else:
            metadata.append((key, value))
    return metadata, tensors


def _empty(c, meta):
    """A tensor for `meta` on the receiver: CPU stays CPU, a device tensor
    lands on the coordinator's device."""
    device = "cpu" if meta.device == "cpu" else c.device
    return torch.empty(meta.size, dtype=meta.dtype, device=device)


def _group_for(c, tensor):
    return c.cpu_group if tensor.is_cpu else c.device_group


def broadcast(c, tensor_dict, src, root):
    """broadcast_tensor_dict from group rank `src` (global rank `root`)."""
    if c.rank == root:
        metadata, tensors = split(tensor_dict)
        tensors = [t.contiguous() for t in tensors]  # the source only reads them
        c.broadcast_object(metadata, src=src)
    else:
        metadata = c.broadcast_object(None, src=src)
        tensor_dict, tensors = {}, []
        for key, value in metadata:
            if isinstance(value, TensorMetadata):
                tensor_dict[key] = _empty(c, value)
                tensors.append(tensor_dict[key])
            else:
                tensor_dict[key] = value
    works = [dist.broadcast(t, src=root, group=_group_for(c, t), async_op=True)
             for t in tensors if t.numel()]
    for w in works:
        w.wait()
    return tensor_dict


def _sliced(key, tensor, all_gather_group, all_gather_tensors):
    """Whether `key` travels as a 1/TP slice (see send)."""
    if all_gather_group is None or all_gather_group.world_size == 1:
        return False
    default = tensor.numel() % all_gather_group.world_size == 0
    return bool((all_gather_tensors or {}).get(key, default))


def _outgoing(tensor_dict, all_gather_group, all_gather_tensors):
    """The tensors a send puts on the wire after the metadata, in order:
    each non-empty tensor, or this rank's 1/TP slice of a sliced one."""
    for key, value in tensor_dict.items():
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        t = value.contiguous()
        if _sliced(key, t, all_gather_group, all_gather_tensors):
            t = t.reshape(all_gather_group.world_size, -1)[all_gather_group.rank_in_group]
        yield t


def send(c, tensor_dict, peer, all_gather_group, all_gather_tensors):
    """send_tensor_dict to global rank `peer`: with `all_gather_group`, only
    this rank's 1/TP slice of each sliced tensor."""
    metadata, _ = split(tensor_dict)
    c.send_object(metadata, dst=c.ranks.index(peer))
    for t in _outgoing(tensor_dict, all_gather_group, all_gather_tensors):
        dist.send(t, dst=peer, group=_group_for(c, t))


def recv(c, peer, all_gather_group, all_gather_tensors):
    """recv_tensor_dict from global rank `peer`; sliced tensors are
    all-gathered over `all_gather_group`."""
    metadata = c.recv_object(src=c.ranks.index(peer))
    out = {}
    for key, value in metadata:
        if not isinstance(value, TensorMetadata):
            out[key] = value
            continue
        tensor = _empty(c, value)
        if tensor.numel() and _sliced(key, tensor, all_gather_group, all_gather_tensors):
            part = tensor.new_empty(tensor.numel() // all_gather_group.world_size)
            dist.recv(part, src=peer, group=_group_for(c, part))
            tensor = all_gather_group.all_gather(part, dim=0).reshape(value.size)
        elif tensor.numel():
            dist.recv(tensor, src=peer, group=_group_for(c, tensor))
        out[key] = tensor
    return out


# ------------------------------------------------------------- asynchronous
class Handle:
    """One asynchronous send or receive of a GroupCoordinator: the works it
    posted and the tensors they read or fill, kept alive until `wait()`.
    `wait()` may be called again (it does nothing the second time); a
    timeout is the group's, as for every wait on it."""

    def __init__(self, works, retained):
        self._works = [w for w in works if w is not None]
        self._retained = tuple(retained)
        self._waited = False

    def is_completed(self):
        return self._waited or all(w.is_completed() for w in self._works)

    def wait(self):
        if self._waited:
            return
        for w in self._works:
            w.wait()
        self._waited = True
        self._retained = ()


def isend_object(c, obj, peer):
    """send_object's two messages (size, then the pickled bytes), posted."""
    from tpcomm import _mq_pickle

    payload = _mq_pickle.pack(obj)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    works = [dist.isend(size, dst=peer, group=c.cpu_group),
             dist.isend(payload, dst=peer, group=c.cpu_group)]
    return Handle(works, (size, payload))


def isend(c, tensor_dict, peer, all_gather_group, all_gather_tensors):
    """send() posted: [the metadata's handle, one handle per tensor sent]."""
    metadata, _ = split(tensor_dict)
    handles = [isend_object(c, metadata, peer)]
    for t in _outgoing(tensor_dict, all_gather_group, all_gather_tensors):
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
        handles.append(Handle([dist.isend(t, dst=peer, group=_group_for(c, t))], (t,)))
    return handles


def irecv(c, peer, all_gather_group, all_gather_tensors):
    """recv() with the tensors posted, not waited: (dict, handles,
    postprocess). The metadata is received before it returns; after every
    handle's wait(), each postprocess() call all-gathers one sliced tensor
    into its place in the dict."""
    metadata = c.recv_object(src=c.ranks.index(peer))
    out, handles, postprocess = {}, [], []
    for key, value in metadata:
        if not isinstance(value, TensorMetadata):
            out[key] = value
            continue
        tensor = _empty(c, value)
        out[key] = tensor
        if tensor.numel() == 0:
            continue
        if _sliced(key, tensor, all_gather_group, all_gather_tensors):
            part = tensor.new_empty(tensor.numel() // all_gather_group.world_size)
            handles.append(Handle([dist.irecv(part, src=peer, group=_group_for(c, part))],
                                  (part,)))
            out[key] = part

            def gather(key=key, part=part, size=value.size):
                out[key] = all_gather_group.all_gather(part, dim=0).reshape(size)

            postprocess.append(gather)
        else:
            handles.append(Handle([dist.irecv(tensor, src=peer, group=_group_for(c, tensor))],
                                  (tensor,)))
    return out, handles, postprocess
