// The shared-memory collectives' data movement (shm_group.hpp): each call
// copies its chunks into this rank's halves, steps (shm_group.cpp) and
// reduces or copies out of every rank's halves, splitting large chunks among
// the worker threads.
#include <algorithm>
#include <cstring>

#include "coordinator/common/error.hpp"
#include "message_queue/collectives/shm_group.hpp"
#include "message_queue/collectives/shm_group_internal.hpp"

namespace tpcomm::mq {

const void* const* ShmGroup::sourcesAt(uint64_t chunk, size_t byteOffset) const {
  thread_local std::vector<const void*> sources;  // one per thread: parts run at once
  sources.resize(options_.size);
  for (int r = 0; r < options_.size; ++r) sources[r] = half(r, chunk) + byteOffset;
  return sources.data();
}

template <typename Fn>
void ShmGroup::split(size_t count, size_t esize, size_t moved, const Fn& fn) {
  const size_t bytes = count * moved;
  const size_t parts =
      pool_ ? std::min<size_t>(pool_->threads(), bytes / kSplitMinBytes) : size_t{1};
  if (parts <= 1) return fn(0, count);
  const size_t perLine = std::max<size_t>(1, kLine / esize);
  const size_t each = alignUp((count + parts - 1) / parts, perLine);
  pool_->run(parts, [&](size_t p) {
    const size_t a = std::min(count, p * each);
    const size_t b = std::min(count, a + each);
    if (b > a) fn(a, b);
  });
}

void ShmGroup::barrier() {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  step(Signature(static_cast<int>(Op::kBarrier), 0, 0, 0, 0));
}

void ShmGroup::allreduceAddRmsNorm(const void* in, size_t rows, DType dtype, const NormRows& norm) {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  const ReduceIsa isa = reduceIsa_.load(std::memory_order_relaxed);
  const size_t esize = dtypeBytes(dtype);
  const size_t rowBytes = norm.hidden * esize;
  // The hidden size travels as the signature's root: ranks that disagree on
  // it (same count, other rows) are named too.
  const Signature sig(static_cast<int>(Op::kAllreduceAddRmsNorm), static_cast<int>(dtype), 0,
                      static_cast<int>(norm.hidden), rows * norm.hidden,
                      Signature::ofEps(norm.eps));
  TPCOMM_CHECK(rowBytes <= options_.bufferBytes, kInvalidUsage, "allreduce_add_rms_norm: a row of ",
               rowBytes, " bytes exceeds the shared-memory chunk of ", options_.bufferBytes);
  if (rows == 0) return step(sig);
  const int n = options_.size;
  const int me = options_.rank;
  const size_t chunkRows = options_.bufferBytes / rowBytes;
  const bool twoPhase = n > 1 && rows * rowBytes >= options_.twoPhaseMinBytes;
  ReduceSpec sum;
  for (size_t first = 0; first < rows; first += chunkRows) {
    const size_t m = std::min(chunkRows, rows - first);
    const uint64_t k = chunks_++;
    std::memcpy(half(me, k), static_cast<const char*>(in) + first * rowBytes, m * rowBytes);
    step(sig);
    NormRows at = norm;
    auto rowsFrom = [&](size_t row) {
      const size_t offset = (first + row) * rowBytes;
      at.residual = static_cast<const char*>(norm.residual) + offset;
      at.residualOut = static_cast<char*>(norm.residualOut) + offset;
      at.normed = static_cast<char*>(norm.normed) + offset;
    };
    if (!twoPhase) {
      rowsFrom(0);
      reduceAddRmsNorm(sourcesAt(k, 0), n, m, dtype, at);
      continue;
    }
    // Rank r sums rows [per x r, per x (r + 1)) of the chunk into its own
    // half; after the second step every rank finishes every row from its
    // owner's sums with its own residual.
    const size_t per = (m + n - 1) / n;
    const size_t from = std::min(m, per * me);
    const size_t to = std::min(m, from + per);
    reduceIntoWith(isa, half(me, k) + from * rowBytes, sourcesAt(k, from * rowBytes), n,
                   (to - from) * norm.hidden, dtype, sum);
    step(sig);
    for (int r = 0; r < n; ++r) {
      const size_t a = std::min(m, per * r);
      const size_t b = std::min(m, a + per);
      if (b == a) continue;
      const void* owner = half(r, k) + a * rowBytes;
      rowsFrom(a);
      reduceAddRmsNorm(&owner, 1, b - a, dtype, at);
    }
  }
}

void ShmGroup::allreduce(const void* in, void* out, size_t count, DType dtype,
                         const ReduceSpec& spec, const ShmPart& part) {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  const ReduceIsa isa = reduceIsa_.load(std::memory_order_relaxed);
  const Signature sig(static_cast<int>(Op::kAllreduce), static_cast<int>(dtype),
                      reductionCode(spec), 0, count, Signature::ofPart(part));
  const int n = options_.size;
  const int me = options_.rank;
  const size_t esize = dtypeBytes(dtype);
  if (count == 0) return step(sig);
  const bool twoPhase = n > 1 && count * esize >= options_.twoPhaseMinBytes;
  const size_t chunkElements = options_.bufferBytes / esize;
  ReduceSpec reduce = spec;
  reduce.premultiply = false;  // applied while copying in
  for (size_t offset = 0; offset < count; offset += chunkElements) {
    const size_t m = std::min(chunkElements, count - offset);
    const uint64_t k = chunks_++;
    const char* src = static_cast<const char*>(in) + offset * esize;
    split(m, esize, 2 * esize, [&](size_t a, size_t b) {
      copyScaled(half(me, k) + a * esize, src + a * esize, b - a, dtype, spec);
    });
    step(sig);
    char* dst = static_cast<char*>(out) + offset * esize;
    if (!twoPhase) {
      split(m, esize, (n + 1) * esize, [&](size_t a, size_t b) {
        reduceIntoWith(isa, dst + a * esize, sourcesAt(k, a * esize), n, b - a, dtype, reduce);
      });
      continue;
    }
    const size_t slice = sliceElements(m, n, esize);
    const size_t from = std::min(m, slice * me);
    const size_t to = std::min(m, from + slice);
    split(to - from, esize, (n + 1) * esize, [&](size_t a, size_t b) {
      reduceIntoWith(isa, half(me, k) + (from + a) * esize, sourcesAt(k, (from + a) * esize), n,
                     b - a, dtype, reduce);
    });
    step(sig);
    split(m, esize, 2 * esize, [&](size_t a, size_t b) {
      for (int r = 0; r < n; ++r) {  // the part of [a, b) that rank r owns
        const size_t lo = std::max(a, std::min(m, slice * r));
        const size_t hi = std::min(b, std::min(m, slice * r + slice));
        if (hi > lo) std::memcpy(dst + lo * esize, half(r, k) + lo * esize, (hi - lo) * esize);
      }
    });
  }
}

void ShmGroup::allgather(const void* in, size_t bytes, const std::vector<void*>& outs,
                         const ShmPart& part) {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  TPCOMM_CHECK_EQ(outs.size(), static_cast<size_t>(options_.size), "(all_gather outputs)");
  const Signature sig(static_cast<int>(Op::kAllgather), 0, 0, 0, bytes, Signature::ofPart(part));
  if (bytes == 0) return step(sig);
  const size_t chunk = options_.bufferBytes;
  for (size_t offset = 0; offset < bytes; offset += chunk) {
    const size_t m = std::min(chunk, bytes - offset);
    const uint64_t k = chunks_++;
    const char* src = static_cast<const char*>(in) + offset;
    split(m, 1, 2,
          [&](size_t a, size_t b) { std::memcpy(half(options_.rank, k) + a, src + a, b - a); });
    step(sig);
    split(m, 1, 2 * options_.size, [&](size_t a, size_t b) {
      for (int r = 0; r < options_.size; ++r) {
        // An in-place call's own part is in place already.
        if (r == options_.rank && outs[r] == in) continue;
        std::memcpy(static_cast<char*>(outs[r]) + offset + a, half(r, k) + a, b - a);
      }
    });
  }
}

void ShmGroup::reduceScatter(const std::vector<const void*>& ins, void* out, size_t count,
                             DType dtype, const ReduceSpec& spec, const ShmPart& part) {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  const ReduceIsa isa = reduceIsa_.load(std::memory_order_relaxed);
  const int n = options_.size;
  TPCOMM_CHECK_EQ(ins.size(), static_cast<size_t>(n), "(reduce_scatter inputs)");
  const Signature sig(static_cast<int>(Op::kReduceScatter), static_cast<int>(dtype),
                      reductionCode(spec), 0, count, Signature::ofPart(part));
  if (count == 0) return step(sig);
  const size_t esize = dtypeBytes(dtype);
  // Each half holds one piece per destination rank, whole cache lines each
  // where the buffer allows.
  const size_t perLine = kLine / esize;
  size_t piece = options_.bufferBytes / n / esize;
  if (piece >= perLine) piece = piece / perLine * perLine;
  TPCOMM_CHECK(piece >= 1, kInvalidUsage, "shared-memory buffer of ", options_.bufferBytes,
               " bytes is too small for a reduce-scatter of ", dtypeName(dtype), " over ", n,
               " ranks");
  ReduceSpec reduce = spec;
  reduce.premultiply = false;
  const size_t mine = options_.rank * piece * esize;  // this rank's piece in every half
  for (size_t offset = 0; offset < count; offset += piece) {
    const size_t m = std::min(piece, count - offset);
    const uint64_t k = chunks_++;
    split(m, esize, 2 * n * esize, [&](size_t a, size_t b) {
      for (int r = 0; r < n; ++r) {
        copyScaled(half(options_.rank, k) + (r * piece + a) * esize,
                   static_cast<const char*>(ins[r]) + (offset + a) * esize, b - a, dtype, spec);
      }
    });
    step(sig);
    split(m, esize, (n + 1) * esize, [&](size_t a, size_t b) {
      reduceIntoWith(isa, static_cast<char*>(out) + (offset + a) * esize,
                     sourcesAt(k, mine + a * esize), n, b - a, dtype, reduce);
    });
  }
}

void ShmGroup::broadcast(void* data, size_t bytes, int root) {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  TPCOMM_CHECK(root >= 0 && root < options_.size, kInvalidUsage, "broadcast root ", root,
               " outside a group of ", options_.size);
  const Signature sig(static_cast<int>(Op::kBroadcast), 0, 0, root, bytes);
  if (bytes == 0) return step(sig);
  const size_t chunk = options_.bufferBytes;
  for (size_t offset = 0; offset < bytes; offset += chunk) {
    const size_t m = std::min(chunk, bytes - offset);
    const uint64_t k = chunks_++;
    char* mine = static_cast<char*>(data) + offset;
    if (options_.rank == root) {
      split(m, 1, 2, [&](size_t a, size_t b) { std::memcpy(half(root, k) + a, mine + a, b - a); });
    }
    step(sig);
    if (options_.rank != root) {
      split(m, 1, 2, [&](size_t a, size_t b) { std::memcpy(mine + a, half(root, k) + a, b - a); });
    }
  }
}

}  // namespace tpcomm::mq
