// libFuzzer target for the code that reads shared memory: the reader's chunk
// decoder and the segment attach checks. Arbitrary bytes in shared memory must
// give a message or a tpcomm::Error, never a crash, hang or overrun.
//
// Mode (first byte, even): the rest is laid over the ring's chunk headers and
// payloads and the writer's published counter, then the reader decodes with a
// zero timeout, copying or in place (the second bit of the first byte).
// Mode (first byte, odd): the rest becomes a whole segment (an anonymous memfd
// as the writer makes one), then attached.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "common/error.hpp"
#include "message_queue/ring/ring.hpp"
#include "message_queue/ring/segment.hpp"
#include "message_queue/region/shared_region.hpp"

using namespace tpcomm;
using namespace tpcomm::mq;

namespace {

struct Ring {
  Geometry geometry{1, 4, 64};
  Writer writer{geometry};
  Reader reader{writer.name(), 0};
  std::unique_ptr<Segment> tamper = Segment::attach(writer.name());
};

// Copies up to `n` bytes of the input to `to` (zero-filling the rest).
void take(const uint8_t*& data, size_t& size, char* to, size_t n) {
  const size_t k = std::min(n, size);
  std::memset(to, 0, n);
  std::memcpy(to, data, k);
  data += k;
  size -= k;
}

void decodeChunks(const uint8_t* data, size_t size, bool inPlace) {
  static Ring ringStorage;  // kept for the whole run
  Ring* ring = &ringStorage;
  Segment& s = *ring->tamper;
  const Geometry& g = ring->geometry;
  s.slot(0).consumed.store(0);
  s.header().published.store(size > 0 ? 1 + data[0] % g.numChunks : 0);
  if (size > 0) {
    ++data;
    --size;
  }
  for (uint64_t c = 0; c < g.numChunks; ++c) {
    take(data, size, reinterpret_cast<char*>(&s.chunkHeader(c)), sizeof(ChunkHeader));
  }
  for (uint64_t c = 0; c < g.numChunks; ++c) take(data, size, s.chunkData(c), g.chunkBytes);
  const auto allocate = [](uint64_t bytes) -> char* {
    static std::vector<char> buffer;
    if (bytes > (1u << 20)) throw std::bad_alloc();  // the caller's allocation policy
    buffer.resize(bytes);
    return buffer.data();
  };
  try {
    if (inPlace) {
      ring->reader.readInPlace(
          std::chrono::milliseconds(0),
          [](const char* p, uint64_t bytes) {
            volatile char sink = 0;
            for (uint64_t i = 0; i < bytes; ++i) sink = sink ^ p[i];  // every byte is readable
          },
          allocate);
    } else {
      ring->reader.read(std::chrono::milliseconds(0), allocate);
    }
  } catch (const Error&) {
  } catch (const std::bad_alloc&) {
  }
}

void attachSegment(const uint8_t* data, size_t size) {
  // A region as a writer makes it: the preamble with the nonce (the input's
  // first 16 bytes), then the segment (the rest). The header's token is set
  // to the nonce's first word (as a writer does) so that the checks past it
  // run too.
  constexpr size_t kPreamble = SharedRegion::kPreambleBytes;
  RegionNonce nonce;
  if (size < sizeof(nonce.words)) return;
  std::memcpy(nonce.words, data, sizeof(nonce.words));
  data += sizeof(nonce.words);
  size -= sizeof(nonce.words);
  std::vector<uint8_t> bytes(kPreamble + size, 0);
  std::memcpy(bytes.data(), nonce.words, sizeof(nonce.words));
  if (size > 0) std::memcpy(bytes.data() + kPreamble, data, size);
  if (size >= offsetof(Header, token) + sizeof(uint64_t)) {
    std::memcpy(bytes.data() + kPreamble + offsetof(Header, token), &nonce.words[0],
                sizeof(uint64_t));
  }
  const int fd = ::memfd_create("tpcomm-shm", MFD_CLOEXEC);
  if (fd < 0) return;
  if (::write(fd, bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size())) {
    ::close(fd);
    return;
  }
  const std::string name = "memfd:" + std::to_string(::getpid()) + ":" + std::to_string(fd) + ":" +
                           std::to_string(size) + ":" + nonce.hex();
  try {
    auto segment = Segment::attach(name);
    (void)segment->geometry();
  } catch (const Error&) {
  }
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 0) {
    decodeChunks(data + 1, size - 1, (data[0] & 2) != 0);
  } else {
    attachSegment(data + 1, size - 1);
  }
  return 0;
}
