// torch's CPU allocator for remat's processes (`remat.core.process.reuse_freed_memory`): a tensor of 256 KiB and
// up gets whole pages of its own (mmap), kept when freed for the next tensor of its size, so that a step does not fault
// fresh pages in for every tensor it makes (a third of a CPU step before: ~1.2 us a page). Smaller ones are
// torch's own allocator's (glibc's heap).
//
// The resident set never grows past the most ever live: a request the kept blocks cannot meet exactly is made
// from the smallest larger kept block (its tail kept) or by growing the largest (`mremap`: its pages move
// along), and kept blocks are unmapped, largest first, until what is kept and what is asked together take no
// more than was resident before. Memory grows only when nothing is kept, so the process peak is what the plans
// count (live tensors), as when every freed tensor went back to the kernel.
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

[[noreturn]] void out_of_memory(size_t size) {  // as torch's own allocator says it: torch.OutOfMemoryError
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU allocator (remat): not enough memory: you tried to allocate ",
                   size, " bytes.");
}

struct Block {
  void* at;
  size_t size;
};

class Reuse final : public c10::Allocator {
 public:
  Reuse(c10::Allocator* small, size_t threshold)
      : small_(small), threshold_(threshold), page_(sysconf(_SC_PAGESIZE)) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < threshold_) return small_->allocate(n);
    size_t size = (n + page_ - 1) / page_ * page_;
    void* at = take(size);
    c10::profiledCPUMemoryReporter().New(at, n);
    return {at, at, &Reuse::free, c10::Device(c10::DeviceType::CPU)};
  }

  // This allocator's blocks come back here, and by `raw_deallocate` the small allocator's raw ones.
  static void free(void* at);

  c10::DeleterFnPtr raw_deleter() const override { return &Reuse::free; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  void give_back(void* at) {
    std::unique_lock<std::mutex> hold(lock_);
    auto it = live_.find(at);
    if (it == live_.end()) {
      hold.unlock();
      small_->raw_deleter()(at);
      return;
    }
    c10::profiledCPUMemoryReporter().Delete(at);
    kept_.push_back({at, it->second});
    kept_bytes_ += it->second;
    live_.erase(it);
  }

  void unmap_kept() {
    std::lock_guard<std::mutex> hold(lock_);
    for (const Block& block : kept_) munmap(block.at, block.size);
    kept_.clear();
    kept_bytes_ = 0;
  }

  size_t kept_bytes() {
    std::lock_guard<std::mutex> hold(lock_);
    return kept_bytes_;
  }

 private:
  void* take(size_t size) {
    std::unique_lock<std::mutex> hold(lock_);
    size_t exact = kept_.size(), larger = kept_.size(), largest = kept_.size();
    for (size_t i = 0; i < kept_.size(); i++) {
      size_t s = kept_[i].size;
      if (s == size) exact = i;  // the last freed of its size: the most likely still in the CPU's caches
      if (s > size && (larger == kept_.size() || s < kept_[larger].size)) larger = i;
      if (largest == kept_.size() || s > kept_[largest].size) largest = i;
    }
    size_t pick = exact < kept_.size() ? exact : larger < kept_.size() ? larger : largest;
    if (pick == kept_.size()) {  // nothing kept: the resident set grows, as live memory does
      hold.unlock();
      return map(size);
    }
    Block block = kept_[pick];
    kept_.erase(kept_.begin() + pick);
    kept_bytes_ -= block.size;
    if (block.size > size) {  // its tail stays kept, pages and all
      char* tail = static_cast<char*>(block.at) + size;
      if (block.size - size >= threshold_) {
        kept_.push_back({tail, block.size - size});
        kept_bytes_ += block.size - size;
      } else {
        munmap(tail, block.size - size);
      }
    } else if (block.size < size) {
      unmap(size - block.size);
      void* grown = mremap(block.at, block.size, size, MREMAP_MAYMOVE);
      if (grown == MAP_FAILED) {
        munmap(block.at, block.size);
        out_of_memory(size);
      }
      block.at = grown;
    }
    live_[block.at] = size;
    return block.at;
  }

  void* map(size_t size) {
    void* at = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (at == MAP_FAILED) out_of_memory(size);
    std::lock_guard<std::mutex> hold(lock_);
    live_[at] = size;
    return at;
  }

  void unmap(size_t bytes) {  // lock held; the largest first: fewest blocks for the bytes
    while (bytes > 0 && !kept_.empty()) {
      size_t largest = 0;
      for (size_t i = 1; i < kept_.size(); i++)
        if (kept_[i].size > kept_[largest].size) largest = i;
      Block block = kept_[largest];
      kept_.erase(kept_.begin() + largest);
      munmap(block.at, block.size);
      kept_bytes_ -= block.size;
      bytes = bytes > block.size ? bytes - block.size : 0;
    }
  }

  c10::Allocator* small_;
  size_t threshold_, page_;
  std::mutex lock_;
  std::unordered_map<void*, size_t> live_;
  std::vector<Block> kept_;  // in the order they were freed
  size_t kept_bytes_ = 0;
};

Reuse* installed = nullptr;  // never deleted: tensors made here may be freed until the process ends

void Reuse::free(void* at) { installed->give_back(at); }

}  // namespace

extern "C" {

// 0 once torch allocates here (again: the same); 1 if torch kept another allocator.
int remat_reuse_install(size_t threshold) {
  if (installed == nullptr) {
    installed = new Reuse(c10::GetCPUAllocator(), threshold);
    c10::SetCPUAllocator(installed, /*priority=*/1);
  }
  return c10::GetCPUAllocator() == installed ? 0 : 1;
}

void remat_reuse_unmap_kept() {
  if (installed != nullptr) installed->unmap_kept();
}

size_t remat_reuse_kept_bytes() { return installed != nullptr ? installed->kept_bytes() : 0; }
}
