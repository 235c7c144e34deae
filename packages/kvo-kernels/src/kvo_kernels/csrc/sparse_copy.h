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

}  // namespace kvo_copy
