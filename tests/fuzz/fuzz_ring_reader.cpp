// libFuzzer target for the code that reads shared memory: the reader's chunk
// decoder and the segment attach checks. Arbitrary bytes in shared memory must
// give a message or a tpcomm::Error, never a crash, hang or overrun.
//
// Mode (first byte, even): the rest is laid over the ring's chunk area and the
// writer's published counter, then the reader decodes with a zero timeout.
// Mode (first byte, odd): the rest becomes a whole segment, then attached.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <new>

#include "coordinator/common/error.hpp"
#include "message_queue/ring.hpp"
#include "message_queue/segment.hpp"

using namespace tpcomm;
using namespace tpcomm::mq;

namespace {

struct Ring {
  Geometry geometry{1, 4, 64};
  Writer writer{geometry};
  Reader reader{writer.name(), 0};
  std::unique_ptr<Segment> tamper = Segment::attach(writer.name());
};

void decodeChunks(const uint8_t* data, size_t size) {
  static Ring ringStorage;  // kept for the whole run; destroyed (and unlinked) at exit
  Ring* ring = &ringStorage;
  Segment& s = *ring->tamper;
  const Geometry& g = ring->geometry;
  s.slot(0).consumed.store(0);
  s.header().published.store(size > 0 ? 1 + data[0] % g.numChunks : 0);
  if (size > 0) {
    ++data;
    --size;
  }
  const size_t stride = (sizeof(ChunkHeader) + g.chunkBytes + 63) / 64 * 64;
  for (uint64_t c = 0; c < g.numChunks; ++c) {
    char* chunk = reinterpret_cast<char*>(&s.chunkHeader(c));
    const size_t n = std::min(stride, size);
    std::memset(chunk, 0, stride);
    std::memcpy(chunk, data, n);
    data += n;
    size -= n;
  }
  try {
    ring->reader.read(std::chrono::milliseconds(0), [](uint64_t bytes) -> char* {
      static std::vector<char> buffer;
      if (bytes > (1u << 20)) throw std::bad_alloc();  // the caller's allocation policy
      buffer.resize(bytes);
      return buffer.data();
    });
  } catch (const Error&) {
  } catch (const std::bad_alloc&) {
  }
}

void attachSegment(const uint8_t* data, size_t size) {
  const std::string name = "/tpcomm-mq-fuzz-" + std::to_string(::getpid());
  int fd = ::shm_open(name.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  if (fd < 0) return;
  if (size > 0 && ::write(fd, data, size) != static_cast<ssize_t>(size)) size = 0;
  ::close(fd);
  try {
    auto segment = Segment::attach(name);
    (void)segment->geometry();
  } catch (const Error&) {
  }
  ::shm_unlink(name.c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 0) {
    decodeChunks(data + 1, size - 1);
  } else {
    attachSegment(data + 1, size - 1);
  }
  return 0;
}
