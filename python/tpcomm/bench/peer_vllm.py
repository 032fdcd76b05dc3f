"""vLLM's custom allreduce beside tpcomm's in `bench car --peer-vllm DIR`.

DIR holds vLLM's `custom_all_reduce.cuh` and `custom_collective_common.cuh`
(from the vllm sdist on the package registry, e.g. vllm-0.33.0's csrc/);
their code is never part of tpcomm. The harness (`peer_vllm.cu`, tpcomm's
own) is compiled against them with nvcc at the first use and cached under
TPCOMM_PEER_BUILD_DIR (default ~/.cache/tpcomm/peer_vllm), keyed by the hash
of the three files, the GPU architecture and nvcc's version.

VllmGroup drives N ranks on N streams of one GPU as LocalGroup does for
tpcomm's kernel: every rank's inputs are registered with vLLM's
register_buffer() (its eager path copies into such a buffer first; its graph
path registers the captured inputs), and graphs captured with capture()
are registered the way vLLM's register_graph_buffers() does, with the peers'
pointers taken from this process instead of IPC handles.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess

import torch

_HEADERS = ("custom_all_reduce.cuh", "custom_collective_common.cuh")
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_ERR = 512


def _nvcc():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        candidate = os.path.join(home, "bin", "nvcc")
        nvcc = candidate if os.path.exists(candidate) else None
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH (nor under CUDA_HOME): the vLLM harness is "
                           "compiled at run time")
    return nvcc


def build(folder, arch=None):
    """Compiles the harness against the headers in `folder` (cached) and
    returns the shared library's path."""
    missing = [h for h in _HEADERS if not os.path.isfile(os.path.join(folder, h))]
    if missing:
        raise FileNotFoundError(f"--peer-vllm {folder}: {', '.join(missing)} missing (take them "
                                f"from csrc/ of the vllm sdist)")
    harness = os.path.join(os.path.dirname(__file__), "peer_vllm.cu")
    if arch is None:
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}"
    nvcc = _nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for path in [harness] + [os.path.join(folder, h) for h in _HEADERS]:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(arch.encode() + version.encode())
    cache = os.environ.get("TPCOMM_PEER_BUILD_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tpcomm", "peer_vllm")
    os.makedirs(cache, exist_ok=True)
    lib = os.path.join(cache, f"peer_vllm_{digest.hexdigest()[:16]}.so")
    if os.path.exists(lib):
        return lib
    cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", "-I", folder, harness,
           "-o", lib + ".tmp", f"-L{cuda_home}/lib64", f"-L{cuda_home}/lib64/stubs", "-lcuda"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError("compiling the vLLM harness failed:\n" + " ".join(cmd) + "\n" +
                           done.stderr[-4000:])
    os.replace(lib + ".tmp", lib)
    return lib


def _load(path):
    lib = ctypes.CDLL(path)
    vp, sz, i, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p
    lib.vh_signal_bytes.restype = i
    lib.vh_resident_blocks.argtypes = [i, i, i]
    lib.vh_resident_blocks.restype = i
    lib.vh_create.argtypes = [ctypes.POINTER(vp), vp, sz, i, i, cp, i]
    lib.vh_create.restype = vp
    lib.vh_destroy.argtypes = [vp]
    lib.vh_register.argtypes = [vp, ctypes.POINTER(vp), cp, i]
    lib.vh_register.restype = i
    lib.vh_allreduce.argtypes = [vp, i, vp, vp, vp, i, i, cp, i]
    lib.vh_allreduce.restype = i
    lib.vh_register_graph_local.argtypes = [ctypes.POINTER(vp), i, cp, i]
    lib.vh_register_graph_local.restype = i
    return lib


def _check(rc, err):
    if rc != 0:
        raise RuntimeError("vLLM's custom allreduce: " + err.value.decode(errors="replace"))


def vllm_algorithm(world_size, nbytes):
    """The kernel vLLM's allreduce() picks (its rule, full NVLink)."""
    if world_size == 2:
        return "1stage"
    if (world_size <= 4 and nbytes < 512 * 1024) or (world_size <= 8 and nbytes < 256 * 1024):
        return "1stage"
    return "2stage"


class VllmGroup:
    """N ranks of vLLM's kernel on N streams of the current GPU."""

    def __init__(self, lib_path, world_size, max_bytes, streams=None):
        if world_size not in (2, 4, 6, 8):
            raise ValueError(f"vLLM's kernel runs at 2, 4, 6 or 8 ranks, not {world_size}")
        self.lib = _load(lib_path)
        self.world_size = world_size
        sig = self.lib.vh_signal_bytes()
        # Each rank: its Signal, then vLLM's temporary buffer (two-stage).
        self.signals = [torch.zeros(sig + max_bytes, dtype=torch.uint8, device="cuda")
                        for _ in range(world_size)]
        self.rank_data = [torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
                          for _ in range(world_size)]
        torch.cuda.synchronize()
        ptrs = (ctypes.c_void_p * world_size)(*[s.data_ptr() for s in self.signals])
        self.handles = []
        for r in range(world_size):
            err = ctypes.create_string_buffer(_ERR)
            h = self.lib.vh_create(ptrs, self.rank_data[r].data_ptr(), 8 << 20, r, world_size,
                                   err, _ERR)
            if not h:
                _check(1, err)
            self.handles.append(h)
        self.streams = streams or [torch.cuda.Stream() for _ in range(world_size)]
        self._registered = set()
        self._resident = {}

    def close(self):
        torch.cuda.synchronize()
        for h in self.handles:
            self.lib.vh_destroy(h)
        self.handles = []

    def blocks_for(self, dtype, nbytes):
        """vLLM's default block limit (36), capped so that every rank's blocks
        are resident at once (they wait for each other on one GPU)."""
        two = 1 if vllm_algorithm(self.world_size, nbytes) == "2stage" else 0
        key = (dtype, two)
        if key not in self._resident:
            self._resident[key] = self.lib.vh_resident_blocks(self.world_size, _DTYPES[dtype], two)
        return max(1, min(36, self._resident[key] // self.world_size))

    def register(self, inputs):
        """register_buffer() of these inputs on every rank (once per set)."""
        key = tuple(x.data_ptr() for x in inputs)
        if key in self._registered:
            return
        ptrs = (ctypes.c_void_p * self.world_size)(*key)
        for h in self.handles:
            err = ctypes.create_string_buffer(_ERR)
            _check(self.lib.vh_register(h, ptrs, err, _ERR), err)
        self._registered.add(key)

    def all_reduce(self, inputs, outputs):
        """Rank r's kernel on streams[r], ordered after the current stream and
        joined back. Eagerly the inputs must be registered; under capture
        they are recorded for register_graph()."""
        current = torch.cuda.current_stream()
        nbytes = inputs[0].numel() * inputs[0].element_size()
        blocks = self.blocks_for(inputs[0].dtype, nbytes)
        dtype = _DTYPES[inputs[0].dtype]
        for r in range(self.world_size):
            s = self.streams[r]
            s.wait_stream(current)
            err = ctypes.create_string_buffer(_ERR)
            _check(self.lib.vh_allreduce(self.handles[r], dtype, ctypes.c_void_p(s.cuda_stream),
                                         inputs[r].data_ptr(), outputs[r].data_ptr(),
                                         inputs[r].numel(), blocks, err, _ERR), err)
        for s in self.streams:
            current.wait_stream(s)
        return outputs

    def register_graph(self):
        """After a capture: the captured calls' pointer tables."""
        handles = (ctypes.c_void_p * self.world_size)(*self.handles)
        err = ctypes.create_string_buffer(_ERR)
        _check(self.lib.vh_register_graph_local(handles, self.world_size, err, _ERR), err)
