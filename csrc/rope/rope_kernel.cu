// Fused RoPE on q and k in one launch (forward and backward).
//
// Math (HF Llama `apply_rotary_pos_emb`, rotate_half(x) = cat(-x2, x1)), per head with
// halves x1 = x[:D/2], x2 = x[D/2:] and table halves c1|c2 = cos, s1|s2 = sin:
//   forward   o1 = x1*c1 - x2*s1          o2 = x2*c2 + x1*s2
//   backward  g1' = g1*c1 + g2*s2         g2' = g2*c2 - g1*s1     (the transposed map)
// The YaRN attention factor is already folded into cos/sin by RotaryEmbedding. All math is
// fp32; each output is rounded once to the storage type.
//
// Work item = one VEC-wide chunk of the first half of one head plus the matching chunk of
// the second half; items are ordered (token, head over q then k, chunk) so q and k of the
// same token are neighbours and the token's cos/sin row is read from DRAM once (L1/L2 hits
// for the other heads). Memory bound: 2 reads + 2 writes of q and k, plus 4*D table bytes
// per token (5% for 16+4 heads).
#include "megablu_common.cuh"
#include "megablu_ops.h"

namespace megablu {
namespace {

template <typename T, typename TT, int VEC>
__global__ void __launch_bounds__(256) rope_kernel(RopeArgs a) {
  const int64_t half = a.D / 2;
  const int64_t chunks = half / VEC;                  // chunks per head
  const int64_t heads = a.H + a.Hkv;
  const int64_t per_tok = heads * chunks;
  const int64_t total = a.B * a.T * per_tok;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) return;

  int64_t tok, head, c, b, t;
  if (total <= 0xffffffffll) {
    // 32-bit divisions (~20 instructions each instead of ~100 for 64-bit)
    const uint32_t i = static_cast<uint32_t>(idx), pt = static_cast<uint32_t>(per_tok);
    const uint32_t ch = static_cast<uint32_t>(chunks), TT32 = static_cast<uint32_t>(a.T);
    const uint32_t tk = i / pt, rem = i - tk * pt, hd = rem / ch, bb = tk / TT32;
    tok = tk; head = hd; c = static_cast<int64_t>(rem - hd * ch) * VEC; b = bb; t = tk - bb * TT32;
  } else {
    tok = idx / per_tok;                                // b * T + t
    const int64_t rem = idx - tok * per_tok;
    head = rem / chunks;
    c = (rem - head * chunks) * VEC;                    // element offset inside the half
    b = tok / a.T;
    t = tok - b * a.T;
  }

  const T* src;
  T* dst;
  if (head < a.H) {
    src = static_cast<const T*>(a.q) + b * a.q_sb + t * a.q_st + head * a.q_sh;
    dst = static_cast<T*>(a.out_q) + (tok * a.H + head) * a.D;
  } else {
    const int64_t h = head - a.H;
    src = static_cast<const T*>(a.k) + b * a.k_sb + t * a.k_st + h * a.k_sh;
    dst = static_cast<T*>(a.out_k) + (tok * a.Hkv + h) * a.D;
  }
  const TT* cp = static_cast<const TT*>(a.cos) + b * a.c_sb + t * a.c_st;
  const TT* sp = static_cast<const TT*>(a.sin) + b * a.s_sb + t * a.s_st;

  const Vec<T, VEC> x1 = load_vec<T, VEC>(src + c);
  const Vec<T, VEC> x2 = load_vec<T, VEC>(src + half + c);
  const Vec<TT, VEC> c1 = load_vec<TT, VEC>(cp + c), c2 = load_vec<TT, VEC>(cp + half + c);
  const Vec<TT, VEC> s1 = load_vec<TT, VEC>(sp + c), s2 = load_vec<TT, VEC>(sp + half + c);

  Vec<T, VEC> o1, o2;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float u = to_f(x1.v[j]), w = to_f(x2.v[j]);
    float r1, r2;
    if (!a.backward) {
      r1 = u * to_f(c1.v[j]) - w * to_f(s1.v[j]);
      r2 = w * to_f(c2.v[j]) + u * to_f(s2.v[j]);
    } else {
      r1 = u * to_f(c1.v[j]) + w * to_f(s2.v[j]);
      r2 = w * to_f(c2.v[j]) - u * to_f(s1.v[j]);
    }
    o1.v[j] = from_f<T>(r1);
    o2.v[j] = from_f<T>(r2);
  }
  store_vec<T, VEC>(dst + c, o1);
  store_vec<T, VEC>(dst + half + c, o2);
}

// Launchers. Left out when tests/ops/emulator compiles the kernels above as host code
// (MEGABLU_HOST_EMULATION) to run their exact index and rounding logic on a CPU.
#ifndef MEGABLU_HOST_EMULATION
template <typename T, typename TT>
cudaError_t launch_typed(const RopeArgs& a, cudaStream_t stream) {
  const int64_t total = a.B * a.T * (a.H + a.Hkv) * (a.D / 2 / a.vec);
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  switch (a.vec) {
    case 8:
      if constexpr (sizeof(T) == 2) {   // 8-wide = 16 bytes only for 2-byte types
        rope_kernel<T, TT, 8><<<blocks, threads, 0, stream>>>(a);
        break;
      }
      return cudaErrorInvalidValue;
    case 4: rope_kernel<T, TT, 4><<<blocks, threads, 0, stream>>>(a); break;
    case 2: rope_kernel<T, TT, 2><<<blocks, threads, 0, stream>>>(a); break;
    case 1: rope_kernel<T, TT, 1><<<blocks, threads, 0, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t rope_launch(const RopeArgs& a, cudaStream_t stream) {
  switch (a.dtype) {
    case DType::F32: return launch_typed<float, float>(a, stream);
    case DType::F16: return cudaErrorInvalidValue;   // not built: megablu trains in bf16
    case DType::BF16:
      return a.table_f32 ? launch_typed<__nv_bfloat16, float>(a, stream)
                         : launch_typed<__nv_bfloat16, __nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

#else
}  // namespace
#endif

}  // namespace megablu
