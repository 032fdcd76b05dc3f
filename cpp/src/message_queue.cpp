// tpcomm::MessageQueue: the shared-memory ring (message_queue/ring) set up
// over a process group from C++, as python/tpcomm/message_queue.py sets it
// up from Python: readers on the writer's host attach to its ring, readers on
// other hosts receive through the group's CPU backend.
#include <algorithm>
#include <atomic>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "backend/boundary.hpp"
#include "common/error.hpp"
#include "common/settings.hpp"
#include "cpp/src/tensor_frame.hpp"
#include "message_queue/ring/ring.hpp"
#include "tpcomm/tpcomm.hpp"

namespace tpcomm {

namespace {

constexpr int64_t kRecordBytes = 512;  // one rank's host id or failure text

at::Tensor record(const std::string& text) {
  at::Tensor t = at::zeros({kRecordBytes}, at::kByte);
  const size_t n = std::min<size_t>(text.size(), kRecordBytes - 1);
  std::memcpy(t.data_ptr(), text.data(), n);
  return t;
}

std::string textOf(const at::Tensor& t) {
  const char* p = static_cast<const char*>(t.data_ptr());
  return std::string(p, strnlen(p, kRecordBytes));
}

// Every rank's record (collective over the group's CPU backend).
std::vector<std::string> allGather(c10d::ProcessGroup& pg, const std::string& text) {
  std::vector<at::Tensor> in{record(text)};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < pg.getSize(); ++r) out[0].push_back(at::empty({kRecordBytes}, at::kByte));
  pg.allgather(out, in)->wait();
  std::vector<std::string> texts;
  for (const auto& t : out[0]) texts.push_back(textOf(t));
  return texts;
}

// Throws on every rank when some rank failed, naming each.
void agree(c10d::ProcessGroup& pg, const std::string& failure, const char* what) {
  const auto failures = allGather(pg, failure);
  std::string named;
  for (size_t r = 0; r < failures.size(); ++r) {
    if (!failures[r].empty()) named += "; group rank " + std::to_string(r) + ": " + failures[r];
  }
  TPCOMM_CHECK(named.empty(), kSystem, "message queue: ", what, " failed", named);
}

}  // namespace

struct MessageQueue::Impl {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  MessageQueueOptions options;
  int rank = 0;
  std::vector<int> remote;  // readers on other hosts (writer's view)
  std::unique_ptr<mq::Writer> writer;
  std::unique_ptr<mq::Reader> reader;
  std::atomic<bool> closed{false};

  bool isWriter() const { return rank == options.writerRank; }

  void check(bool writerSide, const char* what) const {
    TPCOMM_CHECK(!closed, kPeerLost, what, ": the message queue was shut down");
    TPCOMM_CHECK(writerSide == isWriter(), kInvalidUsage, what, " is given data on the writer only; group rank ",
                 rank, " is ", isWriter() ? "the writer" : "a reader",
                 " (writer: group rank ", options.writerRank, ")");
  }

  void send(const std::vector<mq::Writer::Part>& parts) {
    if (writer) writer->write(parts, options.timeout);
    if (remote.empty()) return;
    uint64_t length = 0;
    for (const auto& part : parts) length += part.bytes;
    at::Tensor payload = at::empty({static_cast<int64_t>(length)}, at::kByte);
    char* out = static_cast<char*>(payload.data_ptr());
    for (const auto& part : parts) {
      if (part.bytes != 0) std::memcpy(out, part.data, part.bytes);
      out += part.bytes;
    }
    for (int r : remote) {
      std::vector<at::Tensor> head{at::full({1}, static_cast<int64_t>(length), at::kLong)};
      pg->send(head, r, 0)->wait();
      std::vector<at::Tensor> body{payload};
      if (length != 0) pg->send(body, r, 0)->wait();
    }
  }

  cpp::Decoded receive() {
    if (reader) {
      cpp::Decoded decoded;
      reader->readInPlace(options.timeout, [&](const char* data, uint64_t bytes) {
        decoded = cpp::decode(data, bytes);
      });
      return decoded;
    }
    std::vector<at::Tensor> head{at::empty({1}, at::kLong)};
    pg->recv(head, options.writerRank, 0)->wait();
    const int64_t length = head[0].item<int64_t>();
    TPCOMM_CHECK(length >= 0, kSystem, "message queue: a message of ", length, " bytes");
    std::vector<at::Tensor> body{at::empty({length}, at::kByte)};
    if (length != 0) pg->recv(body, options.writerRank, 0)->wait();
    return cpp::decode(static_cast<const char*>(body[0].data_ptr()), uint64_t(length));
  }
};

MessageQueue::MessageQueue(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MessageQueue::~MessageQueue() = default;

std::unique_ptr<MessageQueue> MessageQueue::create(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const MessageQueueOptions& options) {
  TORCH_CHECK(pg, "tpcomm::MessageQueue::create: the process group is null");
  const int size = pg->getSize();
  TORCH_CHECK(options.writerRank >= 0 && options.writerRank < size,
              "tpcomm::MessageQueue::create: writerRank ", options.writerRank,
              " is out of range for a group of ", size);
  // The ring's own limits (message_queue/ring), checked here on every rank
  // before any collective step.
  TORCH_CHECK(options.maxChunkBytes >= 64 && options.maxChunkBytes <= (1ull << 32) - 64,
              "tpcomm::MessageQueue::create: maxChunkBytes must be in [64, 2^32 - 64], got ",
              options.maxChunkBytes);
  TORCH_CHECK(options.maxChunks >= 1 && options.maxChunks <= (1ull << 20),
              "tpcomm::MessageQueue::create: maxChunks must be in [1, 2^20], got ",
              options.maxChunks);
  TORCH_CHECK(options.maxChunkBytes * options.maxChunks <= (64ull << 30),
              "tpcomm::MessageQueue::create: a ring of ", options.maxChunks, " x ",
              options.maxChunkBytes, " bytes exceeds 64 GiB");
  TORCH_CHECK(options.timeout.count() > 0, "tpcomm::MessageQueue::create: timeout must be > 0 "
              "ms, got ", options.timeout.count());
  return backend::translateErrors([&] {
    auto impl = std::make_unique<Impl>();
    impl->pg = pg;
    impl->options = options;
    impl->rank = pg->getRank();
    const int writerRank = options.writerRank;
    const auto hosts = allGather(*pg, hostIdentity());
    std::vector<int> local;
    for (int r = 0; r < size; ++r) {
      if (r == writerRank) continue;
      (hosts[r] == hosts[writerRank] ? local : impl->remote).push_back(r);
    }
    std::string failure;
    if (impl->isWriter() && !local.empty()) {
      try {
        impl->writer = std::make_unique<mq::Writer>(mq::Geometry{
            static_cast<uint32_t>(local.size()), options.maxChunks, options.maxChunkBytes});
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    // The ring's name (or the writer's failure) from the writer to all.
    std::vector<at::Tensor> name{
        record(failure.empty() ? (impl->writer ? "ok " + impl->writer->name() : "ok ")
                               : "error " + failure)};
    pg->broadcast(name, c10d::BroadcastOptions{writerRank})->wait();
    const std::string answer = textOf(name[0]);
    TPCOMM_CHECK(answer.rfind("ok ", 0) == 0, kSystem, "message queue: the writer (group rank ",
                 writerRank, ") could not create its ring: ", answer.substr(6));
    const auto at = std::find(local.begin(), local.end(), impl->rank);
    if (at != local.end()) {
      try {
        impl->reader = std::make_unique<mq::Reader>(answer.substr(3),
                                                    static_cast<uint32_t>(at - local.begin()));
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    agree(*pg, failure, "attaching a reader");
    if (impl->writer) impl->writer->waitForReaders(options.timeout);
    if (!impl->isWriter()) impl->remote.clear();
    return std::unique_ptr<MessageQueue>(new MessageQueue(std::move(impl)));
  });
}

bool MessageQueue::isWriter() const { return impl_->isWriter(); }
int MessageQueue::writerRank() const { return impl_->options.writerRank; }

std::string MessageQueue::broadcastBytes(const std::string& bytes) {
  return backend::translateErrors([&] {
    auto& q = *impl_;
    if (q.isWriter()) {
      q.check(true, "broadcastBytes");
      const std::string head = cpp::encodeBytes(bytes);
      q.send({{head.data(), head.size()}, {bytes.data(), bytes.size()}});
      return bytes;
    }
    q.check(!bytes.empty(), "broadcastBytes");
    auto decoded = q.receive();
    TPCOMM_CHECK(decoded.isBytes, kInvalidUsage, "broadcastBytes on group rank ", q.rank,
                 " received a tensor dict: the writer called broadcastTensorDict");
    return std::move(decoded.bytes);
  });
}

TensorDict MessageQueue::broadcastTensorDict(const TensorDict& tensors) {
  return backend::translateErrors([&] {
    auto& q = *impl_;
    c10d::BroadcastOptions fromWriter{q.options.writerRank};
    if (q.isWriter()) {
      q.check(true, "broadcastTensorDict");
      cpp::Frame frame = cpp::encodeTensorDict(tensors);
      std::vector<mq::Writer::Part> parts{{frame.head.data(), frame.head.size()}};
      for (const auto& t : frame.cpuData) parts.push_back({t.data_ptr(), t.nbytes()});
      q.send(parts);
      for (auto& t : frame.cudaData) {
        std::vector<at::Tensor> one{t};
        q.pg->broadcast(one, fromWriter)->wait();
      }
      return tensors;
    }
    q.check(!tensors.empty(), "broadcastTensorDict");
    auto decoded = q.receive();
    TPCOMM_CHECK(!decoded.isBytes, kInvalidUsage, "broadcastTensorDict on group rank ", q.rank,
                 " received bytes: the writer called broadcastBytes");
    for (const auto& name : decoded.cudaNames) {
      std::vector<at::Tensor> one{decoded.tensors.at(name)};
      q.pg->broadcast(one, fromWriter)->wait();
    }
    return std::move(decoded.tensors);
  });
}

void MessageQueue::shutdown() {
  auto& q = *impl_;
  if (q.closed.exchange(true)) return;
  if (q.writer) q.writer->shutdown();
  if (q.reader) q.reader->shutdown();
}

}  // namespace tpcomm
