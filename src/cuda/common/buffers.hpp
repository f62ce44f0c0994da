// Host-side helpers of the CUDA backend: error checks and stream-ordered device buffers freed on
// scope exit (also when an error unwinds).
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "dmattn/error.hpp"
#include "dmattn/tensor.hpp"

namespace dmattn::cuda {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Whether ptr is device (or managed) memory: a host pointer in a view marked CUDA would fault in a
// kernel, so entry points check before launching.
inline bool is_device_pointer(const void* ptr) {
  cudaPointerAttributes a{};
  const bool ok = cudaPointerGetAttributes(&a, ptr) == cudaSuccess &&
                  (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged);
  cudaGetLastError();  // clear any error the query left
  return ok;
}

// Throws dmattn::Error unless a CUDA device is present (the host-staging entry points call it first).
inline void require_device() {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0)
    throw Error(std::string("no CUDA device available (") + (err != cudaSuccess ? cudaGetErrorString(err) : "none found") + ")");
}

// Runs f() (work enqueued on the default stream) between two events: the device time in ms.
template <class F>
float time_ms(F&& f) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  f();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

// n bytes from the device back to the host (synchronous).
inline void download(void* dst, const void* src, size_t n) {
  check(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "copy from device");
}

constexpr int kMaxDevices = 64;

// The current device's index (< kMaxDevices), for per-device state.
inline int current_device() {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= kMaxDevices) throw Error("device index out of range (at most 64 devices)");
  return dev;
}

// Lets a kernel use `bytes` of dynamic shared memory, once per device (attributes are per device): set
// on every call, it was host time ahead of each launch. The kernel is a template argument so each
// instance has flags of its own (instances share a function type).
template <auto kKernel>
void allow_dynamic_smem(int bytes) {
  static std::once_flag done[kMaxDevices];
  std::call_once(done[current_device()], [&] {
    check(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "cudaFuncSetAttribute");
  });
}

// The current device's memory pool for dmattn's scratch buffers: it keeps what it has reserved
// (release threshold: unlimited), like PyTorch's caching allocator. The device's default pool gives
// its memory back to the OS at every synchronisation, so each call re-mapped its scratch (the
// pre-pass buffers: ~1.5 GB at N = 65536) inside the timed region.
inline cudaMemPool_t scratch_pool() {
  static cudaMemPool_t pools[kMaxDevices] = {};
  static std::once_flag once[kMaxDevices];
  const int dev = current_device();
  std::call_once(once[dev], [dev] {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev;
    check(cudaMemPoolCreate(&pools[dev], &props), "cudaMemPoolCreate");
    uint64_t keep = UINT64_MAX;
    check(cudaMemPoolSetAttribute(pools[dev], cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
  });
  return pools[dev];
}

struct Buffers {
  cudaStream_t stream = nullptr;
  std::vector<void*> ptrs;
  template <class T>
  T* alloc(size_t bytes) {
    void* p = nullptr;
    check(cudaMallocFromPoolAsync(&p, bytes ? bytes : 1, scratch_pool(), stream), "cudaMallocFromPoolAsync");
    ptrs.push_back(p);
    return static_cast<T*>(p);
  }
  // A device copy of n host elements.
  template <class T>
  T* upload(const T* src, size_t n) {
    T* p = alloc<T>(n * sizeof(T));
    if (n) check(cudaMemcpyAsync(p, src, n * sizeof(T), cudaMemcpyHostToDevice, stream), "upload");
    return p;
  }
  // A device copy of a contiguous host tensor, as a CUDA view (`who` names the caller in errors).
  TensorView stage(const TensorView& t, const char* who) {
    if (t.device != Device::cpu || t.stride != TensorView::contiguous(nullptr, t.dtype, t.shape).stride)
      throw Error(std::string(who) + " takes contiguous host tensors");
    std::byte* d = upload(static_cast<const std::byte*>(t.data), size_t(t.numel()) * dtype_size(t.dtype));
    return TensorView::contiguous(d, t.dtype, t.shape, Device::cuda);
  }
  Buffers() = default;
  explicit Buffers(cudaStream_t s) : stream(s) {}
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    for (void* p : ptrs) cudaFreeAsync(p, stream);
  }
};

// Sub-buffers of one allocation, laid out by running the same code twice: over base 0 to measure
// (size()), then over the allocation's address to hand out the pointers. One pool allocation a call
// instead of one a buffer: each cudaMallocFromPoolAsync took 1-2 us of host time ahead of the call's
// first launch (bench/RESULTS.md).
class Carve {
 public:
  explicit Carve(uintptr_t base) : base_(base) {}
  template <class T>
  T* take(size_t bytes) {
    const size_t at = size_;
    size_ += (bytes + kAlign - 1) / kAlign * kAlign;
    return reinterpret_cast<T*>(base_ + at);
  }
  size_t size() const { return size_; }

 private:
  static constexpr size_t kAlign = 256;  // as cudaMalloc's: TMA and vector accesses need 16
  uintptr_t base_;
  size_t size_ = 0;
};

// One T per host thread and device, made by make() on first use and kept for the thread's life
// (destroying its CUDA objects at thread exit could run after the CUDA context is gone), so concurrent
// callers never share a stream or an event between record and wait.
template <class T, class Make>
T& per_thread_and_device(Make make) {
  thread_local std::array<T*, kMaxDevices> per_device{};
  const int dev = current_device();
  if (!per_device[dev]) per_device[dev] = make();
  return *per_device[dev];
}

// Independent pre-pass work on side streams: side(i) is ordered after everything enqueued on `main`
// before the fork, and `main` waits for all of it when the fork ends (join(), or the destructor when
// an error unwinds, before the caller's Buffers free their memory on `main`). The side streams are
// non-blocking, so they overlap work on the legacy default stream too, and per host thread and device,
// so concurrent callers never share an event between record and wait.
class StreamFork {
 public:
  static constexpr int kSides = 2;
  explicit StreamFork(cudaStream_t main) : main_(main), s_(sides()) {
    check(cudaEventRecord(s_.fork, main_), "cudaEventRecord");
    for (cudaStream_t side : s_.stream) check(cudaStreamWaitEvent(side, s_.fork, 0), "cudaStreamWaitEvent");
  }
  cudaStream_t side(int i) const { return s_.stream[i]; }
  // mark() records where `main` stands now; side_waits_mark(i) orders side(i)'s later work after it
  // (one mark a fork).
  void mark() { check(cudaEventRecord(s_.mark, main_), "cudaEventRecord"); }
  void side_waits_mark(int i) { check(cudaStreamWaitEvent(s_.stream[i], s_.mark, 0), "cudaStreamWaitEvent"); }
  void join() {
    if (joined_) return;
    joined_ = true;
    for (int i = 0; i < kSides; ++i) {
      check(cudaEventRecord(s_.done[i], s_.stream[i]), "cudaEventRecord");
      check(cudaStreamWaitEvent(main_, s_.done[i], 0), "cudaStreamWaitEvent");
    }
  }
  ~StreamFork() {  // on unwind: the same join, its errors dropped (the one in flight is what gets reported)
    try {
      join();
    } catch (...) {
    }
  }
  StreamFork(const StreamFork&) = delete;
  StreamFork& operator=(const StreamFork&) = delete;

 private:
  struct Sides {
    std::array<cudaStream_t, kSides> stream{};
    cudaEvent_t fork = nullptr, mark = nullptr;
    std::array<cudaEvent_t, kSides> done{};
  };
  static Sides& sides() {
    return per_thread_and_device<Sides>([] {
      auto* s = new Sides;
      // The highest priority: the side work is small and latency-bound, so its blocks go ahead of the
      // main stream's queued ones instead of waiting for them to drain.
      int low = 0, high = 0;
      check(cudaDeviceGetStreamPriorityRange(&low, &high), "cudaDeviceGetStreamPriorityRange");
      for (int i = 0; i < kSides; ++i) {
        check(cudaStreamCreateWithPriority(&s->stream[i], cudaStreamNonBlocking, high), "cudaStreamCreate");
        check(cudaEventCreateWithFlags(&s->done[i], cudaEventDisableTiming), "cudaEventCreate");
      }
      check(cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming), "cudaEventCreate");
      check(cudaEventCreateWithFlags(&s->mark, cudaEventDisableTiming), "cudaEventCreate");
      return s;
    });
  }
  cudaStream_t main_;
  Sides& s_;
  bool joined_ = false;
};

// Reads a call's NaN/Inf flags back without waiting for the work enqueued after them: the copy (into
// pinned memory, so it is enqueued rather than done on the spot) goes on a side stream ordered behind
// the work that sets the flags, so the work the caller enqueues next on its stream does not queue
// behind the copy; wait() blocks only until the flags have landed. Per host thread and device, kept
// for the thread's life (as StreamFork's streams).
class FlagReadback {
 public:
  static constexpr int kMax = 4;
  FlagReadback(const int* flags, int n, cudaStream_t stream) : s_(slot()) {
    if (n > kMax) throw Error("FlagReadback: too many flags");
    check(cudaEventRecord(s_.ready, stream), "cudaEventRecord");
    check(cudaStreamWaitEvent(s_.side, s_.ready, 0), "cudaStreamWaitEvent");
    check(cudaMemcpyAsync(s_.host, flags, size_t(n) * sizeof(int), cudaMemcpyDeviceToHost, s_.side), "flag read-back");
    check(cudaEventRecord(s_.done, s_.side), "cudaEventRecord");
  }
  // The flags, once they have landed (blocks the host until then).
  const int* wait() {
    waited_ = true;
    check(cudaEventSynchronize(s_.done), "flag read-back");
    return s_.host;
  }
  ~FlagReadback() {  // on unwind: the copy lands before the next call reuses the buffer (errors dropped)
    if (!waited_) cudaEventSynchronize(s_.done);
  }
  FlagReadback(const FlagReadback&) = delete;
  FlagReadback& operator=(const FlagReadback&) = delete;

 private:
  struct Slot {
    int* host = nullptr;
    cudaStream_t side = nullptr;
    cudaEvent_t ready = nullptr, done = nullptr;
  };
  static Slot& slot() {
    return per_thread_and_device<Slot>([] {
      auto* s = new Slot;
      check(cudaHostAlloc(reinterpret_cast<void**>(&s->host), kMax * sizeof(int), cudaHostAllocDefault), "cudaHostAlloc");
      check(cudaStreamCreateWithFlags(&s->side, cudaStreamNonBlocking), "cudaStreamCreate");
      check(cudaEventCreateWithFlags(&s->ready, cudaEventDisableTiming), "cudaEventCreate");
      check(cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming), "cudaEventCreate");
      return s;
    });
  }
  Slot& s_;
  bool waited_ = false;
};

}  // namespace dmattn::cuda
