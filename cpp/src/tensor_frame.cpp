// The message queue's message layout (tensor_frame.hpp).
#include "cpp/src/tensor_frame.hpp"

#include <cstring>
#include <limits>

#include <ATen/ATen.h>

#include "common/error.hpp"

namespace tpcomm::cpp {

namespace {

constexpr uint32_t kMagic = 0x31515054;  // "TPQ1"
constexpr uint32_t kBytes = 1;
constexpr uint32_t kTensorDict = 2;
constexpr uint16_t kMaxDims = 64;

struct Header {
  uint32_t magic;
  uint32_t kind;
  uint64_t count;
};

struct EntryHead {
  uint32_t nameBytes;
  uint8_t dtype;
  uint8_t device;
  uint16_t ndim;
};

// The dtypes a message may carry: plain dense element types.
bool carried(at::ScalarType type) {
  switch (type) {
    case at::kByte: case at::kChar: case at::kShort: case at::kInt: case at::kLong:
    case at::kHalf: case at::kFloat: case at::kDouble: case at::kComplexHalf:
    case at::kComplexFloat: case at::kComplexDouble: case at::kBool: case at::kBFloat16:
    case at::kUInt16: case at::kUInt32: case at::kUInt64:
    case at::kFloat8_e5m2: case at::kFloat8_e4m3fn: case at::kFloat8_e5m2fnuz:
    case at::kFloat8_e4m3fnuz:
      return true;
    default:
      return false;
  }
}

template <typename T>
void put(std::string& out, const T& value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

class Cursor {
 public:
  Cursor(const char* data, uint64_t length) : data_(data), length_(length) {}
  const char* take(uint64_t bytes, const char* what) {
    TPCOMM_CHECK(bytes <= length_ - at_, kSystem, "message queue: a message of ", length_,
                 " bytes ends inside ", what, " (", bytes, " bytes at offset ", at_, ")");
    const char* p = data_ + at_;
    at_ += bytes;
    return p;
  }
  template <typename T>
  T read(const char* what) {
    T value;
    std::memcpy(&value, take(sizeof(T), what), sizeof(T));
    return value;
  }
  uint64_t left() const { return length_ - at_; }

 private:
  const char* data_;
  uint64_t length_;
  uint64_t at_ = 0;
};

}  // namespace

std::string encodeBytes(const std::string& bytes) {
  std::string head;
  put(head, Header{kMagic, kBytes, bytes.size()});
  return head;
}

Frame encodeTensorDict(const TensorDict& tensors) {
  Frame frame;
  put(frame.head, Header{kMagic, kTensorDict, tensors.size()});
  for (const auto& [name, tensor] : tensors) {
    TPCOMM_CHECK(tensor.defined(), kInvalidUsage, "broadcastTensorDict: tensor '", name,
                 "' is undefined");
    TPCOMM_CHECK(tensor.layout() == at::kStrided, kInvalidUsage, "broadcastTensorDict: tensor '",
                 name, "' is not dense (layout ", c10::str(tensor.layout()), ")");
    TPCOMM_CHECK(carried(tensor.scalar_type()), kInvalidUsage, "broadcastTensorDict: tensor '",
                 name, "' has dtype ", c10::toString(tensor.scalar_type()), ", which a message cannot carry");
    const bool cuda = tensor.is_cuda();
    TPCOMM_CHECK(cuda || tensor.is_cpu(), kInvalidUsage, "broadcastTensorDict: tensor '", name,
                 "' is on ", tensor.device().str(), "; CPU and CUDA tensors only");
    TPCOMM_CHECK(tensor.dim() <= kMaxDims, kInvalidUsage, "broadcastTensorDict: tensor '", name,
                 "' has ", tensor.dim(), " dimensions (at most ", kMaxDims, ")");
    TPCOMM_CHECK(name.size() <= (1u << 16), kInvalidUsage,
                 "broadcastTensorDict: a name of ", name.size(), " bytes (at most 65536)");
    put(frame.head, EntryHead{static_cast<uint32_t>(name.size()),
                              static_cast<uint8_t>(tensor.scalar_type()),
                              static_cast<uint8_t>(cuda ? 1 : 0),
                              static_cast<uint16_t>(tensor.dim())});
    frame.head += name;
    for (int64_t size : tensor.sizes()) put(frame.head, size);
    // The values, not a lazy conjugate or negation of them.
    (cuda ? frame.cudaData : frame.cpuData)
        .push_back(tensor.resolve_conj().resolve_neg().contiguous());
  }
  return frame;
}

Decoded decode(const char* data, uint64_t length) {
  Cursor in(data, length);
  const auto header = in.read<Header>("the header");
  TPCOMM_CHECK(header.magic == kMagic, kSystem, "message queue: a message starts with ",
               header.magic, " instead of the magic ", kMagic,
               " (a writer of another kind, or a corrupt ring)");
  Decoded out;
  if (header.kind == kBytes) {
    out.isBytes = true;
    TPCOMM_CHECK(header.count == in.left(), kSystem, "message queue: a bytes message says ",
                 header.count, " bytes and carries ", in.left());
    out.bytes.assign(in.take(header.count, "the bytes"), header.count);
    return out;
  }
  TPCOMM_CHECK(header.kind == kTensorDict, kSystem, "message queue: unknown message kind ",
               header.kind);
  // Each entry takes at least sizeof(EntryHead) bytes: a count past what the
  // message holds is refused before anything is allocated.
  TPCOMM_CHECK(header.count <= in.left() / sizeof(EntryHead), kSystem,
               "message queue: a tensor dict of ", header.count, " entries in ", in.left(),
               " bytes");
  struct Pending {
    std::string name;
    at::ScalarType dtype;
    bool cuda;
    std::vector<int64_t> sizes;
  };
  std::vector<Pending> entries;
  for (uint64_t i = 0; i < header.count; ++i) {
    const auto head = in.read<EntryHead>("an entry");
    Pending entry;
    entry.dtype = static_cast<at::ScalarType>(head.dtype);
    TPCOMM_CHECK(head.dtype < static_cast<uint8_t>(at::ScalarType::NumOptions) &&
                     carried(entry.dtype),
                 kSystem, "message queue: entry ", i, " has dtype code ", int(head.dtype));
    TPCOMM_CHECK(head.device <= 1 && head.ndim <= kMaxDims, kSystem, "message queue: entry ", i,
                 " has device code ", int(head.device), " and ", head.ndim, " dimensions");
    entry.cuda = head.device == 1;
    entry.name.assign(in.take(head.nameBytes, "a name"), head.nameBytes);
    for (uint16_t d = 0; d < head.ndim; ++d) {
      const auto size = in.read<int64_t>("a shape");
      TPCOMM_CHECK(size >= 0, kSystem, "message queue: entry '", entry.name, "' has size ", size);
      entry.sizes.push_back(size);
    }
    entries.push_back(std::move(entry));
  }
  for (auto& entry : entries) {
    const auto options = at::TensorOptions().dtype(entry.dtype);
    if (entry.cuda) {
      out.cudaNames.push_back(entry.name);
      out.tensors[entry.name] = at::empty(entry.sizes, options.device(at::kCUDA));
      continue;
    }
    // numel x element size, refused where it overflows or passes the message.
    uint64_t bytes = at::elementSize(entry.dtype);
    for (int64_t size : entry.sizes) {
      TPCOMM_CHECK(size == 0 || bytes <= std::numeric_limits<uint64_t>::max() / uint64_t(size),
                   kSystem, "message queue: entry '", entry.name, "' overflows its size");
      bytes *= uint64_t(size);
    }
    const char* source = in.take(bytes, "a tensor's bytes");
    at::Tensor tensor = at::empty(entry.sizes, options);
    if (bytes != 0) std::memcpy(tensor.data_ptr(), source, bytes);
    out.tensors[entry.name] = std::move(tensor);
  }
  TPCOMM_CHECK(in.left() == 0, kSystem, "message queue: ", in.left(),
               " bytes past a tensor dict's last entry");
  return out;
}

}  // namespace tpcomm::cpp
