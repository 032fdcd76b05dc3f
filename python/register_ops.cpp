// The CPU kernels of the GroupCoordinator's torch ops (tpcomm/_ops.py defines
// their schemas, fake kernels and CUDA kernels) and the registry of groups
// they run on. A CPU call goes from the op to the group's tpcomm backend
// (validation, routing, the shared-memory engine) writing its output out of
// place: no Python, no clone, no dist.all_reduce in between. A coordinator
// over another backend (gloo) gets the same results through its
// ProcessGroup.
#include <ATen/MemoryOverlap.h>
#include <c10/core/WrapDimMinimal.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "backend/process_group_tpcomm.hpp"
#include "python/op_outputs.hpp"

namespace py = pybind11;

namespace tpcomm::python {

namespace {

// One registered coordinator: its device group (weakly: the coordinator
// owns it) and the path its last fused call took.
struct OpGroup {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
  std::string lastFusedPath;
};

class OpGroups {
 public:
  void add(const std::string& name, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    OpGroup entry{c10::weak_intrusive_ptr<c10d::ProcessGroup>(group), {}};
    std::lock_guard<std::mutex> lock(mutex_);
    groups_.insert_or_assign(name, std::move(entry));
    generation_.fetch_add(1, std::memory_order_release);
  }

  void remove(const std::string& name) {
    std::optional<OpGroup> gone;  // released after the lock
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = groups_.find(name);
    if (it == groups_.end()) return;
    gone.emplace(std::move(it->second));
    groups_.erase(it);
    generation_.fetch_add(1, std::memory_order_release);
  }

  using Found =
      std::pair<c10::intrusive_ptr<c10d::ProcessGroup>, c10::intrusive_ptr<c10d::Backend>>;

  // The group of a live coordinator, and its tpcomm backend for CPU tensors
  // (null on another backend); throws naming the live ones otherwise. Each
  // thread remembers its last answer while no group was added or removed
  // (a per-token call then takes no lock and no map lookup).
  Found find(c10::string_view name) {
    struct Last {
      uint64_t generation = 0;
      std::string name;
      c10::weak_intrusive_ptr<c10d::ProcessGroup> group{c10::intrusive_ptr<c10d::ProcessGroup>()};
      c10::weak_intrusive_ptr<c10d::Backend> backend{c10::intrusive_ptr<c10d::Backend>()};
    };
    thread_local Last last;
    const uint64_t generation = generation_.load(std::memory_order_acquire);
    if (last.generation == generation && generation != 0 && last.name == name) {
      if (auto group = last.group.lock()) return {std::move(group), last.backend.lock()};
    }
    Found found = findLocked(name);
    last.generation = generation;
    last.name.assign(name.data(), name.size());
    last.group = c10::weak_intrusive_ptr<c10d::ProcessGroup>(found.first);
    last.backend = c10::weak_intrusive_ptr<c10d::Backend>(found.second);
    return found;
  }

 private:
  Found findLocked(c10::string_view name) {
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = groups_.find(std::string(name));
      if (it != groups_.end()) group = it->second.group.lock();
      if (!group) {
        std::string live;
        for (const auto& [key, entry] : groups_) {
          if (entry.group.lock()) live += (live.empty() ? "" : ", ") + key;
        }
        TORCH_CHECK_VALUE(false, "no live tpcomm GroupCoordinator named '", name,
                          "' in this process (live: ", live.empty() ? "none" : live, ")");
      }
    }
    c10::intrusive_ptr<c10d::Backend> backend;
    if (group->hasBackends()) {
      try {
        backend = group->getBackend(c10::DeviceType::CPU);
      } catch (const std::exception&) {
        // No CPU backend: the ProcessGroup serves the call.
      }
    }
    if (backend && dynamic_cast<backend::ProcessGroupTpcomm*>(backend.get()) == nullptr) {
      backend.reset();
    }
    return {group, backend};
  }

 public:
  void setFusedPath(const std::string& name, const std::string& path) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = groups_.find(name);
    if (it != groups_.end()) it->second.lastFusedPath = path;
  }

  std::string fusedPath(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = groups_.find(name);
    return it == groups_.end() ? std::string() : it->second.lastFusedPath;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, OpGroup> groups_;
  std::atomic<uint64_t> generation_{1};  // bumped by add() and remove()
};

OpGroups& opGroups() {
  static OpGroups* groups = new OpGroups();  // outlives every static destructor
  return *groups;
}

// The ops' large outputs, kept for the next call of the same size once the
// caller drops them: a fresh allocation of several MiB is fresh pages from
// the kernel (glibc maps every block above 32 MiB anew), whose faults cost
// more than the collective (64 MiB: about 30 ms against 6 ms here). At most
// kKeptBytes are kept; blocks below kLeastBytes are plain allocations.
class OutputCache {
 public:
  static constexpr size_t kLeastBytes = size_t{1} << 20;
  static constexpr size_t kKeptBytes = size_t{256} << 20;

  at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) *
                         c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
    if (bytes < kLeastBytes) return at::empty(sizes, options);
    void* block = take(bytes);
    return at::from_blob(
        block, sizes, [this, bytes](void* p) { give(p, bytes); }, options);
  }

 private:
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        void* block = it->second;
        free_.erase(it);
        kept_ -= bytes;
        return block;
      }
    }
    void* block = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    TORCH_CHECK(block != nullptr, "out of memory allocating ", bytes, " bytes");
    return block;
  }

  void give(void* block, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (kept_ + bytes <= kKeptBytes) {
        free_.emplace(bytes, block);
        kept_ += bytes;
        return;
      }
    }
    std::free(block);
  }

  std::mutex mutex_;
  std::multimap<size_t, void*> free_;
  size_t kept_ = 0;
};

OutputCache& outputs() {
  static OutputCache* cache = new OutputCache();  // outlives every tensor it made
  return *cache;
}

at::Tensor emptyLike(const at::Tensor& t) { return outputs().empty(t.sizes(), t.options()); }

void finish(const c10::intrusive_ptr<c10d::Work>& work) {
  if (work) work->wait();
}

// A collective waits for its peers: not while holding the GIL of a Python
// caller (torch.ops calls keep it), which would stall the process's other
// Python threads.
class WithoutGil {
 public:
  WithoutGil() {
    if (Py_IsInitialized() && PyGILState_Check()) release_.emplace();
  }

 private:
  std::optional<py::gil_scoped_release> release_;
};

at::Tensor allReduceCpu(const at::Tensor& tensor, c10::string_view groupName) {
  const WithoutGil released;
  auto [group, backend] = opGroups().find(groupName);
  auto* tpcomm = static_cast<backend::ProcessGroupTpcomm*>(backend.get());
  if (tpcomm != nullptr) return allReduceOutOfPlace(*tpcomm, tensor);
  at::Tensor out = emptyLike(tensor);  // contiguous, shaped as `tensor`
  out.copy_(tensor);
  std::vector<at::Tensor> tensors{out};
  finish(group->allreduce(tensors));
  return out;
}

// The sum over the group written into `tensor` (a non-contiguous one through
// a contiguous copy).
void allReduceInPlaceCpu(at::Tensor& tensor, c10::string_view groupName) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(tensor) != at::MemOverlap::Yes,
                    "all_reduce_: the tensor has elements that share memory (an expanded "
                    "view?): the sum cannot be written into it");
  const WithoutGil released;
  auto [group, backend] = opGroups().find(groupName);
  std::vector<at::Tensor> tensors{tensor.is_contiguous() ? tensor : tensor.contiguous()};
  c10d::AllreduceOptions opts;
  opts.asyncOp = false;  // waited for here: no Work for a call done in this thread
  finish(backend ? backend->allreduce(tensors, opts) : group->allreduce(tensors, opts));
  if (!tensors[0].is_same(tensor)) tensor.copy_(tensors[0]);
}

at::Tensor allGatherCpu(const at::Tensor& tensor, int64_t dim, int64_t worldSize,
                        c10::string_view groupName) {
  const WithoutGil released;
  auto [group, backend] = opGroups().find(groupName);
  auto* tpcomm = static_cast<backend::ProcessGroupTpcomm*>(backend.get());
  TORCH_CHECK_VALUE(tensor.dim() > 0, "all_gather: a 0-dim tensor has no dim to gather along");
  TORCH_CHECK_VALUE(worldSize > 0, "all_gather: world_size ", worldSize, " must be positive");
  dim = c10::maybe_wrap_dim(dim, tensor.dim());
  at::Tensor input = tensor.contiguous();
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  std::vector<int64_t> gathered = shape;
  gathered[0] *= worldSize;
  at::Tensor out = outputs().empty(gathered, input.options());
  if (tpcomm != nullptr) {
    finish(tpcomm->_allgather_base(out, input, c10d::AllgatherOptions()));
  } else {
    finish(group->_allgather_base(out, input));
  }
  if (dim == 0) return out;
  std::vector<int64_t> split = {worldSize};
  split.insert(split.end(), shape.begin(), shape.end());
  std::vector<int64_t> result = shape;
  result[dim] *= worldSize;
  return out.reshape(split).movedim(0, dim).reshape(result);
}

at::Tensor reduceScatterCpu(const at::Tensor& tensor, int64_t dim, int64_t worldSize,
                            c10::string_view groupName) {
  const WithoutGil released;
  auto [group, backend] = opGroups().find(groupName);
  auto* tpcomm = static_cast<backend::ProcessGroupTpcomm*>(backend.get());
  TORCH_CHECK_VALUE(tensor.dim() > 0, "reduce_scatter: a 0-dim tensor has no dim to scatter");
  TORCH_CHECK_VALUE(worldSize > 0, "reduce_scatter: world_size ", worldSize, " must be positive");
  dim = c10::maybe_wrap_dim(dim, tensor.dim());
  TORCH_CHECK_VALUE(tensor.size(dim) % worldSize == 0, "reduce_scatter: size ", tensor.size(dim),
                    " of dim ", dim, " does not divide by the group size ", worldSize);
  at::Tensor source = tensor.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape(source.sizes().begin(), source.sizes().end());
  shape[0] /= worldSize;
  at::Tensor out = outputs().empty(shape, source.options());
  if (tpcomm != nullptr) {
    finish(tpcomm->_reduce_scatter_base(out, source, c10d::ReduceScatterOptions()));
  } else {
    finish(group->_reduce_scatter_base(out, source));
  }
  return dim == 0 ? out : out.movedim(0, dim).contiguous();
}

// normed and residualOut (new, or `residualOut` itself) from the fused call
// on a tpcomm group, or composed (the routed allreduce, the add and a
// float32 RMSNorm) on another.
std::tuple<at::Tensor, at::Tensor> addRmsNormCpu(const at::Tensor& tensor,
                                                 const at::Tensor& residual,
                                                 const at::Tensor& weight, double eps,
                                                 c10::string_view groupName,
                                                 std::optional<at::Tensor> residualOut) {
  const WithoutGil released;
  auto [group, backend] = opGroups().find(groupName);
  auto* tpcomm = static_cast<backend::ProcessGroupTpcomm*>(backend.get());
  at::Tensor target = residualOut ? *residualOut : emptyLike(residual);
  at::Tensor normed = emptyLike(tensor);
  at::Tensor out =
      target.is_contiguous() ? target : at::empty_like(target, at::MemoryFormat::Contiguous);
  at::Tensor res = residual.contiguous();
  std::string path;
  if (tpcomm != nullptr) {
    path = tpcomm->allreduceAddRmsNorm(tensor.contiguous(), res, weight.contiguous(), eps, normed,
                                       out);
  } else {
    at::Tensor reduced = tensor.clone(at::MemoryFormat::Contiguous);
    if (group->getSize() > 1) {
      std::vector<at::Tensor> tensors{reduced};
      finish(group->allreduce(tensors));
    }
    at::add_out(out, reduced, res);
    const auto stats = out.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    normed.copy_(at::rms_norm(out.to(stats), {weight.numel()}, weight.to(stats), eps));
    path = "composed";
  }
  if (!out.is_same(target)) target.copy_(out);
  opGroups().setFusedPath(std::string(groupName), path);
  return {normed, target};
}

std::tuple<at::Tensor, at::Tensor> allReduceAddRmsNormCpu(const at::Tensor& tensor,
                                                          const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps,
                                                          c10::string_view groupName) {
  return addRmsNormCpu(tensor, residual, weight, eps, groupName, std::nullopt);
}

at::Tensor allReduceAddRmsNormInPlaceCpu(const at::Tensor& tensor, at::Tensor& residual,
                                         const at::Tensor& weight, double eps,
                                         c10::string_view groupName) {
  return std::get<0>(addRmsNormCpu(tensor, residual, weight, eps, groupName, residual));
}

}  // namespace

at::Tensor allReduceOutOfPlace(backend::ProcessGroupTpcomm& tpcomm, const at::Tensor& tensor) {
  at::Tensor input = tensor.contiguous();
  // A CUDA output from torch's allocator on the current stream (as the op's
  // CUDA kernel, tpcomm/_ops.py, makes it), a CPU one from the cache.
  at::Tensor out =
      input.is_cuda() ? at::empty_like(input, at::MemoryFormat::Contiguous) : emptyLike(input);
  c10d::AllreduceOptions opts;
  opts.asyncOp = false;  // waited for here: no Work for a call done in this thread
  finish(tpcomm.allreduceInto(input, out, opts));
  return out;
}

void registerOps(py::module_& m) {
  m.def(
      "register_op_group",
      [](const std::string& name, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
        opGroups().add(name, group);
      },
      py::arg("name"), py::arg("group"),
      "Registers a GroupCoordinator's device group under its unique name for the CPU kernels "
      "of torch.ops.tpcomm.*.");
  m.def(
      "unregister_op_group", [](const std::string& name) { opGroups().remove(name); },
      py::arg("name"));
  m.def(
      "op_group_fused_path", [](const std::string& name) { return opGroups().fusedPath(name); },
      py::arg("name"), "The path the group's last all_reduce_add_rms_norm took.");
  m.def(
      "set_op_group_fused_path",
      [](const std::string& name, const std::string& path) { opGroups().setFusedPath(name, path); },
      py::arg("name"), py::arg("path"));
  m.def(
      "register_op_cpu_kernels",
      [] {
        // Once per process, after tpcomm/_ops.py defined the schemas.
        static auto* library = [] {
          auto* lib = new torch::Library(torch::Library::IMPL, "tpcomm", c10::DispatchKey::CPU,
                                         __FILE__, __LINE__);
          lib->impl("all_reduce", TORCH_FN(allReduceCpu));
          lib->impl("all_reduce_", TORCH_FN(allReduceInPlaceCpu));
          lib->impl("all_gather", TORCH_FN(allGatherCpu));
          lib->impl("reduce_scatter", TORCH_FN(reduceScatterCpu));
          lib->impl("all_reduce_add_rms_norm", TORCH_FN(allReduceAddRmsNormCpu));
          lib->impl("all_reduce_add_rms_norm_", TORCH_FN(allReduceAddRmsNormInPlaceCpu));
          return lib;
        }();
        (void)library;
      },
      "Registers the CPU kernels of torch.ops.tpcomm.* (once).");
}

}  // namespace tpcomm::python
