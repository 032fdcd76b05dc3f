#include "backend/process_group_tpcomm.hpp"

#include <torch/csrc/distributed/c10d/exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "backend/boundary.hpp"
#include "backend/flight_record.hpp"
#include "backend/validation.hpp"
#include "backend/work.hpp"
#include "common/error.hpp"
#include "coordinator/cpu/cpu_shm_path.hpp"
#include "coordinator/route_stats.hpp"

namespace tpcomm::backend {

using c10d::OpType;
using c10d::Work;
using coord::Pending;
using WorkPtr = c10::intrusive_ptr<Work>;
using Tensors = std::vector<at::Tensor>;
using Refs = c10::ArrayRef<at::Tensor>;

// A call's tensors for the flight recorder: views of the caller's lists or of lists made for it.
struct CallTensors {
  Refs in, out;
};
struct MadeTensors {
  Tensors in, out;
};

namespace {

// Calls every rank makes together (TPCOMM_DEBUG checks them across ranks).
bool isCollective(OpType type) {
  return type != OpType::SEND && type != OpType::RECV && type != OpType::RECVANYSOURCE;
}

// Every tensor of a list of lists, in order.
std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& list : lists) out.insert(out.end(), list.begin(), list.end());
  return out;
}

std::vector<at::Tensor> concat(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  std::vector<at::Tensor> out(a);
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

}  // namespace

template <typename Tensors, typename Call>
WorkPtr ProcessGroupTpcomm::run(OpType type, const char* op, Tensors&& tensors, Call&& call,
                                int peer) {
  WorkPtr returned = translateErrors([&]() -> WorkPtr {
    ++callsOnThisThread();
    coord::GroupFault& fault = co().fault();
    // A broken group, or a collective this rank refused and its peers have
    // not settled yet (group_fault.hpp): raises or waits here.
    if (!fault.usable()) {
      try {
        fault.checkBeforeCall(op);
      } catch (const tpcomm::Error& e) {
        hooks_->runAbort();  // this rank's first call since the group broke, perhaps
        C10_THROW_ERROR(DistBackendError, "tpcomm: " + describeCall(op) + " failed: " + e.what());
      }
    }
    const bool p2p = !isCollective(type);
    const uint64_t seq = p2p ? ++p2pSeq_ : ++collectiveSeq_;
    FlightCall flight;
    if (FlightRecord::get().enabled()) {
      const auto lists = tensors();
      flight = recordCall(p2p, type == OpType::SEND, op, lists.in, lists.out, peer, seq);
    }
    // Set once the call reached a route: an argument error before that is
    // a refusal, one after it a mismatch the route found.
    coord::RouteStats::lastRoute().reset();
    const uint64_t ticket = p2p ? 0 : fault.enter(seq, op, false);
    // Who the call is, for errors (built only where needed: the string). A
    // failed collective on a CPU route breaks the group; a point-to-point
    // failure concerns two ranks (TPCOMM_DEBUG's check keeps their lane in
    // step) and a device route keeps its own recovery.
    auto identity = [&] {
      const bool device = onDeviceRoute();
      return CallIdentity{describeCall(op), op, seq, rank_, !p2p && !device, device, hooks_};
    };
    Pending pending;
    const uint64_t checksBefore = coord::GroupCoordinator::debugChecksOnThisThread();
    try {
      coord::CurrentFault current(&fault);
      pending = call();
    } catch (const tpcomm::Error& e) {
      if (ticket) fault.leave(ticket);
      FlightRecord::get().rename(flight.id, flight.routed());  // left started: never completed
      if (e.code() == ErrorCode::kInvalidUsage) {
        // A mismatch found by the route or by TPCOMM_DEBUG's check: every
        // rank raised at the same step, and the dump is what shows which
        // rank called what.
        const bool routed = coord::RouteStats::lastRoute().has_value() ||
                            coord::GroupCoordinator::debugChecksOnThisThread() != checksBefore;
        const std::string dumped =
            flight.id.id && routed ? FlightRecord::get().dumpAfterFailure() : std::string();
        if (!p2p && !routed) {
          if (co().options().debugChecks) {
            // TPCOMM_DEBUG: the check runs with the refusal as this rank's
            // signature, so every rank raises naming it at the same step.
            co().checkRefusedCall(op, e.what());
          } else {
            // A peer that made this call waits for this rank: it learns
            // that this rank refused it (every rank refusing it breaks
            // nothing).
            fault.refused(seq, op, e.what());
          }
        }
        if (!dumped.empty()) throw tpcomm::Error(e.code(), e.what() + dumped);
        throw;
      }
      // A failure while the call ran in this thread (the CPU shared-memory
      // path) names the call, as a failed Work's wait() does.
      raiseCallFailure(identity(), fault, std::current_exception());
    } catch (const std::exception& e) {
      // Another library's error (ATen, a routed backend's own check):
      // raised as it is, unless it is Gloo's transport failing because the
      // group broke (its connections shut down): then the break is named.
      if (ticket) fault.leave(ticket);
      if (!fault.broken() && std::string(e.what()).find("gloo/transport") != std::string::npos) {
        fault.learnFromPeers();
      }
      if (fault.broken()) raiseCallFailure(identity(), fault, std::current_exception());
      throw;
    } catch (...) {
      if (ticket) fault.leave(ticket);
      throw;
    }
    if (flight.id.id) {
      if (pending.done) {
        FlightRecord::get().retire(flight.id, flight.routed());
      } else {
        FlightRecord::get().rename(flight.id, flight.routed());
        pending.finish = [finish = std::move(pending.finish), fid = flight.id] {
          if (finish) finish();
          FlightRecord::get().retire(fid);
        };
      }
    }
    if (pending.done || !pending.work) {
      if (ticket) fault.leave(ticket);
      if (pending.done && pending.work) return completed(pending.work);  // in this thread
      // A synchronous call (asyncOp=false) completed in this thread, or already
      // ordered on the current stream by the routed backend, returns no Work
      // (as ProcessGroupNCCL; torch's Python API then skips wait()), except
      // where torch keeps each call's Work for wait_tensor
      // (allow_inflight_collective_as_graph_input): a completed one there.
      if (!pending.done && pending.finish) pending.finish();
      if (c10d::allow_inflight_collective_as_graph_input()) {
        return completed(coord::completedWork(std::move(pending.outputs)));
      }
      return WorkPtr();
    }
    auto work = c10::make_intrusive<TpcommWork>(std::move(pending), type, identity(),
                                                co().faultState());
    if (ticket) fault.leave(ticket);  // the work is in flight in its own right
    return work;
  });
  coalescing_.add(returned);  // a no-op unless a batch is open
  return returned;
}

WorkPtr ProcessGroupTpcomm::broadcast(std::vector<at::Tensor>& tensors,
                                      const c10d::BroadcastOptions& opts) {
  return run(
      OpType::BROADCAST, "broadcast",
      [&] {
        return CallTensors{tensors, tensors};
      },
      [&] {
        checkSingle("broadcast", "tensors", tensors);
        checkRank("broadcast", "root rank", opts.rootRank, size_);
        co().fault().noteRoot(opts.rootRank);
        checkRootTensor("broadcast", opts.rootTensor, tensors.size());
        return co().broadcast(tensors, opts);
      });
}

WorkPtr ProcessGroupTpcomm::allreduce(std::vector<at::Tensor>& tensors,
                                      const c10d::AllreduceOptions& opts) {
  // A sparse COO tensor (DDP's sparse embedding gradients): as Gloo does.
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse) {
    return allreduce_sparse(tensors, opts);
  }
  return run(
      OpType::ALLREDUCE, "allreduce",
      [&] {
        return CallTensors{tensors, tensors};
      },
      [&] {
        checkSingle("allreduce", "tensors", tensors);
        checkReduceOp("allreduce", opts.reduceOp, tensors[0].scalar_type());
        return co().allreduce(tensors, opts);
      });
}

WorkPtr ProcessGroupTpcomm::allreduceInto(at::Tensor& input, at::Tensor& output,
                                          const c10d::AllreduceOptions& opts) {
  return run(
      OpType::ALLREDUCE, "allreduce",
      [&] {
        return CallTensors{input, output};
      },
      [&] {
        checkTensors("allreduce", "input", {input});
        checkTensors("allreduce", "output", {output});
        checkSameDevice("allreduce", {input, output});
        checkDtype("allreduce", "output", {output}, input.scalar_type());
        checkNumel("allreduce", "the output", output.numel(), input.numel());
        checkOverlap("allreduce", "the output", output, "the input", input);
        checkReduceOp("allreduce", opts.reduceOp, input.scalar_type());
        return co().allreduceInto(input, output, opts);
      });
}

std::string ProcessGroupTpcomm::allreduceAddRmsNorm(const at::Tensor& input,
                                                    const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps,
                                                    at::Tensor& normed, at::Tensor& residualOut) {
  std::string path;
  run(
      OpType::ALLREDUCE, "all_reduce_add_rms_norm",
      [&] {
        return CallTensors{input, normed};
      },
      [&] {
        checkAddRmsNorm(input, residual, weight, eps, normed, residualOut);
        path = co().allreduceAddRmsNorm(input, residual, weight, eps, normed, residualOut);
        return coord::Pending{};
      });
  return path;
}

WorkPtr ProcessGroupTpcomm::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                             const c10d::AllreduceOptions& opts) {
  return run(
      OpType::ALLREDUCE, "allreduce_sparse", [&] { return CallTensors{}; },
      [&] {
        checkSparse("allreduce_sparse", tensors, opts.reduceOp);
        return co().allreduceSparse(tensors, opts);
      });
}

WorkPtr ProcessGroupTpcomm::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                const c10d::AllreduceCoalescedOptions& opts) {
  return run(
      OpType::ALLREDUCE_COALESCED, "allreduce_coalesced",
      [&] {
        return CallTensors{tensors, tensors};
      },
      [&] {
        checkTensors("allreduce_coalesced", "tensors", tensors);
        checkSameDevice("allreduce_coalesced", tensors);
        checkDtype("allreduce_coalesced", "tensors", tensors, tensors[0].scalar_type());
        checkReduceOp("allreduce_coalesced", opts.reduceOp, tensors[0].scalar_type());
        return co().allreduceCoalesced(tensors, opts);
      });
}

WorkPtr ProcessGroupTpcomm::reduce(std::vector<at::Tensor>& tensors,
                                   const c10d::ReduceOptions& opts) {
  return run(
      OpType::REDUCE, "reduce",
      [&] {
        return CallTensors{tensors, tensors};
      },
      [&] {
        checkSingle("reduce", "tensors", tensors);
        checkRank("reduce", "root rank", opts.rootRank, size_);
        co().fault().noteRoot(opts.rootRank);
        checkRootTensor("reduce", opts.rootTensor, tensors.size());
        checkReduceOp("reduce", opts.reduceOp, tensors[0].scalar_type());
        return co().reduce(tensors, opts);
      });
}

WorkPtr ProcessGroupTpcomm::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                      std::vector<at::Tensor>& inputs,
                                      const c10d::AllgatherOptions& opts) {
  return run(
      OpType::ALLGATHER, "allgather",
      [&] {
        return MadeTensors{inputs, flat(outputs)};
      },
      [&] {
        checkSingle("allgather", "input tensors", inputs);
        checkLength("allgather", "output tensor lists", outputs.size(), 1);
        checkLength("allgather", "output tensor list", outputs[0].size(), size_);
        checkTensors("allgather", "output tensor list", outputs[0]);
        checkSameDevice("allgather", concat(inputs, outputs[0]));
        checkDtype("allgather", "output tensor list", outputs[0], inputs[0].scalar_type());
        for (const auto& out : outputs[0]) {
          checkNumel("allgather", "an output tensor", out.numel(), inputs[0].numel());
          checkOverlap("allgather", "an output tensor", out, "the input", inputs[0]);
        }
        return co().allgather(outputs, inputs, opts);
      });
}

WorkPtr ProcessGroupTpcomm::_allgather_base(at::Tensor& output, at::Tensor& input,
                                            const c10d::AllgatherOptions& opts) {
  return run(
      OpType::_ALLGATHER_BASE, "allgather_into_tensor",
      [&] {
        return CallTensors{input, output};
      },
      [&] {
        const char* op = "allgather_into_tensor";
        checkTensors(op, "input", {input});
        checkTensors(op, "output", {output});
        checkSameDevice(op, {input, output});
        checkDtype(op, "output", {output}, input.scalar_type());
        checkNumel(op, "the output", output.numel(), input.numel() * size_);
        checkSlotOverlap(op, "the input", input, "the output", output);
        return co().allgatherBase(output, input, opts);
      });
}

WorkPtr ProcessGroupTpcomm::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                std::vector<at::Tensor>& inputs,
                                                const c10d::AllgatherOptions& opts) {
  return run(
      OpType::ALLGATHER_COALESCED, "allgather_coalesced",
      [&] {
        return MadeTensors{inputs, flat(outputs)};
      },
      [&] {
        const char* op = "allgather_coalesced";
        checkTensors(op, "input tensors", inputs);
        checkLength(op, "output tensor lists", outputs.size(), size_);
        for (const auto& list : outputs) {
          checkLength(op, "an output tensor list", list.size(), inputs.size());
          checkTensors(op, "an output tensor list", list);
          checkSameDevice(op, concat(inputs, list));
          for (size_t i = 0; i < list.size(); ++i) {
            checkDtype(op, "an output tensor list", {list[i]}, inputs[i].scalar_type());
            checkNumel(op, "an output tensor", list[i].numel(), inputs[i].numel());
          }
        }
        return co().allgatherCoalesced(outputs, inputs, opts);
      });
}

WorkPtr ProcessGroupTpcomm::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions& opts) {
  return run(
      OpType::COALESCED, "allgather_into_tensor_coalesced",
      [&] {
        return CallTensors{inputs, outputs};
      },
      [&] {
        const char* op = "allgather_into_tensor_coalesced";
        checkTensors(op, "inputs", inputs);
        checkTensors(op, "outputs", outputs);
        checkLength(op, "outputs", outputs.size(), inputs.size());
        checkSameDevice(op, concat(inputs, outputs));
        for (size_t i = 0; i < inputs.size(); ++i) {
          checkDtype(op, "outputs", {outputs[i]}, inputs[i].scalar_type());
          checkNumel(op, "an output", outputs[i].numel(), inputs[i].numel() * size_);
          checkSlotOverlap(op, "an input", inputs[i], "its output", outputs[i]);
        }
        checkNoSharing(op, outputs, inputs);
        return co().allgatherIntoTensorCoalesced(outputs, inputs, opts);
      });
}

WorkPtr ProcessGroupTpcomm::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                   std::vector<at::Tensor>& inputs,
                                   const c10d::GatherOptions& opts) {
  return run(
      OpType::GATHER, "gather",
      [&] {
        return MadeTensors{inputs, flat(outputs)};
      },
      [&] {
        checkSingle("gather", "input tensors", inputs);
        checkRank("gather", "root rank", opts.rootRank, size_);
        co().fault().noteRoot(opts.rootRank);
        if (opts.rootRank == rank_) {
          checkLength("gather", "output tensor lists on the root", outputs.size(), 1);
          checkLength("gather", "the gather list", outputs[0].size(), size_);
          checkTensors("gather", "the gather list", outputs[0]);
          checkSameDevice("gather", concat(inputs, outputs[0]));
          checkDtype("gather", "the gather list", outputs[0], inputs[0].scalar_type());
          for (const auto& out : outputs[0]) {
            checkNumel("gather", "a gather list tensor", out.numel(), inputs[0].numel());
          }
        } else {
          TPCOMM_CHECK(outputs.empty() || outputs[0].empty(), kInvalidUsage,
                       "gather: only the root rank (", opts.rootRank,
                       ") passes a gather list; rank ", rank_, " passed one");
        }
        return co().gather(outputs, inputs, opts);
      });
}

WorkPtr ProcessGroupTpcomm::scatter(std::vector<at::Tensor>& outputs,
                                    std::vector<std::vector<at::Tensor>>& inputs,
                                    const c10d::ScatterOptions& opts) {
  return run(
      OpType::SCATTER, "scatter",
      [&] {
        return MadeTensors{flat(inputs), outputs};
      },
      [&] {
        checkSingle("scatter", "output tensors", outputs);
        checkRank("scatter", "root rank", opts.rootRank, size_);
        co().fault().noteRoot(opts.rootRank);
        if (opts.rootRank == rank_) {
          checkLength("scatter", "input tensor lists on the root", inputs.size(), 1);
          checkLength("scatter", "the scatter list", inputs[0].size(), size_);
          checkTensors("scatter", "the scatter list", inputs[0]);
          checkSameDevice("scatter", concat(outputs, inputs[0]));
          checkDtype("scatter", "the scatter list", inputs[0], outputs[0].scalar_type());
          for (const auto& in : inputs[0]) {
            checkNumel("scatter", "a scatter list tensor", in.numel(), outputs[0].numel());
          }
        } else {
          TPCOMM_CHECK(inputs.empty() || inputs[0].empty(), kInvalidUsage,
                       "scatter: only the root rank (", opts.rootRank,
                       ") passes a scatter list; rank ", rank_, " passed one");
        }
        return co().scatter(outputs, inputs, opts);
      });
}

WorkPtr ProcessGroupTpcomm::reduce_scatter(std::vector<at::Tensor>& outputs,
                                           std::vector<std::vector<at::Tensor>>& inputs,
                                           const c10d::ReduceScatterOptions& opts) {
  return run(
      OpType::REDUCE_SCATTER, "reduce_scatter",
      [&] {
        return MadeTensors{flat(inputs), outputs};
      },
      [&] {
        const char* op = "reduce_scatter";
        checkSingle(op, "output tensors", outputs);
        checkLength(op, "input tensor lists", inputs.size(), 1);
        checkLength(op, "the input list", inputs[0].size(), size_);
        checkTensors(op, "the input list", inputs[0]);
        checkSameDevice(op, concat(outputs, inputs[0]));
        checkDtype(op, "the input list", inputs[0], outputs[0].scalar_type());
        for (const auto& in : inputs[0]) {
          checkNumel(op, "an input tensor", in.numel(), outputs[0].numel());
          checkOverlap(op, "the output", outputs[0], "an input tensor", in);
        }
        checkReduceOp(op, opts.reduceOp, outputs[0].scalar_type());
        return co().reduceScatter(outputs, inputs, opts);
      });
}

WorkPtr ProcessGroupTpcomm::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::ReduceScatterOptions& opts) {
  return run(
      OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor",
      [&] {
        return CallTensors{input, output};
      },
      [&] {
        const char* op = "reduce_scatter_tensor";
        checkTensors(op, "input", {input});
        checkTensors(op, "output", {output});
        checkSameDevice(op, {input, output});
        checkDtype(op, "output", {output}, input.scalar_type());
        checkNumel(op, "the input", input.numel(), output.numel() * size_);
        checkSlotOverlap(op, "the output", output, "the input", input);
        checkReduceOp(op, opts.reduceOp, input.scalar_type());
        return co().reduceScatterBase(output, input, opts);
      });
}

WorkPtr ProcessGroupTpcomm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return run(
      OpType::COALESCED, "reduce_scatter_tensor_coalesced",
      [&] {
        return CallTensors{inputs, outputs};
      },
      [&] {
        const char* op = "reduce_scatter_tensor_coalesced";
        checkTensors(op, "inputs", inputs);
        checkTensors(op, "outputs", outputs);
        checkLength(op, "outputs", outputs.size(), inputs.size());
        checkSameDevice(op, concat(inputs, outputs));
        for (size_t i = 0; i < inputs.size(); ++i) {
          checkDtype(op, "outputs", {outputs[i]}, inputs[i].scalar_type());
          checkNumel(op, "an input", inputs[i].numel(), outputs[i].numel() * size_);
          checkSlotOverlap(op, "an output", outputs[i], "its input", inputs[i]);
          checkReduceOp(op, opts.reduceOp, inputs[i].scalar_type());
        }
        checkNoSharing(op, outputs, inputs);
        return co().reduceScatterTensorCoalesced(outputs, inputs, opts);
      });
}

WorkPtr ProcessGroupTpcomm::alltoall_base(at::Tensor& output, at::Tensor& input,
                                          std::vector<int64_t>& outputSplits,
                                          std::vector<int64_t>& inputSplits,
                                          const c10d::AllToAllOptions& opts) {
  return run(
      OpType::ALLTOALL_BASE, "all_to_all_single",
      [&] {
        return CallTensors{input, output};
      },
      [&] {
        const char* op = "all_to_all_single";
        checkTensors(op, "input", {input});
        checkTensors(op, "output", {output});
        checkSameDevice(op, {input, output});
        checkDtype(op, "output", {output}, input.scalar_type());
        checkSplits(op, "input_split_sizes", inputSplits, input, size_);
        checkSplits(op, "output_split_sizes", outputSplits, output, size_);
        return co().alltoallBase(output, input, outputSplits, inputSplits, opts);
      });
}

WorkPtr ProcessGroupTpcomm::alltoall(std::vector<at::Tensor>& outputs,
                                     std::vector<at::Tensor>& inputs,
                                     const c10d::AllToAllOptions& opts) {
  return run(
      OpType::ALLTOALL, "all_to_all",
      [&] {
        return CallTensors{inputs, outputs};
      },
      [&] {
        checkLength("all_to_all", "input_tensor_list", inputs.size(), size_);
        checkLength("all_to_all", "output_tensor_list", outputs.size(), size_);
        checkTensors("all_to_all", "input_tensor_list", inputs);
        checkTensors("all_to_all", "output_tensor_list", outputs);
        checkSameDevice("all_to_all", concat(inputs, outputs));
        checkDtype("all_to_all", "input_tensor_list", inputs, inputs[0].scalar_type());
        checkDtype("all_to_all", "output_tensor_list", outputs, inputs[0].scalar_type());
        return co().alltoall(outputs, inputs, opts);
      });
}

WorkPtr ProcessGroupTpcomm::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  return run(
      OpType::SEND, "send",
      [&] {
        return CallTensors{tensors, {}};
      },
      [&] {
        checkSingle("send", "tensors", tensors);
        checkRank("send", "destination rank", dstRank, size_);
        return co().send(tensors, dstRank, tag);
      },
      dstRank);
}

WorkPtr ProcessGroupTpcomm::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return run(
      OpType::RECV, "recv",
      [&] {
        return CallTensors{{}, tensors};
      },
      [&] {
        checkSingle("recv", "tensors", tensors);
        checkRank("recv", "source rank", srcRank, size_);
        return co().recv(tensors, srcRank, tag);
      },
      srcRank);
}

WorkPtr ProcessGroupTpcomm::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return run(
      OpType::RECVANYSOURCE, "recv",
      [&] {
        return CallTensors{{}, tensors};
      },
      [&] {
        checkSingle("recv", "tensors", tensors);
        return co().recvAnysource(tensors, tag);
      });
}

WorkPtr ProcessGroupTpcomm::barrier(const c10d::BarrierOptions& opts) {
  return run(
      OpType::BARRIER, "barrier", [&] { return CallTensors{}; },
      [&] { return co().barrier(opts); });
}

}  // namespace tpcomm::backend
