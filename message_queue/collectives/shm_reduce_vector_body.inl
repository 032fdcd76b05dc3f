// The body of one instruction-set level's kernels (shm_reduce_vector.hpp),
// included by shm_reduce_vector.cpp once per level, inside that level's
// `#pragma GCC target` region and namespace, after it defined the vector
// traits VF (float), VD (double), VI32 and VI64: each a Vec of kWidth
// lanes, its Scalar, loads, stores and arithmetic, and whether the level
// can divide (kDivide), multiply (kProduct) and take minima (kMinMax).
// Not a header of its own: it has no include guard on purpose.

// A dtype's unit: kElements elements held as kVectors vectors of its
// accumulator (A: VF for float32 and the 16-bit types, VD for float64, VI32
// and VI64 for the integers). A bfloat16 unit is a whole register of
// bfloat16 pairs, split into the even and the odd elements (shifts and
// masks, no cross-lane shuffles); the reduction is element-wise, so the
// order inside a unit does not matter.
template <DType D>
struct Io;
template <>
struct Io<DType::kFloat32> {
  using T = float;
  using A = VF;
  static constexpr size_t kElements = A::kWidth;
  static constexpr int kVectors = 1;
  static void load(const T* p, A::Vec* v) { v[0] = A::load(p); }
  static void store(T* p, const A::Vec* v) { A::store(p, v[0]); }
};
template <>
struct Io<DType::kBFloat16> {
  using T = uint16_t;
  using A = VF;
  static constexpr size_t kElements = 2 * A::kWidth;
  static constexpr int kVectors = 2;
  static void load(const T* p, A::Vec* v) { A::loadBF16Pairs(p, v[0], v[1]); }
  static void store(T* p, const A::Vec* v) { A::storeBF16Pairs(p, v[0], v[1]); }
};
template <>
struct Io<DType::kFloat16> {
  using T = uint16_t;
  using A = VF;
  static constexpr size_t kElements = A::kWidth;
  static constexpr int kVectors = 1;
  static void load(const T* p, A::Vec* v) { v[0] = A::loadFP16(p); }
  static void store(T* p, const A::Vec* v) { A::storeFP16(p, v[0]); }
};
template <typename Arith, typename Scalar>
struct Plain {  // a dtype whose vectors hold its elements as they are
  using T = Scalar;
  using A = Arith;
  static constexpr size_t kElements = A::kWidth;
  static constexpr int kVectors = 1;
  static void load(const T* p, typename A::Vec* v) { v[0] = A::load(p); }
  static void store(T* p, const typename A::Vec* v) { A::store(p, v[0]); }
};
template <>
struct Io<DType::kFloat64> : Plain<VD, double> {};
template <>
struct Io<DType::kInt32> : Plain<VI32, int32_t> {};
template <>
struct Io<DType::kInt64> : Plain<VI64, int64_t> {};

// acc = acc (op) next, as the portable loop's Sum, Product, Min and Max
// (MIN and MAX propagate a NaN from any rank; integers wrap).
template <typename A>
struct Sum {
  static typename A::Vec apply(typename A::Vec acc, typename A::Vec next) {
    return A::add(acc, next);
  }
};
template <typename A>
struct Product {
  static typename A::Vec apply(typename A::Vec acc, typename A::Vec next) {
    return A::mul(acc, next);
  }
};
template <typename A>
struct Min {
  static typename A::Vec apply(typename A::Vec acc, typename A::Vec next) {
    return A::keepNaN(next, A::minFirst(next, acc));
  }
};
template <typename A>
struct Max {
  static typename A::Vec apply(typename A::Vec acc, typename A::Vec next) {
    return A::keepNaN(next, A::maxFirst(next, acc));
  }
};

// kUnroll units per step, then one unit at a time: every source of a block
// is read before the block is stored, so `out` and `copy` may be sources.
// A block goes to `copy` too unless it is null.
template <DType D, template <typename> class Op, bool kDivide, int kUnroll>
size_t runBlocks(typename Io<D>::T* out, typename Io<D>::T* copy, const void* const* srcs, int n,
                 size_t i, size_t count, typename Io<D>::A::Vec divisor) {
  using T = typename Io<D>::T;
  using A = typename Io<D>::A;
  using Vec = typename A::Vec;
  constexpr size_t kStep = kUnroll * Io<D>::kElements;
  constexpr int kV = kUnroll * Io<D>::kVectors;
  for (; i + kStep <= count; i += kStep) {
    Vec acc[kV];
    Vec next[kV];
    for (int u = 0; u < kUnroll; ++u) {
      Io<D>::load(static_cast<const T*>(srcs[0]) + i + u * Io<D>::kElements,
                  acc + u * Io<D>::kVectors);
    }
    for (int j = 1; j < n; ++j) {
      const T* src = static_cast<const T*>(srcs[j]) + i;
      for (int u = 0; u < kUnroll; ++u) {
        Io<D>::load(src + u * Io<D>::kElements, next + u * Io<D>::kVectors);
      }
      for (int v = 0; v < kV; ++v) acc[v] = Op<A>::apply(acc[v], next[v]);
    }
    if constexpr (kDivide) {
      for (int v = 0; v < kV; ++v) acc[v] = A::div(acc[v], divisor);
    }
    for (int u = 0; u < kUnroll; ++u) {
      Io<D>::store(out + i + u * Io<D>::kElements, acc + u * Io<D>::kVectors);
    }
    if (copy != nullptr) {
      for (int u = 0; u < kUnroll; ++u) {
        Io<D>::store(copy + i + u * Io<D>::kElements, acc + u * Io<D>::kVectors);
      }
    }
  }
  return i;
}

template <DType D, template <typename> class Op, bool kDivide>
size_t run(void* out, void* copy, const void* const* srcs, int n, size_t count, int divisor) {
  using T = typename Io<D>::T;
  using A = typename Io<D>::A;
  typename A::Vec d{};
  if constexpr (kDivide) d = A::set1(static_cast<typename A::Scalar>(divisor));
  T* dst = static_cast<T*>(out);
  T* also = static_cast<T*>(copy);
  const size_t i =
      runBlocks<D, Op, kDivide, 4 / Io<D>::kVectors>(dst, also, srcs, n, 0, count, d);
  return runBlocks<D, Op, kDivide, 1>(dst, also, srcs, n, i, count, d);
}

// 0 (the portable loop does it all) for what the level has no instruction
// for: integer division (AVG), and per level A::kProduct / A::kMinMax.
template <DType D>
size_t byKind(void* out, void* copy, const void* const* srcs, int n, size_t count,
              ReduceKind kind, int divisor) {
  using A = typename Io<D>::A;
  switch (kind) {
    case ReduceKind::kSum:
      if (divisor == 1) return run<D, Sum, false>(out, copy, srcs, n, count, 1);
      if constexpr (A::kDivide) return run<D, Sum, true>(out, copy, srcs, n, count, divisor);
      return 0;
    case ReduceKind::kProduct:
      if constexpr (A::kProduct) return run<D, Product, false>(out, copy, srcs, n, count, 1);
      return 0;
    case ReduceKind::kMin:
      if constexpr (A::kMinMax) return run<D, Min, false>(out, copy, srcs, n, count, 1);
      return 0;
    case ReduceKind::kMax:
      if constexpr (A::kMinMax) return run<D, Max, false>(out, copy, srcs, n, count, 1);
      return 0;
  }
  return 0;
}

size_t reduce(void* out, void* copy, const void* const* srcs, int n, size_t count, DType dtype,
              ReduceKind kind, int divisor) {
  switch (dtype) {
    case DType::kFloat32:
      return byKind<DType::kFloat32>(out, copy, srcs, n, count, kind, divisor);
    case DType::kBFloat16:
      return byKind<DType::kBFloat16>(out, copy, srcs, n, count, kind, divisor);
    case DType::kFloat16:
      return byKind<DType::kFloat16>(out, copy, srcs, n, count, kind, divisor);
    case DType::kFloat64:
      return byKind<DType::kFloat64>(out, copy, srcs, n, count, kind, divisor);
    case DType::kInt32:
      return byKind<DType::kInt32>(out, copy, srcs, n, count, kind, divisor);
    case DType::kInt64:
      return byKind<DType::kInt64>(out, copy, srcs, n, count, kind, divisor);
  }
  return 0;
}
