// Thread-safe page allocator: a LIFO free list with reference counts over page ids [0, num_pages).
// Pure C++ (no torch, no Python) so it can be tested and reasoned about on its own.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace oppo {

class PageAllocator {
 public:
  explicit PageAllocator(int64_t num_pages);

  // All-or-nothing: n fresh pages with refcount 1, or nullopt when fewer than n are free.
  // A fresh allocator hands out 0, 1, 2, ... in order; freed pages are reused first (LIFO).
  std::optional<std::vector<int64_t>> alloc(int64_t n);

  // Drops one reference from each page; a page whose count reaches 0 returns to the free list.
  // Validates the whole call first (range, and enough references even when an id repeats) and
  // throws std::invalid_argument without changing anything if any id is bad.
  void free(const std::vector<int64_t>& ids);

  // Adds one reference to each (allocated) page: shared prompt pages of several samples.
  void incref(const std::vector<int64_t>& ids);

  int64_t num_free() const;
  int64_t num_pages() const { return num_pages_; }
  int64_t refcount(int64_t id) const;

 private:
  void check_id(int64_t id) const;

  const int64_t num_pages_;
  mutable std::mutex mu_;
  std::vector<int64_t> free_list_;  // back() is handed out next
  std::vector<int32_t> refcount_;   // [num_pages]
};

}  // namespace oppo
