// The residency rules of DESIGN.md section 6 for one row, in plain C++ (no torch): the
// algorithm behind torch.ops.kvo.residency_update (residency.cpp holds the op around it).
//
// Per row the work is O(K + C): the selected tokens go into a small open-addressing hash (4x
// the selection, power of two) fronted by a 1-bit filter, then the slot table and the LRU order
// are each walked once. Nothing is sized by token ids, so a 128K (or 2**40) token position
// costs the same as a small one. Offsets and ids are 64-bit.

#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

namespace kvo_residency {

constexpr int64_t kNotOffloaded = -3;
constexpr int64_t kFirstOffload = -2;
constexpr int64_t kSteady = -1;

constexpr int64_t kEmptyKey = std::numeric_limits<int64_t>::min();
constexpr uint8_t kHit = 1;

// Per-row outcome, reported after the parallel region (exceptions must not cross OpenMP).
enum RowStatus : int8_t { kOk = 0, kBadLruOrder = 1 };

// Where a row's valid top-k entries end: position >= limit is padding (seq_lens), like < 0.
constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

inline uint64_t next_pow2(uint64_t v) {
  uint64_t p = 16;
  while (p < v) p <<= 1;
  return p;
}

// Reusable per-thread buffers: sized once for the largest K and C seen, then only refilled.
// The selected tokens live in an open-addressing hash (linear probing, 4x the width, power of
// two: short probe chains, few branch misses); everything known about a selected token is
// kept by its cell, so a probe touches only the key array.
struct Scratch {
  std::vector<int64_t> keys;            // per cell: token, or kEmptyKey
  std::vector<int64_t> cell_slot;       // per cell: the token's slot, -1 while a miss; one
                                        // extra cell (the "padding cell") stays -1 forever
  std::vector<int64_t> distinct_cells;  // cells of the distinct tokens, first-occurrence order
  std::vector<int64_t> position_cell;   // per top-k position: its token's cell, or padding cell
  std::vector<uint64_t> filter;         // 1 bit per (token & filter_mask): cheap "not selected"
  std::vector<uint8_t> slot_flags;      // per slot: kHit
  std::vector<int64_t> candidates;      // slots whose token passed the filter
  std::vector<int64_t> evictable;       // slots not holding a selected token, LRU order
  std::vector<int64_t> hit_slots;       // slots holding a selected token, LRU order
  std::vector<int64_t> sorted_tokens;   // first offload: distinct tokens ascending
  uint64_t hash_mask = 0;
  int hash_shift = 0;
  int64_t padding_cell = 0;
  uint64_t filter_mask = 0;

  void prepare(int64_t width, int64_t capacity) {
    const uint64_t size = next_pow2(static_cast<uint64_t>(4 * width));
    if (keys.size() != size) {
      keys.assign(size, kEmptyKey);
      cell_slot.assign(size + 1, -1);
      hash_mask = size - 1;
      hash_shift = 64 - __builtin_ctzll(size);
      padding_cell = static_cast<int64_t>(size);
    }
    const uint64_t filter_bits =
        std::max<uint64_t>(64, next_pow2(static_cast<uint64_t>(16 * width)));
    if (filter.size() * 64 != filter_bits) {
      filter.assign(filter_bits / 64, 0);
      filter_mask = filter_bits - 1;
    }
    if (static_cast<int64_t>(distinct_cells.size()) < width) {
      distinct_cells.resize(width);
      position_cell.resize(width);
      sorted_tokens.resize(width);
    }
    if (static_cast<int64_t>(slot_flags.size()) < capacity) {
      slot_flags.resize(capacity);
      candidates.resize(capacity);
      evictable.resize(capacity);
      hit_slots.resize(capacity);
    }
  }

  uint64_t cell_of(int64_t token) const {
    return (static_cast<uint64_t>(token) * 0x9E3779B97F4A7C15ULL) >> hash_shift;
  }

  // The token's cell, or -1 when it is not selected.
  int64_t find(int64_t token) const {
    uint64_t cell = cell_of(token);
    while (true) {
      const int64_t key = keys[cell];
      if (key == token) return static_cast<int64_t>(cell);
      if (key == kEmptyKey) return -1;
      cell = (cell + 1) & hash_mask;
    }
  }

  // Collects the distinct valid tokens of one top-k row; returns how many. Entries < 0 or
  // >= limit are padding.
  int64_t collect(const int64_t* topk, int64_t width, int64_t limit) {
    int64_t count = 0;
    int64_t* keys_ = keys.data();
    for (int64_t k = 0; k < width; ++k) {
      const int64_t token = topk[k];
      if (token < 0 || token >= limit) {
        position_cell[k] = padding_cell;
        continue;
      }
      uint64_t cell = cell_of(token);
      while (true) {
        const int64_t key = keys_[cell];
        if (key == token) break;
        if (key == kEmptyKey) {
          keys_[cell] = token;
          cell_slot[cell] = -1;
          distinct_cells[count++] = static_cast<int64_t>(cell);
          const uint64_t bit = static_cast<uint64_t>(token) & filter_mask;
          filter[bit >> 6] |= uint64_t{1} << (bit & 63);
          break;
        }
        cell = (cell + 1) & hash_mask;
      }
      position_cell[k] = static_cast<int64_t>(cell);
    }
    return count;
  }

  // Leaves the hash and the filter empty again: O(distinct), not O(table).
  void clear(int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t cell = distinct_cells[i];
      const uint64_t bit = static_cast<uint64_t>(keys[cell]) & filter_mask;
      filter[bit >> 6] = 0;  // every bit in the filter came from one of these tokens
      keys[cell] = kEmptyKey;
    }
  }
};

// The thread-local holds only a pointer: code that uses a thread_local object directly gets
// its address recomputed (a __tls_get_addr call) inside every loop; a heap object does not.
inline Scratch& thread_scratch() {
  thread_local std::unique_ptr<Scratch> scratch;
  if (!scratch) scratch = std::make_unique<Scratch>();
  return *scratch;
}

struct RowOut {
  int64_t* slots;
  int64_t* miss_count;
  int64_t* miss_tokens;
  int64_t* miss_slots;
};

inline void reset_row(int64_t* slot_tokens, int64_t* lru, int64_t capacity) {
  std::fill(slot_tokens, slot_tokens + capacity, int64_t{-1});
  for (int64_t i = 0; i < capacity; ++i) lru[i] = i;
}

inline void write_outputs(const Scratch& s, int64_t width, int64_t misses,
                          const RowOut& out) {
  const int64_t* cell_slot = s.cell_slot.data();
  const int64_t* position_cell = s.position_cell.data();
  for (int64_t k = 0; k < width; ++k) out.slots[k] = cell_slot[position_cell[k]];
  *out.miss_count = misses;
  std::fill(out.miss_tokens + misses, out.miss_tokens + width, int64_t{-1});
  std::fill(out.miss_slots + misses, out.miss_slots + width, int64_t{-1});
}

// Identity mapping: the row is not offloaded, every selected position is its own slot.
inline void identity_row(const int64_t* topk, int64_t width, int64_t limit,
                         const RowOut& out) {
  for (int64_t k = 0; k < width; ++k) {
    const int64_t token = topk[k];
    out.slots[k] = (token < 0 || token >= limit) ? -1 : token;
  }
  *out.miss_count = 0;
  std::fill(out.miss_tokens, out.miss_tokens + width, int64_t{-1});
  std::fill(out.miss_slots, out.miss_slots + width, int64_t{-1});
}

// First offload: reset, then the distinct tokens in ascending order fill slots 0..n-1 (the
// same as a steady update after a reset, with the misses taken in ascending token order).
inline void first_offload_row(Scratch& s, int64_t count, int64_t* slot_tokens, int64_t* lru,
                              int64_t capacity, int64_t width, const RowOut& out) {
  for (int64_t i = 0; i < count; ++i) s.sorted_tokens[i] = s.keys[s.distinct_cells[i]];
  std::sort(s.sorted_tokens.begin(), s.sorted_tokens.begin() + count);
  reset_row(slot_tokens, lru, capacity);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t token = s.sorted_tokens[i];
    s.cell_slot[s.find(token)] = i;
    slot_tokens[i] = token;
    out.miss_tokens[i] = token;
    out.miss_slots[i] = i;
  }
  // New LRU: the unused slots count..C-1, then the filled ones in miss order.
  for (int64_t i = 0; i < capacity - count; ++i) lru[i] = count + i;
  for (int64_t i = 0; i < count; ++i) lru[capacity - count + i] = i;
  write_outputs(s, width, count, out);
}

// Steady update: hits keep their slot, misses take the evictable slots in LRU order.
// Reads and checks everything first; returns kBadLruOrder (row untouched) on a corrupt state.
// `count` distinct tokens were collected into `s` (at most the capacity: checked before).
inline RowStatus steady_row(Scratch& s, int64_t count, int64_t* slot_tokens, int64_t* lru,
                            int64_t capacity, int64_t stable_len, int64_t width,
                            const RowOut& out) {
  // Walk the slots for hits. Tokens at or past the stable length count as dropped already.
  // A branch-free filter pass first; exact hash look-ups only for the slots that pass it.
  uint8_t* flags = s.slot_flags.data();
  int64_t* candidates = s.candidates.data();
  std::fill(flags, flags + capacity, uint8_t{0});
  int64_t dropped = 0;
  int64_t num_candidates = 0;
  const uint64_t* filter = s.filter.data();
  const uint64_t filter_mask = s.filter_mask;
  for (int64_t slot = 0; slot < capacity; ++slot) {
    const int64_t token = slot_tokens[slot];
    dropped += token >= stable_len;
    const uint64_t live = static_cast<uint64_t>(token) < static_cast<uint64_t>(stable_len);
    const uint64_t bit = static_cast<uint64_t>(token) & filter_mask;
    candidates[num_candidates] = slot;
    num_candidates += live & (filter[bit >> 6] >> (bit & 63)) & 1;
  }
  int64_t distinct_hits = 0;
  for (int64_t i = 0; i < num_candidates; ++i) {
    const int64_t slot = candidates[i];
    const int64_t cell = s.find(slot_tokens[slot]);
    if (cell >= 0) {
      distinct_hits += s.cell_slot[cell] < 0;
      s.cell_slot[cell] = slot;
      flags[slot] = kHit;
    }
  }
  // Walk the LRU order (least recent first). Every entry is bounds-checked; that it is a
  // permutation is the op's own invariant (checking it exactly would cost a random
  // read-modify-write per slot), and a repeated slot cannot make anything go out of bounds.
  int64_t* evictable = s.evictable.data();
  int64_t* hit_slots = s.hit_slots.data();
  int64_t num_evictable = 0;
  int64_t num_hits = 0;
  uint64_t bad = 0;
  for (int64_t i = 0; i < capacity; ++i) {
    int64_t slot = lru[i];
    const uint64_t outside = static_cast<uint64_t>(slot) >= static_cast<uint64_t>(capacity);
    slot = outside ? 0 : slot;
    bad |= outside;
    const int64_t hit = flags[slot] & kHit;
    evictable[num_evictable] = slot;
    hit_slots[num_hits] = slot;
    num_evictable += 1 - hit;
    num_hits += hit;
  }
  // A corrupt state (a slot outside [0, C), or a token held twice so that too few slots are
  // evictable) leaves the row as it was.
  if (bad || num_evictable < count - distinct_hits) return kBadLruOrder;

  // Everything is checked: change the row.
  if (dropped > 0) {
    for (int64_t slot = 0; slot < capacity; ++slot) {
      if (slot_tokens[slot] >= stable_len) slot_tokens[slot] = -1;
    }
  }
  int64_t misses = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t cell = s.distinct_cells[i];
    if (s.cell_slot[cell] >= 0) continue;
    const int64_t slot = evictable[misses];
    const int64_t token = s.keys[cell];
    s.cell_slot[cell] = slot;
    slot_tokens[slot] = token;
    out.miss_tokens[misses] = token;
    out.miss_slots[misses] = slot;
    ++misses;
  }
  // New LRU: [evictable left unused..., just filled (miss order)..., hits...]; the filled
  // slots are the first `misses` evictable ones, so this is a rotation plus the hits.
  int64_t* cursor = std::copy(evictable + misses, evictable + num_evictable, lru);
  cursor = std::copy(evictable, evictable + misses, cursor);
  std::copy(hit_slots, hit_slots + num_hits, cursor);
  write_outputs(s, width, misses, out);
  return kOk;
}

}  // namespace kvo_residency
