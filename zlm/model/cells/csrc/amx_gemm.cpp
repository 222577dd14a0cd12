// The recurrent product of the bf16 time loops through oneDNN's batch-reduce GEMM
// micro-kernel (torch's at::native::cpublas::brgemm), on CPUs with AMX: one kernel call per
// block of output columns, with no primitive lookup, output allocation or reorder per step,
// where the packed oneDNN linear spends most of a small product's time on those (docs/kernels.md).
//
// A packed weight is a bf16 tensor (Np / nb, K, nb): the B matrix (K, N) of the product
// a (M, K) x B -> c (M, N) fp32, its columns padded with zeros to Np, the next multiple of
// 16, and cut into blocks of nb columns (32, or 16 where Np is not a multiple of 32), each in
// the VNNI layout AMX reads (pairs of k interleaved: K must be even). `amx_pack` makes it
// once per window; `amx_mm_into` writes the product into rows of Np columns (the padding's
// columns come out 0), the blocks split over the threads. The sums accumulate in fp32 and
// come back in fp32 (the packed oneDNN linear rounds its result to bf16).

#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

namespace zlm {

bool amx_ready() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor amx_pack(const at::Tensor& b) {
  TORCH_CHECK(amx_ready(), "amx_pack: this CPU or torch build has no AMX bf16 micro-kernel");
  TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.dim() == 2 && b.is_contiguous(), "amx_pack: b (K, N) bf16");
  const int64_t K = b.size(0), N = b.size(1);
  TORCH_CHECK(K % 2 == 0 && K > 0 && N > 0, "amx_pack: K even");
  const int64_t Np = (N + 15) / 16 * 16, nb = Np % 32 == 0 ? 32 : 16;
  at::Tensor src_t = b;
  if (Np != N) {  // zero columns up to Np
    src_t = at::zeros({K, Np}, b.options());
    src_t.narrow(1, 0, N).copy_(b);
  }
  at::Tensor out = at::empty({Np / nb, K, nb}, b.options());
  const auto* src = reinterpret_cast<const at::BFloat16*>(src_t.data_ptr());
  auto* dst = reinterpret_cast<at::BFloat16*>(out.data_ptr());
  for (int64_t q = 0; q < Np / nb; ++q)
    at::native::cpublas::pack(K, nb, Np, nb, at::kBFloat16, at::kBFloat16, src + q * nb, dst + q * K * nb);
  return out;
}

int64_t amx_columns(const at::Tensor& packed) { return packed.size(0) * packed.size(2); }

bool is_amx_packed(const at::Tensor& w) { return w.scalar_type() == at::kBFloat16 && w.dim() == 3; }

void amx_mm_into(const uint16_t* a, int64_t m, const at::Tensor& packed, float* c) {
  const int64_t blocks = packed.size(0), K = packed.size(1), nb = packed.size(2), N = blocks * nb;  // N = Np
  const auto* A = reinterpret_cast<const at::BFloat16*>(a);
  const auto* P = reinterpret_cast<const at::BFloat16*>(packed.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q)
      at::native::cpublas::brgemm(m, nb, K, K, nb, N, false, A, P + q * K * nb, c + q * nb, true);
    at::native::cpublas::brgemm_release(true);  // the tile registers go back before other work
  });
}

// (M, Np): the caller keeps the first N columns.
at::Tensor amx_mm(const at::Tensor& a, const at::Tensor& packed) {
  TORCH_CHECK(is_amx_packed(packed), "amx_mm: a weight packed by amx_pack");
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && a.dim() == 2 && a.is_contiguous() && a.size(1) == packed.size(1),
              "amx_mm: a (M, K) contiguous bf16, K as packed");
  at::Tensor c = at::empty({a.size(0), amx_columns(packed)}, a.options().dtype(at::kFloat));
  amx_mm_into(ptr<const uint16_t>(a), a.size(0), packed, ptr<float>(c));
  return c;
}

}  // namespace zlm
