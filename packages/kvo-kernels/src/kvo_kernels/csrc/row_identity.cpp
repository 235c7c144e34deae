// kvo_identity::row_serials_cpu (row_identity.h): the offload path's row serials in C++. The
// NumPy version costs a dozen array operations per layer call (~0.1-0.2 ms inside a vLLM
// step, where each small op pays its dispatch and a cold cache); this is one pass over the
// rows' covered blocks (a few hundred compares at 32K tokens).

#include "row_identity.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvo_identity {
namespace {

constexpr const char* kOp = "row_serials";

// Element [r][c] of a CPU int32/int64 tensor as int64 (1-D: c is ignored).
class Ints {
 public:
  Ints(const at::Tensor& t, const char* name, int64_t dims, int64_t min_rows)
      : tensor_(t.contiguous()) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), kOp, ": ", name, " must be a CPU tensor, got ",
                      t.device());
    TORCH_CHECK_VALUE(t.dim() == dims, kOp, ": ", name, " must be ", dims, "-D, got shape ",
                      t.sizes());
    TORCH_CHECK_VALUE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, kOp, ": ",
                      name, " must be int32 or int64, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.size(0) >= min_rows, kOp, ": ", name, " has ", t.size(0),
                      " rows, the call names ", min_rows);
    wide_ = tensor_.scalar_type() == at::kLong;
    data_ = tensor_.data_ptr();
    width_ = dims == 2 ? tensor_.size(1) : 1;
  }
  int64_t at(int64_t r, int64_t c = 0) const {
    const int64_t i = r * width_ + c;
    return wide_ ? static_cast<const int64_t*>(data_)[i]
                 : static_cast<int64_t>(static_cast<const int32_t*>(data_)[i]);
  }
  int64_t width() const { return width_; }

 private:
  at::Tensor tensor_;
  const void* data_ = nullptr;
  bool wide_ = true;
  int64_t width_ = 1;
};

// A state tensor: int64, contiguous, on the CPU, of the given shape.
int64_t* state(at::Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(),
                    kOp, ": ", name, " must be a contiguous int64 CPU tensor");
  TORCH_CHECK_VALUE(t.sizes() == shape, kOp, ": ", name, " has shape ", t.sizes(),
                    ", expected ", shape);
  return t.data_ptr<int64_t>();
}

int64_t ceil_div(int64_t value, int64_t by) { return value > 0 ? (value + by - 1) / by : 0; }

}  // namespace

void row_serials_cpu(const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_lens, const at::Tensor& versions,
                     at::Tensor recorded_blocks, at::Tensor recorded_versions,
                     at::Tensor covered, at::Tensor serials, at::Tensor next_serial,
                     int64_t rows, int64_t block_size) {
  TORCH_CHECK_VALUE(block_size >= 1, kOp, ": block_size must be >= 1, got ", block_size);
  TORCH_CHECK_VALUE(recorded_blocks.dim() == 2, kOp, ": recorded_blocks must be 2-D");
  const int64_t max_rows = recorded_blocks.size(0);
  const int64_t max_blocks = recorded_blocks.size(1);
  TORCH_CHECK_VALUE(rows >= 0 && rows <= max_rows, kOp, ": ", rows, " batch rows, at most ",
                    max_rows, " (max_num_seqs)");
  int64_t* rec_blocks = state(recorded_blocks, "recorded_blocks", {max_rows, max_blocks});
  int64_t* rec_versions = state(recorded_versions, "recorded_versions", {max_rows, max_blocks});
  int64_t* rec_covered = state(covered, "covered", {max_rows});
  int64_t* row_serials = state(serials, "serials", {max_rows});
  int64_t* next = state(next_serial, "next_serial", {1});
  TORCH_CHECK_VALUE(versions.dim() == 1, kOp, ": versions must be 1-D");
  const int64_t num_blocks = versions.size(0);
  const int64_t* block_versions = state(const_cast<at::Tensor&>(versions), "versions",
                                        {num_blocks});
  const Ints table(block_table, "block_table", 2, rows);
  const Ints lens(seq_lens, "seq_lens", 1, rows);
  const Ints queries(query_lens, "query_lens", 1, rows);
  const int64_t width = std::min(table.width(), max_blocks);

  // Pass 1, nothing changes: every covered block must be a pool block.
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK_VALUE(lens.at(r) >= 0 && queries.at(r) >= 0, kOp, ": row ", r,
                      " has seq_len ", lens.at(r), " and query_len ", queries.at(r),
                      "; both must be >= 0");
    const int64_t cover = std::min(ceil_div(lens.at(r), block_size), width);
    for (int64_t c = 0; c < cover; ++c) {
      const int64_t block = table.at(r, c);
      TORCH_CHECK_INDEX(block < num_blocks, kOp, ": block_table[", r, "][", c, "] = ", block,
                        " is outside the pool's ", num_blocks, " blocks");
    }
  }
  // Pass 2: keep or renew each row's serial, then record what it covers.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t cover_now = ceil_div(lens.at(r), block_size);
    const int64_t cover_before = rec_covered[r];
    const int64_t need = ceil_div(lens.at(r) - queries.at(r), block_size);
    const int64_t limit = std::min(std::max(cover_now, cover_before), width);
    int64_t* row_blocks = rec_blocks + r * max_blocks;
    int64_t* row_versions = rec_versions + r * max_blocks;
    bool keep = need >= 1 && need <= cover_before && row_serials[r] >= 0;
    for (int64_t c = 0; c < limit; ++c) {
      int64_t block = -1;
      int64_t version = -1;
      if (c < cover_now) {
        block = table.at(r, c);
        version = block_versions[std::max<int64_t>(block, 0)];
      }
      if (c < need && (block != row_blocks[c] || version != row_versions[c])) keep = false;
      row_blocks[c] = block;
      row_versions[c] = version;
    }
    rec_covered[r] = cover_now;
    if (!keep) row_serials[r] = (*next)++;
  }
}

}  // namespace kvo_identity
