"""The message queue's tensor-dict format before frames, kept to measure
against in the same run: a pickled header list of (key, kind, dtype, shape,
bytes), then the CPU tensors' bytes, each 64-byte aligned; the reader slices
one uint8 buffer per tensor in Python. Same queue, same ring."""

import pickle
import struct

import torch

_ALIGN = 64
_LEN = struct.Struct("<Q")


def _raw_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def broadcast_tensor_dict(mq, tensor_dict=None):
    """mq.broadcast_tensor_dict as it was (CPU tensors only)."""
    if mq.is_writer:
        meta, raws = [], []
        for key, value in tensor_dict.items():
            if not isinstance(value, torch.Tensor):
                meta.append((key, "obj", value, None, 0))
                continue
            nbytes = value.numel() * value.element_size()
            meta.append((key, "cpu", value.dtype, tuple(value.shape), nbytes))
            if nbytes:
                raws.append(_raw_bytes(value))
        header = pickle.dumps(meta, protocol=5)
        message = [_LEN.pack(len(header)), header]
        pos = _LEN.size + len(header)
        for raw in raws:
            pad = -pos % _ALIGN
            if pad:
                message.append(bytes(pad))
            message.append(raw)
            pos += pad + raw.nbytes
        mq._send(message, None)
        return tensor_dict
    buf = mq._recv(None)
    raw = buf.numpy()
    (hlen,) = _LEN.unpack_from(raw, 0)
    meta = pickle.loads(raw[_LEN.size:_LEN.size + hlen])
    pos = _LEN.size + hlen
    out = {}
    for key, kind, a, shape, nbytes in meta:
        if kind == "obj":
            out[key] = a
        elif nbytes:
            pos += -pos % _ALIGN
            out[key] = buf[pos:pos + nbytes].view(a).reshape(shape)
            pos += nbytes
        else:
            out[key] = torch.empty(shape, dtype=a)
    return out


class _Parts:
    def __init__(self, parts):
        self.write = parts.append


def broadcast_object(mq, obj=None):
    """mq.broadcast_object as it was: tensors inside `obj` pickled by torch."""
    if mq.is_writer:
        parts = []
        pickle.Pickler(_Parts(parts), protocol=5).dump(obj)
        mq._send(parts, None)
        return obj
    if mq._reader is not None:
        return mq._reader.read_object(mq._timeout, None, None)
    return pickle.loads(mq._recv(None).numpy())
