#pragma once
// TPCOMM_DEBUG's cross-rank check. Internal to coordinator/.
//
// Each rank describes its side of a collective as a signature string
// ("allreduce SUM float32[4, 4]"); the signatures are all-gathered through the
// CPU backend and, when any differs, every rank throws InvalidUsage naming
// the ranks and what each passed, so a mismatch is an error, never a hang or a
// silently wrong result.

#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace tpcomm::coord {

// Python's spelling: "float32", "int64", ...
std::string dtypeName(at::ScalarType dtype);
std::string describeTensor(const at::Tensor& tensor);
std::string describeTensors(const std::vector<at::Tensor>& tensors);
std::string describeReduceOp(const c10d::ReduceOp& op);

// Throws InvalidUsage on every rank when the ranks' signatures differ.
void checkSameAcrossRanks(c10d::Backend& cpu, const std::string& groupName, uint64_t sequence,
                          const std::string& signature);

// All-to-all: what rank i sends to rank j (sendCounts[j] on rank i, in
// elements) must be what rank j expects from rank i (recvCounts[i] on rank j).
// Throws InvalidUsage on every rank naming the pairs that disagree. Every
// rank must pass one count per rank.
void checkAlltoallCounts(c10d::Backend& cpu, const std::string& groupName, uint64_t sequence,
                         const std::string& op, const std::vector<int64_t>& sendCounts,
                         const std::vector<int64_t>& recvCounts);

}  // namespace tpcomm::coord
