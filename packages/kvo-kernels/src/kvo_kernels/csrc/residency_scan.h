// The loops of a steady step that touch every entry: the look-up of each selected token in
// the window, the filter pass over the deep log, and the check of every row's values. The
// last two also have an AVX2 version (x86-64 with GCC or Clang, chosen at run time where the
// CPU has AVX2; the filter gathers its words four at a time, ~1.7x faster here). An AVX2
// look-up measured no faster than the branch-free portable one, so there is none. Both give
// the same results; KVO_RESIDENCY_SCALAR=1 forces the portable loops (the tests run both).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include "lru_log.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVO_RESIDENCY_AVX2 1
#endif

namespace kvo_residency {

// The window index's cell of a token: its low bits (cell_mask = cells - 1, at least 2**15
// cells). Positions are dense, so tokens within 2**15 of each other (any two of a 32K-token
// sequence) never share a cell; tokens a multiple of the cell count apart do, which only
// sends one of them to the slow path. (Measured here: ~10% of a row-step faster at 32K
// tokens than a Fibonacci hash into 2C cells, whose collisions sent ~10% of the hits there.)
constexpr uint64_t kMinWindowCells = uint64_t{1} << 15;

inline uint64_t window_cell(int64_t token, uint64_t cell_mask) {
  return static_cast<uint64_t>(token) & cell_mask;
}

inline bool use_avx2() {
  static const bool enabled = [] {
#ifdef KVO_RESIDENCY_AVX2
    const char* scalar = std::getenv("KVO_RESIDENCY_SCALAR");
    return __builtin_cpu_supports("avx2") && !(scalar != nullptr && scalar[0] == '1');
#else
    return false;
#endif
  }();
  return enabled;
}

// Where the selected tokens are in the window. For every position k: a token in [0,
// hit_limit) whose window entry (found through `window_index`) holds it is a hit:
// slots[k] = its slot and window_hit[its window position] = 1; otherwise slots[k] = -1 and,
// if the token is valid ([0, limit)), k is appended to `slow`. Returns how many were.
// Masks, not conditionals, keep the loop free of branches. (Measured here: appending to
// `slow` in this loop beats a second pass over per-position flags; marking through a
// conditional address instead of the read-modify-write is slower.)
struct WindowLookup {
  const uint16_t* window_index;
  uint64_t cell_mask;
  const int64_t* window;
  uint64_t window_mask;
  int64_t hit_limit;  // min(limit, stable length, kTokenLimit)
  int64_t limit;
};

template <typename Token>
inline int64_t look_up_window(const WindowLookup& w, const Token* __restrict topk,
                              int64_t width, int32_t* __restrict slots,
                              uint8_t* __restrict window_hit, int64_t* __restrict slow) {
  const auto hit_limit = static_cast<uint64_t>(w.hit_limit);
  const auto limit = static_cast<uint64_t>(w.limit);
  int64_t num_slow = 0;
  for (int64_t k = 0; k < width; ++k) {
    const int64_t token = topk[k];
    const uint64_t at =
        static_cast<uint64_t>(w.window_index[window_cell(token, w.cell_mask)]) & w.window_mask;
    const int64_t entry = w.window[at];
    const uint64_t hit = static_cast<uint64_t>(static_cast<uint64_t>(token) < hit_limit) &
                         static_cast<uint64_t>(packed_token(entry) == token);
    slots[k] = static_cast<int32_t>(packed_slot(entry) | static_cast<int64_t>(hit - 1));
    window_hit[at] |= static_cast<uint8_t>(hit);
    slow[num_slow] = k;
    num_slow += static_cast<int64_t>(static_cast<uint64_t>(static_cast<uint64_t>(token) < limit) &
                                     (hit ^ 1));
  }
  return num_slow;
}

// The indices i in [begin, end) of `entries` whose token may be one of the slow tokens: in
// [0, token_bound) with its bit set in `filter`. Appends them to `found`; returns the count.
// token_bound <= kTokenLimit, so tombstones and empty entries never pass.
inline int64_t filter_portable(const int64_t* __restrict entries, int64_t begin, int64_t end,
                               const uint64_t* __restrict filter, uint64_t filter_mask,
                               int64_t token_bound, int64_t* __restrict found) {
  int64_t count = 0;
  const auto bound = static_cast<uint64_t>(token_bound);
  for (int64_t i = begin; i < end; ++i) {
    const auto token = static_cast<uint64_t>(packed_token(entries[i]));  // negative: huge
    const uint64_t bit = token & filter_mask;
    if ((static_cast<uint64_t>(token < bound) & (filter[bit >> 6] >> (bit & 63))) != 0) {
      found[count++] = i;
    }
  }
  return count;
}

#ifdef KVO_RESIDENCY_AVX2
__attribute__((target("avx2"))) inline int64_t filter_avx2(
    const int64_t* __restrict entries, int64_t begin, int64_t end,
    const uint64_t* __restrict filter, uint64_t filter_mask, int64_t token_bound,
    int64_t* __restrict found) {
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(filter_mask));
  const __m256i bit_in_word = _mm256_set1_epi64x(63);
  const __m256i one = _mm256_set1_epi64x(1);
  const __m256i bound = _mm256_set1_epi64x(token_bound);
  int64_t count = 0;
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    const __m256i entry = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(entries + i));
    // Logical shift: tombstones and empty entries become >= 2**43 >= token_bound.
    const __m256i token = _mm256_srli_epi64(entry, kSlotBits);
    const __m256i bit = _mm256_and_si256(token, mask);
    const __m256i word = _mm256_i64gather_epi64(reinterpret_cast<const long long*>(filter),
                                                _mm256_srli_epi64(bit, 6), 8);
    const __m256i set = _mm256_cmpeq_epi64(
        _mm256_and_si256(_mm256_srlv_epi64(word, _mm256_and_si256(bit, bit_in_word)), one), one);
    int lanes = _mm256_movemask_pd(
        _mm256_castsi256_pd(_mm256_and_si256(set, _mm256_cmpgt_epi64(bound, token))));
    while (lanes != 0) {
      found[count++] = i + __builtin_ctz(lanes);
      lanes &= lanes - 1;
    }
  }
  return count + filter_portable(entries, i, end, filter, filter_mask, token_bound,
                                 found + count);
}
#endif

#ifdef KVO_RESIDENCY_AVX2
// Eight entries at a time: the filter words gathered, the passing indices compressed out.
__attribute__((target("avx512f"))) inline int64_t filter_avx512(
    const int64_t* __restrict entries, int64_t begin, int64_t end,
    const uint64_t* __restrict filter, uint64_t filter_mask, int64_t token_bound,
    int64_t* __restrict found) {
  const __m512i mask = _mm512_set1_epi64(static_cast<int64_t>(filter_mask));
  const __m512i bit_in_word = _mm512_set1_epi64(63);
  const __m512i one = _mm512_set1_epi64(1);
  const __m512i bound = _mm512_set1_epi64(token_bound);
  __m512i index = _mm512_add_epi64(_mm512_set1_epi64(begin),
                                   _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
  const __m512i eight = _mm512_set1_epi64(8);
  int64_t count = 0;
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m512i entry = _mm512_loadu_si512(entries + i);
    // Logical shift: tombstones and empty entries become >= 2**43 >= token_bound.
    const __m512i token = _mm512_srli_epi64(entry, kSlotBits);
    const __m512i bit = _mm512_and_si512(token, mask);
    const __m512i word = _mm512_i64gather_epi64(_mm512_srli_epi64(bit, 6), filter, 8);
    const __m512i shifted = _mm512_srlv_epi64(word, _mm512_and_si512(bit, bit_in_word));
    const __mmask8 pass = _mm512_mask_test_epi64_mask(
        _mm512_cmplt_epu64_mask(token, bound), shifted, one);
    _mm512_mask_compressstoreu_epi64(found + count, pass, index);
    count += __builtin_popcount(pass);
    index = _mm512_add_epi64(index, eight);
  }
  return count + filter_portable(entries, i, end, filter, filter_mask, token_bound,
                                 found + count);
}

inline bool use_avx512() {
  static const bool enabled = [] {
    const char* scalar = std::getenv("KVO_RESIDENCY_SCALAR");
    return __builtin_cpu_supports("avx512f") && !(scalar != nullptr && scalar[0] == '1');
  }();
  return enabled;
}
#endif

inline int64_t filter_entries(const int64_t* entries, int64_t begin, int64_t end,
                              const uint64_t* filter, uint64_t filter_mask, int64_t token_bound,
                              int64_t* found) {
#ifdef KVO_RESIDENCY_AVX2
  if (use_avx512()) {
    return filter_avx512(entries, begin, end, filter, filter_mask, token_bound, found);
  }
  if (use_avx2()) {
    return filter_avx2(entries, begin, end, filter, filter_mask, token_bound, found);
  }
#endif
  return filter_portable(entries, begin, end, filter, filter_mask, token_bound, found);
}

// Whether any of values[0, count) lies in [low, high): the check that no valid top-k entry
// reaches max_seq_len, run over every row before anything changes.
template <typename Token>
inline bool any_in_range_portable(const Token* values, int64_t begin, int64_t count,
                                  int64_t low, int64_t high) {
  uint64_t any = 0;
  for (int64_t k = begin; k < count; ++k) {
    any |= static_cast<uint64_t>(values[k] >= low) & static_cast<uint64_t>(values[k] < high);
  }
  return any != 0;
}

#ifdef KVO_RESIDENCY_AVX2
__attribute__((target("avx2"))) inline bool any_in_range_avx2(const int64_t* values,
                                                             int64_t count, int64_t low,
                                                             int64_t high) {
  const __m256i below_low = _mm256_set1_epi64x(low - 1);
  const __m256i high_v = _mm256_set1_epi64x(high);
  __m256i any = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 4 <= count; k += 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + k));
    any = _mm256_or_si256(any, _mm256_and_si256(_mm256_cmpgt_epi64(v, below_low),
                                                _mm256_cmpgt_epi64(high_v, v)));
  }
  return !_mm256_testz_si256(any, any) || any_in_range_portable(values, k, count, low, high);
}
#endif

inline bool any_in_range(const int64_t* values, int64_t count, int64_t low, int64_t high) {
  if (high <= low) return false;  // e.g. seq_lens below max_seq_len: nothing to look for
#ifdef KVO_RESIDENCY_AVX2
  if (use_avx2()) return any_in_range_avx2(values, count, low, high);
#endif
  return any_in_range_portable(values, 0, count, low, high);
}

// int32 top-k: compared as int32 (the bounds clamped), the loop vectorises with SSE2 alone.
inline bool any_in_range(const int32_t* values, int64_t count, int64_t low, int64_t high) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (high <= low || low > kInt32Max) return false;
  const auto low32 = static_cast<int32_t>(std::max<int64_t>(low, -kInt32Max));
  const auto last32 = static_cast<int32_t>(std::min<int64_t>(high - 1, kInt32Max));
  uint32_t any = 0;
  for (int64_t k = 0; k < count; ++k) {
    any |= static_cast<uint32_t>(values[k] >= low32) & static_cast<uint32_t>(values[k] <= last32);
  }
  return any != 0;
}

}  // namespace kvo_residency
