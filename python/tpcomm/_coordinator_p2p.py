"""GroupCoordinator's point-to-point methods (vLLM's surface): objects,
tensor dicts (whole, sliced across a tensor-parallel group, asynchronous)
and tensors between two ranks of the group, ranks given within the group.
The protocols are _tensor_dict's and _mq_pickle's; this class names the
peer and keeps the asynchronous sends alive. A GroupCoordinator is one
(coordinator.py); the attributes it reads (rank, world_size,
rank_in_group, cpu_group, device_group, device, _global, _pending_isends)
are the coordinator's."""

import torch
import torch.distributed as dist

from tpcomm import _mq_pickle, _tensor_dict


class PointToPointMethods:
    def _peer(self, peer, default_step, what):
        if peer is None:
            peer = (self.rank_in_group + default_step) % self.world_size
        root = self._global(peer, what)
        if root == self.rank:
            raise ValueError(f"{what} {peer} is this rank itself")
        return root

    def send_object(self, obj, dst):
        """Pickles `obj` to group rank `dst` over the CPU group (CPU tensors
        inside it out of band, as the message queue sends them)."""
        peer = self._peer(dst, 1, "send_object: dst")
        payload = _mq_pickle.pack(obj)
        dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=peer,
                  group=self.cpu_group)
        dist.send(payload, dst=peer, group=self.cpu_group)

    def recv_object(self, src):
        """The object group rank `src` sent with send_object."""
        peer = self._peer(src, -1, "recv_object: src")
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=peer, group=self.cpu_group)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(payload, src=peer, group=self.cpu_group)
        return _mq_pickle.unpack(payload)

    def isend_object(self, obj, dst):
        """send_object without waiting: a handle (is_completed(), wait())
        that keeps the pickled bytes alive until wait(). Pairs with
        recv_object."""
        peer = self._peer(dst, 1, "isend_object: dst")
        return _tensor_dict.isend_object(self, obj, peer)

    def send_tensor_dict(self, tensor_dict, dst=None, all_gather_group=None,
                         all_gather_tensors=None):
        """Sends a dict of str -> tensor | picklable to group rank `dst` (the
        next rank by default). With `all_gather_group` (the tensor-parallel
        group, whose ranks all send the same dict), each rank sends only its
        1/TP slice of every tensor whose size divides by TP (per key:
        `all_gather_tensors[key]` overrides) and the receivers all-gather."""
        if self.world_size == 1:
            return tensor_dict
        peer = self._peer(dst, 1, "send_tensor_dict: dst")
        _tensor_dict.send(self, tensor_dict, peer, all_gather_group, all_gather_tensors)
        return None

    def recv_tensor_dict(self, src=None, all_gather_group=None, all_gather_tensors=None):
        """The dict group rank `src` (the previous rank by default) sent;
        `all_gather_group` and `all_gather_tensors` must match the sender's."""
        if self.world_size == 1:
            return None
        peer = self._peer(src, -1, "recv_tensor_dict: src")
        return _tensor_dict.recv(self, peer, all_gather_group, all_gather_tensors)

    def isend_tensor_dict(self, tensor_dict, dst=None, all_gather_group=None,
                          all_gather_tensors=None):
        """send_tensor_dict without waiting (a pipeline stage sends its
        output and goes on): the handles [metadata, one per tensor sent].
        The group also keeps them, with the tensors they read, until they
        complete, so a caller may drop them. Pairs with recv_tensor_dict or
        irecv_tensor_dict."""
        if self.world_size == 1:
            return []
        peer = self._peer(dst, 1, "isend_tensor_dict: dst")
        self._reap_isends()
        handles = _tensor_dict.isend(self, tensor_dict, peer, all_gather_group,
                                     all_gather_tensors)
        self._pending_isends.append(handles)
        return handles

    # The isends kept for callers that dropped their handles: beyond this
    # many, the oldest is waited for (the sender slows to its receiver).
    MAX_PENDING_ISENDS = 64

    def _reap_isends(self):
        """Drops kept isends that completed, oldest first. Completion is read
        from the tensors' handles: a Gloo send reports completion only once
        waited for, and the receiver takes the metadata before the tensors,
        so once the tensors went the metadata's wait() returns at once. An
        entry without tensors has only its metadata to ask; past
        MAX_PENDING_ISENDS entries the oldest is waited for."""
        pending = self._pending_isends
        while pending:
            handles = pending[0]
            judged = handles[1:] or handles
            if not all(h.is_completed() for h in judged):
                if len(pending) <= self.MAX_PENDING_ISENDS:
                    break
            for h in pending.popleft():
                h.wait()

    def irecv_tensor_dict(self, src=None, all_gather_group=None, all_gather_tensors=None):
        """recv_tensor_dict with the tensors posted, not waited: (dict,
        handles, postprocess). The metadata arrives before it returns; after
        every handle's wait(), call each postprocess() to all-gather the
        sliced tensors into the dict. (None, [], []) at world size 1."""
        if self.world_size == 1:
            return None, [], []
        peer = self._peer(src, -1, "irecv_tensor_dict: src")
        return _tensor_dict.irecv(self, peer, all_gather_group, all_gather_tensors)

    def send(self, tensor, dst=None):
        """Sends `tensor` to group rank `dst` (the next rank by default)."""
        peer = self._peer(dst, 1, "send: dst")
        dist.send(tensor.contiguous(), dst=peer, group=self.device_group)

    def recv(self, size, dtype, src=None):
        """A new tensor of `size` and `dtype` on this group's device, from
        group rank `src` (the previous rank by default)."""
        peer = self._peer(src, -1, "recv: src")
        tensor = torch.empty(size, dtype=dtype, device=self.device)
        dist.recv(tensor, src=peer, group=self.device_group)
        return tensor
