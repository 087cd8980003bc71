#include "allocator.h"

#include <stdexcept>
#include <string>
#include <unordered_map>

namespace oppo {

PageAllocator::PageAllocator(int64_t num_pages) : num_pages_(num_pages) {
  if (num_pages <= 0) {
    throw std::invalid_argument("PageAllocator: num_pages must be positive, got " + std::to_string(num_pages));
  }
  free_list_.reserve(num_pages);
  for (int64_t id = num_pages - 1; id >= 0; --id) free_list_.push_back(id);
  refcount_.assign(num_pages, 0);
}

void PageAllocator::check_id(int64_t id) const {
  if (id < 0 || id >= num_pages_) {
    throw std::invalid_argument("PageAllocator: page id " + std::to_string(id) + " outside [0, " +
                                std::to_string(num_pages_) + ")");
  }
}

std::optional<std::vector<int64_t>> PageAllocator::alloc(int64_t n) {
  if (n < 0) throw std::invalid_argument("PageAllocator.alloc: n must be >= 0, got " + std::to_string(n));
  std::lock_guard<std::mutex> lock(mu_);
  if (n > static_cast<int64_t>(free_list_.size())) return std::nullopt;
  std::vector<int64_t> ids(n);
  for (int64_t i = 0; i < n; ++i) {
    ids[i] = free_list_.back();
    free_list_.pop_back();
    refcount_[ids[i]] = 1;
  }
  return ids;
}

void PageAllocator::free(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  std::unordered_map<int64_t, int32_t> drops;
  for (int64_t id : ids) {
    check_id(id);
    if (++drops[id] > refcount_[id]) {
      throw std::invalid_argument("PageAllocator.free: page " + std::to_string(id) +
                                  " freed more times than it is referenced (" +
                                  std::to_string(refcount_[id]) + ")");
    }
  }
  // Push in reverse so that the next alloc returns these pages in the order they were given.
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    if (--refcount_[*it] == 0) free_list_.push_back(*it);
  }
}

void PageAllocator::incref(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t id : ids) {
    check_id(id);
    if (refcount_[id] == 0) {
      throw std::invalid_argument("PageAllocator.incref: page " + std::to_string(id) + " is not allocated");
    }
  }
  for (int64_t id : ids) ++refcount_[id];
}

int64_t PageAllocator::num_free() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(free_list_.size());
}

int64_t PageAllocator::refcount(int64_t id) const {
  check_id(id);
  std::lock_guard<std::mutex> lock(mu_);
  return refcount_[id];
}

}  // namespace oppo
