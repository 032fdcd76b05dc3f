// The merging of flight-recorder dumps (backend/flight_dump.hpp): two dumps
// in torch's format, as two recorders of one rank write them, merged into
// one that holds both's entries and group tables.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/TraceUtils.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "backend/flight_dump.hpp"

namespace {

using Dict = c10::Dict<c10::IValue, c10::IValue>;

Dict dict() { return Dict(c10::AnyType::get(), c10::AnyType::get()); }

Dict entry(int64_t pg, int64_t record, int64_t created, const std::string& name,
           const std::string& state) {
  Dict e = dict();
  e.insert("pg_id", pg);
  e.insert("record_id", record);
  e.insert("time_created_ns", created);
  e.insert("profiling_name", name);
  e.insert("state", state);
  return e;
}

std::string dump(const std::vector<Dict>& entries, const std::string& group,
                 const std::string& extraKey) {
  Dict d = dict();
  d.insert("version", "2.10");
  Dict config = dict();
  Dict row = dict();
  row.insert("desc", group + " desc");
  row.insert("ranks", "[0, 1]");
  config.insert(group, row);
  d.insert("pg_config", config);
  Dict status = dict();
  status.insert(group, dict());
  d.insert("pg_status", status);
  d.insert(extraKey, true);
  c10::List<c10::IValue> list(c10::AnyType::get());
  for (const auto& e : entries) list.push_back(e);
  if (!entries.empty()) d.insert("entries", list);
  return c10d::pickle_str(d);
}

Dict parsed(const std::string& s) {
  return torch::jit::unpickle(s.data(), s.size()).toGenericDict();
}

std::vector<std::string> names(const Dict& d) {
  std::vector<std::string> out;
  for (const auto& e : d.at("entries").toListRef()) {
    const Dict row = e.toGenericDict();
    out.push_back(row.at("profiling_name").toStringRef() + "/" + row.at("state").toStringRef());
  }
  return out;
}

TEST(FlightDump, TwoRecordersEntriesAndGroupsMergeInCreationOrder) {
  // tpcomm's recorder (pg 0) and NCCL's (pg 1): the same record ids.
  const std::string ours = dump({entry(0, 0, 100, "nccl:all_reduce tpcomm/cpu_shm", "completed"),
                                 entry(0, 1, 300, "nccl:all_reduce tpcomm/cpu_shm", "started")},
                                "0", "ours");
  const std::string nccl = dump({entry(1, 0, 200, "nccl:all_gather", "completed"),
                                 entry(1, 1, 400, "nccl:broadcast", "scheduled")},
                                "1", "nccl_comm_state");
  const Dict m = parsed(tpcomm::backend::mergeFlightDumps(ours, nccl));
  EXPECT_EQ(names(m), (std::vector<std::string>{
                          "nccl:all_reduce tpcomm/cpu_shm/completed", "nccl:all_gather/completed",
                          "nccl:all_reduce tpcomm/cpu_shm/started", "nccl:broadcast/scheduled"}));
  EXPECT_EQ(m.at("pg_config").toGenericDict().size(), 2u);
  EXPECT_EQ(m.at("pg_status").toGenericDict().size(), 2u);
  EXPECT_TRUE(m.contains("ours"));  // the older's keys the newer lacks stay
  EXPECT_TRUE(m.contains("nccl_comm_state"));
  EXPECT_EQ(m.at("version").toStringRef(), "2.10");
}

TEST(FlightDump, AnEntryInBothTakesTheNewerDumpsState) {
  const std::string first = dump({entry(0, 0, 100, "nccl:send 0->1", "started"),
                                  entry(0, 1, 150, "nccl:recv 0<-1", "started")},
                                 "0", "a");
  const std::string later = dump({entry(0, 0, 100, "nccl:send 0->1", "completed")}, "0", "a");
  const Dict m = parsed(tpcomm::backend::mergeFlightDumps(first, later));
  // The entry the ring evicted from the later dump stays as the first had it.
  EXPECT_EQ(names(m),
            (std::vector<std::string>{"nccl:send 0->1/completed", "nccl:recv 0<-1/started"}));
  // Merging again changes nothing.
  const std::string again =
      tpcomm::backend::mergeFlightDumps(tpcomm::backend::mergeFlightDumps(first, later), later);
  EXPECT_EQ(names(parsed(again)), names(m));
}

TEST(FlightDump, DumpsWithoutEntriesMerge) {
  const Dict m = parsed(tpcomm::backend::mergeFlightDumps(dump({}, "0", "a"), dump({}, "1", "b")));
  EXPECT_FALSE(m.contains("entries"));
  EXPECT_EQ(m.at("pg_config").toGenericDict().size(), 2u);
}

TEST(FlightDump, WhatIsNotADumpIsRefusedNamingWhich) {
  const std::string good = dump({}, "0", "a");
  try {
    tpcomm::backend::mergeFlightDumps(good, "not a pickle");
    FAIL() << "merged garbage";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("the newer flight-recorder dump does not unpickle"),
              std::string::npos)
        << e.what();
  }
  c10::List<c10::IValue> list(c10::AnyType::get());
  list.push_back(1);
  try {
    tpcomm::backend::mergeFlightDumps(c10d::pickle_str(list), good);
    FAIL() << "merged a list";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("the older flight-recorder dump is not a dict"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
