#pragma once
// What both examples share: their arguments, a launcher that runs one
// process per rank (the program itself again, with --rank), and the
// group's store.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace example {

// --name value pairs; `defaults` lists every name the program takes.
inline std::map<std::string, std::string> parseArgs(int argc, char** argv,
                                                    std::map<std::string, std::string> defaults) {
  for (int i = 1; i < argc; ++i) {
    std::string name = argv[i];
    if (name.rfind("--", 0) != 0 || !defaults.count(name.substr(2)) || i + 1 >= argc) {
      std::fprintf(stderr, "unknown or incomplete argument '%s'; arguments (with defaults):\n",
                   name.c_str());
      for (const auto& [key, value] : defaults) {
        std::fprintf(stderr, "  --%s %s\n", key.c_str(), value.c_str());
      }
      std::exit(64);
    }
    defaults[name.substr(2)] = argv[++i];
  }
  return defaults;
}

// A TCP port free now on this host (for the store of a launched run).
inline int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  int port = 29500;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

// Runs `world` copies of this program with `args` (argv without the program
// name) plus --rank r, and waits for them (at most `limit`; then they are
// killed). Returns 0 when every rank exited 0, else the first failing rank's
// status (or 124).
inline int launchRanks(const std::vector<std::string>& args0, int world,
                       std::chrono::seconds limit) {
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::vector<std::string> args{"/proc/self/exe"};
      args.insert(args.end(), args0.begin(), args0.end());
      args.push_back("--rank");
      args.push_back(std::to_string(r));
      std::vector<char*> raw;
      for (auto& a : args) raw.push_back(a.data());
      raw.push_back(nullptr);
      ::execv("/proc/self/exe", raw.data());
      std::perror("execv");
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::vector<int> status(world, -1);
  for (int left = world; left > 0;) {
    for (int r = 0; r < world; ++r) {
      int s = 0;
      if (status[r] == -1 && ::waitpid(pids[r], &s, WNOHANG) == pids[r]) {
        status[r] = WIFEXITED(s) ? WEXITSTATUS(s) : 128 + WTERMSIG(s);
        --left;
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "launcher: ranks still running after %llds; killing them\n",
                   static_cast<long long>(limit.count()));
      for (int r = 0; r < world; ++r) {
        if (status[r] == -1) ::kill(pids[r], SIGKILL);
      }
      for (int r = 0; r < world; ++r) {
        if (status[r] == -1) ::waitpid(pids[r], nullptr, 0);
      }
      return 124;
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world; ++r) {
    if (status[r] != 0) return status[r];
  }
  return 0;
}

// The launcher's environment (torchrun's, or any that sets the same
// variables) as the defaults of --rank, --world-size, --master-addr, --port.
inline std::string fromEnv(const char* name, const std::string& otherwise) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : otherwise;
}

// The launcher (no --rank and no RANK): runs `world` ranks of this program
// with its own arguments, on a free port unless --port names one, and
// returns their status.
inline int launchSelf(int argc, char** argv, const std::map<std::string, std::string>& args,
                      int world, std::chrono::seconds limit) {
  std::vector<std::string> again(argv + 1, argv + argc);
  if (args.at("port") == "0") {
    again.push_back("--port");
    again.push_back(std::to_string(freePort()));
  }
  return launchRanks(again, world, limit);
}

// `own` arguments plus the launch's: --world-size, --rank, --master-addr and
// --port, defaulting to the launcher's environment.
inline std::map<std::string, std::string> withLaunchArgs(std::map<std::string, std::string> own) {
  own.insert({{"world-size", fromEnv("WORLD_SIZE", "2")},
              {"rank", fromEnv("RANK", "-1")},
              {"master-addr", fromEnv("MASTER_ADDR", "127.0.0.1")},
              {"port", fromEnv("MASTER_PORT", "0")}});
  return own;
}

// Rank 0 serves the store and the others connect; under torchrun, whose
// agent already serves one at MASTER_ADDR:MASTER_PORT
// (TORCHELASTIC_USE_AGENT_STORE=True), every rank connects to it. The
// program's keys sit under a prefix of their own.
inline c10::intrusive_ptr<c10d::Store> makeStore(const std::string& host, int port, int rank,
                                                 int world) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(port);
  options.isServer = rank == 0 && fromEnv("TORCHELASTIC_USE_AGENT_STORE", "") != "True";
  options.numWorkers = world;
  options.waitWorkers = true;
  options.timeout = std::chrono::seconds(60);
  auto store = c10::make_intrusive<c10d::TCPStore>(host, options);
  return c10::make_intrusive<c10d::PrefixStore>("tpcomm-example", store);
}

// Whether a Python interpreter is mapped into this process.
inline bool pythonLoaded() {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return false;
  char line[4096];
  bool found = false;
  while (!found && std::fgets(line, sizeof(line), maps) != nullptr) {
    const std::string text(line);
    found = text.find("libpython") != std::string::npos ||
            text.find("libtorch_python") != std::string::npos;
  }
  std::fclose(maps);
  return found;
}

}  // namespace example
