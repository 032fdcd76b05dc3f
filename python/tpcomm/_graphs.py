"""tpcomm.graph_capture(): the zero-copy mode of the custom allreduce for CUDA
graphs.

A plain `torch.cuda.graph` capture of `dist.all_reduce` already works and
replays correctly: the kernel copies each replay's input into its staging
buffer. Inside

    with tpcomm.graph_capture(group):
        with torch.cuda.graph(g):
            y = model(x)

every custom allreduce captured into a graph instead reads its peers' inputs
where they lie: when the context exits, the ranks exchange the captured
inputs' IPC handles and map each other's. Every rank must capture the same
calls; ranks that captured different numbers of them all get a ValueError,
and those graphs refuse to replay (with an error, not a crash). Replay the
graphs only after the context exited. Inputs the kernel cannot read in place
are still copied (see tpcomm.describe(group)["custom_allreduce"]["zero_copy"]).
"""

from contextlib import contextmanager

import torch.distributed as dist

from tpcomm import _C, _fast_calls
from tpcomm._registration import _backend_of

_fast_into = _C._fast_all_reduce_into


def _backend(group):
    return _backend_of(group)


@contextmanager
def graph_capture(group=None):
    """Zero-copy registration of the custom allreduces captured inside (every
    rank of `group`, default the world, enters and exits it together)."""
    backend = _backend(group)
    backend.begin_graph_registration()
    try:
        yield
    except BaseException:
        # Keep the ranks in step (finishing is collective), then re-raise.
        try:
            backend.finish_graph_registration()
        except Exception:  # noqa: BLE001 - the body's error is the one to report
            pass
        raise
    backend.finish_graph_registration()


def all_reduce_into(input_, out, group=None, average=False):
    """out = sum (or mean) of every rank's `input_`, ordered on the current
    stream; the custom kernel reads `input_` in place where it can. Plain
    tensors take the direct route (_C._fast_all_reduce_into: the same backend
    call without the binding's conversions)."""
    if group is None:
        group = dist.group.WORLD
    handle = _fast_calls.cached_handle(group)
    if handle and _fast_into(handle, input_, out, average):
        return out
    work = _backend(group).all_reduce_into(input_, out, average, False)
    if work is not None:  # CPU tensors: Gloo's work; CUDA: ordered on the current stream
        work.wait()
    return out
