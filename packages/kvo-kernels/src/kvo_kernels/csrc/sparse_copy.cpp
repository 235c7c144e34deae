// kvo::sparse_copy on the host: the offload path's miss copies (pool rows -> hot-buffer rows).
//
// The reference implementation checks its indices with several PyTorch ops (bounds, a
// torch.unique of the destinations) and copies through advanced indexing: on this path that
// costs more than the copy itself. Here one pass reads the indices, checks them, and copies
// each row with one memcpy. The contract is the reference's: rows are the first dimension,
// trailing shapes and dtypes equal, every index in range, no destination twice; a refused
// call writes nothing.

#include "sparse_copy.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvo_copy {
namespace {

// Rows of `t` are contiguous runs of `row_bytes` bytes `stride0` elements apart.
void check_rows_layout(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "sparse_copy (host): ", name,
                    " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() >= 1, "sparse_copy: ", name, " must have a row dimension");
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK_VALUE(t.size(d) == 1 || t.stride(d) == expected, "sparse_copy (host): ", name,
                      "'s rows must each be contiguous");
    expected *= t.size(d);
  }
}

std::vector<int64_t> read_indices(const at::Tensor& idx, const char* name, int64_t limit) {
  TORCH_CHECK_VALUE(idx.device().is_cpu(), "sparse_copy (host): ", name,
                    " must be a CPU tensor, got ", idx.device());
  TORCH_CHECK_VALUE(idx.dim() == 1, "sparse_copy: ", name, " must be 1-D [M]");
  TORCH_CHECK_VALUE(idx.scalar_type() == at::kLong || idx.scalar_type() == at::kInt,
                    "sparse_copy: ", name, " must be int32 or int64, got ", idx.scalar_type());
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
    TORCH_CHECK_INDEX(out[i] >= 0 && out[i] < limit, "sparse_copy: ", name, "[", i, "] = ",
                      out[i], " is outside [0, ", limit, ")");
  }
  return out;
}

}  // namespace

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

}  // namespace kvo_copy
