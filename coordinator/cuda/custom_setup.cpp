#include "coordinator/cuda/custom_setup.hpp"

#include <algorithm>
#include <map>

#include "common/error.hpp"
#include "coordinator/faults/group_fault.hpp"

namespace tpcomm::coord {

namespace {

// Fixed-width text fields, so every rank's record has the same length.
constexpr size_t kHostWidth = 128;
constexpr size_t kUuidWidth = 64;
constexpr size_t kHandleWidth = 64;
constexpr size_t kMessageWidth = 384;
constexpr size_t kSettingsWidth = 512;
constexpr uint32_t kProbeToken = 0x7C0DE000;

void putField(std::string& out, const std::string& value, size_t width) {
  out += fixedWidth(value, width);
}

// Field `index` of a record made of fields of the given widths.
std::string getField(const std::string& record, const std::vector<size_t>& widths, size_t index,
                     bool text = true) {
  size_t offset = 0;
  for (size_t i = 0; i < index; ++i) offset += widths[i];
  const std::string field = record.substr(offset, widths[index]);
  return text ? trimmed(field) : field;
}

std::string encodeSettings(const LaunchSettings& settings) {
  std::string out;
  for (const auto& [name, value] : settings) out += name + "=" + value + "\n";
  TPCOMM_CHECK(out.size() <= kSettingsWidth, kInvalidUsage, "launch settings of ", out.size(),
               " bytes");
  return out;
}

LaunchSettings decodeSettings(const std::string& text) {
  LaunchSettings out;
  for (const std::string& line : detail::splitLines(text)) {
    const size_t eq = line.find('=');
    out.emplace_back(line.substr(0, eq), eq == std::string::npos ? "" : line.substr(eq + 1));
  }
  return out;
}

// The first setting (in rank 0's order) on which ranks disagree, described;
// "" when all agree.
std::string settingsMismatch(const std::vector<std::string>& encoded) {
  std::vector<std::map<std::string, std::string>> byRank;
  for (const auto& e : encoded) {
    const LaunchSettings s = decodeSettings(e);
    byRank.emplace_back(s.begin(), s.end());
  }
  std::vector<std::string> names;
  for (const auto& [name, value] : decodeSettings(encoded[0])) names.push_back(name);
  for (size_t r = 1; r < byRank.size(); ++r) {
    for (const auto& [name, value] : byRank[r]) {
      if (!byRank[0].count(name)) names.push_back(name);
    }
  }
  for (const auto& name : names) {
    const auto valueOf = [&](size_t r) {
      auto it = byRank[r].find(name);
      return it == byRank[r].end() ? std::string("(not set)") : it->second;
    };
    bool same = true;
    for (size_t r = 1; r < byRank.size(); ++r) same = same && valueOf(r) == valueOf(0);
    if (same) continue;
    std::string values;
    for (size_t r = 0; r < byRank.size(); ++r) {
      values += detail::concat(r ? ", " : "", "rank ", r, ": ", valueOf(r));
    }
    return detail::concat("ranks disagree on ", name, " (", values,
                          "); every rank of a group must use the same value");
  }
  return "";
}

}  // namespace

std::string failureOf(const std::exception& e) {
  std::string what = e.what();
  return what.empty() ? "unknown error" : what;
}

std::string firstFailure(const std::vector<std::string>& messages) {
  for (size_t r = 0; r < messages.size(); ++r) {
    if (!messages[r].empty()) return detail::concat("rank ", r, ": ", messages[r]);
  }
  return "";
}

std::string fixedWidth(const std::string& value, size_t width) {
  std::string field = value.substr(0, width);
  field.resize(width, '\0');
  return field;
}

std::string trimmed(const std::string& field) { return field.substr(0, field.find('\0')); }

std::vector<std::string> allgatherBytes(c10d::Backend& cpu, int size, const std::string& mine) {
  auto options = at::TensorOptions().dtype(at::kByte);
  const int64_t n = static_cast<int64_t>(mine.size());
  std::vector<at::Tensor> input{at::empty({n}, options)};
  std::copy(mine.begin(), mine.end(), static_cast<char*>(input[0].data_ptr()));
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < size; ++r) output[0].push_back(at::empty({n}, options));
  waitWork(*cpu.allgather(output, input));
  std::vector<std::string> out;
  for (const auto& t : output[0]) {
    TPCOMM_CHECK_EQ(t.numel(), n, "(allgathered record length)");
    out.emplace_back(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(n));
  }
  return out;
}

CustomSetupResult setUpCustomAllreduce(c10d::Backend& cpu, int rank, int size, CustomDevice& device,
                                       const std::string& hostId, size_t maxBytes,
                                       const LaunchSettings& launch, const std::string& skip) {
  CustomSetupResult result;
  if (size < 2 || size > car::kMaxRanks) {
    result.reason = detail::concat("world size ", size, " is outside 2..", car::kMaxRanks);
    return result;  // every rank sees the same size: no round needed
  }

  // Round 0: the settings that shape a launch, before anything is allocated.
  LaunchSettings settings{{"TPCOMM_CAR_MAX_BYTES", std::to_string(maxBytes)},
                          {"kernel protocol", car::protocolId()}};
  settings.insert(settings.end(), launch.begin(), launch.end());
  std::vector<std::string> encoded;
  for (const auto& r :
       allgatherBytes(cpu, size, fixedWidth(encodeSettings(settings), kSettingsWidth))) {
    encoded.push_back(trimmed(r));
  }
  result.reason = settingsMismatch(encoded);
  if (!result.reason.empty()) return result;
  if (!skip.empty()) {  // the same on every rank: its settings agree
    result.reason = skip;
    return result;
  }

  // Round 1: who and where every rank is, and its buffer's handle.
  const std::vector<size_t> widths{1, kHostWidth, kUuidWidth, kHandleWidth, kMessageWidth};
  std::string uuid, handle, failure;
  try {
    uuid = device.gpuUuid();
    handle = device.allocate(maxBytes);
    TPCOMM_CHECK(handle.size() <= kHandleWidth, kInvalidUsage, "IPC handle of ", handle.size(),
                 " bytes");
  } catch (const std::exception& e) {
    failure = "could not allocate its custom-allreduce buffer: " + failureOf(e);
  }
  std::string mine;
  putField(mine, failure.empty() ? "1" : "0", 1);
  putField(mine, hostId, kHostWidth);
  putField(mine, uuid, kUuidWidth);
  putField(mine, handle, kHandleWidth);
  putField(mine, failure, kMessageWidth);
  const std::vector<std::string> records = allgatherBytes(cpu, size, mine);
  std::vector<std::string> failures(size), hosts(size), uuids(size), handles(size);
  for (int r = 0; r < size; ++r) {
    failures[r] = getField(records[r], widths, 4);
    hosts[r] = getField(records[r], widths, 1);
    uuids[r] = getField(records[r], widths, 2);
    handles[r] = getField(records[r], widths, 3, /*text=*/false);
  }
  result.reason = firstFailure(failures);
  if (!result.reason.empty()) return result;

  car::Topology topology;
  topology.hostIds = hosts;
  for (int r = 0; r < size; ++r) {
    // Ranks sharing a GPU share its UUID (process-local indices may differ).
    const auto first = std::find(uuids.begin(), uuids.end(), uuids[r]);
    topology.devices.push_back(static_cast<int>(first - uuids.begin()));
  }
  result.devices = topology.devices;
  // Round 2 only among ranks of one host: the host check needs no exchange.
  car::Eligibility e = car::groupEligibility(topology);  // hosts (no P2P rows yet)
  if (!e.eligible) {
    result.reason = e.reason;
    return result;
  }

  // Round 2: P2P access and NVLink rows (a character per peer each).
  std::string row(2 * size, '?');
  for (int r = 0; r < size; ++r) {
    try {
      row[r] = device.peerAccess(uuids[r]);
    } catch (const std::exception&) {
      row[r] = 'x';
    }
    try {
      row[size + r] = device.linkTo(uuids[r]);
    } catch (const std::exception&) {
      row[size + r] = '?';
    }
  }
  for (const auto& other : allgatherBytes(cpu, size, row)) {
    topology.access.push_back(other.substr(0, size));
    topology.links.push_back(other.substr(size));
  }
  e = car::groupEligibility(topology);
  if (!e.eligible) {
    result.reason = e.reason;
    return result;
  }

  // Round 3: open every peer's buffer and write the probe token into it.
  std::vector<void*> bases(size, nullptr);
  failure.clear();
  try {
    bases[rank] = device.ownBase();
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      bases[r] = device.open(handles[r]);
      device.writeProbe(bases[r], rank, kProbeToken + rank);
    }
  } catch (const std::exception& e) {
    failure = "could not open or write to a peer's buffer: " + failureOf(e);
  }
  std::string opened;
  putField(opened, failure, kMessageWidth);
  std::vector<std::string> openFailures;
  for (const auto& r : allgatherBytes(cpu, size, opened)) {
    openFailures.push_back(getField(r, {kMessageWidth}, 0));
  }
  result.reason = firstFailure(openFailures);
  if (!result.reason.empty()) return result;

  // Round 4: what arrived.
  std::string seen;
  try {
    const std::vector<uint32_t> probes = device.readProbes(size);
    std::vector<int> missing;
    for (int r = 0; r < size; ++r) {
      if (r != rank && probes.at(r) != kProbeToken + r) missing.push_back(r);
    }
    if (!missing.empty()) {
      seen = detail::concat("rank ", rank, " saw no write from rank ", missing.front());
      if (missing.size() > 1) seen += detail::concat(" (and ", missing.size() - 1, " more)");
    }
  } catch (const std::exception& e) {
    seen = detail::concat("rank ", rank, " could not read its probe slots: ", failureOf(e));
  }
  std::string probe;
  putField(probe, seen, kMessageWidth);
  std::vector<std::string> details;
  for (const auto& r : allgatherBytes(cpu, size, probe)) {
    const std::string d = getField(r, {kMessageWidth}, 0);
    if (!d.empty()) details.push_back(d);
  }
  topology.probeSucceeded = details.empty();
  for (size_t i = 0; i < details.size(); ++i) {
    topology.probeDetail += (i ? "; " : "") + details[i];
  }
  e = car::groupEligibility(topology);
  if (!e.eligible) {
    result.reason = e.reason;
    return result;
  }
  result.available = true;
  result.bases = bases;
  return result;
}

}  // namespace tpcomm::coord
