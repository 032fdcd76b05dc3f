#include "coordinator/cuda/autotune.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/error.hpp"
#include "common/settings.hpp"

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

// No iostreams here (see common/error.hpp): an extension built by gcc 13
// that uses std::ostringstream or std::ifstream binds to libc10's weak
// copies and crashes (seen on the GPU machine at the first cache write).
namespace {

std::string number(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", v);
  return text;
}

}  // namespace

std::string formatTuned(const TunedRoutes& tuned, const RouteTimings& t) {
  std::string out = "# tpcomm autotune: CUDA allreduce crossovers measured on this machine\n";
  out += "# bytes oneshot_us twoshot_us nccl_us\n";
  for (size_t i = 0; i < t.sizes.size(); ++i) {
    out += detail::concat("# ", t.sizes[i], " ", number(t.oneShotUs[i]), " ",
                          number(t.twoShotUs[i]), " ",
                          t.ncclUs.empty() ? std::string("-") : number(t.ncclUs[i]), "\n");
  }
  out += detail::concat("oneshot_max_bytes=", tuned.oneShotMaxBytes, "\n");
  out += detail::concat("custom_max_bytes=", tuned.customMaxBytes, "\n");
  return out;
}

std::optional<TunedRoutes> parseTuned(const std::string& text, int64_t maxBytes) {
  std::optional<int64_t> oneShot, custom;
  for (const std::string& line : detail::splitLines(text)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t eq = line.find('=');
    if (eq == std::string::npos) return std::nullopt;
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    char* stop = nullptr;
    errno = 0;
    const long long v = std::strtoll(value.c_str(), &stop, 10);
    if (value.empty() || *stop != '\0' || errno != 0 || v < 0 || v > maxBytes) return std::nullopt;
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
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return std::nullopt;
  std::string text;
  char chunk[4096];
  size_t got = 0;
  while ((got = std::fread(chunk, 1, sizeof(chunk), f)) > 0) text.append(chunk, got);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return std::nullopt;
  return parseTuned(text, maxBytes);
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
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return "cannot write " + tmp + ": " + std::strerror(errno);
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !written) {
    std::remove(tmp.c_str());
    return "cannot write " + tmp;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    return "cannot rename " + tmp + " to " + path + ": " + why;
  }
  return "";
}

}  // namespace tpcomm::coord
