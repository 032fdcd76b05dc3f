#pragma once
// The torch backends a tpcomm group made from C++ stands on: its CPU group
// (torch's ProcessGroupGloo) and its device group (torch's ProcessGroupNCCL,
// made on the first CUDA call), made without Python.

#include <optional>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "coordinator/cpu/cpu_hier_path.hpp"

namespace tpcomm::cpp {

// Makes Gloo groups (store, rank, size, timeout), each on network devices of
// its own (every Gloo group has a listener of its own, by whose address its
// connections are told apart). The interface, as the Python package picks
// it for the same store: GLOO_SOCKET_IFNAME; else, when `groupStore` is a
// TCPStore (under any PrefixStores) at an address other than loopback, this
// host's address on the route to it; else torch's default device. Each made
// group is checked (name, rank, size) before it is returned.
coord::BackendFactory glooFactory(const c10::intrusive_ptr<c10d::Store>& groupStore);

// Makes torch's ProcessGroupNCCL (store, rank, size, timeout). Throws
// (kSystem) when the NCCL header this build used is not torch's NCCL.
coord::BackendFactory ncclFactory();

// Asks `made` through the vtable torch's constructor installed (a volatile
// pointer, so that the compiler cannot answer from the header instead)
// whether it is torch's `name` group of this rank and size (and timeout,
// where given); throws (kSystem) naming what it answered otherwise. Returns
// `made`.
c10::intrusive_ptr<c10d::Backend> checkMade(
    c10::intrusive_ptr<c10d::Backend> made, const char* name, int rank, int size,
    std::optional<std::chrono::milliseconds> timeout = std::nullopt);

}  // namespace tpcomm::cpp
