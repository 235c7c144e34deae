// The host (CPU) implementation of kvo::sparse_copy: dst[dst_rows[i]] = src[src_rows[i]].
#pragma once

#include <ATen/ATen.h>

namespace kvo_copy {

// Checks every argument and index before writing anything (a refused call leaves dst as it
// was), then copies whole rows with memcpy, over threads when there are many.
void sparse_copy_cpu(const at::Tensor& src, at::Tensor dst, const at::Tensor& src_rows,
                     const at::Tensor& dst_rows);

// kvo::sparse_copy_gather: the copies of sparse_copy_cpu, then out[k] = dst[gather_rows[k]],
// in one pass over the rows (a copied row the gather needs is read from the source once).
// Checks every argument and index first; a refused call writes neither dst nor out.
void sparse_copy_gather_cpu(const at::Tensor& src, at::Tensor dst, const at::Tensor& src_rows,
                            const at::Tensor& dst_rows, const at::Tensor& gather_rows,
                            at::Tensor out);

// The offload decode step's miss copies, read straight from a residency update's result:
// for batch row r < rows and i < miss_counts[r], token t = miss_tokens[r][i] (a request-local
// position) is copied from pool row block_table[r][t / block_size] * block_size +
// t % block_size to hot row r * capacity + miss_slots[r][i]. Index tensors int32 or int64.
// Checks every argument and index first (no hot row written twice); a refused call writes
// nothing. Returns the number of rows copied.
int64_t copy_residency_misses_cpu(const at::Tensor& pool, at::Tensor hot,
                                  const at::Tensor& block_table, const at::Tensor& miss_counts,
                                  const at::Tensor& miss_tokens, const at::Tensor& miss_slots,
                                  int64_t rows, int64_t block_size, int64_t capacity);

}  // namespace kvo_copy
