// CSR sparse x dense product for the CPU (XLA FFI): y[r, :] = sum_e data[e] * x[indices[e], :] over row r's entries.
//
// The GA of a GCN/GraphSAGE layer on a large graph reads one row of x per nonzero, at random. jaxlib's own CPU kernel
// (Eigen) waits on each of those reads in turn once x no longer fits in the last-level cache, so the cost per edge
// grows with the graph. This kernel prefetches the rows `kAhead` nonzeros ahead, so the misses overlap; each row of
// the result is summed in entry order (two interleaved partial sums for narrow rows, then added), the same order at
// any thread count, so results are deterministic. Rows are split into contiguous chunks of equal nonzeros, one per
// thread of XLA's intra-op pool.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kAhead = 256;           // nonzeros prefetched ahead (measured: 128-256 best up to 2^22 vertices)
constexpr int64_t kMinTaskNnzF = 1 << 18;  // entries x features below which one thread does the product

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void prefetch_row(const float* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + off, 0, 3);
}

// Rows [r0, r1) for a width that is a multiple of 8, NC = width / 8 <= 8 chunks held in registers.
template <int NC>
void rows_vec(const float* data, const int32_t* idx, const int32_t* ptr, const float* x, float* y, int64_t r0,
              int64_t r1, int64_t nnz) {
  constexpr int64_t F = 8 * NC;
  for (int64_t r = r0; r < r1; ++r) {
    v8 a[NC], b[NC];
    for (int c = 0; c < NC; ++c) a[c] = b[c] = v8{};
    int64_t e = ptr[r];
    const int64_t end = ptr[r + 1];
    for (; e + 1 < end; e += 2) {
      if (e + kAhead + 1 < nnz) {
        prefetch_row(x + int64_t(idx[e + kAhead]) * F, F * 4);
        prefetch_row(x + int64_t(idx[e + kAhead + 1]) * F, F * 4);
      }
      const float* x0 = x + int64_t(idx[e]) * F;
      const float* x1 = x + int64_t(idx[e + 1]) * F;
      const v8 w0 = v8{} + data[e], w1 = v8{} + data[e + 1];
      for (int c = 0; c < NC; ++c) {
        a[c] += w0 * load8(x0 + 8 * c);
        b[c] += w1 * load8(x1 + 8 * c);
      }
    }
    if (e < end) {
      const float* x0 = x + int64_t(idx[e]) * F;
      const v8 w0 = v8{} + data[e];
      for (int c = 0; c < NC; ++c) a[c] += w0 * load8(x0 + 8 * c);
    }
    for (int c = 0; c < NC; ++c) {
      const v8 s = a[c] + b[c];
      std::memcpy(y + r * F + 8 * c, &s, sizeof(s));
    }
  }
}

// Any width: the same order of sums (two partial sums per column, then added), one column at a time.
void rows_any(const float* data, const int32_t* idx, const int32_t* ptr, const float* x, float* y, int64_t f,
              int64_t r0, int64_t r1, int64_t nnz) {
  for (int64_t r = r0; r < r1; ++r) {
    float* out = y + r * f;
    const int64_t start = ptr[r], end = ptr[r + 1];
    for (int64_t j = 0; j < f; ++j) out[j] = 0.0f;
    for (int64_t j0 = 0; j0 < f; j0 += 8) {
      const int64_t j1 = std::min(f, j0 + 8);
      float a[8] = {0}, b[8] = {0};
      int64_t e = start;
      for (; e + 1 < end; e += 2) {
        if (j0 == 0 && e + kAhead + 1 < nnz) {
          prefetch_row(x + int64_t(idx[e + kAhead]) * f, f * 4);
          prefetch_row(x + int64_t(idx[e + kAhead + 1]) * f, f * 4);
        }
        const float* x0 = x + int64_t(idx[e]) * f;
        const float* x1 = x + int64_t(idx[e + 1]) * f;
        for (int64_t j = j0; j < j1; ++j) {
          a[j - j0] += data[e] * x0[j];
          b[j - j0] += data[e + 1] * x1[j];
        }
      }
      if (e < end) {
        const float* x0 = x + int64_t(idx[e]) * f;
        for (int64_t j = j0; j < j1; ++j) a[j - j0] += data[e] * x0[j];
      }
      for (int64_t j = j0; j < j1; ++j) out[j] = a[j - j0] + b[j - j0];
    }
  }
}

void run_rows(const float* data, const int32_t* idx, const int32_t* ptr, const float* x, float* y, int64_t f,
              int64_t r0, int64_t r1, int64_t nnz) {
  switch (f % 8 == 0 ? f / 8 : 0) {
    case 1: return rows_vec<1>(data, idx, ptr, x, y, r0, r1, nnz);
    case 2: return rows_vec<2>(data, idx, ptr, x, y, r0, r1, nnz);
    case 3: return rows_vec<3>(data, idx, ptr, x, y, r0, r1, nnz);
    case 4: return rows_vec<4>(data, idx, ptr, x, y, r0, r1, nnz);
    case 5: return rows_vec<5>(data, idx, ptr, x, y, r0, r1, nnz);
    case 6: return rows_vec<6>(data, idx, ptr, x, y, r0, r1, nnz);
    case 7: return rows_vec<7>(data, idx, ptr, x, y, r0, r1, nnz);
    case 8: return rows_vec<8>(data, idx, ptr, x, y, r0, r1, nnz);
    default: return rows_any(data, idx, ptr, x, y, f, r0, r1, nnz);
  }
}

ffi::Future CsrSpmm(ffi::Buffer<ffi::F32> data, ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> indptr,
                    ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out, ffi::ThreadPool pool) {
  const int64_t rows = indptr.element_count() - 1;
  const auto xd = x.dimensions();
  const int64_t f = xd.size() > 1 ? xd[1] : 1;
  const int32_t* ptr = indptr.typed_data();
  const int64_t nnz = ptr[rows];
  const float* dp = data.typed_data();
  const int32_t* ip = indices.typed_data();
  const float* xp = x.typed_data();
  float* yp = out->typed_data();
  const int64_t tasks = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), 64);
  if (tasks == 1 || nnz * f < kMinTaskNnzF || rows < 2 * tasks) {
    run_rows(dp, ip, ptr, xp, yp, f, 0, rows, nnz);
    ffi::Promise done;
    done.SetAvailable();
    return ffi::Future(done);
  }
  // Contiguous row chunks of about nnz / tasks entries each (counting each row once, so empty rows are work too).
  const int64_t total = nnz + rows;
  ffi::CountDownPromise done(tasks);
  ffi::Future future(done);
  int64_t r0 = 0;
  for (int64_t t = 0; t < tasks; ++t) {
    int64_t r1 = rows;
    if (t + 1 < tasks) {
      const int64_t target = total * (t + 1) / tasks;
      int64_t lo = r0, hi = rows;   // first row r with ptr[r] + r >= target
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (int64_t(ptr[mid]) + mid < target) lo = mid + 1; else hi = mid;
      }
      r1 = lo;
    }
    pool.Schedule([=]() mutable {
      run_rows(dp, ip, ptr, xp, yp, f, r0, r1, nnz);
      done.CountDown();
    });
    r0 = r1;
  }
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(dorylus_csr_spmm, CsrSpmm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // data [nnz]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // indices [nnz]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // indptr [rows + 1]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [cols, F]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [rows, F]
                                  .Ctx<ffi::ThreadPool>());
