// The body of one instruction-set level's kernels (shm_reduce_vector.hpp),
// included by shm_reduce_vector.cpp once per level, inside that level's
// `#pragma GCC target` region and namespace, after it defined `V`: the
// vector type F of kWidth floats and its loads, stores and arithmetic.
// Not a header of its own: it has no include guard on purpose.

// A dtype's unit: kElements elements held as kVectors float vectors. A
// bfloat16 unit is a whole register of bfloat16 pairs, split into the even
// and the odd elements (shifts and masks, no cross-lane shuffles); the
// reduction is element-wise, so the order inside a unit does not matter.
template <DType D>
struct Io;
template <>
struct Io<DType::kFloat32> {
  using T = float;
  static constexpr size_t kElements = V::kWidth;
  static constexpr int kVectors = 1;
  static void load(const T* p, F* v) { v[0] = V::loadF32(p); }
  static void store(T* p, const F* v) { V::storeF32(p, v[0]); }
};
template <>
struct Io<DType::kBFloat16> {
  using T = uint16_t;
  static constexpr size_t kElements = 2 * V::kWidth;
  static constexpr int kVectors = 2;
  static void load(const T* p, F* v) { V::loadBF16Pairs(p, v[0], v[1]); }
  static void store(T* p, const F* v) { V::storeBF16Pairs(p, v[0], v[1]); }
};
template <>
struct Io<DType::kFloat16> {
  using T = uint16_t;
  static constexpr size_t kElements = V::kWidth;
  static constexpr int kVectors = 1;
  static void load(const T* p, F* v) { v[0] = V::loadFP16(p); }
  static void store(T* p, const F* v) { V::storeFP16(p, v[0]); }
};

// acc = acc (op) next, as the portable loop's Sum, Product, Min and Max
// (MIN and MAX propagate a NaN from any rank).
struct Sum {
  static F apply(F acc, F next) { return V::add(acc, next); }
};
struct Product {
  static F apply(F acc, F next) { return V::mul(acc, next); }
};
struct Min {
  static F apply(F acc, F next) { return V::keepNaN(next, V::minFirst(next, acc)); }
};
struct Max {
  static F apply(F acc, F next) { return V::keepNaN(next, V::maxFirst(next, acc)); }
};

// kUnroll units per step, then one unit at a time: every source of a block
// is read before the block is stored, so `out` may be one of the sources.
template <DType D, typename Op, bool kDivide, int kUnroll>
size_t runBlocks(typename Io<D>::T* out, const void* const* srcs, int n, size_t i, size_t count,
                 F divisor) {
  using T = typename Io<D>::T;
  constexpr size_t kStep = kUnroll * Io<D>::kElements;
  constexpr int kV = kUnroll * Io<D>::kVectors;
  for (; i + kStep <= count; i += kStep) {
    F acc[kV];
    F next[kV];
    for (int u = 0; u < kUnroll; ++u) {
      Io<D>::load(static_cast<const T*>(srcs[0]) + i + u * Io<D>::kElements,
                  acc + u * Io<D>::kVectors);
    }
    for (int j = 1; j < n; ++j) {
      const T* src = static_cast<const T*>(srcs[j]) + i;
      for (int u = 0; u < kUnroll; ++u) {
        Io<D>::load(src + u * Io<D>::kElements, next + u * Io<D>::kVectors);
      }
      for (int v = 0; v < kV; ++v) acc[v] = Op::apply(acc[v], next[v]);
    }
    if (kDivide) {
      for (int v = 0; v < kV; ++v) acc[v] = V::div(acc[v], divisor);
    }
    for (int u = 0; u < kUnroll; ++u) {
      Io<D>::store(out + i + u * Io<D>::kElements, acc + u * Io<D>::kVectors);
    }
  }
  return i;
}

template <DType D, typename Op, bool kDivide>
size_t run(void* out, const void* const* srcs, int n, size_t count, float divisor) {
  using T = typename Io<D>::T;
  const F d = V::set1(divisor);
  T* dst = static_cast<T*>(out);
  const size_t i = runBlocks<D, Op, kDivide, 4 / Io<D>::kVectors>(dst, srcs, n, 0, count, d);
  return runBlocks<D, Op, kDivide, 1>(dst, srcs, n, i, count, d);
}

template <DType D>
size_t byKind(void* out, const void* const* srcs, int n, size_t count, ReduceKind kind,
              int divisor) {
  switch (kind) {
    case ReduceKind::kSum:
      return divisor != 1 ? run<D, Sum, true>(out, srcs, n, count, static_cast<float>(divisor))
                          : run<D, Sum, false>(out, srcs, n, count, 1.0f);
    case ReduceKind::kProduct:
      return run<D, Product, false>(out, srcs, n, count, 1.0f);
    case ReduceKind::kMin:
      return run<D, Min, false>(out, srcs, n, count, 1.0f);
    case ReduceKind::kMax:
      return run<D, Max, false>(out, srcs, n, count, 1.0f);
  }
  return 0;
}

size_t reduce(void* out, const void* const* srcs, int n, size_t count, DType dtype,
              ReduceKind kind, int divisor) {
  switch (dtype) {
    case DType::kFloat32:
      return byKind<DType::kFloat32>(out, srcs, n, count, kind, divisor);
    case DType::kBFloat16:
      return byKind<DType::kBFloat16>(out, srcs, n, count, kind, divisor);
    case DType::kFloat16:
      return byKind<DType::kFloat16>(out, srcs, n, count, kind, divisor);
    default:
      return 0;
  }
}
