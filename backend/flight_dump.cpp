#include "backend/flight_dump.hpp"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <typeinfo>

#include <fcntl.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TraceUtils.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>

namespace tpcomm::backend {

namespace {

using Dict = c10::Dict<c10::IValue, c10::IValue>;

Dict parse(const std::string& dump, const char* which) {
  c10::IValue v;
  try {
    v = torch::jit::unpickle(dump.data(), dump.size());
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("the ") + which +
                             " flight-recorder dump does not unpickle: " + e.what());
  }
  if (!v.isGenericDict()) {
    throw std::runtime_error(std::string("the ") + which +
                             " flight-recorder dump is not a dict: " + v.tagKind());
  }
  return v.toGenericDict();
}

int64_t intField(const Dict& entry, const char* key) {
  auto it = entry.find(c10::IValue(key));
  return it != entry.end() && it->value().isInt() ? it->value().toInt() : -1;
}

// An entry's identity across dumps of one process.
using EntryKey = std::tuple<int64_t, int64_t, int64_t>;  // pg_id, record_id, time_created_ns

EntryKey keyOf(const Dict& entry) {
  return {intField(entry, "pg_id"), intField(entry, "record_id"),
          intField(entry, "time_created_ns")};
}

// `into`'s table `key` with `from`'s rows added (`from`'s where both have a row).
void mergeTable(Dict& into, const Dict& from, const char* key) {
  auto theirs = from.find(c10::IValue(key));
  if (theirs == from.end() || !theirs->value().isGenericDict()) return;
  auto ours = into.find(c10::IValue(key));
  if (ours == into.end() || !ours->value().isGenericDict()) {
    into.insert_or_assign(c10::IValue(key), theirs->value());
    return;
  }
  Dict table = ours->value().toGenericDict().copy();
  for (const auto& row : theirs->value().toGenericDict()) {
    table.insert_or_assign(row.key(), row.value());
  }
  into.insert_or_assign(c10::IValue(key), table);
}

}  // namespace

std::string mergeFlightDumps(const std::string& older, const std::string& newer) {
  const Dict a = parse(older, "older");
  const Dict b = parse(newer, "newer");
  Dict out(c10::AnyType::get(), c10::AnyType::get());
  for (const auto& kv : a) out.insert_or_assign(kv.key(), kv.value());
  for (const auto& kv : b) out.insert_or_assign(kv.key(), kv.value());
  mergeTable(out, a, "pg_config");
  mergeTable(out, b, "pg_config");
  mergeTable(out, a, "pg_status");
  mergeTable(out, b, "pg_status");
  std::map<EntryKey, c10::IValue> byKey;
  std::map<std::pair<int64_t, EntryKey>, EntryKey> byTime;  // creation time first
  for (const Dict* dump : {&a, &b}) {
    auto entries = dump->find(c10::IValue("entries"));
    if (entries == dump->end()) continue;
    if (!entries->value().isList()) throw std::runtime_error("a dump's entries are not a list");
    for (const auto& e : entries->value().toListRef()) {
      if (!e.isGenericDict()) throw std::runtime_error("a dump's entry is not a dict");
      const EntryKey key = keyOf(e.toGenericDict());
      byKey[key] = e;  // the newer dump's, where both have it
      byTime[{std::get<2>(key), key}] = key;
    }
  }
  if (!byKey.empty()) {
    c10::List<c10::IValue> entries(c10::AnyType::get());
    for (const auto& [when, key] : byTime) entries.push_back(byKey.at(key));
    out.insert_or_assign(c10::IValue("entries"), entries);
  }
  return c10d::pickle_str(out);
}

namespace {

std::atomic<int> dumpRank{-1};

// `data` written to a new file `path` (replacing one there), all of it.
bool writeWhole(const std::string& path, const std::string& data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  return ::close(fd) == 0 && done == data.size();
}

int currentRank() {
  const int r = dumpRank.load();
  if (r >= 0) return r;
  const char* env = std::getenv("RANK");
  return env != nullptr && *env != '\0' ? std::atoi(env) : 0;
}

class MergingWriter : public c10d::DebugInfoWriter {
 public:
  explicit MergingWriter(const std::string& prefix)
      : c10d::DebugInfoWriter(prefix, currentRank()), prefix_(prefix) {}

  std::string getWriterTarget() override { return prefix_ + std::to_string(currentRank()); }

  void write(const std::string& trace) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::string target = getWriterTarget();
    std::string merged = trace;
    if (!written_.empty() && target == writtenTo_) {
      try {
        merged = mergeFlightDumps(written_, trace);
      } catch (const std::exception& e) {
        // Not a dump this writer knows: written as it is, as torch's would.
        std::fprintf(stderr, "tpcomm: flight-recorder dump written unmerged: %s\n", e.what());
      }
    }
    // Whole or not at all: a reader never sees a half-written file.
    const std::string partial = target.substr(0, target.find_last_of('/') + 1) + ".tpcomm-fr-" +
                                std::to_string(::getpid()) + ".partial";
    const bool ok = writeWhole(partial, merged);
    if (!ok || std::rename(partial.c_str(), target.c_str()) != 0) {
      std::fprintf(stderr, "tpcomm: could not write the flight-recorder dump %s\n", target.c_str());
      std::remove(partial.c_str());
      return;
    }
    written_ = std::move(merged);
    writtenTo_ = target;
  }

 private:
  const std::string prefix_;
  std::mutex mutex_;
  std::string written_;    // by mutex_: the file's content
  std::string writtenTo_;  // by mutex_: the file
};

std::mutex registering;
MergingWriter* registered = nullptr;           // by registering; owned by torch
std::string notRegistered = "not registered";  // by registering

}  // namespace

void registerMergingDumpWriter() {
  std::lock_guard<std::mutex> lock(registering);
  if (registered != nullptr) return;
  std::string prefix;
  for (const char* name : {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') {
      prefix = v;
      break;
    }
  }
  if (prefix.empty()) {
    notRegistered = "no TORCH_FR_DUMP_TEMP_FILE set: torch's own writer names the file";
    return;
  }
  try {
    // torch's own writer when none was registered (made here, unused).
    c10d::DebugInfoWriter& current = c10d::DebugInfoWriter::getWriter(currentRank());
    if (typeid(current) != typeid(c10d::DebugInfoWriter)) {
      notRegistered =
          "the program registered a dump writer before tpcomm: dumps go through it unmerged";
      return;
    }
    auto writer = std::make_unique<MergingWriter>(prefix);
    MergingWriter* raw = writer.get();
    c10d::DebugInfoWriter::registerWriter(std::move(writer));
    registered = raw;
  } catch (const std::exception& e) {
    notRegistered = std::string("the merging dump writer could not be registered: ") + e.what();
  }
}

void setMergingDumpRank(int rank) { dumpRank.store(rank); }

std::string mergingDumpStatus() {
  std::lock_guard<std::mutex> lock(registering);
  if (registered == nullptr) return notRegistered;
  if (&c10d::DebugInfoWriter::getWriter(currentRank()) != registered) {
    return "a dump writer registered after tpcomm's takes the dumps, unmerged";
  }
  return "merged into " + registered->getWriterTarget();
}

}  // namespace tpcomm::backend
