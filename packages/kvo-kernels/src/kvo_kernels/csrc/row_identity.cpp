// kvo_identity::row_serials_cpu (row_identity.h): the offload path's row serials in C++. The
// NumPy version costs a dozen array operations per layer call (~0.1-0.2 ms inside a vLLM
// step, where each small op pays its dispatch and a cold cache); this is one pass over the
// rows' covered blocks (a few hundred compares at 32K tokens).

#include "row_identity.h"

#include "index_matrix.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <vector>

namespace kvo_identity {
namespace {

constexpr const char* kOp = "row_serials";


// A state tensor: int64, contiguous, on the CPU, of the given shape.
int64_t* state(at::Tensor& t, const char* name, at::IntArrayRef shape, const char* op = kOp) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(),
                    op, ": ", name, " must be a contiguous int64 CPU tensor");
  TORCH_CHECK_VALUE(t.sizes() == shape, op, ": ", name, " has shape ", t.sizes(),
                    ", expected ", shape);
  return t.data_ptr<int64_t>();
}

int64_t ceil_div(int64_t value, int64_t by) { return value > 0 ? (value + by - 1) / by : 0; }

// The identity steps' shared parts (identity_decode_step and identity_decode_lane).

void check_pool_and_hot(const char* op, const at::Tensor& pool, const at::Tensor& hot,
                        int64_t rows, int64_t capacity) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&pool, &hot}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->dim() >= 1 && t->is_contiguous(), op,
                      ": pool and hot must be contiguous CPU tensors with a row dimension");
  }
  TORCH_CHECK_VALUE(pool.scalar_type() == hot.scalar_type() &&
                        pool.sizes().slice(1) == hot.sizes().slice(1),
                    op, ": pool and hot rows differ in dtype or shape");
  TORCH_CHECK_VALUE(rows * capacity <= hot.size(0), op, ": ", rows, " rows of capacity ",
                    capacity, " need ", rows * capacity, " hot rows, hot has ", hot.size(0));
}

void check_answer(const char* op, const at::Tensor& hot_slots, const at::Tensor& valid,
                  int64_t rows, int64_t width) {
  TORCH_CHECK_VALUE(hot_slots.device().is_cpu() && hot_slots.scalar_type() == at::kLong &&
                        hot_slots.is_contiguous() && hot_slots.dim() == 2 &&
                        hot_slots.size(0) == rows && hot_slots.size(1) == width,
                    op, ": hot_slots must be a contiguous int64 CPU tensor [", rows, ", ", width,
                    "]");
  TORCH_CHECK_VALUE(valid.device().is_cpu() && valid.scalar_type() == at::kBool &&
                        valid.is_contiguous() && valid.sizes() == hot_slots.sizes(),
                    op, ": valid must be a contiguous bool CPU tensor [", rows, ", ", width, "]");
}

// Everything checked: each row's new position pool -> its identity slot, filled advanced,
// rows past the batch hold nothing, and the top-k's hot slots and validity. Returns the
// selected entries.
int64_t apply_identity_step(const at::Tensor& pool, at::Tensor& hot,
                            const kvo_host::IndexMatrix& lens,
                            const kvo_host::IndexMatrix& picks,
                            const std::vector<int64_t>& sources, int64_t* filled_to,
                            int64_t* held_serials, at::Tensor& hot_slots, at::Tensor& valid,
                            int64_t rows, int64_t max_rows, int64_t capacity) {
  const int64_t pool_rows = pool.size(0);
  const int64_t width = picks.width();
  const int64_t item = static_cast<int64_t>(pool.element_size());
  const int64_t row_bytes = (pool.numel() / std::max<int64_t>(pool_rows, 1)) * item;
  const char* pool_base = static_cast<const char*>(pool.data_ptr());
  char* hot_base = static_cast<char*>(hot.data_ptr());
  int64_t* slots_out = hot_slots.data_ptr<int64_t>();
  bool* valid_out = valid.data_ptr<bool>();
  int64_t selected = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lens.at(r);
    std::memcpy(hot_base + (r * capacity + len - 1) * row_bytes,
                pool_base + sources[static_cast<size_t>(r)] * row_bytes,
                static_cast<size_t>(row_bytes));
    filled_to[r] = len;
    for (int64_t k = 0; k < width; ++k) {
      const int64_t t = picks.at(r, k);
      const bool chosen = t >= 0;
      slots_out[r * width + k] = chosen ? r * capacity + t : -1;
      valid_out[r * width + k] = chosen;
      selected += chosen;
    }
  }
  for (int64_t r = rows; r < max_rows; ++r) held_serials[r] = -1;
  return selected;
}

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
  const kvo_host::IndexMatrix table(block_table, kOp, "block_table", 2, rows);
  const kvo_host::IndexMatrix lens(seq_lens, kOp, "seq_lens", 1, rows);
  const kvo_host::IndexMatrix queries(query_lens, kOp, "query_lens", 1, rows);
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

namespace kvo_identity {

std::tuple<int64_t, int64_t> identity_decode_step_cpu(
    const at::Tensor& pool, at::Tensor hot, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& serials, at::Tensor held, at::Tensor filled,
    const at::Tensor& topk, at::Tensor hot_slots, at::Tensor valid, int64_t rows,
    int64_t block_size, int64_t capacity) {
  constexpr const char* op = "identity_decode_step";
  TORCH_CHECK_VALUE(block_size >= 1 && capacity >= 1, op, ": block_size (", block_size,
                    ") and capacity (", capacity, ") must be >= 1");
  TORCH_CHECK_VALUE(held.dim() == 1, op, ": held must be 1-D");
  const int64_t max_rows = held.size(0);
  TORCH_CHECK_VALUE(rows >= 1 && rows <= max_rows, op, ": ", rows, " batch rows, expected 1 to ",
                    max_rows);
  int64_t* held_serials = state(held, "held", {max_rows}, op);
  int64_t* filled_to = state(filled, "filled", {max_rows}, op);
  check_pool_and_hot(op, pool, hot, rows, capacity);
  const kvo_host::IndexMatrix table(block_table, op, "block_table", 2, rows);
  const kvo_host::IndexMatrix lens(seq_lens, op, "seq_lens", 1, rows);
  const kvo_host::IndexMatrix request(serials, op, "serials", 1, rows);
  const kvo_host::IndexMatrix picks(topk, op, "topk", 2, rows);
  const int64_t width = picks.width();
  check_answer(op, hot_slots, valid, rows, width);

  // Is every row in the steady identity state? If not, nothing changes.
  for (int64_t r = 0; r < rows; ++r) {
    if (held_serials[r] != request.at(r) || filled_to[r] != lens.at(r) - 1) return {-1, 0};
  }
  // Check every copy and top-k entry before writing anything.
  const int64_t pool_rows = pool.size(0);
  std::vector<int64_t> sources(static_cast<size_t>(rows));
  int64_t context = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lens.at(r);
    TORCH_CHECK_VALUE(len >= 1 && len <= capacity, op, ": row ", r, " has seq_len ", len,
                      "; a NOT_OFFLOADED row holds 1 to ", capacity, " tokens");
    const int64_t position = len - 1;
    TORCH_CHECK_INDEX(position / block_size < table.width(), op, ": position ", position,
                      " of row ", r, " is past the block table's ",
                      table.width() * block_size, " tokens");
    const int64_t block = table.at(r, position / block_size);
    const int64_t source = block * block_size + position % block_size;
    TORCH_CHECK_INDEX(block >= 0 && source < pool_rows, op, ": position ", position,
                      " of row ", r, " is in block ", block, ", outside the pool's ", pool_rows,
                      " rows");
    sources[static_cast<size_t>(r)] = source;
    for (int64_t k = 0; k < width; ++k) {
      TORCH_CHECK_INDEX(picks.at(r, k) < len, op, ": topk[", r, "][", k, "] = ", picks.at(r, k),
                        " is not a position of the row's ", len, " tokens");
    }
    context += len;
  }
  // Apply: the new rows, the state, the answer.
  const int64_t selected = apply_identity_step(pool, hot, lens, picks, sources, filled_to,
                                               held_serials, hot_slots, valid, rows, max_rows,
                                               capacity);
  return {selected, context};
}

}  // namespace kvo_identity

namespace kvo_identity {

std::tuple<int64_t, int64_t> identity_decode_lane_cpu(
    const at::Tensor& pool, at::Tensor hot, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, const at::Tensor& block_table, const at::Tensor& versions,
    at::Tensor recorded_blocks, at::Tensor recorded_versions, at::Tensor covered,
    const at::Tensor& serials, at::Tensor held, at::Tensor filled, const at::Tensor& topk,
    at::Tensor hot_slots, at::Tensor valid, int64_t rows, int64_t block_size,
    int64_t capacity) {
  constexpr const char* op = "identity_decode_lane";
  const std::tuple<int64_t, int64_t> decline{-1, 0};
  TORCH_CHECK_VALUE(block_size >= 1 && capacity >= 1, op, ": block_size (", block_size,
                    ") and capacity (", capacity, ") must be >= 1");
  TORCH_CHECK_VALUE(recorded_blocks.dim() == 2 && held.dim() == 1 && versions.dim() == 1, op,
                    ": recorded_blocks must be 2-D, held and versions 1-D");
  const int64_t max_rows = recorded_blocks.size(0);
  const int64_t max_blocks = recorded_blocks.size(1);
  TORCH_CHECK_VALUE(rows >= 1 && rows <= max_rows && held.size(0) == max_rows, op, ": ", rows,
                    " batch rows, expected 1 to ", max_rows, " (held has ", held.size(0), ")");
  int64_t* rec_blocks = state(recorded_blocks, "recorded_blocks", {max_rows, max_blocks}, op);
  int64_t* rec_versions =
      state(recorded_versions, "recorded_versions", {max_rows, max_blocks}, op);
  int64_t* rec_covered = state(covered, "covered", {max_rows}, op);
  const int64_t* row_serials =
      state(const_cast<at::Tensor&>(serials), "serials", {max_rows}, op);
  int64_t* held_serials = state(held, "held", {max_rows}, op);
  int64_t* filled_to = state(filled, "filled", {max_rows}, op);
  const int64_t num_blocks = versions.size(0);
  const int64_t* block_versions =
      state(const_cast<at::Tensor&>(versions), "versions", {num_blocks}, op);
  check_pool_and_hot(op, pool, hot, rows, capacity);
  const kvo_host::IndexMatrix starts(query_start_loc, op, "query_start_loc", 1, rows + 1);
  const kvo_host::IndexMatrix lens(seq_lens, op, "seq_lens", 1, rows);
  const kvo_host::IndexMatrix table(block_table, op, "block_table", 2, rows);
  const kvo_host::IndexMatrix picks(topk, op, "topk", 2, rows);
  const int64_t width = picks.width();
  TORCH_CHECK_VALUE(topk.size(0) == rows, op, ": topk has ", topk.size(0), " rows, the call ",
                    rows);
  check_answer(op, hot_slots, valid, rows, width);
  const int64_t table_width = std::min(table.width(), max_blocks);
  const int64_t pool_rows = pool.size(0);

  // Decide, changing nothing: is this the steady state of row_serials (every row keeps its
  // serial) followed by identity_decode_step (every row holds its request, filled to its new
  // position), with every index inside what it addresses? Any doubt: decline.
  std::vector<int64_t> sources(static_cast<size_t>(rows));
  int64_t context = 0;
  for (int64_t r = 0; r <= rows; ++r) {
    if (starts.at(r) != starts.at(0) + r) return decline;   // not one query token per row
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lens.at(r);
    if (len < 2 || len > capacity) return decline;   // no stable prefix, or past the hot row
    const int64_t cover_now = ceil_div(len, block_size);
    for (int64_t c = 0; c < std::min(cover_now, table_width); ++c) {
      if (table.at(r, c) >= num_blocks) return decline;
    }
    const int64_t need = ceil_div(len - 1, block_size);
    const int64_t limit = std::min(std::max(cover_now, rec_covered[r]), table_width);
    if (need > rec_covered[r] || row_serials[r] < 0) return decline;
    const int64_t* row_blocks = rec_blocks + r * max_blocks;
    const int64_t* row_versions = rec_versions + r * max_blocks;
    for (int64_t c = 0; c < std::min(need, limit); ++c) {
      const int64_t block = table.at(r, c);
      if (block != row_blocks[c] || block_versions[std::max<int64_t>(block, 0)] !=
                                        row_versions[c]) {
        return decline;
      }
    }
    if (held_serials[r] != row_serials[r] || filled_to[r] != len - 1) return decline;
    const int64_t position = len - 1;
    if (position / block_size >= table.width()) return decline;
    const int64_t block = table.at(r, position / block_size);
    const int64_t source = block * block_size + position % block_size;
    if (block < 0 || source >= pool_rows) return decline;
    sources[static_cast<size_t>(r)] = source;
    for (int64_t k = 0; k < width; ++k) {
      if (picks.at(r, k) >= len) return decline;
    }
    context += len;
  }
  // Apply: what row_serials records (the serials stay), then the identity step.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t cover_now = ceil_div(lens.at(r), block_size);
    const int64_t limit = std::min(std::max(cover_now, rec_covered[r]), table_width);
    int64_t* row_blocks = rec_blocks + r * max_blocks;
    int64_t* row_versions = rec_versions + r * max_blocks;
    for (int64_t c = 0; c < limit; ++c) {
      const int64_t block = c < cover_now ? table.at(r, c) : -1;
      row_blocks[c] = block;
      row_versions[c] = c < cover_now ? block_versions[std::max<int64_t>(block, 0)] : -1;
    }
    rec_covered[r] = cover_now;
  }
  const int64_t selected = apply_identity_step(pool, hot, lens, picks, sources, filled_to,
                                               held_serials, hot_slots, valid, rows, max_rows,
                                               capacity);
  return {selected, context};
}

}  // namespace kvo_identity

namespace kvo_identity {

int64_t pool_write_rows_cpu(at::Tensor pool, const at::Tensor& rows, const at::Tensor& slots,
                            at::Tensor versions, at::Tensor write_counter, int64_t block_size) {
  constexpr const char* op = "pool_write_rows";
  TORCH_CHECK_VALUE(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  TORCH_CHECK_VALUE(pool.device().is_cpu() && rows.device().is_cpu() && pool.is_contiguous() &&
                        rows.is_contiguous() && pool.dim() >= 1 && rows.dim() >= 1,
                    op, ": pool and rows must be contiguous CPU tensors with a row dimension");
  TORCH_CHECK_VALUE(pool.scalar_type() == rows.scalar_type() &&
                        pool.sizes().slice(1) == rows.sizes().slice(1),
                    op, ": rows ", rows.sizes(), " ", rows.scalar_type(),
                    " do not match the pool's rows ", pool.sizes(), " ", pool.scalar_type());
  TORCH_CHECK_VALUE(versions.dim() == 1, op, ": versions must be 1-D");
  const int64_t num_blocks = versions.size(0);
  int64_t* block_versions = state(versions, "versions", {num_blocks}, op);
  int64_t* counter = state(write_counter, "write_counter", {1}, op);
  const int64_t count = rows.size(0);
  const kvo_host::IndexMatrix where(slots, op, "slots", 1, count);
  const int64_t pool_rows = pool.size(0);
  bool first_row = false;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t slot = where.at(i);
    if (slot < 0) continue;
    TORCH_CHECK_INDEX(slot < pool_rows && slot / block_size < num_blocks, op, ": slots[", i,
                      "] = ", slot, " is outside the pool's ", pool_rows, " rows");
    first_row = first_row || slot % block_size == 0;
  }
  const int64_t row_bytes =
      (pool.numel() / std::max<int64_t>(pool_rows, 1)) * static_cast<int64_t>(pool.element_size());
  char* pool_base = static_cast<char*>(pool.data_ptr());
  const char* rows_base = static_cast<const char*>(rows.data_ptr());
  if (first_row) ++counter[0];
  int64_t written = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t slot = where.at(i);
    if (slot < 0) continue;
    std::memcpy(pool_base + slot * row_bytes, rows_base + i * row_bytes,
                static_cast<size_t>(row_bytes));
    if (slot % block_size == 0) block_versions[slot / block_size] = counter[0];
    ++written;
  }
  return written;
}

}  // namespace kvo_identity
