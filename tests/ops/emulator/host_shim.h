// Just enough of the CUDA execution model, on the host, to run megablu's kernels unchanged
// (compiled with MEGABLU_HOST_EMULATION by g++): threadIdx/blockIdx per std::thread,
// __syncthreads as a block barrier, warp shuffles through a per-warp exchange buffer and
// barrier, shared-memory atomics as std::atomic_ref. Tests only; never part of the build.
#pragma once

#define MEGABLU_HOST_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__

#include <vector_types.h>   // uint2, uint4

#include <atomic>
#include <barrier>
#include <cmath>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct EmuDim { unsigned x = 0, y = 0, z = 0; };
inline thread_local EmuDim threadIdx, blockIdx;
inline EmuDim blockDim, gridDim;

namespace emu {
struct Warp {
  float buf[32];
  std::unique_ptr<std::barrier<>> bar;
};
struct Block {
  std::unique_ptr<std::barrier<>> bar;
  std::vector<Warp> warps;
};
inline Block* block = nullptr;

// Run `kernel()` for every thread of a grid. sync=true: all threads of a block run
// concurrently (kernels that use __syncthreads / shuffles); else one after another.
inline void launch(unsigned grid, unsigned threads, const std::function<void()>& kernel, bool sync) {
  gridDim.x = grid;
  blockDim.x = threads;
  for (unsigned b = 0; b < grid; ++b) {
    if (!sync) {
      for (unsigned t = 0; t < threads; ++t) {
        blockIdx.x = b;
        threadIdx.x = t;
        kernel();
      }
      continue;
    }
    Block blk;
    blk.bar = std::make_unique<std::barrier<>>(threads);
    blk.warps.resize((threads + 31) / 32);
    for (auto& w : blk.warps) w.bar = std::make_unique<std::barrier<>>(32);
    block = &blk;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
      ts.emplace_back([=] {
        blockIdx.x = b;
        threadIdx.x = t;
        kernel();
      });
    for (auto& t : ts) t.join();
    block = nullptr;
  }
}
}  // namespace emu

inline void __syncthreads() { emu::block->bar->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int o) {
  emu::Warp& w = emu::block->warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x & 31;
  w.buf[lane] = v;
  w.bar->arrive_and_wait();
  const float r = w.buf[lane ^ o];
  w.bar->arrive_and_wait();
  return r;
}

inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
