#pragma once
// Hand-vectorised reductions for every dtype the shared-memory path reduces
// (shm_reduce.hpp dispatches to them): one kernel per instruction-set level,
// each accumulating in vector registers, source after source in rank order,
// and rounding once, so that its bits are those of the portable loop in
// shm_reduce.cpp (a float16 NaN is stored as sign | 0x7e00, a bfloat16 NaN
// as 0x7fc0, as the portable conversions do; which NaN's sign or payload
// survives a SUM or PRODUCT of two NaNs is the instruction operand order's,
// which the compiler may swap, so ranks agree on one level at set-up).
// Internal to message_queue/.

#include <cstddef>
#include <cstdint>

#include "message_queue/collectives/shm_reduce.hpp"

namespace tpcomm::mq::vec {

// Elements of out[0, return value) reduced as reduceInto would; the caller
// reduces the rest (fewer than the kernel's block) with the portable loop.
// Returns 0 for a dtype or reduction the level has no kernel for. `divisor`
// as in ReduceSpec (SUM only); `out` may be one of the sources. Where `copy`
// is not null, the same elements go there too (it may be a source as well,
// at the same place as `out` in it).
using Kernel = size_t (*)(void* out, void* copy, const void* const* srcs, int n, size_t count,
                          DType dtype, ReduceKind kind, int divisor);

size_t reduceAvx2(void* out, void* copy, const void* const* srcs, int n, size_t count,
                  DType dtype, ReduceKind kind, int divisor);
size_t reduceAvx512(void* out, void* copy, const void* const* srcs, int n, size_t count,
                    DType dtype, ReduceKind kind, int divisor);

}  // namespace tpcomm::mq::vec
