#pragma once
// The torch backends a tpcomm group made from C++ stands on: its CPU group
// (torch's ProcessGroupGloo) and its device group (torch's ProcessGroupNCCL,
// made on the first CUDA call), made without Python.

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

}  // namespace tpcomm::cpp
