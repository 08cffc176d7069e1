#include "core/model/vector_math.h"

#include <atomic>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace sbp {

void spend_first_vector_math_calls() {
  static std::atomic<int> spent_for{0};  // the largest thread count whose threads have spent their first call
  static std::mutex mutex;
  const int threads = at::get_num_threads();
  if (spent_for.load(std::memory_order_acquire) >= threads) return;
  std::lock_guard<std::mutex> lock(mutex);
  if (spent_for.load(std::memory_order_relaxed) >= threads) return;
  // ATen gives a thread a share only above one grain (32768 elements) per thread: one grain for each thread.
  const auto n = std::int64_t(threads) * at::internal::GRAIN_SIZE;
  for (const auto dtype : {at::kFloat, at::kDouble}) (void)at::linspace(0, 4096, n, at::TensorOptions(dtype)).cos();
  spent_for.store(threads, std::memory_order_release);
}

}  // namespace sbp
