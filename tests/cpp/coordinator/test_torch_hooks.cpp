// The C++ hooks into torch's internals check their ground: the flight
// recorder's layout check (backend/flight_record) on real recorders, intact
// and altered, and the Gloo connection finder's check of its descriptor
// folder (coordinator/faults/gloo_sockets).
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/flight_record.hpp"
#include "coordinator/faults/gloo_sockets.hpp"

namespace tpcomm {
namespace {

using Recorder = c10d::FlightRecorder<c10::Event>;

TEST(TorchHooks, AFreshRecorderPassesTheLayoutCheck) {
  Recorder recorder;  // as torch constructs its instance
  EXPECT_EQ(backend::recorderLayoutProblem(&recorder), "");
}

TEST(TorchHooks, ARecorderNotAsItsConstructorLeftItFailsTheLayoutCheck) {
  const std::string expected = "torch's flight recorder does not look as its header says";
  {
    Recorder recorder;
    recorder.enabled_ = !recorder.enabled_;  // enabled no longer follows its size
    EXPECT_EQ(backend::recorderLayoutProblem(&recorder), expected);
  }
  {
    Recorder recorder;
    recorder.reset_epoch_ += 7;  // an epoch with no start index
    EXPECT_EQ(backend::recorderLayoutProblem(&recorder), expected);
  }
  {
    Recorder recorder;
    recorder.entries_.resize(recorder.max_entries_ + 1);  // more entries than its size
    EXPECT_EQ(backend::recorderLayoutProblem(&recorder), expected);
  }
}

TEST(TorchHooks, TorchsOwnRecorderIsFoundAndOn) {
  auto& record = backend::FlightRecord::get();
  EXPECT_TRUE(record.enabled()) << record.status();
  EXPECT_EQ(record.status().rfind("on (", 0), 0u) << record.status();
}

TEST(TorchHooks, GlooFinderChecksItsDescriptorFolder) {
  EXPECT_EQ(coord::GlooSockets::groundOf("/proc/self/fd"), "");
  EXPECT_EQ(coord::GlooSockets::ground(), "");
  EXPECT_EQ(coord::GlooSockets::status().rfind("on (", 0), 0u) << coord::GlooSockets::status();

  // POSIX calls, not std::filesystem: with torch 2.11 the test binary binds
  // std::filesystem::remove_all to libtorch.so's own copy, which crashes (a
  // call through a null pointer inside it).
  char dirTemplate[] = "/tmp/tpcomm-hooks-XXXXXX";
  ASSERT_NE(::mkdtemp(dirTemplate), nullptr);
  const std::string dir = dirTemplate;
  const std::string missing = dir + "/missing";
  EXPECT_EQ(coord::GlooSockets::groundOf(missing.c_str()).rfind(missing + " cannot be read: ", 0),
            0u);
  EXPECT_FALSE(coord::GlooSockets::snapshotOf(missing.c_str()).has_value());
  const std::string empty = dir + "/empty";
  ASSERT_EQ(::mkdir(empty.c_str(), 0700), 0);
  EXPECT_EQ(coord::GlooSockets::groundOf(empty.c_str()),
            empty + " does not list a TCP socket this process just opened");
  ASSERT_TRUE(coord::GlooSockets::snapshotOf(empty.c_str()).has_value());
  EXPECT_TRUE(coord::GlooSockets::snapshotOf(empty.c_str())->empty());
  EXPECT_EQ(::rmdir(empty.c_str()), 0);
  EXPECT_EQ(::rmdir(dir.c_str()), 0);
}

// A rendezvous record as Gloo's TCP transport lays it out: host name's
// length and bytes, the address's length and bytes (a sockaddr_storage and
// a sequence number), then `pairs` pair identifiers.
std::vector<uint8_t> glooRecord(const std::string& host, const sockaddr_storage& addr,
                                size_t pairs) {
  std::vector<uint8_t> out;
  auto put = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  };
  const size_t hostLen = host.size();
  put(&hostLen, sizeof(hostLen));
  put(host.data(), host.size());
  const size_t addrLen = sizeof(sockaddr_storage) + sizeof(int64_t);
  put(&addrLen, sizeof(addrLen));
  put(&addr, sizeof(addr));
  const int64_t seq = -1;
  put(&seq, sizeof(seq));
  for (size_t i = 0; i < pairs; ++i) put(&seq, sizeof(seq));
  return out;
}

sockaddr_storage ipv4(const char* ip, uint16_t port) {
  sockaddr_storage ss{};
  auto* in = reinterpret_cast<sockaddr_in*>(&ss);
  in->sin_family = AF_INET;
  in->sin_port = htons(port);
  inet_pton(AF_INET, ip, &in->sin_addr);
  return ss;
}

TEST(TorchHooks, GloosRendezvousRecordGivesItsListenersAddress) {
  std::string why;
  auto endpoint =
      coord::GlooSockets::parseRecord(glooRecord("host-a", ipv4("10.1.2.3", 4567), 3), &why);
  ASSERT_TRUE(endpoint.has_value()) << why;
  EXPECT_EQ(endpoint->str(), "10.1.2.3:4567");
  // An IPv4-mapped IPv6 address is the same endpoint as its IPv4 one.
  sockaddr_storage mapped{};
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&mapped);
  in6->sin6_family = AF_INET6;
  in6->sin6_port = htons(4567);
  inet_pton(AF_INET6, "::ffff:10.1.2.3", &in6->sin6_addr);
  auto same = coord::GlooSockets::parseRecord(glooRecord("h", mapped, 0), &why);
  ASSERT_TRUE(same.has_value()) << why;
  EXPECT_TRUE(*same == *endpoint);
}

TEST(TorchHooks, ARecordLaidOutOtherwiseIsRefusedWithItsReason) {
  auto reason = [](const std::vector<uint8_t>& record) {
    std::string why;
    EXPECT_FALSE(coord::GlooSockets::parseRecord(record, &why).has_value());
    return why;
  };
  const auto good = glooRecord("host", ipv4("127.0.0.1", 999), 2);
  EXPECT_EQ(reason({1, 2, 3}), "its rendezvous record (3 bytes) is shorter than a length");
  auto longHost = good;
  const size_t huge = 1 << 20;
  std::memcpy(longHost.data(), &huge, sizeof(huge));
  EXPECT_NE(reason(longHost).find("does not hold a host name's length (1048576)"),
            std::string::npos);
  auto shortAddr = good;
  const size_t tiny = 4;
  std::memcpy(shortAddr.data() + sizeof(size_t) + 4, &tiny, sizeof(tiny));
  EXPECT_NE(reason(shortAddr).find("does not hold an address's length (4)"), std::string::npos);
  auto ragged = good;
  ragged.push_back(0);
  EXPECT_NE(reason(ragged).find("ends inside a pair identifier"), std::string::npos);
  sockaddr_storage local{};
  local.ss_family = AF_UNIX;
  EXPECT_NE(reason(glooRecord("host", local, 0)).find("holds address family 1"), std::string::npos);
  EXPECT_NE(reason(glooRecord("host", ipv4("127.0.0.1", 0), 0)).find("holds port 0"),
            std::string::npos);
}

}  // namespace
}  // namespace tpcomm
