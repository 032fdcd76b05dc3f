#include "coordinator/debug/debug_check.hpp"

#include <map>

#include "common/error.hpp"
#include "coordinator/faults/group_fault.hpp"

namespace tpcomm::coord {

// getDtypeNames gives std::string up to torch 2.12 and string_view from 2.13.
std::string dtypeName(at::ScalarType dtype) { return std::string(c10::getDtypeNames(dtype).first); }

std::string describeTensor(const at::Tensor& tensor) {
  std::string out = dtypeName(tensor.scalar_type()) + "[";
  const auto sizes = tensor.sizes();
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(sizes[i]);
  }
  return out + "]";
}

std::string describeTensors(const std::vector<at::Tensor>& tensors) {
  std::string out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i > 0) out += ", ";
    out += describeTensor(tensors[i]);
  }
  return out;
}

std::string describeReduceOp(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "UNUSED";
  }
}

namespace {

std::vector<at::Tensor> gatherFromAll(c10d::Backend& cpu, const at::Tensor& input) {
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < cpu.getSize(); ++r) outputs[0].push_back(at::empty_like(input));
  std::vector<at::Tensor> inputs{input};
  waitWork(*cpu.allgather(outputs, inputs));
  return outputs[0];
}

// Signatures are ASCII; whatever else arrived (a peer that is not running
// the same check) is shown as '?' rather than garbling the message.
std::string printable(std::string text) {
  for (char& c : text) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return text;
}

}  // namespace

void checkAlltoallCounts(c10d::Backend& cpu, const std::string& groupName, uint64_t sequence,
                         const std::string& op, const std::vector<int64_t>& sendCounts,
                         const std::vector<int64_t>& recvCounts) {
  const int n = cpu.getSize();
  TPCOMM_CHECK_EQ(static_cast<int>(sendCounts.size()), n, "(all-to-all send counts)");
  TPCOMM_CHECK_EQ(static_cast<int>(recvCounts.size()), n, "(all-to-all receive counts)");
  at::Tensor mine = at::empty({2 * n}, at::TensorOptions().dtype(at::kLong));
  auto* data = mine.data_ptr<int64_t>();
  std::copy(sendCounts.begin(), sendCounts.end(), data);
  std::copy(recvCounts.begin(), recvCounts.end(), data + n);
  const auto all = gatherFromAll(cpu, mine);
  std::string mismatches;
  int shown = 0;
  int total = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      const int64_t sent = all[i].data_ptr<int64_t>()[j];
      const int64_t expected = all[j].data_ptr<int64_t>()[n + i];
      if (sent == expected) continue;
      if (++total > 8) continue;
      mismatches += " rank " + std::to_string(i) + " sends " + std::to_string(sent) +
                    " elements to rank " + std::to_string(j) + ", which expects " +
                    std::to_string(expected) + " from it;";
      ++shown;
    }
  }
  if (total == 0) return;
  if (total > shown) mismatches += " (" + std::to_string(total - shown) + " more pairs)";
  TPCOMM_THROW(kInvalidUsage, "TPCOMM_DEBUG: ranks disagree on ", op, " #", sequence, " of group '",
               groupName, "': split sizes do not match:", mismatches);
}

void checkSameAcrossRanks(c10d::Backend& cpu, const std::string& groupName, uint64_t sequence,
                          const std::string& signature) {
  const auto lengthOpts = at::TensorOptions().dtype(at::kLong);
  at::Tensor length = at::full({1}, static_cast<int64_t>(signature.size()), lengthOpts);
  int64_t longest = 0;
  for (const auto& l : gatherFromAll(cpu, length)) longest = std::max(longest, l.item<int64_t>());

  at::Tensor bytes = at::zeros({longest}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(bytes.data_ptr(), signature.data(), signature.size());
  std::map<std::string, std::vector<int>> ranksBySignature;
  const auto all = gatherFromAll(cpu, bytes);
  for (size_t r = 0; r < all.size(); ++r) {
    const char* data = static_cast<const char*>(all[r].data_ptr());
    ranksBySignature[printable(std::string(data, strnlen(data, longest)))].push_back(
        static_cast<int>(r));
  }
  if (ranksBySignature.size() == 1) return;

  std::string out = "TPCOMM_DEBUG: ranks disagree on collective #" + std::to_string(sequence) +
                    " of group '" + groupName + "':";
  for (const auto& [sig, ranks] : ranksBySignature) {
    out += ranks.size() == 1 ? " rank " : " ranks ";
    for (size_t i = 0; i < ranks.size(); ++i) out += (i ? "," : "") + std::to_string(ranks[i]);
    out += " called " + sig + ";";
  }
  TPCOMM_THROW(kInvalidUsage, out);
}

}  // namespace tpcomm::coord
