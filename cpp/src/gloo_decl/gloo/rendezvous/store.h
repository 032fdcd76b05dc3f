#pragma once
// Declarations only (see ../../README.md): the base ProcessGroupGloo.hpp's
// GlooStore derives from. tpcomm never makes a GlooStore (torch's
// constructor does), so these virtuals need only exist for the header's
// overrides to compile.
#include <chrono>
#include <string>
#include <vector>

namespace gloo::rendezvous {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& value) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys,
                    const std::chrono::milliseconds& timeout) = 0;
};

}  // namespace gloo::rendezvous
