// The host (CPU) implementation of kvo::sparse_copy: dst[dst_rows[i]] = src[src_rows[i]].
#pragma once

#include <ATen/ATen.h>

namespace kvo_copy {

// Checks every argument and index before writing anything (a refused call leaves dst as it
// was), then copies whole rows with memcpy, over threads when there are many.
void sparse_copy_cpu(const at::Tensor& src, at::Tensor dst, const at::Tensor& src_rows,
                     const at::Tensor& dst_rows);

}  // namespace kvo_copy
