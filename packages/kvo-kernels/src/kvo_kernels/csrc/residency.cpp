// torch.ops.kvo.residency_update (CPU): one decode step of one layer for R residency rows.
//
// Checks every argument and value first (nothing changes on an error), then runs the rows of
// residency_rows.h in parallel over OpenMP threads; the state tensors are updated in place.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "residency_rows.h"

namespace kvo_residency {
namespace {

void check_index_tensor(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "residency_update: ", name,
                    " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong, "residency_update: ", name,
                    " must be int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dims, "residency_update: ", name, " must have ", dims,
                    " dimensions, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), "residency_update: ", name, " must be contiguous");
}

void check_rows(const at::Tensor& t, const char* name, int64_t rows) {
  TORCH_CHECK_VALUE(t.size(0) == rows, "residency_update: ", name, " has ", t.size(0),
                    " rows but the table has ", rows);
}

// First failing value of one row (checked before anything changes), or an empty string.
std::string check_row_values(int64_t r, int64_t state, int64_t stable_len, int64_t limit,
                             const int64_t* topk, int64_t width, int64_t max_seq_len) {
  if (stable_len < 0) {
    return "stable_lens[" + std::to_string(r) + "] is " + std::to_string(stable_len) +
           "; must be >= 0";
  }
  if (limit < 0) {
    return "seq_lens[" + std::to_string(r) + "] is " + std::to_string(limit) + "; must be >= 0";
  }
  if (state != kNotOffloaded && state != kFirstOffload && state != kSteady) {
    return "states[" + std::to_string(r) + "] is " + std::to_string(state) +
           "; allowed: -3 (NOT_OFFLOADED), -2 (FIRST_OFFLOAD), -1 (STEADY)";
  }
  // A branch-free scan first (it vectorises); the position only when something is wrong.
  bool beyond = false;
  for (int64_t k = 0; k < width; ++k) beyond |= (topk[k] >= max_seq_len) & (topk[k] < limit);
  for (int64_t k = 0; beyond && k < width; ++k) {
    const int64_t token = topk[k];
    if (token >= max_seq_len && token < limit) {
      return "topk[" + std::to_string(r) + ", " + std::to_string(k) + "] is token position " +
             std::to_string(token) + ", at or beyond max_seq_len=" +
             std::to_string(max_seq_len) +
             "; raise max_seq_len or pass seq_lens so such entries count as padding";
    }
  }
  return {};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> residency_update_cpu(
    at::Tensor slot_tokens, at::Tensor lru_order, at::Tensor row_requests,
    const at::Tensor& topk, const at::Tensor& request_ids, const at::Tensor& stable_lens,
    const at::Tensor& states, const std::optional<at::Tensor>& seq_lens, int64_t max_seq_len) {
  check_index_tensor(slot_tokens, "slot_tokens", 2);
  check_index_tensor(lru_order, "lru_order", 2);
  check_index_tensor(row_requests, "row_requests", 1);
  check_index_tensor(topk, "topk", 2);
  check_index_tensor(request_ids, "request_ids", 1);
  check_index_tensor(stable_lens, "stable_lens", 1);
  check_index_tensor(states, "states", 1);
  const int64_t rows = slot_tokens.size(0);
  const int64_t capacity = slot_tokens.size(1);
  const int64_t width = topk.size(1);
  TORCH_CHECK_VALUE(capacity >= 1, "residency_update: slot_tokens must have capacity >= 1, "
                    "got shape ", slot_tokens.sizes());
  TORCH_CHECK_VALUE(lru_order.sizes() == slot_tokens.sizes(), "residency_update: lru_order "
                    "shape ", lru_order.sizes(), " must equal slot_tokens shape ",
                    slot_tokens.sizes());
  TORCH_CHECK_VALUE(width >= 1, "residency_update: topk must have at least one column, got "
                    "shape ", topk.sizes());
  TORCH_CHECK_VALUE(width <= (int64_t{1} << 40), "residency_update: topk width ", width,
                    " is too large");
  TORCH_CHECK_VALUE(max_seq_len >= 1, "residency_update: max_seq_len must be >= 1, got ",
                    max_seq_len);
  check_rows(row_requests, "row_requests", rows);
  check_rows(topk, "topk", rows);
  check_rows(request_ids, "request_ids", rows);
  check_rows(stable_lens, "stable_lens", rows);
  check_rows(states, "states", rows);
  const int64_t* limits = nullptr;
  if (seq_lens.has_value()) {
    check_index_tensor(*seq_lens, "seq_lens", 1);
    check_rows(*seq_lens, "seq_lens", rows);
    limits = seq_lens->data_ptr<int64_t>();
  }

  at::Tensor slots = at::empty({rows, width}, topk.options());
  at::Tensor miss_counts = at::empty({rows}, topk.options());
  at::Tensor miss_tokens = at::empty({rows, width}, topk.options());
  at::Tensor miss_slots = at::empty({rows, width}, topk.options());

  int64_t* st = slot_tokens.data_ptr<int64_t>();
  int64_t* lru = lru_order.data_ptr<int64_t>();
  int64_t* req = row_requests.data_ptr<int64_t>();
  const int64_t* tk = topk.data_ptr<int64_t>();
  const int64_t* rid = request_ids.data_ptr<int64_t>();
  const int64_t* stable_ptr = stable_lens.data_ptr<int64_t>();
  const int64_t* state_ptr = states.data_ptr<int64_t>();
  int64_t* out_slots = slots.data_ptr<int64_t>();
  int64_t* out_counts = miss_counts.data_ptr<int64_t>();
  int64_t* out_tokens = miss_tokens.data_ptr<int64_t>();
  int64_t* out_miss_slots = miss_slots.data_ptr<int64_t>();

  // Phase 1, nothing changes yet: the values of every row (a cheap serial scan: a second
  // parallel region costs more than it saves), then, only when the width exceeds the capacity
  // so that an overflow is possible, each row's distinct count. A failing row fails the call.
  for (int64_t r = 0; r < rows; ++r) {
    const std::string problem =
        check_row_values(r, state_ptr[r], stable_ptr[r], limits ? limits[r] : kNoLimit,
                         tk + r * width, width, max_seq_len);
    TORCH_CHECK_VALUE(problem.empty(), "residency_update: ", problem);
  }
  const int threads = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows)));
  std::vector<int64_t> overflow(static_cast<size_t>(rows), -1);
  if (width > capacity) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
      if (state_ptr[r] == kNotOffloaded) continue;
      Scratch& scratch = thread_scratch();
      scratch.prepare(width, capacity);
      const int64_t count = scratch.collect(tk + r * width, width, limits ? limits[r] : kNoLimit);
      scratch.clear(count);
      if (count > capacity) overflow[r] = count;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    // kvo_core.residency.inputs.overflow_message, word for word.
    TORCH_CHECK(overflow[r] < 0, "residency overflow: row ", r, " selects ", overflow[r],
                " distinct tokens but the hot buffer has only ", capacity,
                " slots; capacity must be >= the distinct top-k tokens of a row");
  }

  // Phase 2: the update, rows in parallel. Rows are handed out one at a time (dynamic): on a
  // shared machine a thread may be descheduled for milliseconds, and the others then take
  // over its rows instead of waiting for a fixed share to finish.
  std::vector<int8_t> status(static_cast<size_t>(rows), kOk);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row_offset = r * capacity;  // 64-bit offsets: R * C may exceed 2**31
    const int64_t out_offset = r * width;
    int64_t* row_tokens = st + row_offset;
    int64_t* row_lru = lru + row_offset;
    const int64_t* row_topk = tk + out_offset;
    const int64_t limit = limits ? limits[r] : kNoLimit;
    const RowOut out{out_slots + out_offset, out_counts + r, out_tokens + out_offset,
                     out_miss_slots + out_offset};
    const int64_t state = state_ptr[r];
    if (state == kNotOffloaded) {
      identity_row(row_topk, width, limit, out);
      continue;
    }
    Scratch& scratch = thread_scratch();
    scratch.prepare(width, capacity);
    const int64_t count = scratch.collect(row_topk, width, limit);
    if (state == kFirstOffload) {
      first_offload_row(scratch, count, row_tokens, row_lru, capacity, width, out);
      req[r] = rid[r];
    } else {
      if (req[r] != rid[r]) {
        reset_row(row_tokens, row_lru, capacity);
      }
      status[r] = steady_row(scratch, count, row_tokens, row_lru, capacity, stable_ptr[r],
                             width, out);
      // A corrupt row keeps its state; its outputs are not returned (the call raises).
      if (status[r] == kOk) req[r] = rid[r];
    }
    scratch.clear(count);
  }
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK_VALUE(status[r] == kOk, "residency_update: the state of row ", r,
                      " is corrupt (lru_order[", r, "] holds a slot outside [0, ", capacity,
                      "), or slot_tokens[", r, "] holds a token twice); it was left as it "
                      "was, reset it");
  }
  return {slots, miss_counts, miss_tokens, miss_slots};
}

}  // namespace
}  // namespace kvo_residency

// A fragment: the Python side of kvo-kernels may define other ops in the kvo namespace.
TORCH_LIBRARY_FRAGMENT(kvo, m) {
  m.def(
      "residency_update(Tensor(a!) slot_tokens, Tensor(b!) lru_order, Tensor(c!) row_requests, "
      "Tensor topk, Tensor request_ids, Tensor stable_lens, Tensor states, Tensor? seq_lens, "
      "int max_seq_len) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvo, CPU, m) {
  m.impl("residency_update", &kvo_residency::residency_update_cpu);
}
