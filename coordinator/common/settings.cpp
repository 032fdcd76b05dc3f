#include "coordinator/common/settings.hpp"

#include <algorithm>
#include <cctype>
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

Settings Settings::parse(const Lookup& lookup) {
  Settings s;
  if (auto v = lookup("TPCOMM_DEBUG")) s.debug = parseBool("TPCOMM_DEBUG", *v);
  if (auto v = lookup("TPCOMM_HOST_ID")) s.hostId = *v;
  return s;
}

const std::vector<SettingInfo>& settingTable() { return kSettingTable; }

const Settings& settings() {
  static const Settings instance = Settings::parse(fromEnvironment);
  return instance;
}

}  // namespace tpcomm
