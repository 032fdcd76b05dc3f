#include "python/mq_frames.hpp"

#include <c10/core/TensorImpl.h>

#include <unistd.h>

#include <cstring>

#include "common/error.hpp"

namespace tpcomm::python {

namespace {

constexpr uint64_t kAlign = 64;
constexpr uint8_t kInline = 0;
constexpr uint8_t kInArena = 1;
constexpr uint32_t kMaxDims = 64;
constexpr uint32_t kMaxTensors = 1u << 20;

struct FrameHeader {
  uint32_t magic;
  uint32_t count;
  uint64_t streamBytes;
  uint64_t tableBytes;
};
static_assert(sizeof(FrameHeader) == 24, "the frame header is 24 bytes");

struct Entry {
  uint8_t where;
  uint8_t dtype;  // c10::ScalarType
  uint8_t ndim;
  uint8_t reserved;
  uint32_t slot;    // arena slot (kInArena)
  uint64_t offset;  // kInline: from the frame's start; kInArena: from the arena's data
  uint64_t bytes;
};
static_assert(sizeof(Entry) == 24, "a table entry is 24 bytes plus its shape");

uint64_t alignUp(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

const char kZeros[kAlign] = {};

template <typename T>
void put(std::vector<char>& out, const T& value) {
  const char* p = reinterpret_cast<const char*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}

// Element size of a dtype a frame may carry, or 0.
size_t carriedElementSize(int code) {
  if (code < 0 || code >= static_cast<int>(c10::ScalarType::NumOptions)) return 0;
  const auto type = static_cast<c10::ScalarType>(code);
  if (c10::isQIntType(type) || type == c10::ScalarType::Undefined) return 0;
  return c10::elementSize(type);
}

[[noreturn]] void corrupt(uint64_t bytes, const std::string& what) {
  TPCOMM_THROW(kSystem, "message queue: corrupt or truncated message of ", bytes, " bytes: ", what);
}

}  // namespace

OutgoingFrame buildFrame(std::vector<mq::Writer::Part> stream, std::vector<at::Tensor> tensors,
                         mq::Arena* arena) {
  OutgoingFrame f;
  TPCOMM_CHECK(tensors.size() <= kMaxTensors, kInvalidUsage, "a message carries at most ",
               kMaxTensors, " tensors, got ", tensors.size());
  uint64_t streamBytes = 0;
  for (const auto& p : stream) streamBytes += p.bytes;
  std::vector<Entry> entries(tensors.size());
  uint64_t tableBytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor& t = tensors[i];
    TPCOMM_CHECK(t.device().is_cpu() && t.layout() == at::kStrided && !t.is_quantized(),
                 kInvalidUsage, "a message carries dense CPU tensors, got one on ", t.device(),
                 " with layout ", c10::str(t.layout()));
    TPCOMM_CHECK(t.dim() <= static_cast<int64_t>(kMaxDims), kInvalidUsage,
                 "a tensor in a message has at most ", kMaxDims, " dimensions, got ", t.dim());
    if (t.is_conj()) t = t.resolve_conj();
    if (t.is_neg()) t = t.resolve_neg();
    t = t.contiguous();
    Entry& e = entries[i];
    e.dtype = static_cast<uint8_t>(t.scalar_type());
    e.ndim = static_cast<uint8_t>(t.dim());
    e.bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    mq::Arena::Block block;
    if (arena != nullptr && e.bytes > 0 && arena->find(t.data_ptr(), e.bytes, &block)) {
      e.where = kInArena;
      e.slot = block.slot;
      e.offset = block.offset;
      f.arenaSlots.push_back(block.slot);
    }
    tableBytes += sizeof(Entry) + 8 * e.ndim;
  }
  // Inline tensors: 64-aligned after the stream, in order.
  uint64_t pos = alignUp(sizeof(FrameHeader) + tableBytes + streamBytes);
  for (Entry& e : entries) {
    if (e.where != kInline || e.bytes == 0) continue;
    e.offset = pos;
    pos = alignUp(pos + e.bytes);
  }
  f.head.reserve(sizeof(FrameHeader) + tableBytes);
  put(f.head,
      FrameHeader{kFrameMagic, static_cast<uint32_t>(tensors.size()), streamBytes, tableBytes});
  for (size_t i = 0; i < tensors.size(); ++i) {
    put(f.head, entries[i]);
    for (int64_t d : tensors[i].sizes()) put(f.head, d);
  }
  f.parts.push_back({f.head.data(), f.head.size()});
  for (const auto& p : stream) f.parts.push_back(p);
  uint64_t written = f.head.size() + streamBytes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Entry& e = entries[i];
    if (e.where != kInline || e.bytes == 0) continue;
    if (e.offset > written) f.parts.push_back({kZeros, e.offset - written});
    f.parts.push_back({tensors[i].data_ptr(), e.bytes});
    written = e.offset + e.bytes;
  }
  f.bytes = written;
  f.tensors = std::move(tensors);
  return f;
}

bool isFrame(const char* data, uint64_t bytes) {
  uint32_t magic = 0;
  if (bytes < sizeof(FrameHeader)) return false;
  std::memcpy(&magic, data, sizeof(magic));
  return magic == kFrameMagic;
}

namespace {

struct Parsed {
  Entry entry;
  std::vector<int64_t> shape;
};

// Gives back the holds of the arena entries in [from, end) that will never
// become views (a frame that failed part way), so that no block stays held.
void releaseUnbuilt(const std::vector<Parsed>& entries, size_t from,
                    const std::shared_ptr<mq::Arena>& arena) {
  if (!arena) return;
  for (size_t i = from; i < entries.size(); ++i) {
    const Entry& e = entries[i].entry;
    if (e.where == kInArena && e.bytes > 0 && arena->validRange(e.slot, e.offset, e.bytes)) {
      arena->release(e.slot);
    }
  }
}

// The table's entries, each checked against the message (and the arena).
std::vector<Parsed> parseTable(const char* base, uint64_t bytes, const FrameHeader& h,
                               const std::shared_ptr<mq::Arena>& arena) {
  const uint64_t tableEnd = sizeof(FrameHeader) + h.tableBytes;
  const uint64_t dataStart = tableEnd + h.streamBytes;
  std::vector<Parsed> entries;
  entries.reserve(h.count);
  uint64_t pos = sizeof(FrameHeader);
  for (uint32_t i = 0; i < h.count; ++i) {
    Parsed p;
    Entry& e = p.entry;
    if (tableEnd - pos < sizeof(Entry)) {
      corrupt(bytes, detail::concat("tensor ", i, " overruns the table"));
    }
    std::memcpy(&e, base + pos, sizeof(e));
    pos += sizeof(Entry);
    if (e.ndim > kMaxDims || tableEnd - pos < 8ull * e.ndim) {
      corrupt(bytes,
              detail::concat("tensor ", i, "'s shape (", int(e.ndim), " dims) overruns the table"));
    }
    p.shape.resize(e.ndim);
    std::memcpy(p.shape.data(), base + pos, 8ull * e.ndim);
    pos += 8ull * e.ndim;
    const size_t elementSize = carriedElementSize(e.dtype);
    if (elementSize == 0) {
      corrupt(bytes, detail::concat("tensor ", i, " has dtype code ", int(e.dtype)));
    }
    uint64_t numel = 1;
    for (int64_t d : p.shape) {
      if (d < 0 || (d > 0 && numel > (uint64_t{1} << 62) / static_cast<uint64_t>(d))) {
        corrupt(bytes, detail::concat("tensor ", i, " has shape ", p.shape));
      }
      numel *= static_cast<uint64_t>(d);
    }
    if (numel > (uint64_t{1} << 62) / elementSize || numel * elementSize != e.bytes) {
      corrupt(bytes,
              detail::concat("tensor ", i, " of shape ", p.shape, " says ", e.bytes, " bytes"));
    }
    if (e.bytes > 0 && e.where == kInArena) {
      if (!arena) {
        corrupt(bytes,
                detail::concat("tensor ", i, " lies in an arena this reader has not mapped"));
      }
      if (!arena->validRange(e.slot, e.offset, e.bytes) || e.offset % kAlign != 0) {
        corrupt(bytes, detail::concat("tensor ", i, " (", e.bytes, " bytes at ", e.offset,
                                      ", slot ", e.slot, ") lies outside the arena"));
      }
    } else if (e.bytes > 0 &&
               (e.where != kInline || e.offset < dataStart || e.offset % kAlign != 0 ||
                e.offset > bytes || e.bytes > bytes - e.offset)) {
      corrupt(bytes, detail::concat("tensor ", i, " (", e.bytes, " bytes at ", e.offset,
                                    ") lies outside the message"));
    }
    entries.push_back(std::move(p));
  }
  if (pos != tableEnd) corrupt(bytes, "its table has bytes after the last tensor");
  return entries;
}

// A view of the arena that gives its hold back when it dies, in the process
// that received it only (a forked child's copy of the view must not release
// the parent's hold a second time).
at::Tensor arenaView(const std::shared_ptr<mq::Arena>& arena, const Parsed& p,
                     const at::TensorOptions& options) {
  const uint32_t slot = p.entry.slot;
  const pid_t owner = ::getpid();
  return at::from_blob(
      arena->data() + p.entry.offset, p.shape,
      [arena, slot, owner](void*) {
        if (::getpid() == owner) arena->release(slot);
      },
      options);
}

// A view of the message's storage, made without the dispatcher.
at::Tensor messageView(const at::Tensor& message, const Parsed& p, c10::ScalarType dtype) {
  const size_t elementSize = c10::elementSize(dtype);
  const uint64_t byteOffset = static_cast<uint64_t>(message.storage_offset()) + p.entry.offset;
  if (byteOffset % elementSize != 0) {  // a message not at the start of its storage
    return message
        .narrow(0, static_cast<int64_t>(p.entry.offset), static_cast<int64_t>(p.entry.bytes))
        .clone()
        .view(dtype)
        .view(p.shape);
  }
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(message.storage()),
                                                   c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                   caffe2::TypeMeta::fromScalarType(dtype));
  impl->set_storage_offset(static_cast<int64_t>(byteOffset / elementSize));
  impl->set_sizes_contiguous(p.shape);
  return at::Tensor(std::move(impl));
}

}  // namespace

IncomingFrame parseFrame(const at::Tensor& message, const std::shared_ptr<mq::Arena>& arena) {
  const uint64_t bytes = static_cast<uint64_t>(message.numel());
  const char* base = static_cast<const char*>(message.const_data_ptr());
  if (bytes < sizeof(FrameHeader)) corrupt(bytes, "shorter than a frame header");
  FrameHeader h;
  std::memcpy(&h, base, sizeof(h));
  if (h.magic != kFrameMagic) corrupt(bytes, "not a frame");
  if (h.count > kMaxTensors || h.tableBytes > bytes - sizeof(FrameHeader) ||
      h.streamBytes > bytes - sizeof(FrameHeader) - h.tableBytes) {
    corrupt(bytes, detail::concat("its header (", h.count, " tensors, ", h.tableBytes,
                                  "-byte table, ", h.streamBytes, "-byte stream) overruns it"));
  }
  // A corrupt table's holds stay held (the writer's arena then fills up and
  // says so): releasing slots read from it could free a block that another
  // message's views still show.
  const std::vector<Parsed> entries = parseTable(base, bytes, h, arena);
  IncomingFrame f;
  f.streamOffset = sizeof(FrameHeader) + h.tableBytes;
  f.streamBytes = h.streamBytes;
  f.tensors.reserve(entries.size());
  try {
    for (const Parsed& p : entries) {
      const auto dtype = static_cast<c10::ScalarType>(p.entry.dtype);
      const auto options = at::TensorOptions().dtype(dtype);
      if (p.entry.bytes == 0) {
        f.tensors.push_back(at::empty(p.shape, options));
      } else if (p.entry.where == kInArena) {
        f.tensors.push_back(arenaView(arena, p, options));
      } else {
        f.tensors.push_back(messageView(message, p, dtype));
      }
    }
  } catch (const std::exception& e) {
    releaseUnbuilt(entries, f.tensors.size(), arena);
    corrupt(bytes, detail::concat("tensor ", f.tensors.size(), " cannot be built: ", e.what()));
  }
  return f;
}

}  // namespace tpcomm::python
