// The C++ hooks into torch's internals check their ground: the flight
// recorder's layout check (backend/flight_record) on real recorders, intact
// and altered, and the Gloo connection finder's check of its descriptor
// folder (coordinator/gloo_sockets).
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "backend/flight_record.hpp"
#include "coordinator/gloo_sockets.hpp"

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

}  // namespace
}  // namespace tpcomm
