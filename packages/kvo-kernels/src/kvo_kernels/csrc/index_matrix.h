// Reading the host ops' small index tensors (block tables, lengths, top-k lists): int32 or
// int64, 1-D or 2-D, checked once, then read element by element as int64.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace kvo_host {

// Element [r][c] of a CPU int32/int64 index tensor as int64 (1-D: c is ignored). The checks
// name the op and the argument in their message.
class IndexMatrix {
 public:
  IndexMatrix(const at::Tensor& t, const char* op, const char* name, int64_t dims,
              int64_t min_rows)
      : tensor_(t.contiguous()) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), op, " (host): ", name, " must be a CPU tensor, got ",
                      t.device());
    TORCH_CHECK_VALUE(t.dim() == dims, op, ": ", name, " must be ", dims, "-D, got shape ",
                      t.sizes());
    TORCH_CHECK_VALUE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, op, ": ",
                      name, " must be int32 or int64, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.size(0) >= min_rows, op, ": ", name, " has ", t.size(0),
                      " rows, the call names ", min_rows);
    wide_ = tensor_.scalar_type() == at::kLong;
    data_ = tensor_.data_ptr();
    width_ = dims == 2 ? tensor_.size(1) : 1;
  }
  int64_t at(int64_t r, int64_t c = 0) const {
    const int64_t i = r * width_ + c;
    return wide_ ? static_cast<const int64_t*>(data_)[i]
                 : static_cast<int64_t>(static_cast<const int32_t*>(data_)[i]);
  }
  int64_t width() const { return width_; }

 private:
  at::Tensor tensor_;
  const void* data_ = nullptr;
  bool wide_ = true;
  int64_t width_ = 1;
};

}  // namespace kvo_host
