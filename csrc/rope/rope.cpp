// Torch binding of the fused RoPE kernel (csrc/rope/rope_kernel.cu).
#include "megablu_bindings.h"

namespace megablu {

namespace {
// stride of dim i, 0 when the dim has size 1 (so a meaningless stride never blocks vectors)
int64_t st(const at::Tensor& t, int i) { return t.size(i) == 1 ? 0 : t.stride(i); }
}  // namespace

std::vector<at::Tensor> rope_apply(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                   const at::Tensor& sin, bool backward) {
  MEGABLU_CHECK(q.is_cuda() && k.is_cuda() && cos.is_cuda() && sin.is_cuda(), "rope: CUDA tensors expected");
  MEGABLU_CHECK(q.dim() == 4 && k.dim() == 4, "rope: q (B,T,H,D) and k (B,T,Hkv,D) expected, got ", q.sizes(),
              " and ", k.sizes());
  MEGABLU_CHECK(cos.dim() == 3 && sin.dim() == 3, "rope: cos/sin (B|1, T, D) expected, got ", cos.sizes());
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), Hkv = k.size(2);
  MEGABLU_CHECK(k.size(0) == B && k.size(1) == T && k.size(3) == D, "rope: k ", k.sizes(), " does not match q ",
              q.sizes());
  MEGABLU_CHECK(D % 2 == 0, "rope: head_dim must be even, got ", D);
  MEGABLU_CHECK(q.scalar_type() == k.scalar_type(), "rope: q and k dtypes differ");
  MEGABLU_CHECK(cos.scalar_type() == sin.scalar_type(), "rope: cos and sin dtypes differ");
  MEGABLU_CHECK(cos.scalar_type() == q.scalar_type() || cos.scalar_type() == at::kFloat,
              "rope: cos/sin must be float32 or q's dtype");
  for (const at::Tensor* t : {&cos, &sin}) {
    MEGABLU_CHECK((t->size(0) == B || t->size(0) == 1) && t->size(1) == T && t->size(2) == D,
                "rope: cos/sin shape ", t->sizes(), " does not match q ", q.sizes());
    MEGABLU_CHECK(t->stride(2) == 1 || D == 1, "rope: cos/sin need a contiguous last dim");
  }
  MEGABLU_CHECK(q.stride(3) == 1 && k.stride(3) == 1, "rope: q/k need a contiguous last dim");

  const c10::cuda::CUDAGuard guard(q.device());
  auto oq = at::empty({B, T, H, D}, q.options());
  auto ok = at::empty({B, T, Hkv, D}, k.options());

  RopeArgs a{};
  a.q = q.data_ptr(); a.k = k.data_ptr(); a.out_q = oq.data_ptr(); a.out_k = ok.data_ptr();
  a.cos = cos.data_ptr(); a.sin = sin.data_ptr();
  a.B = B; a.T = T; a.H = H; a.Hkv = Hkv; a.D = D;
  a.q_sb = st(q, 0); a.q_st = st(q, 1); a.q_sh = st(q, 2);
  a.k_sb = st(k, 0); a.k_st = st(k, 1); a.k_sh = st(k, 2);
  a.c_sb = st(cos, 0); a.c_st = st(cos, 1);
  a.s_sb = st(sin, 0); a.s_st = st(sin, 1);
  a.dtype = to_dtype(q.scalar_type());
  a.table_f32 = cos.scalar_type() == at::kFloat && q.scalar_type() != at::kFloat;
  a.backward = backward;
  const int64_t es = q.element_size(), ts = cos.element_size();
  a.vec = pick_vec(static_cast<int>(16 / es),
                   {D / 2, a.q_sb, a.q_st, a.q_sh, a.k_sb, a.k_st, a.k_sh, a.c_sb, a.c_st, a.s_sb, a.s_st},
                   {{a.q, es}, {a.k, es}, {a.cos, ts}, {a.sin, ts}});
  check_launch(rope_launch(a, c10::cuda::getCurrentCUDAStream()), "rope");
  return {oq, ok};
}

}  // namespace megablu
