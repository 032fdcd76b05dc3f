#pragma once
// What the coordinator hands back for one routed call: the work the chosen
// backend started, plus what must run once that work has succeeded. The
// backend layer wraps it in the Work type the caller sees.

#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace tpcomm::coord {

struct Pending {
  // The routed backend's work. Null where the backend completed or
  // stream-ordered a synchronous call without one (ProcessGroupNCCL with
  // asyncOp=false); the finish step then runs at once.
  c10::intrusive_ptr<c10d::Work> work;
  // Runs exactly once, after `work` succeeded and before the call's future
  // completes (e.g. the division of an AVG done as SUM). May be empty.
  std::function<void()> finish;
  // The call's results: Work::result() and the value of its future.
  std::vector<at::Tensor> outputs;
  // False where the routed backend's work has no future (Gloo's send/recv
  // and reduce-scatter works); the backend layer then provides one.
  bool hasFuture = true;
  // `work` completed in the caller's thread already (the shared-memory
  // path): the backend layer hands it back as it is, no wrapper.
  bool done = false;
};

}  // namespace tpcomm::coord
