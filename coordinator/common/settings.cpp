#include "coordinator/common/settings.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "coordinator/common/error.hpp"

namespace tpcomm {

namespace {

const std::vector<SettingInfo> kSettingTable = {
    {"TPCOMM_DEBUG", "bool", "0",
     "Before each collective, check op, shapes and dtypes across ranks through the CPU group "
     "and raise naming the ranks that differ (costs one extra CPU round trip per call)."},
    {"TPCOMM_HOST_ID", "string", "",
     "This process's host identity for the shared-memory message queue (empty: the host name); "
     "ranks with different ids talk through the CPU group instead."},
    {"TPCOMM_CAR_MAX_BYTES", "int", "8388608",
     "The largest allreduce the custom peer-to-peer kernel takes (bytes, a multiple of 16); "
     "each rank's staging buffer is twice this."},
    {"TPCOMM_CAR_TIMEOUT_MS", "int", "10000",
     "How long a custom-allreduce kernel waits for a peer before it stops and the host raises "
     "an error naming that peer."},
    {"TPCOMM_CAR_BLOCKS", "int", "0",
     "Thread blocks per custom-allreduce kernel, 1 to 64 (0: chosen from the size and world "
     "size)."},
};

std::optional<std::string> fromEnvironment(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

}  // namespace

bool parseBool(const std::string& name, const std::string& value) {
  std::string v = value;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off" || v.empty()) return false;
  TPCOMM_THROW(kInvalidUsage, "setting ", name, "='", value,
               "' is not a boolean (use 1/0, true/false, yes/no, on/off)");
}

int64_t parseInt(const std::string& name, const std::string& value, int64_t low, int64_t high) {
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || end == nullptr || *end != '\0' || errno == ERANGE) {
    TPCOMM_THROW(kInvalidUsage, "setting ", name, "='", value, "' is not an integer");
  }
  if (parsed < low || parsed > high) {
    TPCOMM_THROW(kInvalidUsage, "setting ", name, "=", value, " is outside ", low, "..", high);
  }
  return parsed;
}

Settings Settings::parse(const Lookup& lookup) {
  Settings s;
  if (auto v = lookup("TPCOMM_DEBUG")) s.debug = parseBool("TPCOMM_DEBUG", *v);
  if (auto v = lookup("TPCOMM_HOST_ID")) s.hostId = *v;
  if (auto v = lookup("TPCOMM_CAR_MAX_BYTES")) {
    s.carMaxBytes = parseInt("TPCOMM_CAR_MAX_BYTES", *v, 16, int64_t{1} << 30);
    TPCOMM_CHECK(s.carMaxBytes % 16 == 0, kInvalidUsage, "setting TPCOMM_CAR_MAX_BYTES=", *v,
                 " is not a multiple of 16");
  }
  if (auto v = lookup("TPCOMM_CAR_TIMEOUT_MS")) {
    s.carTimeoutMs = parseInt("TPCOMM_CAR_TIMEOUT_MS", *v, 1, int64_t{24} * 3600 * 1000);
  }
  if (auto v = lookup("TPCOMM_CAR_BLOCKS")) s.carBlocks = parseInt("TPCOMM_CAR_BLOCKS", *v, 0, 64);
  return s;
}

const std::vector<SettingInfo>& settingTable() { return kSettingTable; }

const Settings& settings() {
  static const Settings instance = Settings::parse(fromEnvironment);
  return instance;
}

}  // namespace tpcomm
