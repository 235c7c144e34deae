// The residency rules of docs/design.md section 6 for one row, in plain C++ (no torch): the
// algorithm behind torch.ops.kvo.residency_update (residency.cpp holds the op around it).
//
// A row keeps its slot tokens and its LRU order as [deep log..., window...] (lru_log.h),
// where the window is what the last step selected. A steady step:
// 1. indexes the window in a per-thread table and looks every selected token up there: a
//    decode step re-selects most of the last one, so most hits are found with two loads and
//    no branch (residency_scan.h);
// 2. collects the other selected tokens (misses, and hits deeper in the order) in a small
//    per-thread hash with a bit filter in front;
// 3. reads the window once to count its hits (and find any the index lost to a collision),
//    and the deep log once (a filter test per entry, AVX2 where the CPU has it) to find the
//    deep hits and, from its head, the misses' victims;
// 4. rewrites the window, the old one split on the way: its hits stay in the window, the
//    rest is appended to the deep log.
// Every random access lands in per-thread tables that stay in cache from row to row; the
// row's own arrays are read front to back, which is what a cold table (each layer's, when its
// turn comes) costs least for. So the work is O(K) random accesses plus one streamed pass
// over the deep log (O(C), a few cycles an entry). The O(K)-only design, a per-row token
// index next to a linked or logged LRU order, was built first and measured slower here: it
// pays ~1000 cold random reads and writes a row-step (look-ups, insertions, deletions), and
// such a read costs the host CPU far more than streaming the whole deep log (see the report
// of issue 4). So was a per-row token -> slot array (16-bit slots, one load per look-up, no
// window index; built and checked equal to this one in a C++ harness): about as fast at
// R=1, 2-3x slower at R=32, where each row's state is out of L2 when its turn comes and 2048
// independent loads into it cost 12-20 ns each on this machine (~3.5 ns in L2, ~1 in L1).
// Other O(C) work happens only on a reset (new request, first offload), on a speculative
// drop, and when the deep log is compacted (rare). Everything followed in the
// state is checked before anything changes: a corrupt row is reported and left as it was,
// never followed out of bounds. Offsets and ids are 64-bit.

#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>


#include "lru_log.h"
#include "residency_scan.h"

namespace kvo_residency {

constexpr int64_t kNotOffloaded = -3;
constexpr int64_t kFirstOffload = -2;
constexpr int64_t kSteady = -1;
constexpr int64_t kEmpty = -1;

// Per-row outcome, reported after the parallel region (exceptions must not cross OpenMP).
enum RowStatus : int8_t { kOk = 0, kCorruptOrder = 1 };

// Where a row's valid top-k entries end: position >= limit is padding (seq_lens), like < 0.
constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

constexpr uint64_t kHashMultiplier = 0x9E3779B97F4A7C15ULL;  // Fibonacci hashing

inline uint64_t next_pow2(uint64_t v) {
  uint64_t p = 16;
  while (p < v) p <<= 1;
  return p;
}

// One row of the table's state (pointers into the op's tensors).
struct RowState {
  int64_t* tokens;  // [C] the token each slot holds, kEmpty when none
  LruLog lru;
  int64_t capacity;

  int64_t& max_resident() { return lru.meta[kMetaMaxResident]; }
};

// A row's outputs: int32 like upstream's (slots < 2**20, tokens < 2**31: checked by the op).
struct RowOut {
  int32_t* slots;
  int32_t* miss_count;
  int32_t* miss_tokens;
  int32_t* miss_slots;
};

// One cell of the scratch hash: a selected token (valid tokens are < 2**31: the op checks
// max_seq_len) and its slot, side by side so that an insertion or a look-up touches one
// cache line (a step's hash is cold when its row's turn comes).
struct Cell {
  uint32_t key;  // the token, or kFreeKey
  int32_t slot;  // its slot, -1 while unknown
};

// A deep log entry met by the scan, with its log position.
struct Met {
  int64_t position;
  int64_t entry;
};

// Reusable per-thread buffers, sized once for the largest K and C seen, then only refilled;
// all the random accesses of a step land here.
struct Scratch {
  // The distinct selected tokens the window did not answer: open addressing (>= 2x the
  // width, a power of two), emptied in O(distinct), with a bit filter (16 bits per token)
  // that lets the log scans skip nearly every entry without probing.
  std::vector<Cell> cells;
  std::vector<int64_t> distinct_cells;  // first-occurrence order
  std::vector<uint64_t> filter;
  // The window's index: window_cell(token) -> window position. Only a hint: a position is
  // used only when the window entry there holds the token. 16 bits: half the cache lines of
  // int32 for the 2**15+ cells (measured ~10% of a cold row-step at 32K tokens). The window
  // holds at most K entries (K = 2048 for DSA); past 2**16 an entry's position is stored
  // truncated, never matches, and its hits take the slow path (right, only slower).
  std::vector<uint16_t> window_index;
  std::vector<int64_t> filtered;        // deep log indices the filter let through
  std::vector<int64_t> slow;            // positions the window did not answer
  std::vector<int64_t> slow_cells;      // their tokens' cells
  std::vector<uint8_t> window_hit;      // per window position
  std::vector<Met> deep_hits;           // deep log entries holding a hit, log order
  std::vector<Met> candidates;          // deep log entries that are not hits, from the head
  std::vector<int64_t> victims;         // slots the misses take, LRU order
  std::vector<int64_t> next_window;     // the new window, built before it replaces the old
  std::vector<int64_t> miss_cells;      // the misses' cells, first-occurrence order
  std::vector<int64_t> sorted_tokens;   // first offload: distinct tokens ascending
  int64_t num_distinct = 0;
  uint64_t hash_mask = 0;
  int hash_shift = 0;
  uint64_t filter_mask = 0;
  uint64_t window_cell_mask = 0;

  static constexpr uint32_t kFreeKey = 0xFFFFFFFFu;  // no valid token (they are < 2**31)

  void prepare(int64_t width, int64_t capacity, int64_t window_size, int64_t deep_size) {
    const uint64_t size = next_pow2(static_cast<uint64_t>(2 * width));
    if (cells.size() != size) {
      cells.assign(size, Cell{kFreeKey, static_cast<int32_t>(kEmpty)});
      hash_mask = size - 1;
      hash_shift = 64 - __builtin_ctzll(size);
      const uint64_t filter_bits =
          next_pow2(static_cast<uint64_t>(std::max<int64_t>(64, 16 * width)));
      filter.assign(filter_bits / 64, 0);
      filter_mask = filter_bits - 1;
    }
    if (static_cast<int64_t>(slow.size()) < width) {
      slow.resize(width);
      slow_cells.resize(width);
      distinct_cells.resize(width);
      miss_cells.resize(width);
      sorted_tokens.resize(width);
    }
    const uint64_t window_index_size =
        std::max(kMinWindowCells, next_pow2(static_cast<uint64_t>(2 * capacity)));
    if (window_index.size() < window_index_size) {
      window_index.assign(window_index_size, 0);
      window_cell_mask = window_index_size - 1;
    }
    if (static_cast<int64_t>(filtered.size()) < deep_size) filtered.resize(deep_size);
    if (static_cast<int64_t>(window_hit.size()) < window_size) window_hit.resize(window_size, 0);
    if (static_cast<int64_t>(deep_hits.size()) < capacity) {
      deep_hits.resize(capacity);
      candidates.resize(capacity);
      victims.resize(capacity);
      next_window.resize(capacity + 1);  // + 1: step 8 writes an entry before it counts it
    }
  }

  uint64_t home(int64_t token) const {
    return (static_cast<uint64_t>(token) * kHashMultiplier) >> hash_shift;
  }
  bool maybe_selected(int64_t token) const {
    const uint64_t bit = static_cast<uint64_t>(token) & filter_mask;
    return (filter[bit >> 6] >> (bit & 63)) & 1;
  }

  // Adds a token in [0, 2**31) (once); returns its cell. The table never fills: at most
  // `width` tokens in >= 2 * width cells.
  int64_t add(int64_t token) {
    uint64_t cell = home(token);
    const auto key32 = static_cast<uint32_t>(token);
    while (true) {
      const uint32_t key = cells[cell].key;
      if (key == key32) return static_cast<int64_t>(cell);
      if (key == kFreeKey) {
        cells[cell] = Cell{key32, static_cast<int32_t>(kEmpty)};
        distinct_cells[num_distinct++] = static_cast<int64_t>(cell);
        const uint64_t bit = static_cast<uint64_t>(token) & filter_mask;
        filter[bit >> 6] |= uint64_t{1} << (bit & 63);
        return static_cast<int64_t>(cell);
      }
      cell = (cell + 1) & hash_mask;
    }
  }

  // The token's cell, or -1 when it was not added (any int64: a token outside [0, 2**31),
  // which a corrupt entry may carry, matches no key).
  int64_t find(int64_t token) const {
    uint64_t cell = home(token);
    while (true) {
      const uint32_t key = cells[cell].key;
      if (key == kFreeKey) return -1;
      if (static_cast<uint64_t>(key) == static_cast<uint64_t>(token)) {
        return static_cast<int64_t>(cell);
      }
      cell = (cell + 1) & hash_mask;
    }
  }
  int64_t token_of(int64_t cell) const { return cells[cell].key; }

  // Leaves the hash and the filter empty again: O(distinct), not O(table).
  void clear_tokens() {
    for (int64_t i = 0; i < num_distinct; ++i) {
      const int64_t cell = distinct_cells[i];
      const uint64_t bit = static_cast<uint64_t>(cells[cell].key) & filter_mask;
      filter[bit >> 6] = 0;  // every bit in the filter came from one of these tokens
      cells[cell].key = kFreeKey;
    }
    num_distinct = 0;
  }

  // How many distinct valid tokens a top-k row holds (entries < 0 or >= limit are padding).
  template <typename Token>
  int64_t count_distinct(const Token* topk, int64_t width, int64_t limit) {
    for (int64_t k = 0; k < width; ++k) {
      if (topk[k] >= 0 && topk[k] < limit) add(topk[k]);
    }
    const int64_t count = num_distinct;
    clear_tokens();
    return count;
  }
};

// The thread-local holds only a pointer: code that uses a thread_local object directly gets
// its address recomputed (a __tls_get_addr call) inside every loop; a heap object does not.
inline Scratch& thread_scratch() {
  thread_local std::unique_ptr<Scratch> scratch;
  if (!scratch) scratch = std::make_unique<Scratch>();
  return *scratch;
}

// Fills [begin, end) with -1 (most of a miss list is padding). Plain stores: streaming ones,
// which skip reading the output lines into the cache, measured 4-5% slower a row-step on this
// Zen 4 (R=32 and R=1; on the Zen 3 of issue 4 they were even).
inline void fill_padding(int32_t* begin, int32_t* end) {
  std::fill(begin, end, static_cast<int32_t>(kEmpty));
}

inline void pad_miss_lists(int64_t width, int64_t misses, const RowOut& out) {
  *out.miss_count = static_cast<int32_t>(misses);
  fill_padding(out.miss_tokens + misses, out.miss_tokens + width);
  fill_padding(out.miss_slots + misses, out.miss_slots + width);
}

// All slots empty, LRU order 0..C-1.
inline void reset_row_state(RowState& row) {
  std::fill(row.tokens, row.tokens + row.capacity, kEmpty);
  row.lru.reset_rotated(0);
  row.max_resident() = -1;
}

// Identity mapping: the row is not offloaded, every selected position is its own slot.
template <typename Token>
inline void identity_row(const Token* topk, int64_t width, int64_t limit, const RowOut& out) {
  const auto limit_u = static_cast<uint64_t>(limit);  // negative tokens: huge, padding
  for (int64_t k = 0; k < width; ++k) {
    const int64_t token = topk[k];
    out.slots[k] = static_cast<int32_t>(
        token | static_cast<int64_t>(
                    static_cast<uint64_t>(static_cast<uint64_t>(token) < limit_u) - 1));
  }
  pad_miss_lists(width, 0, out);
}

// First offload: reset, then the distinct tokens in ascending order fill slots 0..n-1 (the
// same as a steady update after a reset, with the misses taken in ascending token order).
// The caller checked that n <= C. O(C + K log K): first offloads are rare.
template <typename Token>
inline void first_offload_row(Scratch& s, RowState& row, const Token* topk, int64_t width,
                              int64_t limit, const RowOut& out) {
  int64_t* cells = s.slow_cells.data();  // per position: its token's cell, -1 for padding
  for (int64_t k = 0; k < width; ++k) {
    const int64_t token = topk[k];
    cells[k] = (token < 0 || token >= limit) ? -1 : s.add(token);
  }
  const int64_t count = s.num_distinct;
  for (int64_t i = 0; i < count; ++i) s.sorted_tokens[i] = s.token_of(s.distinct_cells[i]);
  std::sort(s.sorted_tokens.begin(), s.sorted_tokens.begin() + count);
  std::fill(row.tokens, row.tokens + row.capacity, kEmpty);
  row.lru.reset_rotated(count);  // the unused slots count..C-1, then the filled ones
  for (int64_t slot = 0; slot < count; ++slot) {
    const int64_t token = s.sorted_tokens[slot];
    row.tokens[slot] = token;
    row.lru.window[slot] = pack(token, slot);
    s.cells[s.find(token)].slot = static_cast<int32_t>(slot);
    out.miss_tokens[slot] = static_cast<int32_t>(token);
    out.miss_slots[slot] = static_cast<int32_t>(slot);
  }
  row.max_resident() = count > 0 ? s.sorted_tokens[count - 1] : -1;
  for (int64_t k = 0; k < width; ++k) {
    out.slots[k] = cells[k] < 0 ? static_cast<int32_t>(kEmpty) : s.cells[cells[k]].slot;
  }
  pad_miss_lists(width, count, out);
  s.clear_tokens();
}

// Forgets the resident tokens at or beyond the stable length (a speculative suffix that may
// have been overwritten in the host pool): slot tokens and the order's entries both say -1;
// the slots stay where they are in the order. O(C), and only run when max_resident says some
// token may be that far. The window's entries are forgotten too (its hits hold tokens below
// the stable length: unchanged). The caller checked every entry's slot.
inline void drop_speculative(RowState& row, int64_t stable_len) {
  int64_t largest = -1;
  for (int64_t slot = 0; slot < row.capacity; ++slot) {
    const int64_t token = row.tokens[slot];
    if (token >= stable_len) row.tokens[slot] = kEmpty;
    else largest = std::max(largest, token);
  }
  row.max_resident() = largest;
  const auto forget = [stable_len](int64_t entry) {
    return packed_token(entry) >= stable_len ? pack(-1, packed_slot(entry)) : entry;
  };
  LruLog& lru = row.lru;
  for (int64_t p = lru.head(); p < lru.tail(); ++p) {
    int64_t& entry = lru.deep_at(p);
    if (entry != kTombstone) entry = forget(entry);
  }
  for (int64_t i = 0; i < lru.window_len(); ++i) lru.window[i] = forget(lru.window[i]);
}

// Steady update: hits keep their slot, misses take the evictable slots in LRU order; the new
// LRU order is [evictable left unused..., just filled (miss order)..., hits (old order)...].
// Reads and checks everything it will follow first; on a corrupt state it returns the
// problem with the row untouched. The caller checked that the distinct tokens fit in C.
template <typename Token>
inline RowStatus steady_row(Scratch& s, RowState& row, const Token* __restrict topk,
                            int64_t width, int64_t limit, int64_t stable_len,
                            const RowOut& out) {
  const int64_t capacity = row.capacity;
  LruLog& lru = row.lru;
  const int64_t window_len = lru.window_len();
  const int64_t head = lru.head();
  const int64_t tail = lru.tail();
  if (window_len < 0 || window_len > capacity || head < 0 || head > tail ||
      tail - head > lru.deep_size) {
    return kCorruptOrder;
  }
  int64_t* __restrict window = lru.window;
  uint16_t* __restrict window_index = s.window_index.data();
  uint8_t* __restrict window_hit = s.window_hit.data();
  int32_t* __restrict out_slots = out.slots;
  const uint64_t window_cell_mask = s.window_cell_mask;

  // 1. Index the window (reading it front to back) and check that its entries name slots.
  //    (Each loop of a step keeps its own accumulators: one live across the whole step is
  //    spilled to the stack, and its read-modify-write there serialises the loop.)
  uint64_t bad = 0;
  {
    uint64_t bad_window = 0;
    for (int64_t i = 0; i < window_len; ++i) {
      const int64_t entry = window[i];
      bad_window |= (static_cast<uint64_t>(entry) >> 63) |
                    static_cast<uint64_t>(packed_slot(entry) >= capacity);
      window_index[window_cell(packed_token(entry), window_cell_mask)] =
          static_cast<uint16_t>(i);
    }
    bad = bad_window;
  }

  // 2. Every position: a valid token the window holds is a hit (unless it is at or past the
  //    stable length: about to be dropped); the other valid ones are slow.
  const WindowLookup lookup{window_index, window_cell_mask, window,
                            static_cast<uint64_t>(lru.window_size - 1),
                            std::min({limit, stable_len, kTokenLimit}), limit};
  int64_t* __restrict slow = s.slow.data();
  const int64_t num_slow = look_up_window(lookup, topk, width, out_slots, window_hit, slow);

  // 3. The slow tokens, each once, into the scratch hash and its filter.
  int64_t* __restrict slow_cells = s.slow_cells.data();
  for (int64_t j = 0; j < num_slow; ++j) slow_cells[j] = s.add(topk[slow[j]]);
  Cell* __restrict cells = s.cells.data();

  // 4. One pass over the window: entries step 2 hit are hits (counted); an entry it did not
  //    hit whose token may be slow (the filter says so) is a suspect. A suspect holding a
  //    slow token (the window index lost it to a collision) is a hit too. The loop has no
  //    branch and no store but the suspect's (a rare path inside it cost every entry a
  //    register spill); the window is split into hits and unused entries in step 8, where
  //    they go.
  int64_t* __restrict suspects = s.filtered.data();  // free until step 5
  const uint64_t* __restrict filter = s.filter.data();
  const uint64_t filter_mask = s.filter_mask;
  const auto stable_u = static_cast<uint64_t>(stable_len);
  int64_t num_window_hits = 0;  // window entries holding a hit
  int64_t num_suspects = 0;
  for (int64_t i = 0; i < window_len; ++i) {
    const uint64_t hit = window_hit[i];
    const auto token = static_cast<uint64_t>(packed_token(window[i]));
    const uint64_t bit = token & filter_mask;
    suspects[num_suspects] = i;
    num_suspects += static_cast<int64_t>((hit ^ 1) & static_cast<uint64_t>(token < stable_u) &
                                         (filter[bit >> 6] >> (bit & 63)));
    num_window_hits += static_cast<int64_t>(hit);
  }
  int64_t window_found = 0;  // slow tokens found in the window
  for (int64_t j = 0; j < num_suspects; ++j) {
    const int64_t i = suspects[j];
    const int64_t cell = s.find(packed_token(window[i]));
    if (cell >= 0) {
      cells[cell].slot = static_cast<int32_t>(packed_slot(window[i]));
      window_hit[i] = 1;
      ++window_found;
    }
  }
  num_window_hits += window_found;

  // 5. One pass over the deep log: entries holding a slow token are hits; the others, from
  //    the head, are the candidate victims (no more are needed than there are slow tokens
  //    left). The filter settles nearly every entry without a branch or a probe.
  Met* __restrict deep_hits = s.deep_hits.data();
  Met* __restrict candidates = s.candidates.data();
  int64_t num_deep_hits = 0;
  int64_t num_candidates = 0;
  const int64_t max_candidates = s.num_distinct - window_found;
  const int64_t* __restrict deep = lru.deep;
  const auto deep_mask = static_cast<uint64_t>(lru.deep_size - 1);
  // A deep hit: its slot is the token's; a false positive of the filter: not a hit.
  const auto deep_hit = [&](int64_t position, int64_t entry) {
    const int64_t cell = s.find(packed_token(entry));
    if (cell < 0) return false;
    cells[cell].slot = static_cast<int32_t>(packed_slot(entry));
    deep_hits[num_deep_hits++] = {position, entry};
    return true;
  };
  // Tombstones and empty slots carry negative tokens: as unsigned, never below stable_u.
  const auto maybe_hit = [&](int64_t entry) {
    const auto token = static_cast<uint64_t>(packed_token(entry));
    const uint64_t bit = token & filter_mask;
    return static_cast<uint64_t>(token < stable_u) & (filter[bit >> 6] >> (bit & 63));
  };
  int64_t position = head;
  for (; position < tail && num_candidates < max_candidates; ++position) {
    const int64_t entry = deep[static_cast<uint64_t>(position) & deep_mask];
    const uint64_t hit = maybe_hit(entry) != 0 && deep_hit(position, entry);
    candidates[num_candidates] = {position, entry};
    num_candidates += static_cast<int64_t>(static_cast<uint64_t>(entry != kTombstone) & (hit ^ 1));
  }
  // Past the candidates only hits matter: a filter test per entry (the circular log is one
  // or two runs of the array). Slots are checked where they are used: candidates and hits.
  if (max_candidates > num_deep_hits && position < tail) {  // slow tokens still unresolved
    int64_t* __restrict filtered = s.filtered.data();
    const int64_t start = static_cast<int64_t>(static_cast<uint64_t>(position) & deep_mask);
    const int64_t first_run = std::min(tail - position, lru.deep_size - start);
    const int64_t bound = std::min(stable_len, kTokenLimit);
    int64_t count = filter_entries(deep, start, start + first_run, filter, filter_mask, bound,
                                   filtered);
    for (int64_t i = 0; i < count; ++i) {
      deep_hit(position + (filtered[i] - start), deep[filtered[i]]);
    }
    const int64_t second_run = tail - position - first_run;
    count = filter_entries(deep, 0, second_run, filter, filter_mask, bound, filtered);
    for (int64_t i = 0; i < count; ++i) {
      deep_hit(position + first_run + filtered[i], deep[filtered[i]]);
    }
  }
  for (int64_t i = 0; i < num_candidates; ++i) {
    bad |= static_cast<uint64_t>(packed_slot(candidates[i].entry) >= capacity);
  }
  for (int64_t i = 0; i < num_deep_hits; ++i) {
    bad |= static_cast<uint64_t>(packed_slot(deep_hits[i].entry) >= capacity);
  }

  // 6. The misses (slow tokens neither pass found), first-occurrence order, and their
  //    victims: the first candidates, then (rarely) the window's unused entries.
  int64_t* __restrict miss_cells = s.miss_cells.data();
  int64_t misses = 0;
  for (int64_t i = 0; i < s.num_distinct; ++i) {
    const int64_t cell = s.distinct_cells[i];
    miss_cells[misses] = cell;
    misses += cells[cell].slot < 0;
  }
  int64_t* __restrict victims = s.victims.data();
  const int64_t from_deep = std::min(misses, num_candidates);
  for (int64_t i = 0; i < from_deep; ++i) victims[i] = packed_slot(candidates[i].entry);
  // The walk from the head stops after the last victim it takes from the deep log.
  const int64_t walk_end = misses == 0           ? head
                           : from_deep < misses ? tail
                                                : candidates[from_deep - 1].position + 1;
  int64_t window_from = 0;  // window entries the walk took, when the deep log ran out
  int64_t num_victims = from_deep;
  while (num_victims < misses && window_from < window_len) {
    const int64_t entry = window[window_from];
    victims[num_victims] = packed_slot(entry);
    num_victims += window_hit[window_from++] ^ 1;
  }
  if (num_victims < misses) bad = 1;  // the order holds too few slots
  // Slots listed twice are not looked for (that would cost a mark per slot per step); the
  // order is rebuilt from checked slots only, so a corrupt one cannot lead out of bounds, and
  // lru_order reports it.
  const auto clear_marks = [&]() { std::fill(window_hit, window_hit + window_len, uint8_t{0}); };
  if (bad != 0) {  // leave the row as it was; only the scratch is cleaned up
    clear_marks();
    s.clear_tokens();
    return kCorruptOrder;
  }

  // 7. Everything is checked: change the row. Drop the speculative suffix, then fill.
  if (stable_len <= row.max_resident()) drop_speculative(row, stable_len);
  int64_t largest = row.max_resident();
  {  // the victims' token lines, with loads nothing waits on (they are cold, and scattered)
    uint64_t sum = 0;
    for (int64_t i = 0; i < misses; ++i) sum += static_cast<uint64_t>(row.tokens[victims[i]]);
    asm volatile("" : : "r"(sum));
  }
  for (int64_t i = 0; i < misses; ++i) {
    const int64_t cell = miss_cells[i];
    const int64_t token = s.token_of(cell);
    const int64_t slot = victims[i];
    row.tokens[slot] = token;
    largest = std::max(largest, token);
    cells[cell].slot = static_cast<int32_t>(slot);
    out.miss_tokens[i] = static_cast<int32_t>(token);
    out.miss_slots[i] = static_cast<int32_t>(slot);
  }
  row.max_resident() = largest;

  // 8. The new order. Window: the filled slots (miss order), then the hits in their old
  //    order: the ones the walk passed (deep log, then window), the deep ones ahead of the
  //    walk, then the window's own. Deep log: drop the walked prefix, leave tombstones where
  //    the deep hits ahead of the walk were, append the unused window entries.
  int64_t* __restrict next = s.next_window.data();
  int64_t length = 0;
  for (int64_t i = 0; i < misses; ++i) next[length++] = pack(out.miss_tokens[i], victims[i]);
  int64_t first_ahead = 0;
  while (first_ahead < num_deep_hits && deep_hits[first_ahead].position < walk_end) {
    next[length++] = deep_hits[first_ahead++].entry;
  }
  int64_t hits_walked = 0;  // window hits among the entries the walk took
  for (int64_t i = 0; i < window_from; ++i) {
    next[length] = window[i];
    length += window_hit[i];
    hits_walked += window_hit[i];
  }
  for (int64_t i = first_ahead; i < num_deep_hits; ++i) next[length++] = deep_hits[i].entry;

  lru.head() = walk_end;
  for (int64_t i = first_ahead; i < num_deep_hits; ++i) {
    lru.deep_at(deep_hits[i].position) = kTombstone;
  }
  const int64_t num_unused = (window_len - window_from) - (num_window_hits - hits_walked);
  // At least one free position past the log once the unused entries are in (when the new
  // window holds anything): the split below writes every entry there before it decides.
  if (lru.tail() - lru.head() + num_unused >= lru.deep_size) lru.compact();
  {  // The rest of the window, split: hits to the new window, the others to the deep log.
    int64_t* __restrict deep = lru.deep;
    const auto deep_mask = static_cast<uint64_t>(lru.deep_size - 1);
    uint64_t deep_tail = static_cast<uint64_t>(lru.tail());
    for (int64_t i = window_from; i < window_len; ++i) {
      const int64_t entry = window[i];
      const uint64_t hit = window_hit[i];
      next[length] = entry;
      deep[deep_tail & deep_mask] = entry;
      length += static_cast<int64_t>(hit);
      deep_tail += hit ^ 1;
    }
    lru.tail() = static_cast<int64_t>(deep_tail);
  }

  clear_marks();
  std::copy(next, next + length, window);
  for (int64_t i = length; i < window_len; ++i) window[i] = kNoEntry;
  lru.window_len() = length;

  // 9. Outputs: hits the window index found have their slot since step 2; the rest now.
  for (int64_t j = 0; j < num_slow; ++j) {
    out_slots[slow[j]] = cells[slow_cells[j]].slot;
  }
  pad_miss_lists(width, misses, out);
  s.clear_tokens();
  return kOk;
}

}  // namespace kvo_residency
