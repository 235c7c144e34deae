// kvo::sparse_copy on the host: the offload path's miss copies (pool rows -> hot-buffer rows),
// kvo::sparse_copy_gather: those copies and the decode step's gather of the selected
// hot-buffer rows for attention in one pass, and copy_residency_misses: the copies told
// straight from a residency update's result and vLLM's block table (no index arrays built in
// Python first).
//
// The reference implementation checks its indices with several PyTorch ops (bounds, a
// torch.unique of the destinations) and copies through advanced indexing: on this path that
// costs more than the copy itself. Here one pass reads the indices, checks them, and copies
// each row with one memcpy. The contract is the reference's: rows are the first dimension,
// trailing shapes and dtypes equal, every index in range, no destination twice; a refused
// call writes nothing.

#include "sparse_copy.h"

#include "index_matrix.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace kvo_copy {
namespace {

// sparse_copy_gather stays on the calling thread below this many bytes moved: a decode
// step's few hundred rows per request take tens of microseconds, and on a loaded host a
// parallel region waits for a descheduled thread's time slice (milliseconds).
constexpr int64_t kParallelBytes = int64_t{16} << 20;
constexpr int64_t kGrainBytes = int64_t{4} << 20;

// Rows of `t` are contiguous runs of `row_bytes` bytes `stride0` elements apart.
void check_rows_layout(const at::Tensor& t, const char* name, const char* op = "sparse_copy") {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, " (host): ", name, " must be a CPU tensor, got ",
                    t.device());
  TORCH_CHECK_VALUE(t.dim() >= 1, op, ": ", name, " must have a row dimension");
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK_VALUE(t.size(d) == 1 || t.stride(d) == expected, op, " (host): ", name,
                      "'s rows must each be contiguous");
    expected *= t.size(d);
  }
}

std::vector<int64_t> read_indices(const at::Tensor& idx, const char* name, int64_t limit,
                                  const char* op = "sparse_copy") {
  TORCH_CHECK_VALUE(idx.device().is_cpu(), op, " (host): ", name, " must be a CPU tensor, got ",
                    idx.device());
  TORCH_CHECK_VALUE(idx.dim() == 1, op, ": ", name, " must be 1-D");
  TORCH_CHECK_VALUE(idx.scalar_type() == at::kLong || idx.scalar_type() == at::kInt, op, ": ",
                    name, " must be int32 or int64, got ", idx.scalar_type());
  const int64_t n = idx.size(0);
  std::vector<int64_t> out(static_cast<size_t>(n));
  const at::Tensor c = idx.contiguous();
  if (c.scalar_type() == at::kLong) {
    const int64_t* p = c.data_ptr<int64_t>();
    std::copy(p, p + n, out.begin());
  } else {
    const int32_t* p = c.data_ptr<int32_t>();
    std::copy(p, p + n, out.begin());
  }
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(out[i] >= 0 && out[i] < limit, op, ": ", name, "[", i, "] = ", out[i],
                      " is outside [0, ", limit, ")");
  }
  return out;
}

// Bytes [first, last) that rows of `t` may touch.
std::pair<const char*, const char*> row_span(const at::Tensor& t, int64_t row_bytes) {
  const char* base = static_cast<const char*>(t.data_ptr());
  if (t.size(0) == 0) return {base, base};
  return {base, base + (t.size(0) - 1) * t.stride(0) * t.element_size() + row_bytes};
}

bool overlaps(std::pair<const char*, const char*> a, std::pair<const char*, const char*> b) {
  return a.first < b.second && b.first < a.second;
}


}  // namespace

int64_t copy_residency_misses_cpu(const at::Tensor& pool, at::Tensor hot,
                                  const at::Tensor& block_table, const at::Tensor& miss_counts,
                                  const at::Tensor& miss_tokens, const at::Tensor& miss_slots,
                                  int64_t rows, int64_t block_size, int64_t capacity) {
  const char* op = "copy_residency_misses";
  check_rows_layout(pool, "pool", op);
  check_rows_layout(hot, "hot", op);
  TORCH_CHECK_VALUE(pool.scalar_type() == hot.scalar_type(), op, ": hot dtype ",
                    hot.scalar_type(), " differs from pool dtype ", pool.scalar_type());
  TORCH_CHECK_VALUE(pool.sizes().slice(1) == hot.sizes().slice(1), op,
                    ": hot row shape differs from pool row shape");
  TORCH_CHECK_VALUE(rows >= 0 && block_size >= 1 && capacity >= 1, op, ": rows (", rows,
                    ") must be >= 0, block_size (", block_size, ") and capacity (", capacity,
                    ") >= 1");
  TORCH_CHECK_VALUE(rows * capacity <= hot.size(0), op, ": ", rows, " rows of capacity ",
                    capacity, " need ", rows * capacity, " hot rows, hot has ", hot.size(0));
  const kvo_host::IndexMatrix table(block_table, op, "block_table", 2, rows);
  const kvo_host::IndexMatrix counts(miss_counts, op, "miss_counts", 1, rows);
  const kvo_host::IndexMatrix tokens(miss_tokens, op, "miss_tokens", 2, rows);
  const kvo_host::IndexMatrix slots(miss_slots, op, "miss_slots", 2, rows);
  TORCH_CHECK_VALUE(tokens.width() == slots.width(), op, ": miss_tokens has ", tokens.width(),
                    " columns, miss_slots ", slots.width());
  const int64_t pool_rows = pool.size(0);
  std::vector<std::pair<int64_t, int64_t>> copies;   // (pool row, hot row)
  std::vector<uint8_t> written(static_cast<size_t>(rows * capacity), 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t count = counts.at(r);
    TORCH_CHECK_VALUE(count >= 0 && count <= tokens.width(), op, ": miss_counts[", r, "] = ",
                      count, " is outside [0, ", tokens.width(), "]");
    for (int64_t i = 0; i < count; ++i) {
      const int64_t token = tokens.at(r, i);
      const int64_t slot = slots.at(r, i);
      TORCH_CHECK_INDEX(token >= 0 && token / block_size < table.width(), op, ": miss_tokens[",
                        r, "][", i, "] = ", token, " is outside the block table's ",
                        table.width() * block_size, " tokens");
      const int64_t block = table.at(r, token / block_size);
      const int64_t source = block * block_size + token % block_size;
      TORCH_CHECK_INDEX(block >= 0 && source < pool_rows, op, ": token ", token, " of row ", r,
                        " is in block ", block, ", outside the pool's ", pool_rows, " rows");
      TORCH_CHECK_INDEX(slot >= 0 && slot < capacity, op, ": miss_slots[", r, "][", i, "] = ",
                        slot, " is outside [0, ", capacity, ")");
      const int64_t target = r * capacity + slot;
      TORCH_CHECK_VALUE(!written[static_cast<size_t>(target)], op, ": hot slot ", slot,
                        " of row ", r, " is named twice");
      written[static_cast<size_t>(target)] = 1;
      copies.emplace_back(source, target);
    }
  }
  if (copies.empty() || pool.numel() == 0) return static_cast<int64_t>(copies.size());
  const int64_t item = static_cast<int64_t>(pool.element_size());
  const int64_t row_bytes = (pool.numel() / pool_rows) * item;
  const int64_t pool_stride = pool.stride(0) * item;
  const int64_t hot_stride = hot.stride(0) * item;
  const char* pool_base = static_cast<const char*>(pool.data_ptr());
  char* hot_base = static_cast<char*>(hot.data_ptr());
  // Chunks of 64 KiB over PyTorch's threads: the misses are scattered over a pool that is
  // mostly out of cache, and one thread copying them waits out each row's memory latency
  // (measured on 2 CPUs, rows of 2.3 KB: 4.7-6.7 GB/s on one thread, 6.8-11 GB/s on two).
  const int64_t count = static_cast<int64_t>(copies.size());
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{64} << 10) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto& [source, target] = copies[static_cast<size_t>(i)];
      std::memcpy(hot_base + target * hot_stride, pool_base + source * pool_stride,
                  static_cast<size_t>(row_bytes));
    }
  });
  return count;
}

void sparse_copy_cpu(const at::Tensor& src, at::Tensor dst, const at::Tensor& src_rows,
                     const at::Tensor& dst_rows) {
  check_rows_layout(src, "src");
  check_rows_layout(dst, "dst");
  TORCH_CHECK_VALUE(src.scalar_type() == dst.scalar_type(), "sparse_copy: dst dtype ",
                    dst.scalar_type(), " differs from src dtype ", src.scalar_type());
  TORCH_CHECK_VALUE(src.sizes().slice(1) == dst.sizes().slice(1),
                    "sparse_copy: dst row shape differs from src row shape");
  const std::vector<int64_t> from = read_indices(src_rows, "src_rows", src.size(0));
  const std::vector<int64_t> to = read_indices(dst_rows, "dst_rows", dst.size(0));
  TORCH_CHECK_VALUE(from.size() == to.size(), "sparse_copy: dst_rows has ", to.size(),
                    " entries, src_rows ", from.size());
  std::vector<int64_t> sorted = to;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK_VALUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                    "sparse_copy: dst_rows repeats a destination row; each must appear once");
  const int64_t count = static_cast<int64_t>(from.size());
  if (count == 0 || src.numel() == 0) return;

  const int64_t item = static_cast<int64_t>(src.element_size());
  const int64_t row_bytes = (src.numel() / src.size(0)) * item;
  const int64_t src_stride = src.stride(0) * item;
  const int64_t dst_stride = dst.stride(0) * item;
  const char* src_base = static_cast<const char*>(src.data_ptr());
  char* dst_base = static_cast<char*>(dst.data_ptr());
  // Small copies stay on the calling thread: starting threads costs more than they save.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(dst_base + to[i] * dst_stride, src_base + from[i] * src_stride,
                  static_cast<size_t>(row_bytes));
    }
  });
}

void sparse_copy_gather_cpu(const at::Tensor& src, at::Tensor dst, const at::Tensor& src_rows,
                            const at::Tensor& dst_rows, const at::Tensor& gather_rows,
                            at::Tensor out) {
  const char* op = "sparse_copy_gather";
  check_rows_layout(src, "src", op);
  check_rows_layout(dst, "dst", op);
  check_rows_layout(out, "out", op);
  TORCH_CHECK_VALUE(src.scalar_type() == dst.scalar_type(), op, ": dst dtype ",
                    dst.scalar_type(), " differs from src dtype ", src.scalar_type());
  TORCH_CHECK_VALUE(out.scalar_type() == dst.scalar_type(), op, ": out dtype ",
                    out.scalar_type(), " differs from dst dtype ", dst.scalar_type());
  TORCH_CHECK_VALUE(src.sizes().slice(1) == dst.sizes().slice(1), op,
                    ": dst row shape differs from src row shape");
  TORCH_CHECK_VALUE(out.sizes().slice(1) == dst.sizes().slice(1), op,
                    ": out row shape differs from dst row shape");
  const std::vector<int64_t> from = read_indices(src_rows, "src_rows", src.size(0), op);
  const std::vector<int64_t> to = read_indices(dst_rows, "dst_rows", dst.size(0), op);
  const std::vector<int64_t> picks = read_indices(gather_rows, "gather_rows", dst.size(0), op);
  TORCH_CHECK_VALUE(from.size() == to.size(), op, ": dst_rows has ", to.size(),
                    " entries, src_rows ", from.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(picks.size()) == out.size(0), op, ": gather_rows has ",
                    picks.size(), " entries, out has ", out.size(0), " rows");
  // (destination row, copy index) sorted by row: the repeat check and the gather's look-up.
  std::vector<std::pair<int64_t, int64_t>> by_row(to.size());
  for (size_t i = 0; i < to.size(); ++i) by_row[i] = {to[i], static_cast<int64_t>(i)};
  std::sort(by_row.begin(), by_row.end());
  for (size_t i = 1; i < by_row.size(); ++i) {
    TORCH_CHECK_VALUE(by_row[i].first != by_row[i - 1].first, op,
                      ": dst_rows repeats a destination row; each must appear once");
  }
  const int64_t item = static_cast<int64_t>(dst.element_size());
  const int64_t row_bytes = dst.size(0) ? (dst.numel() / dst.size(0)) * item
                                        : (out.size(0) ? (out.numel() / out.size(0)) * item : 0);
  if (row_bytes == 0) return;
  const auto out_span = row_span(out, row_bytes);
  TORCH_CHECK_VALUE(!overlaps(out_span, row_span(dst, row_bytes)) &&
                        !overlaps(out_span, row_span(src, row_bytes)),
                    op, ": out overlaps src or dst in memory; it must be a separate tensor");

  const int64_t src_stride = src.stride(0) * item;
  const int64_t dst_stride = dst.stride(0) * item;
  const int64_t out_stride = out.stride(0) * item;
  const char* src_base = static_cast<const char*>(src.data_ptr());
  char* dst_base = static_cast<char*>(dst.data_ptr());
  char* out_base = static_cast<char*>(out.data_ptr());
  const auto copy_row = [&](int64_t i) {
    std::memcpy(dst_base + to[i] * dst_stride, src_base + from[i] * src_stride,
                static_cast<size_t>(row_bytes));
  };
  const int64_t copies = static_cast<int64_t>(from.size());
  const int64_t gathered = static_cast<int64_t>(picks.size());
  if ((copies + gathered) * row_bytes >= kParallelBytes) {
    // Large: the copies, then the gather, each over threads (a row written by the first
    // loop is read by the second, after parallel_for's join).
    const int64_t grain = std::max<int64_t>(1, kGrainBytes / row_bytes);
    at::parallel_for(0, copies, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) copy_row(i);
    });
    at::parallel_for(0, gathered, grain, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        std::memcpy(out_base + k * out_stride, dst_base + picks[k] * dst_stride,
                    static_cast<size_t>(row_bytes));
      }
    });
    return;
  }
  // One pass on the calling thread: a row the gather needs that a copy writes is copied just
  // before, so the gather reads it from cache, not from memory a second time.
  std::vector<uint8_t> done(static_cast<size_t>(copies), 0);
  for (int64_t k = 0; k < gathered; ++k) {
    const int64_t row = picks[k];
    const auto hit = std::lower_bound(by_row.begin(), by_row.end(),
                                      std::pair<int64_t, int64_t>{row, 0});
    if (hit != by_row.end() && hit->first == row && !done[hit->second]) {
      copy_row(hit->second);
      done[hit->second] = 1;
    }
    std::memcpy(out_base + k * out_stride, dst_base + row * dst_stride,
                static_cast<size_t>(row_bytes));
  }
  for (int64_t i = 0; i < copies; ++i) {
    if (!done[i]) copy_row(i);
  }
}

}  // namespace kvo_copy
