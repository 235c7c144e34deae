// The state one residency row keeps between steps besides its slot tokens: its LRU order, as
// two arrays of packed (token, slot) entries that a step reads front to back.
//
// The order (least recent first) is [deep log..., window...]:
// - the window: the slots the last step filled or hit, in their LRU order. It is the most
//   recent part of the order, and a decode step re-selects most of it, so a step finds most
//   of its hits there and then rewrites it whole (~K entries). Entries past its length hold
//   kNoEntry, which never matches a token;
// - the deep log: every other slot, oldest first, in a circular array (an empty slot carries
//   the token -1). A slot that leaves it from the middle (a hit deep in the order) leaves a
//   tombstone behind; a full log is compacted. Log positions are absolute int64 counters.
// Per row: window[W] and deep[L] int64 (W, L: the power of two >= C) and meta[4] int64.
// Entries carry their slot's current token (a speculative drop rewrites them too), so that
// no per-slot array has to be read at random: in a real model each layer's table is cold
// when its turn comes, and on the host CPU a cold random read costs far more than a
// streamed one.

#pragma once

#include <cstdint>
#include <limits>

namespace kvo_residency {

// pack(token, slot) = token << kSlotBits | slot. Fixed widths let the hot loops shift by
// constants: slots below 2**20 (the design's hot buffers hold <= 32640), tokens below 2**43.
constexpr int kSlotBits = 20;
constexpr int64_t kSlotMask = (int64_t{1} << kSlotBits) - 1;
constexpr int64_t kMaxCapacity = int64_t{1} << kSlotBits;
constexpr int64_t kTokenLimit = int64_t{1} << (63 - kSlotBits);

inline int64_t pack(int64_t token, int64_t slot) {
  return static_cast<int64_t>(static_cast<uint64_t>(token) << kSlotBits) | slot;
}
inline int64_t packed_token(int64_t entry) { return entry >> kSlotBits; }
inline int64_t packed_slot(int64_t entry) { return entry & kSlotMask; }

// Neither equals a packed entry (that would take the token -2**43).
constexpr int64_t kTombstone = std::numeric_limits<int64_t>::min();  // deep log hole
constexpr int64_t kNoEntry = std::numeric_limits<int64_t>::min();    // window past its end

// meta[] fields of a row.
constexpr int kMetaMaxResident = 0;  // an upper bound on the row's tokens (-1: none resident)
constexpr int kMetaWindowLen = 1;    // entries in the window
constexpr int kMetaDeepHead = 2;     // log position of the deep log's oldest entry
constexpr int kMetaDeepTail = 3;     // log position after its newest entry
constexpr int kMetaFields = 4;

struct LruLog {
  int64_t* window;      // [W]
  int64_t* deep;        // [L], circular
  int64_t* meta;        // [kMetaFields]
  int64_t capacity;     // C
  int64_t window_size;  // W, a power of two >= C
  int64_t deep_size;    // L, a power of two >= C

  int64_t& window_len() { return meta[kMetaWindowLen]; }
  int64_t& head() { return meta[kMetaDeepHead]; }
  int64_t& tail() { return meta[kMetaDeepTail]; }
  int64_t& deep_at(int64_t position) {
    return deep[static_cast<uint64_t>(position) & static_cast<uint64_t>(deep_size - 1)];
  }

  // Order first, ..., C - 1 (deep log, all empty), then 0, ..., first - 1 (the window,
  // whose entries the caller writes).
  void reset_rotated(int64_t first) {
    for (int64_t i = first; i < window_size; ++i) window[i] = kNoEntry;
    window_len() = first;
    head() = 0;
    tail() = 0;
    for (int64_t slot = first; slot < capacity; ++slot) push_deep(pack(-1, slot));
  }

  void push_deep(int64_t entry) { deep_at(tail()++) = entry; }

  // Squeezes the tombstones out of the deep log, order kept. The caller checked that
  // tail - head <= L.
  void compact() {
    const int64_t end = tail();
    int64_t write = head();
    for (int64_t read = head(); read < end; ++read) {
      const int64_t entry = deep_at(read);
      if (entry != kTombstone) deep_at(write++) = entry;
    }
    tail() = write;
  }
};

}  // namespace kvo_residency
