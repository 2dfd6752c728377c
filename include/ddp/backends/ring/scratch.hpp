#pragma once
// Scratch memory for the algorithms' temporaries (receive chunks, partial sums, reduced blocks).
//
// Made per call as std::vector, a temporary was zero-filled and, above malloc's mmap threshold,
// faulted in page by page and returned to the kernel afterwards: for a 512 KiB all_reduce over TCP
// that was about a third of the time. A collective runs from start to end on one thread, so each
// use site (a Tag type) keeps one buffer per thread, uninitialized, aligned for any element type,
// and reuses it. A buffer above scratch_retained_bytes is freed when the call ends, so a single
// huge collective does not pin its temporaries for the thread's lifetime. Nested use of the same
// Tag on one thread (not done by the algorithms) gets a private buffer instead of the shared one.

#include <algorithm>
#include <cstddef>
#include <memory>
#include <new>

namespace ddp::algo::detail {

inline constexpr std::size_t scratch_retained_bytes = std::size_t{32} << 20;
inline constexpr std::align_val_t scratch_alignment{64};

struct scratch_free {
  void operator()(std::byte* p) const noexcept { ::operator delete[](p, scratch_alignment); }
};
using scratch_memory = std::unique_ptr<std::byte[], scratch_free>;

inline scratch_memory allocate_scratch(std::size_t bytes) {
  return scratch_memory(static_cast<std::byte*>(::operator new[](std::max<std::size_t>(bytes, 1), scratch_alignment)));
}

/// `bytes` of uninitialized memory for the duration of this object, from Tag's buffer on this thread.
template <class Tag>
class scratch {
 public:
  explicit scratch(std::size_t bytes) {
    slot& s = local();
    if (s.in_use) {
      own_ = allocate_scratch(bytes);
      data_ = own_.get();
      return;
    }
    if (s.capacity < bytes || !s.memory) {  // data() is never null, even for 0 bytes (memcpy's contract)
      s.memory.reset();  // free first: the old and new buffer need not coexist
      s.memory = allocate_scratch(bytes);
      s.capacity = bytes;
    }
    s.in_use = true;
    shared_ = &s;
    data_ = s.memory.get();
  }
  ~scratch() {
    if (shared_ == nullptr) return;
    shared_->in_use = false;
    if (shared_->capacity > scratch_retained_bytes) {
      shared_->memory.reset();
      shared_->capacity = 0;
    }
  }
  scratch(const scratch&) = delete;
  scratch& operator=(const scratch&) = delete;

  std::byte* data() const noexcept { return data_; }
  template <class T>
  T* as() const noexcept {
    return reinterpret_cast<T*>(data_);
  }

 private:
  struct slot {
    scratch_memory memory;
    std::size_t capacity = 0;
    bool in_use = false;
  };
  static slot& local() noexcept {
    thread_local slot s;
    return s;
  }

  slot* shared_ = nullptr;
  scratch_memory own_;
  std::byte* data_ = nullptr;
};

}  // namespace ddp::algo::detail
