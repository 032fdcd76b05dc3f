#include "coordinator/autotune.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "coordinator/common/error.hpp"
#include "coordinator/common/settings.hpp"

namespace tpcomm::coord {

TunedRoutes chooseCrossovers(const RouteTimings& t, int64_t maxBytes, double margin) {
  TPCOMM_CHECK(t.oneShotUs.size() == t.sizes.size() && t.twoShotUs.size() == t.sizes.size() &&
                   (t.ncclUs.empty() || t.ncclUs.size() == t.sizes.size()),
               kInvalidUsage, "autotune: timings of different lengths");
  TunedRoutes out{maxBytes, maxBytes};
  for (size_t i = 0; i < t.sizes.size(); ++i) {
    if (t.twoShotUs[i] < t.oneShotUs[i] * (1.0 - margin)) {
      out.oneShotMaxBytes = i == 0 ? 0 : t.sizes[i - 1];
      break;
    }
  }
  for (size_t i = 0; i < t.ncclUs.size(); ++i) {
    const bool oneShot = t.sizes[i] <= out.oneShotMaxBytes;
    const double custom = oneShot ? t.oneShotUs[i] : t.twoShotUs[i];
    if (t.ncclUs[i] < custom * (1.0 - margin)) {
      out.customMaxBytes = i == 0 ? 0 : t.sizes[i - 1];
      break;
    }
  }
  out.oneShotMaxBytes = std::min(out.oneShotMaxBytes, out.customMaxBytes);
  return out;
}

std::string autotuneKey(const std::string& host, const std::string& gpuModel, int worldSize,
                        int64_t maxBytes) {
  std::string key =
      host + "-" + gpuModel + "-ws" + std::to_string(worldSize) + "-max" + std::to_string(maxBytes);
  for (char& c : key) {
    const bool safe =
        std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_';
    if (!safe) c = '_';
  }
  return key;
}

std::string autotunePath(const std::string& key) {
  std::string dir = settings().autotuneDir;
  if (dir.empty()) {
    if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
      dir = std::string(xdg) + "/tpcomm";
    } else if (const char* home = std::getenv("HOME"); home && *home) {
      dir = std::string(home) + "/.cache/tpcomm";
    } else {
      dir = "/tmp/tpcomm-cache";
    }
  }
  return dir + "/" + key + ".txt";
}

std::string formatTuned(const TunedRoutes& tuned, const RouteTimings& t) {
  std::ostringstream out;
  out << "# tpcomm autotune: CUDA allreduce crossovers measured on this machine\n";
  out << "# bytes oneshot_us twoshot_us nccl_us\n";
  for (size_t i = 0; i < t.sizes.size(); ++i) {
    out << "# " << t.sizes[i] << " " << t.oneShotUs[i] << " " << t.twoShotUs[i] << " ";
    if (t.ncclUs.empty()) {
      out << "-";
    } else {
      out << t.ncclUs[i];
    }
    out << "\n";
  }
  out << "oneshot_max_bytes=" << tuned.oneShotMaxBytes << "\n";
  out << "custom_max_bytes=" << tuned.customMaxBytes << "\n";
  return out.str();
}

std::optional<TunedRoutes> parseTuned(const std::string& text, int64_t maxBytes) {
  std::istringstream in(text);
  std::string line;
  std::optional<int64_t> oneShot, custom;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t eq = line.find('=');
    if (eq == std::string::npos) return std::nullopt;
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || errno != 0 || v < 0 || v > maxBytes) return std::nullopt;
    if (key == "oneshot_max_bytes") {
      oneShot = v;
    } else if (key == "custom_max_bytes") {
      custom = v;
    } else {
      return std::nullopt;
    }
  }
  if (!oneShot || !custom || *oneShot > *custom) return std::nullopt;
  return TunedRoutes{*oneShot, *custom};
}

std::optional<TunedRoutes> readTuned(const std::string& path, int64_t maxBytes) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return parseTuned(text.str(), maxBytes);
}

std::string writeTuned(const std::string& path, const std::string& text) {
  const size_t slash = path.rfind('/');
  if (slash != std::string::npos) {
    // mkdir -p, one level at a time.
    const std::string dir = path.substr(0, slash);
    for (size_t i = 1; i <= dir.size(); ++i) {
      if (i == dir.size() || dir[i] == '/') {
        if (::mkdir(dir.substr(0, i).c_str(), 0755) != 0 && errno != EEXIST) {
          return "cannot create " + dir.substr(0, i) + ": " + std::strerror(errno);
        }
      }
    }
  }
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!(out << text)) return "cannot write " + tmp;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    return "cannot rename " + tmp + " to " + path + ": " + why;
  }
  return "";
}

}  // namespace tpcomm::coord
