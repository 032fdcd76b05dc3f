"""tpcomm: a torch.distributed backend for tensor-parallel inference and training.

``import tpcomm`` registers the backend ``"tpcomm"`` once; then

    torch.distributed.init_process_group(backend="tpcomm")

serves CPU tensors through Gloo and CUDA tensors through NCCL (created only
when the first CUDA tensor arrives).
"""

import torch
import torch.distributed  # registers c10d's Python types before our extension loads

from tpcomm import _C
from tpcomm._registration import BACKEND_NAME, register
from tpcomm.message_queue import MessageQueue, PeerLostError

register()


def settings():
    """Every TPCOMM_* setting as (name, type, default, doc) tuples."""
    return list(_C.settings())


def build_info():
    """The CUDA version and SM architectures this build's kernels target."""
    return dict(_C.build_info())


__all__ = ["BACKEND_NAME", "MessageQueue", "PeerLostError", "build_info", "register",
           "settings"]
