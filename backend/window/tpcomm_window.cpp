#include "backend/window/tpcomm_window.hpp"

#if defined(C10D_BACKEND_HAS_WINDOW)

#include <algorithm>
#include <tuple>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "backend/boundary.hpp"
#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/group_life.hpp"
#include "coordinator/cpu/cpu_shm_path.hpp"

namespace tpcomm::backend {

namespace {

const char* const kFailedKey = "failed";

using detail::bytesOf;
using detail::firstLine;

// The deleter of a storage moved into a window: drops its hold on the region.
void releaseRegion(void* keep) { delete static_cast<std::shared_ptr<void>*>(keep); }

}  // namespace

TpcommWindow::TpcommWindow(std::shared_ptr<coord::GroupCoordinator> group,
                           const std::optional<at::Tensor>& tensor)
    : group_(std::move(group)) {
  std::tie(number_, store_) = group_->nextWindow();
  if (tensor) tensor_register(*tensor, true);
}

std::string TpcommWindow::what(const char* op) const {
  return detail::concat("window ", op, " on group '", group_->options().groupName, "' (rank ",
                        group_->rank(), " of ", group_->size(), ")");
}

void TpcommWindow::checkPeer(const char* op, int64_t rank) const {
  TPCOMM_CHECK(rank >= 0 && rank < group_->size(), kInvalidUsage, what(op), ": rank ", rank,
               " is not one of the group's ", group_->size(), " ranks");
}

void TpcommWindow::checkCall(const char* op, int64_t rank,
                             const std::unordered_map<std::string, std::string>& hints) const {
  checkRegistered(op);
  checkPeer(op, rank);
  TPCOMM_CHECK(hints.empty(), kInvalidUsage, what(op), ": hint '", hints.begin()->first,
               "' is not one tpcomm knows (it takes none)");
}

void TpcommWindow::checkRegistered(const char* op) const {
  TPCOMM_CHECK(shm_, kInvalidUsage, what(op),
               ": no tensor is registered (dist._new_window(tensor) or tensor_register first)");
}

std::chrono::milliseconds TpcommWindow::timeoutOf(std::chrono::milliseconds asked) const {
  return asked.count() > 0 ? asked : group_->options().timeout;
}

void TpcommWindow::tensor_register(const at::Tensor& tensor, bool owning) {
  translateErrors([&] {
    const int rank = group_->rank();
    const int size = group_->size();
    TPCOMM_CHECK(!shm_, kInvalidUsage, what("tensor_register"),
                 ": a tensor is registered already (tensor_deregister first)");
    // Numbered before anything can fail, alike on every rank.
    const int registration = registrations_++;
    auto store = c10::make_intrusive<c10d::PrefixStore>(
        detail::concat("reg-", registration, "/"), store_);
    const std::string key = std::to_string(rank);
    // This rank's part: checks, its region with the tensor's bytes. A
    // failure is published in its place, so that the others raise at once.
    std::unique_ptr<mq::ShmWindow> shm;
    c10::StorageImpl* storage = nullptr;
    try {
      TPCOMM_CHECK(tensor.defined() && tensor.device().is_cpu(), kInvalidUsage,
                   "tpcomm's windows hold CPU tensors, this one is on ",
                   tensor.defined() ? tensor.device().str() : std::string("no device"));
      TPCOMM_CHECK(tensor.layout() == at::kStrided && tensor.is_contiguous(), kInvalidUsage,
                   "the tensor must be dense and contiguous");
      storage = tensor.storage().unsafeGetStorageImpl();
      TPCOMM_CHECK(storage->data_ptr().get_deleter() != &releaseRegion, kInvalidUsage,
                   "the tensor's storage is in a window already");
      TPCOMM_CHECK(group_->fault().usable(), kPeerLost, "the group broke: ",
                   group_->fault().reason());
      shm = std::make_unique<mq::ShmWindow>(rank, size, storage->nbytes());
      if (storage->nbytes() > 0) std::memcpy(shm->data(rank), storage->data(), storage->nbytes());
      std::string sizes;
      for (int64_t d : tensor.sizes()) sizes += (sizes.empty() ? "" : ",") + std::to_string(d);
      store->set(key, bytesOf(detail::concat(hostIdentity(), "\n", shm->name(), "\n",
                                             static_cast<int>(tensor.scalar_type()), "\n",
                                             tensor.storage_offset() * tensor.element_size(),
                                             "\n", sizes)));
    } catch (const std::exception& e) {
      store->set(key, bytesOf(detail::concat(kFailedKey, "\n", e.what())));
      throw tpcomm::Error(ErrorCode::kInvalidUsage,
                          what("tensor_register") + ": " + firstLine(e.what()));
    }

    // Every rank's region, host and tensor (or why it failed).
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back(std::to_string(r));
    const auto timeout = group_->options().timeout;
    try {
      store->wait(keys, timeout);
    } catch (const std::exception& e) {
      TPCOMM_THROW(kTimeout, what("tensor_register"), ": not every rank registered within ",
                   timeout.count(), " ms: ", firstLine(e.what()));
    }
    std::vector<std::string> names(size);
    std::vector<Registered> registered(size);
    std::vector<bool> local(size);
    std::vector<int> remote;
    std::string failure;
    for (int r = 0; r < size; ++r) {
      const auto value = store->get(keys[r]);
      auto fields = detail::splitAt(std::string(value.begin(), value.end()), '\n');
      fields.resize(5);
      if (fields[0] == kFailedKey) {
        if (failure.empty()) failure = detail::concat("rank ", r, " could not register: ", fields[1]);
        continue;
      }
      // A rank of another host: reached through Gloo, never mapped.
      local[r] = fields[0] == hostIdentity();
      if (!local[r]) remote.push_back(r);
      names[r] = local[r] ? fields[1] : std::string();
      registered[r].dtype = static_cast<c10::ScalarType>(std::stoi(fields[2]));
      registered[r].offsetBytes = std::stoull(fields[3]);
      registered[r].numel = 1;
      for (const auto& d : detail::splitAt(fields[4], ',')) {
        registered[r].sizes.push_back(std::stoll(d));
        registered[r].numel *= registered[r].sizes.back();
      }
    }
    // Everyone read every key: the last rank to say so removes them.
    if (store->add("read", 1) == size) {
      for (const auto& k : keys) store->deleteKey(k);
      store->deleteKey("read");
    }
    TPCOMM_CHECK(failure.empty(), kInvalidUsage, what("tensor_register"), ": ", failure);
    try {
      shm->attach(names);
    } catch (const std::exception& e) {
      store->set(kFailedKey, bytesOf(detail::concat("rank ", rank,
                                                    " could not map its peers' windows: ",
                                                    firstLine(e.what()))));
      throw;
    }
    // Its receiving thread, before any peer can send (they send once every
    // rank passed the meeting below).
    std::unique_ptr<RemoteWindow> between;
    if (!remote.empty()) {
      mq::ShmWindow* into = shm.get();
      between = std::make_unique<RemoteWindow>(
          group_->cpuBackend(), remoteTag(number_, registration), storage->nbytes(), remote,
          [into](int source, const RemoteWindow::Message& message, const uint8_t* data) {
            if (message.kind == RemoteWindow::kPut) {
              into->deliver(message.offset, data, message.bytes);
            } else {
              into->deliverSignal(source);
            }
          },
          what("receive"));
    }
    try {
      coord::meetOnStore(*store, "attached", kFailedKey, rank, size, timeout,
                         what("tensor_register"));
    } catch (...) {
      if (between) between->close(std::chrono::milliseconds(0));
      throw;
    }
    // Every rank mapped every region of its host: no one needs the
    // descriptors, nor the meeting's keys.
    shm->closeDescriptor();
    if (store->add("left", 1) == size) {
      for (const char* k : {"attached", "left"}) store->deleteKey(k);
    }
    // The tensor's whole storage moves into this rank's region, in place.
    auto* keep = new std::shared_ptr<void>(shm->keep(rank));
    storage->set_data_ptr_noswap(
        at::DataPtr(shm->data(rank), keep, &releaseRegion, at::Device(at::kCPU)));
    storage->set_resizable(false);
    shm_ = std::move(shm);
    remote_ = std::move(between);
    registered_ = std::move(registered);
    local_ = std::move(local);
    if (owning) owned_ = tensor;
  });
}

void TpcommWindow::tensor_deregister() {
  translateErrors([&] {
    checkRegistered("tensor_deregister");
    // The receiving thread ends once every peer on another host closed
    // (within the group's timeout), the peers' mappings go (views from
    // map_remote_tensor keep theirs); this rank's tensor keeps its shared
    // memory.
    if (remote_) remote_->close(group_->options().timeout);
    remote_.reset();
    shm_.reset();
    registered_.clear();
    owned_.reset();
  });
}

c10::intrusive_ptr<c10d::Work> TpcommWindow::put(const at::Tensor& tensor, int64_t dstRank,
                                                 int64_t targetOffsetNelems, bool /*asyncOp*/,
                                                 const c10d::PutOptions& opts) {
  return translateErrors([&] {
    checkCall("put", dstRank, opts.hints);
    TPCOMM_CHECK(tensor.defined() && tensor.device().is_cpu() && tensor.layout() == at::kStrided &&
                     tensor.is_contiguous(),
                 kInvalidUsage, what("put"), ": the tensor must be a contiguous CPU tensor");
    TPCOMM_CHECK(!tensor.is_conj() && !tensor.is_neg(), kInvalidUsage, what("put"),
                 ": a conjugated or negated view puts its raw bytes: resolve_conj() or "
                 "resolve_neg() it first");
    TPCOMM_CHECK(targetOffsetNelems >= 0, kInvalidUsage, what("put"), ": offset ",
                 targetOffsetNelems, " is negative");
    const Registered& target = registered_[dstRank];
    TPCOMM_CHECK(tensor.scalar_type() == target.dtype, kInvalidUsage, what("put"), ": a ",
                 c10::toString(tensor.scalar_type()), " tensor into rank ", dstRank, "'s ",
                 c10::toString(target.dtype), " window");
    TPCOMM_CHECK(targetOffsetNelems <= target.numel &&
                     tensor.numel() <= target.numel - targetOffsetNelems,
                 kInvalidUsage, what("put"), ": ", tensor.numel(), " elements at offset ",
                 targetOffsetNelems, " run past rank ", dstRank, "'s window of ", target.numel,
                 " elements");
    TPCOMM_CHECK(group_->fault().usable(), kPeerLost, what("put"), ": the group broke: ",
                 group_->fault().reason());
    const size_t offset =
        target.offsetBytes + static_cast<size_t>(targetOffsetNelems) * tensor.element_size();
    if (local_[dstRank]) {
      shm_->put(static_cast<int>(dstRank), offset, tensor.data_ptr(), tensor.nbytes());
    } else {
      remote_->put(static_cast<int>(dstRank), offset, tensor.data_ptr(), tensor.nbytes(),
                   std::max(opts.timeout, std::chrono::milliseconds(0)));
    }
    return coord::completedWork({});
  });
}

at::Tensor TpcommWindow::map_remote_tensor(int64_t rank) {
  return translateErrors([&] {
    checkRegistered("map_remote_tensor");
    checkPeer("map_remote_tensor", rank);
    TPCOMM_CHECK(local_[rank], kInvalidUsage, what("map_remote_tensor"), ": rank ", rank,
                 " is on another host: its tensor cannot be mapped here (put and signal reach "
                 "it)");
    const Registered& r = registered_[rank];
    auto* keep = new std::shared_ptr<void>(shm_->keep(static_cast<int>(rank)));
    return at::from_blob(
        shm_->data(static_cast<int>(rank)) + r.offsetBytes, r.sizes,
        [keep](void*) { delete keep; }, at::TensorOptions().dtype(r.dtype).device(at::kCPU));
  });
}

c10::intrusive_ptr<c10d::Work> TpcommWindow::signal(int64_t peerRank, bool /*asyncOp*/,
                                                    const c10d::SignalOptions& opts) {
  return translateErrors([&] {
    checkCall("signal", peerRank, opts.hints);
    if (local_[peerRank]) {
      shm_->signal(static_cast<int>(peerRank));
    } else {
      remote_->signal(static_cast<int>(peerRank),
                      std::max(opts.timeout, std::chrono::milliseconds(0)));
    }
    return coord::completedWork({});
  });
}

c10::intrusive_ptr<c10d::Work> TpcommWindow::wait_signal(int64_t peerRank, bool /*asyncOp*/,
                                                         const c10d::WaitSignalOptions& opts) {
  return translateErrors([&] {
    checkCall("wait_signal", peerRank, opts.hints);
    auto& fault = group_->fault();
    try {
      shm_->waitSignal(static_cast<int>(peerRank), timeoutOf(opts.timeout), [&] {
        if (fault.broken()) {
          TPCOMM_THROW(kPeerLost, "the group broke: ", fault.reason());
        }
        if (remote_ && !local_[peerRank]) {
          const std::string why = remote_->stopped();
          TPCOMM_CHECK(why.empty(), kPeerLost, "its receiving thread stopped: ", why);
        }
      });
    } catch (const tpcomm::Error& e) {
      throw tpcomm::Error(e.code(), what("wait_signal") + ": " + e.what());
    }
    return coord::completedWork({});
  });
}

c10d::WindowAttr TpcommWindow::get_attr(int64_t peerRank) {
  return translateErrors([&] {
    checkPeer("get_attr", peerRank);
    c10d::WindowAttr attr;
    // One coherent memory on this host; a copy of another host's, reached
    // by messages.
    attr.access_type = !shm_ || local_[peerRank] ? c10d::WindowAccessType::UNIFIED
                                                 : c10d::WindowAccessType::SEPARATE;
    return attr;
  });
}

}  // namespace tpcomm::backend

#endif
