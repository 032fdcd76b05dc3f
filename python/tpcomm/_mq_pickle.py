"""Pickling for the message queue: CPU tensors travel out of band.

A pickler of this module hands every plain CPU tensor (or nn.Parameter) it
meets, at any depth of the object, to a list instead of pickling it; the
stream refers to it by index, and the queue sends its bytes raw beside the
stream, 64-byte aligned (see python/mq_frames.hpp). The reader rebuilds each
tensor as a view of the received bytes. What becomes of each kind:

- CPU tensors of every dtype (bool, bfloat16, complex, float8, uint16/32
  included; torch's own pickling fails on the last three), 0-dim and empty
  ones: out of band. Views and non-contiguous tensors arrive as contiguous
  tensors of the same shape and values; conjugate and negative bits are
  resolved. Each tensor arrives as its own copy: two tensors sharing storage
  on the writer do not share it on the reader (the same tensor object twice
  is one tensor twice, as with pickle), except tensors the writer placed in
  the queue's arena, which arrive as views of the arena.
- requires_grad: arrives requiring grad, as a leaf (as torch's pickling
  does); nn.Parameter arrives as an nn.Parameter; attributes set on a tensor
  or a parameter (its __dict__) arrive with it.
- Tensor subclasses other than nn.Parameter, nested, sparse and quantized
  tensors, and meta tensors: torch's own pickling, whole, inside the stream
  (correct, slower). Named tensors: torch refuses to pickle them, and so do
  we.
- A received tensor is a view of its message's buffer: its
  untyped_storage() is that whole buffer (torch.save of it saves the whole
  message); clone() one to detach it from the rest.
- CUDA (and other device) tensors inside an object: refused with a
  TypeError naming broadcast_tensor_dict, which sends them over the device
  group; in a tensor dict, at any depth, they go that way. Point to point
  (`pack`), they go through torch's own pickling.
"""

import pickle
import threading

import torch

_received = threading.local()  # the tensors of the frame being unpickled
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided
# Named tensors (pickled in band): gone from torch 2.15, with Tensor.has_names.
_has_names = getattr(_Tensor, "has_names", None)


def _tensor(i):
    return _received.tensors[i]


def _grad_tensor(i):
    return _received.tensors[i].requires_grad_()


def _parameter(i, requires_grad):
    return _Parameter(_received.tensors[i], requires_grad)


def _set_attributes(tensor, state):
    tensor.__dict__.update(state)


def _device_tensor(dtype, shape):
    """A tensor dict's CUDA tensor: allocated here, filled over the device group."""
    t = torch.empty(shape, dtype=dtype, device=torch.cuda.current_device())
    _received.device.append(t)
    return t


class _Parts:
    """A file for pickle.Pickler that keeps what it is given: small pieces
    and, for large bytes-like payloads, the payload itself (no copy)."""

    def __init__(self, parts):
        self.write = parts.append


def _in_band(tensor):
    """torch's own pickling of `tensor`, whole and inside the stream: its
    rebuild functions may rely on the storages of the tensors it is made of
    (a nested tensor's buffer), which out-of-band views would not give them."""
    return pickle.loads, (pickle.dumps(tensor, protocol=5),)


# What a pickler does with a device (non-CPU) tensor.
REFUSE, COLLECT, TORCH = "refuse", "collect", "torch"


class Pickler(pickle.Pickler):
    """Pickles into `parts` (protocol 5); CPU tensors go to `self.tensors`.
    Device tensors: `self.device_mode` REFUSE (TypeError), COLLECT (tensor
    dicts: into `self.device`, the reader allocates their like) or TORCH
    (torch's own pickling)."""

    def __init__(self, parts):
        super().__init__(_Parts(parts), protocol=5)
        self.tensors = None
        self.device = None
        self.device_mode = REFUSE

    def reducer_override(self, obj):
        kind = type(obj)
        if kind is not _Tensor and kind is not _Parameter:
            if isinstance(obj, _Tensor):
                return _in_band(obj)  # a subclass
            return NotImplemented
        if obj.is_cpu:
            if (obj.layout != _strided or obj.is_quantized or obj.is_nested
                    or (_has_names is not None and _has_names(obj))):
                if self.device_mode == COLLECT and obj.layout != _strided:
                    raise ValueError(f"a {obj.layout} tensor in a tensor dict: tensor dicts "
                                     "carry dense tensors")
                return _in_band(obj)
            i = len(self.tensors)
            grad = obj.requires_grad
            self.tensors.append(obj.detach() if grad else obj)
            if kind is _Parameter:
                rebuild = _parameter, (i, grad)
            else:
                rebuild = (_grad_tensor, (i,)) if grad else (_tensor, (i,))
            state = obj.__dict__
            if state:
                return rebuild + (state, None, None, _set_attributes)
            return rebuild
        if obj.is_meta or self.device_mode == TORCH:
            return _in_band(obj)
        if self.device_mode == REFUSE:
            raise TypeError(
                f"a {obj.device} tensor inside an object: the message queue carries CPU "
                "tensors inside objects; send device tensors with broadcast_tensor_dict, which "
                "moves them over the device group")
        if not obj.is_cuda or obj.layout != _strided:
            raise ValueError(f"a {obj.device} tensor with layout {obj.layout} in a tensor dict: "
                             "dense cpu and cuda tensors are supported")
        self.device.append(obj.detach().contiguous())
        return _device_tensor, (obj.dtype, tuple(obj.shape))


class Dumper:
    """One queue's pickler, reused message after message (not thread-safe,
    as a queue end is not)."""

    def __init__(self):
        self._parts = []
        self._pickler = Pickler(self._parts)

    def dump(self, obj, device_mode=REFUSE):
        """(stream parts, CPU tensors, device tensors or None) of `obj`. The
        parts list is this dumper's: valid until clear(), which drops it."""
        parts, pickler = self._parts, self._pickler
        parts.clear()
        pickler.tensors = []
        pickler.device = [] if device_mode == COLLECT else None
        pickler.device_mode = device_mode
        try:
            pickler.dump(obj)
            return parts, pickler.tensors, pickler.device
        finally:
            pickler.clear_memo()  # the memo references every object of `obj`
            pickler.tensors = pickler.device = None

    def clear(self):
        """Drops the last stream's parts (they may reference large payloads)."""
        self._parts.clear()


def loads_object(stream, tensors):
    """Unpickles a frame's stream whose tensors are `tensors`."""
    outer = getattr(_received, "tensors", None)
    _received.tensors = tensors
    try:
        return pickle.loads(stream)
    finally:
        _received.tensors = outer


def loads_tensor_dict(stream, tensors):
    """Unpickles a tensor dict's frame: (dict, its device tensors, in the
    writer's order, still to be received)."""
    outer = getattr(_received, "tensors", None), getattr(_received, "device", None)
    _received.tensors, _received.device = tensors, []
    try:
        return pickle.loads(stream), _received.device
    finally:
        _received.tensors, _received.device = outer


def pack(obj):
    """`obj` as one uint8 tensor (a frame when it holds CPU tensors, else a
    plain pickle stream), for sending point to point."""
    from tpcomm import _C

    parts, tensors, _ = Dumper().dump(obj, TORCH)
    if tensors:
        return _C.mq_pack_frame(parts, tensors)
    return torch.frombuffer(bytearray(b"".join(memoryview(p).cast("B") for p in parts)),
                            dtype=torch.uint8)


def unpack(message):
    """The object `pack` made `message` of (its tensors: views of it)."""
    from tpcomm import _C

    if _C.mq_is_frame(message):
        return _C.mq_load_frame(message, loads_object)
    return pickle.loads(message.numpy())
