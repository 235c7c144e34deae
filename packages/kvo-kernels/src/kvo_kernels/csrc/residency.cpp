// torch.ops.kvo.residency_update (CPU): one decode step of one layer for R residency rows,
// and torch.ops.kvo.residency_lru_order, which reads the rows' LRU order out of their state.
//
// Checks every argument and value first (nothing changes on an error), then runs the rows of
// residency_rows.h, inline for one row or one thread (no OpenMP region to start) and over
// OpenMP threads for more; the state tensors are updated in place.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "residency_rows.h"
#include "row_identity.h"
#include "sparse_copy.h"

namespace kvo_residency {
namespace {

// The largest max_seq_len: every token position fits the int32 outputs.
constexpr int64_t kMaxSeqLen = int64_t{1} << 31;

// Steps with fewer top-k entries (rows x width) than this run on the calling thread
// (update_rows): R=8 rows of K=128 take ~10 us there, R=8 of K=2048 go parallel.
constexpr int64_t kParallelEntries = 8192;

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype,
                  int64_t dims) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "residency_update: ", name,
                    " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, "residency_update: ", name, " must be ",
                    dtype == at::kLong ? "int64" : "int32", ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dims, "residency_update: ", name, " must have ", dims,
                    " dimensions, got shape ", t.sizes());
}

// A state tensor: owned by the table, used in place, so it must already be contiguous.
void check_state(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  check_tensor(t, name, at::kLong, static_cast<int64_t>(shape.size()));
  TORCH_CHECK_VALUE(t.sizes() == shape, "residency_update: ", name, " must have shape ", shape,
                    ", got ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), "residency_update: ", name, " must be contiguous");
}

// The width of a row's window or deep log: a power of two >= C.
int64_t check_log_width(const at::Tensor& t, const char* name, int64_t rows, int64_t capacity) {
  check_tensor(t, name, at::kLong, 2);
  const int64_t width = t.size(1);
  TORCH_CHECK_VALUE(width >= capacity && (width & (width - 1)) == 0, "residency_update: ", name,
                    " must have a power-of-two width >= the capacity ", capacity, ", got shape ",
                    t.sizes());
  check_state(t, name, {rows, width});
  return width;
}

// The table's capacity C from slot_tokens [R, C] (checked first: every other shape follows it).
int64_t check_capacity(const at::Tensor& slot_tokens, const char* op) {
  check_tensor(slot_tokens, "slot_tokens", at::kLong, 2);
  const int64_t capacity = slot_tokens.size(1);
  TORCH_CHECK_VALUE(capacity >= 1 && capacity <= kMaxCapacity, op, ": slot_tokens must have a "
                    "capacity in [1, ", kMaxCapacity, "], got shape ", slot_tokens.sizes());
  return capacity;
}

// An input tensor with one entry (or one row) per residency row; made contiguous if needed.
at::Tensor input_rows(const at::Tensor& t, const char* name, int64_t dims, int64_t rows,
                      at::ScalarType dtype = at::kLong) {
  check_tensor(t, name, dtype, dims);
  TORCH_CHECK_VALUE(t.size(0) == rows, "residency_update: ", name, " has ", t.size(0),
                    " rows but the table has ", rows);
  return t.contiguous();
}

// First failing value of one row (checked before anything changes), or an empty string.
template <typename Token>
std::string check_row_values(int64_t r, int64_t state, int64_t stable_len, int64_t limit,
                             const Token* topk, int64_t width, int64_t max_seq_len) {
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
  // A scan for any bad entry first (it runs on every row of every call); the position
  // only when something is wrong.
  const bool beyond = any_in_range(topk, width, max_seq_len, limit);
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

// Where one call writes its results: [R, K], [R], [R, K], [R, K] int32, contiguous.
struct Outputs {
  int32_t* slots;
  int32_t* miss_counts;
  int32_t* miss_tokens;
  int32_t* miss_slots;
};

// The width K of the call, once `topk` is checked (the outputs' shapes depend on it).
using MakeOutputs = std::function<Outputs(int64_t rows, int64_t width)>;

// The checked arguments of one call, as pointers (the state is updated in place).
struct Rows {
  int64_t* tokens;
  int64_t* windows;
  int64_t* deeps;
  int64_t* metas;
  int64_t* req;
  const int64_t* rid;
  const int64_t* stable_ptr;
  const int64_t* state_ptr;
  const int64_t* limits;  // nullptr: no seq_lens
  int64_t rows;
  int64_t capacity;
  int64_t window_size;
  int64_t deep_size;
  int64_t width;
  int64_t max_seq_len;
};

// Checks every row's values, then updates the rows (int32 or int64 top-k). The output
// buffers are made (or checked) first; the values of every row are checked, and each row's
// distinct count when an overflow is possible, before any row changes: on the calling
// thread when that count is not needed, else in the update's OpenMP region, a barrier
// between the passes. The error of a failing row is raised after the region.
template <typename Token>
void update_rows(const Rows& a, const Token* tk, const MakeOutputs& make_outputs) {
  int64_t* tokens = a.tokens;
  int64_t* windows = a.windows;
  int64_t* deeps = a.deeps;
  int64_t* metas = a.metas;
  int64_t* req = a.req;
  const int64_t* rid = a.rid;
  const int64_t* stable_ptr = a.stable_ptr;
  const int64_t* state_ptr = a.state_ptr;
  const int64_t* limits = a.limits;
  const int64_t rows = a.rows;
  const int64_t capacity = a.capacity;
  const int64_t window_size = a.window_size;
  const int64_t deep_size = a.deep_size;
  const int64_t width = a.width;
  const int64_t max_seq_len = a.max_seq_len;

  const Outputs outputs = make_outputs(rows, width);
  int32_t* out_slots = outputs.slots;
  int32_t* out_counts = outputs.miss_counts;
  int32_t* out_tokens = outputs.miss_tokens;
  int32_t* out_miss_slots = outputs.miss_slots;

  // Pass 1, nothing changes: a bad value flags its row; so does a row selecting more distinct
  // tokens than it has slots (counted only when the width exceeds the capacity).
  std::vector<uint8_t> bad_value(static_cast<size_t>(rows), 0);
  std::vector<int64_t> overflow(static_cast<size_t>(rows), -1);
  const auto check_row = [&](int64_t r) {
    const int64_t limit = limits ? limits[r] : kNoLimit;
    const int64_t state = state_ptr[r];
    const Token* row_topk = tk + r * width;
    const bool bad = stable_ptr[r] < 0 || limit < 0 ||
                     (state != kNotOffloaded && state != kFirstOffload && state != kSteady) ||
                     any_in_range(row_topk, width, max_seq_len, limit);
    bad_value[r] = static_cast<uint8_t>(bad);
    if (!bad && width > capacity && state != kNotOffloaded) {
      Scratch& scratch = thread_scratch();
      scratch.prepare(width, capacity, window_size, deep_size);
      const int64_t count = scratch.count_distinct(row_topk, width, limit);
      if (count > capacity) overflow[r] = count;
    }
  };
  const auto any_failed = [&]() {
    for (int64_t r = 0; r < rows; ++r) {
      if (bad_value[r] != 0 || overflow[r] >= 0) return true;
    }
    return false;
  };

  // Pass 2: the update, one row per task. 64-bit offsets: R * C may exceed 2**31.
  std::vector<int8_t> status(static_cast<size_t>(rows), kOk);
  const auto update_row = [&](int64_t r) {
    const int64_t out_offset = r * width;
    const Token* row_topk = tk + out_offset;
    const int64_t limit = limits ? limits[r] : kNoLimit;
    const RowOut out{out_slots + out_offset, out_counts + r, out_tokens + out_offset,
                     out_miss_slots + out_offset};
    const int64_t state = state_ptr[r];
    if (state == kNotOffloaded) {
      identity_row(row_topk, width, limit, out);
      return;
    }
    RowState row{tokens + r * capacity,
                 LruLog{windows + r * window_size, deeps + r * deep_size, metas + r * kMetaFields,
                        capacity, window_size, deep_size},
                 capacity};
    Scratch& scratch = thread_scratch();
    scratch.prepare(width, capacity, window_size, deep_size);
    if (state == kFirstOffload) {
      first_offload_row(scratch, row, row_topk, width, limit, out);
      req[r] = rid[r];
      return;
    }
    if (req[r] != rid[r]) reset_row_state(row);
    status[r] = steady_row(scratch, row, row_topk, width, limit, stable_ptr[r], out);
    // A corrupt row keeps its state; its outputs are not returned (the call raises).
    if (status[r] == kOk) req[r] = rid[r];
  };

  // Rows are handed out one at a time (dynamic): on a shared machine a thread may be
  // descheduled for milliseconds, and the others take over its rows. One row, one thread or
  // a small step (fewer than kParallelEntries top-k entries in all: a few microseconds of
  // work, less than starting the region costs, and on a loaded host its barrier waits for a
  // descheduled thread's time slice): no OpenMP region to start. Where no row can overflow
  // (K <= C), the checks are a vector compare per row (~0.1 us) and run on the calling
  // thread: the update's region then has one barrier, not two.
  const int threads = rows * width < kParallelEntries
                          ? 1
                          : static_cast<int>(std::max<int64_t>(
                                1, std::min<int64_t>(at::get_num_threads(), rows)));
  if (threads <= 1 || width <= capacity) {
    for (int64_t r = 0; r < rows; ++r) check_row(r);
    if (!any_failed()) {
      if (threads <= 1) {
        for (int64_t r = 0; r < rows; ++r) update_row(r);
      } else {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; ++r) update_row(r);
      }
    }
  } else {
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
      for (int64_t r = 0; r < rows; ++r) check_row(r);
      // (the loop's barrier: every row is checked) every thread sees the same flags
      if (!any_failed()) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; ++r) update_row(r);
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {  // the first bad value, in the words of its check
    if (bad_value[r] == 0) continue;
    const std::string problem =
        check_row_values(r, state_ptr[r], stable_ptr[r], limits ? limits[r] : kNoLimit,
                         tk + r * width, width, max_seq_len);
    TORCH_CHECK_VALUE(false, "residency_update: ", problem);
  }
  for (int64_t r = 0; r < rows; ++r) {
    // kvo_core.residency.inputs.overflow_message, word for word.
    TORCH_CHECK(overflow[r] < 0, "residency overflow: row ", r, " selects ", overflow[r],
                " distinct tokens but the hot buffer has only ", capacity,
                " slots; capacity must be >= the distinct top-k tokens of a row");
  }
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK_VALUE(status[r] == kOk, "residency_update: the state of row ", r,
                      " is corrupt: its LRU order (lru_window, lru_deep, row_meta) does not list "
                      "every slot of [0, ", capacity, ") once; the row was left as it was, "
                      "reset it");
  }
}

// Checks every argument, then the values and the update (update_rows).
void run_update(at::Tensor& slot_tokens, at::Tensor& lru_window, at::Tensor& lru_deep,
                at::Tensor& row_meta, at::Tensor& row_requests, const at::Tensor& topk_in,
                const at::Tensor& request_ids_in, const at::Tensor& stable_lens_in,
                const at::Tensor& states_in, const std::optional<at::Tensor>& seq_lens_in,
                int64_t max_seq_len, const MakeOutputs& make_outputs) {
  const int64_t capacity = check_capacity(slot_tokens, "residency_update");
  const int64_t rows = slot_tokens.size(0);
  check_state(slot_tokens, "slot_tokens", {rows, capacity});
  const int64_t window_size = check_log_width(lru_window, "lru_window", rows, capacity);
  const int64_t deep_size = check_log_width(lru_deep, "lru_deep", rows, capacity);
  check_state(row_meta, "row_meta", {rows, kMetaFields});
  check_state(row_requests, "row_requests", {rows});
  // int32 (what vLLM's indexers give) or int64.
  const at::ScalarType topk_dtype = topk_in.scalar_type();
  TORCH_CHECK_VALUE(topk_dtype == at::kInt || topk_dtype == at::kLong,
                    "residency_update: topk must be int32 or int64, got ", topk_dtype);
  const at::Tensor topk = input_rows(topk_in, "topk", 2, rows, topk_dtype);
  const at::Tensor request_ids = input_rows(request_ids_in, "request_ids", 1, rows);
  const at::Tensor stable_lens = input_rows(stable_lens_in, "stable_lens", 1, rows);
  const at::Tensor states = input_rows(states_in, "states", 1, rows);
  const int64_t width = topk.size(1);
  TORCH_CHECK_VALUE(width >= 1, "residency_update: topk must have at least one column, got "
                    "shape ", topk.sizes());
  TORCH_CHECK_VALUE(width <= (int64_t{1} << 30), "residency_update: topk width ", width,
                    " is too large (at most 2**30)");
  // Tokens are int32 outputs (and share one int64 with their slot in the order, lru_log.h).
  static_assert(kMaxSeqLen <= kTokenLimit, "tokens must fit a packed entry");
  TORCH_CHECK_VALUE(max_seq_len >= 1 && max_seq_len <= kMaxSeqLen, "residency_update: "
                    "max_seq_len must be in [1, 2**31], got ", max_seq_len);
  at::Tensor seq_lens;
  const int64_t* limits = nullptr;
  if (seq_lens_in.has_value()) {
    seq_lens = input_rows(*seq_lens_in, "seq_lens", 1, rows);
    limits = seq_lens.data_ptr<int64_t>();
  }

  const Rows args{slot_tokens.data_ptr<int64_t>(), lru_window.data_ptr<int64_t>(),
                  lru_deep.data_ptr<int64_t>(),    row_meta.data_ptr<int64_t>(),
                  row_requests.data_ptr<int64_t>(), request_ids.data_ptr<int64_t>(),
                  stable_lens.data_ptr<int64_t>(), states.data_ptr<int64_t>(),
                  limits,   rows,   capacity,   window_size,   deep_size,   width,   max_seq_len};
  if (topk_dtype == at::kInt) {
    update_rows(args, topk.data_ptr<int32_t>(), make_outputs);
  } else {
    update_rows(args, topk.data_ptr<int64_t>(), make_outputs);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> residency_update_cpu(
    at::Tensor slot_tokens, at::Tensor lru_window, at::Tensor lru_deep, at::Tensor row_meta,
    at::Tensor row_requests, const at::Tensor& topk, const at::Tensor& request_ids,
    const at::Tensor& stable_lens, const at::Tensor& states,
    const std::optional<at::Tensor>& seq_lens, int64_t max_seq_len) {
  at::Tensor slots, miss_counts, miss_tokens, miss_slots;
  run_update(slot_tokens, lru_window, lru_deep, row_meta, row_requests, topk, request_ids,
             stable_lens, states, seq_lens, max_seq_len, [&](int64_t rows, int64_t width) {
               const auto options = topk.options().dtype(at::kInt);
               slots = at::empty({rows, width}, options);
               miss_counts = at::empty({rows}, options);
               miss_tokens = at::empty({rows, width}, options);
               miss_slots = at::empty({rows, width}, options);
               return Outputs{slots.data_ptr<int32_t>(), miss_counts.data_ptr<int32_t>(),
                              miss_tokens.data_ptr<int32_t>(), miss_slots.data_ptr<int32_t>()};
             });
  return {slots, miss_counts, miss_tokens, miss_slots};
}

// The bytes a tensor's elements can occupy, [first, last + 1), whatever its strides.
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t low = 0;
  int64_t high = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d);
    (reach < 0 ? low : high) += reach;
  }
  const auto item = static_cast<int64_t>(t.element_size());
  return {base + static_cast<uintptr_t>(low * item),
          base + static_cast<uintptr_t>((high + 1) * item)};
}

// A tensor with the name an error message gives it.
struct Named {
  const char* name;
  const at::Tensor* tensor;
};

// An output buffer of the caller: int32, contiguous, the call's shape, and sharing no memory
// with anything the call reads or writes (the op reads topk while it writes slots).
void check_output(const at::Tensor& out, const char* name, at::IntArrayRef shape,
                  const std::vector<Named>& others) {
  check_tensor(out, name, at::kInt, static_cast<int64_t>(shape.size()));
  TORCH_CHECK_VALUE(out.sizes() == shape, "residency_update: ", name, " must have shape ",
                    shape, ", got ", out.sizes());
  TORCH_CHECK_VALUE(out.is_contiguous(), "residency_update: ", name, " must be contiguous");
  const auto [begin, end] = byte_span(out);
  for (const Named& other : others) {
    const at::Tensor& t = *other.tensor;
    if (!t.defined() || t.numel() == 0 || out.numel() == 0) continue;
    const auto [other_begin, other_end] = byte_span(t);
    TORCH_CHECK_VALUE(end <= other_begin || other_end <= begin, "residency_update: ", name,
                      " shares memory with ", other.name, "; pass separate buffers");
  }
}

// The same update, written into the caller's buffers (e.g. allocated once for a decode loop or
// a captured graph). Every buffer is checked before anything changes.
void residency_update_out_cpu(at::Tensor slot_tokens, at::Tensor lru_window, at::Tensor lru_deep,
                              at::Tensor row_meta, at::Tensor row_requests,
                              const at::Tensor& topk, const at::Tensor& request_ids,
                              const at::Tensor& stable_lens, const at::Tensor& states,
                              const std::optional<at::Tensor>& seq_lens, int64_t max_seq_len,
                              at::Tensor slots, at::Tensor miss_counts, at::Tensor miss_tokens,
                              at::Tensor miss_slots) {
  const at::Tensor no_seq_lens;
  const at::Tensor& lens = seq_lens.has_value() ? *seq_lens : no_seq_lens;
  run_update(slot_tokens, lru_window, lru_deep, row_meta, row_requests, topk, request_ids,
             stable_lens, states, seq_lens, max_seq_len, [&](int64_t rows, int64_t width) {
               // Each buffer against everything the call reads or writes, and the buffers
               // after it (checked last to first, so each pair once).
               std::vector<Named> others = {
                   {"slot_tokens", &slot_tokens}, {"lru_window", &lru_window},
                   {"lru_deep", &lru_deep},       {"row_meta", &row_meta},
                   {"row_requests", &row_requests}, {"topk", &topk},
                   {"request_ids", &request_ids}, {"stable_lens", &stable_lens},
                   {"states", &states},           {"seq_lens", &lens}};
               const Named outputs[] = {{"out.slots", &slots},
                                        {"out.miss_counts", &miss_counts},
                                        {"out.miss_tokens", &miss_tokens},
                                        {"out.miss_slots", &miss_slots}};
               for (int i = 3; i >= 0; --i) {
                 const std::vector<int64_t> shape =
                     i == 1 ? std::vector<int64_t>{rows} : std::vector<int64_t>{rows, width};
                 check_output(*outputs[i].tensor, outputs[i].name, shape, others);
                 others.push_back(outputs[i]);
               }
               return Outputs{slots.data_ptr<int32_t>(), miss_counts.data_ptr<int32_t>(),
                              miss_tokens.data_ptr<int32_t>(), miss_slots.data_ptr<int32_t>()};
             });
}

// [R, C] int64: each row's slots, least recently used first (the deep log, then the window).
at::Tensor residency_lru_order_cpu(const at::Tensor& slot_tokens, const at::Tensor& lru_window,
                                   const at::Tensor& lru_deep, const at::Tensor& row_meta) {
  const int64_t capacity = check_capacity(slot_tokens, "residency_lru_order");
  const int64_t rows = slot_tokens.size(0);
  const int64_t window_size = check_log_width(lru_window, "lru_window", rows, capacity);
  const int64_t deep_size = check_log_width(lru_deep, "lru_deep", rows, capacity);
  check_state(row_meta, "row_meta", {rows, kMetaFields});
  at::Tensor order = at::empty({rows, capacity}, slot_tokens.options());
  int64_t* out = order.data_ptr<int64_t>();
  std::vector<uint8_t> seen(static_cast<size_t>(capacity));
  for (int64_t r = 0; r < rows; ++r) {
    LruLog lru{lru_window.data_ptr<int64_t>() + r * window_size,
               lru_deep.data_ptr<int64_t>() + r * deep_size,
               row_meta.data_ptr<int64_t>() + r * kMetaFields, capacity, window_size, deep_size};
    const int64_t head = lru.head();
    const int64_t tail = lru.tail();
    const int64_t window_len = lru.window_len();
    bool ok = head >= 0 && head <= tail && tail - head <= deep_size && window_len >= 0 &&
              window_len <= capacity;
    std::fill(seen.begin(), seen.end(), uint8_t{0});
    int64_t count = 0;
    const auto visit = [&](int64_t entry) {
      const int64_t slot = packed_slot(entry);
      if (entry == kTombstone) return;
      if (slot >= capacity || seen[slot] || count >= capacity) {
        ok = false;
        return;
      }
      seen[slot] = 1;
      out[r * capacity + count++] = slot;
    };
    for (int64_t p = head; ok && p < tail; ++p) visit(lru.deep_at(p));
    for (int64_t i = 0; ok && i < window_len; ++i) {
      if (lru.window[i] < 0) ok = false;
      else visit(lru.window[i]);
    }
    TORCH_CHECK_VALUE(ok && count == capacity, "residency_lru_order: the LRU order of row ", r,
                      " does not list every slot of [0, ", capacity, ") once; reset the row");
  }
  return order;
}

}  // namespace
}  // namespace kvo_residency

// A fragment: the Python side of kvo-kernels may define other ops in the kvo namespace.
TORCH_LIBRARY_FRAGMENT(kvo, m) {
  m.def(
      "residency_update(Tensor(a!) slot_tokens, Tensor(b!) lru_window, Tensor(c!) lru_deep, "
      "Tensor(d!) row_meta, Tensor(e!) row_requests, Tensor topk, Tensor request_ids, "
      "Tensor stable_lens, Tensor states, Tensor? seq_lens, int max_seq_len) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "residency_update_out(Tensor(a!) slot_tokens, Tensor(b!) lru_window, Tensor(c!) lru_deep, "
      "Tensor(d!) row_meta, Tensor(e!) row_requests, Tensor topk, Tensor request_ids, "
      "Tensor stable_lens, Tensor states, Tensor? seq_lens, int max_seq_len, Tensor(f!) slots, "
      "Tensor(g!) miss_counts, Tensor(h!) miss_tokens, Tensor(i!) miss_slots) -> ()");
  m.def(
      "residency_lru_order(Tensor slot_tokens, Tensor lru_window, Tensor lru_deep, "
      "Tensor row_meta) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvo, CPU, m) {
  m.impl("residency_update", &kvo_residency::residency_update_cpu);
  m.impl("residency_update_out", &kvo_residency::residency_update_out_cpu);
  m.impl("residency_lru_order", &kvo_residency::residency_lru_order_cpu);
}

// The same function as a plain Python binding: NativeResidencyTable calls it this way, which
// skips the dispatcher's boxing of eleven arguments (~5 us a call here). The GIL is released
// while it runs (it touches no Python object); errors translate to the same Python exceptions
// (ValueError for TORCH_CHECK_VALUE, RuntimeError otherwise).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("residency_update", &kvo_residency::residency_update_cpu,
        "torch.ops.kvo.residency_update without the dispatcher",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("residency_update_out", &kvo_residency::residency_update_out_cpu,
        "torch.ops.kvo.residency_update_out without the dispatcher",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sparse_copy", &kvo_copy::sparse_copy_cpu,
        "kvo::sparse_copy's host implementation (csrc/sparse_copy.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sparse_copy_gather", &kvo_copy::sparse_copy_gather_cpu,
        "kvo::sparse_copy_gather's host implementation (csrc/sparse_copy.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("copy_residency_misses", &kvo_copy::copy_residency_misses_cpu,
        "a residency update's miss copies, pool -> hot buffer (csrc/sparse_copy.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("row_serials", &kvo_identity::row_serials_cpu,
        "the offload path's request serials of batch rows (csrc/row_identity.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pool_write_rows", &kvo_identity::pool_write_rows_cpu,
        "the offload path's pool write and block versions (csrc/row_identity.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("identity_decode_lane", &kvo_identity::identity_decode_lane_cpu,
        "row_serials + identity_decode_step in the steady state of short requests, or "
        "nothing (csrc/row_identity.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("identity_decode_step", &kvo_identity::identity_decode_step_cpu,
        "a decode step of NOT_OFFLOADED rows: new rows to their identity slots, hot slots "
        "of the top-k (csrc/row_identity.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
