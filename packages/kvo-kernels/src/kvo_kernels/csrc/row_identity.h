// Which request a batch row serves, told from vLLM's block tables alone: the per-call serials
// of kvo-vllm's offload path (kvo_vllm.dsa.offload_identity.RowIdentity, whose NumPy code is
// the reference and states the rules), in one pass over the rows' blocks.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace kvo_identity {

// For batch rows r < rows: the row keeps its serial iff its stable prefix
// [0, seq_lens[r] - query_lens[r]) is non-empty, lies in blocks the row recorded last call,
// and those blocks (ids in block_table[r], versions in versions[block]) are the recorded ones;
// otherwise it gets serial next_serial[0]++ (rows in order). Then the row's covered blocks
// (ceil(seq_len / block_size), at most the table's and the state's width), their versions
// and the count are recorded, columns past the count as -1. State tensors (int64, contiguous,
// updated in place): recorded_blocks and recorded_versions [max_rows, max_blocks], covered
// and serials [max_rows], next_serial [1]; versions [num_blocks] is read. block_table int32
// or int64 [>= rows, W]; seq_lens and query_lens int32 or int64 [>= rows]. Every argument and
// covered block id is checked first: a refused call changes nothing.
void row_serials_cpu(const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_lens, const at::Tensor& versions,
                     at::Tensor recorded_blocks, at::Tensor recorded_versions,
                     at::Tensor covered, at::Tensor serials, at::Tensor next_serial,
                     int64_t rows, int64_t block_size);

}  // namespace kvo_identity

namespace kvo_identity {

// One decode step of batch rows r < rows that are all NOT_OFFLOADED (kvo-vllm's
// offload_hot_rows: hot row r holds position p at slot p, positions [0, filled[r]) filled, for
// the request with serial held[r]), each decoding one token. If every row holds this call's
// request (held[r] == serials[r]) with [0, seq_len - 1) filled: copies each row's new
// position p = seq_len - 1 from pool row block_table[r][p / block_size] * block_size +
// p % block_size to hot row r * capacity + p, records filled[r] = seq_len and held = -1 for
// rows >= rows, and writes, for each top-k entry t = topk[r][k], hot_slots[r][k] =
// r * capacity + t and valid[r][k] = true (t < 0: -1 and false). Returns (selected entries,
// sum of seq_lens). Otherwise returns (-1, 0) and changes nothing. Every argument, index and
// top-k entry (< seq_len) is checked before anything changes; a refused call raises.
std::tuple<int64_t, int64_t> identity_decode_step_cpu(
    const at::Tensor& pool, at::Tensor hot, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const at::Tensor& serials, at::Tensor held, at::Tensor filled,
    const at::Tensor& topk, at::Tensor hot_slots, at::Tensor valid, int64_t rows,
    int64_t block_size, int64_t capacity);

}  // namespace kvo_identity

namespace kvo_identity {

// The offload path's write of one layer call: pool[slots[i]] = rows[i] for i < rows.size(0)
// (slots < 0 skipped), and, when some written slot is a block's first row (slot % block_size
// == 0: a block handed to a new owner is always written from there), write_counter[0] += 1 and
// versions[slot / block_size] = write_counter[0] for each such block (kvo-vllm's
// RowIdentity.note_writes). pool and rows contiguous CPU, same dtype and row shape; slots
// int32 or int64 1-D [>= rows]; versions [num_blocks] and write_counter [1] int64. Checks
// everything first: a refused call changes nothing. Returns the rows written.
int64_t pool_write_rows_cpu(at::Tensor pool, const at::Tensor& rows, const at::Tensor& slots,
                            at::Tensor versions, at::Tensor write_counter, int64_t block_size);

}  // namespace kvo_identity

namespace kvo_identity {

// row_serials followed by identity_decode_step, for the steady state of short requests only,
// in one call (kvo-vllm's offload path at a short context: one call per layer instead of two,
// and none of the Python between them). Batch rows r < rows each decode one token
// (query_start_loc[r] == query_start_loc[0] + r for r <= rows), every row keeps its serial
// (row_serials' rule, on the given state), holds that request in its hot row filled to its
// new position, and every index is inside what it addresses: then it records what
// row_serials records (the serials stay as they are), does what identity_decode_step does
// and returns the same (selected entries, sum of seq_lens). Otherwise returns (-1, 0) and
// changes nothing: the caller takes the two-call path, which also names anything refused.
// topk has exactly rows rows. Arguments as the two ops take them; a malformed argument raises.
std::tuple<int64_t, int64_t> identity_decode_lane_cpu(
    const at::Tensor& pool, at::Tensor hot, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, const at::Tensor& block_table, const at::Tensor& versions,
    at::Tensor recorded_blocks, at::Tensor recorded_versions, at::Tensor covered,
    const at::Tensor& serials, at::Tensor held, at::Tensor filled, const at::Tensor& topk,
    at::Tensor hot_slots, at::Tensor valid, int64_t rows, int64_t block_size,
    int64_t capacity);

}  // namespace kvo_identity
