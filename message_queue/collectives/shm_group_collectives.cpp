// The shared-memory collectives' data movement (shm_group.hpp): each call
// copies its chunks into this rank's slots, steps (shm_group.cpp) and
// reduces or copies out of every rank's slots, splitting large chunks among
// the worker threads.
#include <algorithm>
#include <cstring>

#include "common/error.hpp"
#include "message_queue/collectives/shm_group.hpp"
#include "message_queue/collectives/shm_group_internal.hpp"

namespace tpcomm::mq {

const void* const* ShmGroup::sourcesAt(uint64_t chunk, size_t byteOffset, const void* own) const {
  thread_local std::vector<const void*> sources;  // one per thread: parts run at once
  sources.resize(options_.size);
  for (int r = 0; r < options_.size; ++r) sources[r] = slot(r, chunk) + byteOffset;
  if (own != nullptr) sources[options_.rank] = own;
  return sources.data();
}

size_t ShmGroup::partsFor(size_t bytes) const {
  if (!pool_) return 1;
  return std::clamp<size_t>(bytes / kSplitBytes, 1, static_cast<size_t>(pool_->threads()));
}

template <typename Fn>
void ShmGroup::split(size_t count, size_t esize, size_t parts, const Fn& fn) {
  if (count == 0) return;
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
  beginCall(std::min(chunkRows, rows) * rowBytes);
  const bool twoPhase = n > 1 && rows * rowBytes >= options_.twoPhaseMinBytes;
  ReduceSpec sum;
  for (size_t first = 0; first < rows; first += chunkRows) {
    const size_t m = std::min(chunkRows, rows - first);
    const uint64_t k = chunks_++;
    std::memcpy(slot(me, k), static_cast<const char*>(in) + first * rowBytes, m * rowBytes);
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
    // slot; after the second step every rank finishes every row from its
    // owner's sums with its own residual.
    const size_t per = (m + n - 1) / n;
    const size_t from = std::min(m, per * me);
    const size_t to = std::min(m, from + per);
    reduceIntoWith(isa, slot(me, k) + from * rowBytes, sourcesAt(k, from * rowBytes), n,
                   (to - from) * norm.hidden, dtype, sum);
    step(sig);
    for (int r = 0; r < n; ++r) {
      const size_t a = std::min(m, per * r);
      const size_t b = std::min(m, a + per);
      if (b == a) continue;
      const void* owner = slot(r, k) + a * rowBytes;
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
  const Signature sig(static_cast<int>(Op::kAllreduce), static_cast<int>(dtype),
                      reductionCode(spec), 0, count, Signature::ofPart(part));
  const int n = options_.size;
  const size_t esize = dtypeBytes(dtype);
  if (count == 0) return step(sig);
  beginCall(std::min<size_t>(options_.bufferBytes, count * esize));
  if (n > 1 && count * esize >= options_.twoPhaseMinBytes) {
    return allreducePipelined(static_cast<const char*>(in), static_cast<char*>(out), count, dtype,
                              spec, sig);
  }
  // Small: every rank reduces the whole chunk from every rank's slot.
  const ReduceIsa isa = reduceIsa_.load(std::memory_order_relaxed);
  const int me = options_.rank;
  const size_t chunkElements = options_.bufferBytes / esize;
  ReduceSpec reduce = spec;
  reduce.premultiply = false;  // applied while copying in
  for (size_t offset = 0; offset < count; offset += chunkElements) {
    const size_t m = std::min(chunkElements, count - offset);
    const uint64_t k = chunks_++;
    const size_t parts = partsFor(m * esize);
    const char* src = static_cast<const char*>(in) + offset * esize;
    split(m, esize, parts, [&](size_t a, size_t b) {
      copyScaled(slot(me, k) + a * esize, src + a * esize, b - a, dtype, spec);
    });
    step(sig);
    char* dst = static_cast<char*>(out) + offset * esize;
    split(m, esize, parts, [&](size_t a, size_t b) {
      reduceIntoWith(isa, dst + a * esize, sourcesAt(k, a * esize), n, b - a, dtype, reduce);
    });
  }
}

void ShmGroup::allreducePipelined(const char* in, char* out, size_t count, DType dtype,
                                  const ReduceSpec& spec, const Signature& sig) {
  const ReduceIsa isa = reduceIsa_.load(std::memory_order_relaxed);
  const int n = options_.size;
  const int me = options_.rank;
  const size_t esize = dtypeBytes(dtype);
  const size_t chunkElements = options_.bufferBytes / esize;
  const size_t chunks = (count + chunkElements - 1) / chunkElements;
  const uint64_t first = chunks_;
  // One slice size for every chunk of the call, the last (shorter) one
  // included, so that a rank's own slice is the same part of every slot:
  // the part its copy-in skips is then exactly the part its peers read
  // there in the same phase.
  const size_t slice = sliceElements(std::min(chunkElements, count), n, esize);
  // This rank's own slice of a chunk never enters its slot (peers still
  // read that part of the slot, the reduced slice of the chunk before the
  // last, while this rank copies in: shm_group.hpp): it is reduced from the
  // input, or, for PREMUL_SUM, from its scaled copy in the output (which
  // the reduction then overwrites with the reduced slice).
  const bool scaled = spec.premultiply;
  ReduceSpec reduce = spec;
  reduce.premultiply = false;
  struct Chunk {
    size_t offset, m, from, to, parts;
    uint64_t k;
  };
  const auto chunk = [&](size_t j) {
    Chunk c;
    c.offset = j * chunkElements;
    c.m = std::min(chunkElements, count - c.offset);
    c.from = std::min(c.m, slice * me);
    c.to = std::min(c.m, c.from + slice);
    c.parts = partsFor(c.m * esize);
    c.k = first + j;
    return c;
  };
  // PREMUL_SUM: this rank's own slice of chunk j, scaled, into the output.
  const auto scaleOwn = [&](const Chunk& c, size_t a, size_t b) {
    const size_t lo = std::max(a, c.from), hi = std::min(b, c.to);
    if (hi > lo) {
      copyScaled(out + (c.offset + lo) * esize, in + (c.offset + lo) * esize, hi - lo, dtype, spec);
    }
  };
  // fn(lo, hi) over the peers' part of chunk j ([0, from) and [to, m): what
  // this rank copies in and out), split among the chunk's parts so that
  // every thread gets an equal share of it.
  const auto splitPeers = [&](const Chunk& c, const auto& fn) {
    const size_t own = c.to - c.from;
    split(c.m - own, esize, c.parts, [&](size_t a, size_t b) {
      if (a < c.from) fn(a, std::min(b, c.from));
      if (b > c.from) fn(std::max(a, c.from) + own, b + own);
    });
  };
  // This rank's slot of chunk j: every element a peer reads (all but its
  // own slice), and with `own` (PREMUL_SUM) its scaled own slice into the
  // output. The first chunk's goes there only after the first step, where
  // disagreeing calls raise: a refused in-place call leaves its input as
  // it was.
  const auto copyIn = [&](const Chunk& c, bool own) {
    const char* src = in + c.offset * esize;
    char* dst = slot(me, c.k);
    const auto copy = [&](size_t lo, size_t hi) {
      if (hi > lo) copyScaled(dst + lo * esize, src + lo * esize, hi - lo, dtype, spec);
    };
    if (!own) return splitPeers(c, copy);
    split(c.m, esize, c.parts, [&](size_t a, size_t b) {
      copy(a, std::min(b, c.from));
      copy(std::max(a, c.to), b);
      scaleOwn(c, a, b);
    });
  };
  // This rank's slice of chunk j, reduced from every rank's slot (its own
  // input, or its scaled copy, in its place) into its own slot for the
  // peers and, from the same registers, into the output (where its input
  // or scaled copy was: every element is read before it is written).
  const auto reduceSlice = [&](const Chunk& c) {
    split(c.to - c.from, esize, c.parts, [&](size_t a, size_t b) {
      const size_t at = (c.from + a) * esize;
      const void* own = (scaled ? out : in) + c.offset * esize + at;
      reduceIntoWith(isa, slot(me, c.k) + at, sourcesAt(c.k, at, own), n, b - a, dtype, reduce,
                     out + c.offset * esize + at);
    });
  };
  // The peers' reduced slices of chunk j into the output (this rank's own
  // is there since its reduction).
  const auto copyOut = [&](const Chunk& c) {
    char* dst = out + c.offset * esize;
    splitPeers(c, [&](size_t a, size_t b) {
      for (int r = 0; r < n; ++r) {  // the part of [a, b) that rank r owns
        if (r == me) continue;
        const size_t lo = std::max(a, std::min(c.m, slice * r));
        const size_t hi = std::min(b, std::min(c.m, slice * r + slice));
        if (hi > lo) std::memcpy(dst + lo * esize, slot(r, c.k) + lo * esize, (hi - lo) * esize);
      }
    });
  };
  // chunks_ counts a chunk once its slot is written; a step that throws on
  // disagreeing calls (the first) sets it itself.
  copyIn(chunk(0), false);
  chunks_ = first + 1;
  step(sig);
  if (scaled) {
    const Chunk c = chunk(0);
    split(c.m, esize, c.parts, [&](size_t a, size_t b) { scaleOwn(c, a, b); });
  }
  for (size_t j = 1; j <= chunks; ++j) {
    if (j >= 2) copyOut(chunk(j - 2));
    reduceSlice(chunk(j - 1));
    if (j < chunks) {
      copyIn(chunk(j), scaled);
      chunks_ = first + j + 1;
    }
    step(sig);
  }
  copyOut(chunk(chunks - 1));
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
  beginCall(std::min(chunk, bytes));
  for (size_t offset = 0; offset < bytes; offset += chunk) {
    const size_t m = std::min(chunk, bytes - offset);
    const uint64_t k = chunks_++;
    const size_t parts = partsFor(m);
    const char* src = static_cast<const char*>(in) + offset;
    split(m, 1, parts,
          [&](size_t a, size_t b) { std::memcpy(slot(options_.rank, k) + a, src + a, b - a); });
    step(sig);
    split(m, 1, parts, [&](size_t a, size_t b) {
      for (int r = 0; r < options_.size; ++r) {
        // An in-place call's own part is in place already.
        if (r == options_.rank && outs[r] == in) continue;
        std::memcpy(static_cast<char*>(outs[r]) + offset + a, slot(r, k) + a, b - a);
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
  // Each slot holds one piece per destination rank, whole cache lines each
  // where the buffer allows.
  const size_t perLine = kLine / esize;
  size_t piece = options_.bufferBytes / n / esize;
  if (piece >= perLine) piece = piece / perLine * perLine;
  TPCOMM_CHECK(piece >= 1, kInvalidUsage, "shared-memory buffer of ", options_.bufferBytes,
               " bytes is too small for a reduce-scatter of ", dtypeName(dtype), " over ", n,
               " ranks");
  // A call smaller than a piece gets pieces of its size (whole lines), so
  // that its chunk moves on through the slot as the other calls' do.
  piece = std::min(piece, alignUp(count, perLine));
  ReduceSpec reduce = spec;
  reduce.premultiply = false;
  beginCall(n * piece * esize);
  const size_t mine = options_.rank * piece * esize;  // this rank's piece in every slot
  for (size_t offset = 0; offset < count; offset += piece) {
    const size_t m = std::min(piece, count - offset);
    const uint64_t k = chunks_++;
    const size_t parts = partsFor(n * m * esize);
    split(m, esize, parts, [&](size_t a, size_t b) {
      for (int r = 0; r < n; ++r) {
        copyScaled(slot(options_.rank, k) + (r * piece + a) * esize,
                   static_cast<const char*>(ins[r]) + (offset + a) * esize, b - a, dtype, spec);
      }
    });
    step(sig);
    split(m, esize, parts, [&](size_t a, size_t b) {
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
  beginCall(std::min(chunk, bytes));
  for (size_t offset = 0; offset < bytes; offset += chunk) {
    const size_t m = std::min(chunk, bytes - offset);
    const uint64_t k = chunks_++;
    char* mine = static_cast<char*>(data) + offset;
    const size_t parts = partsFor(m);
    if (options_.rank == root) {
      split(m, 1, parts,
            [&](size_t a, size_t b) { std::memcpy(slot(root, k) + a, mine + a, b - a); });
    }
    step(sig);
    if (options_.rank != root) {
      split(m, 1, parts,
            [&](size_t a, size_t b) { std::memcpy(mine + a, slot(root, k) + a, b - a); });
    }
  }
}

}  // namespace tpcomm::mq
