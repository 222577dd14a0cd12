// The recurrent product of the fp32 time loops through MKL's packed GEMM, where the torch
// build carries MKL (x86 wheels link it in and export its symbols). The functions are
// declared weak: where torch has no MKL (an ARM build, a build against another BLAS) they
// resolve to null, `mkl_packed_ready()` says false, and the windows keep oneDNN.
//
// A packed weight is a byte tensor holding MKL's packed copy of W^T for a weight W (N, K):
// `mkl_pack` makes it once per window (training: the weights change every step) for
// row-major products a (M, K) x W^T (K, N) with a fixed M (the batch); `mkl_packed_addmm`
// computes c = a W^T + beta c into c's own memory. Measured against the oneDNN packed
// linear the windows call otherwise: docs/kernels.md.

#include "kernels.h"

#include <ATen/ops/empty.h>

namespace {
// MKL's CBLAS constants (mkl_cblas.h).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
}  // namespace

extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                      int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

namespace zlm {

bool mkl_packed_ready() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr && cblas_sgemm_compute != nullptr;
}

at::Tensor mkl_pack(const at::Tensor& w, int64_t m) {
  TORCH_CHECK(mkl_packed_ready(), "mkl_pack: this torch build has no MKL packed GEMM");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous(), "mkl_pack: w (N, K) fp32");
  const int n = static_cast<int>(w.size(0)), k = static_cast<int>(w.size(1));
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, static_cast<int>(m), n, k);
  // The allocator aligns to 64 bytes, as MKL asks of a packed buffer.
  at::Tensor out = at::empty({static_cast<int64_t>(bytes)}, w.options().dtype(at::kByte));
  cblas_sgemm_pack(kRowMajor, kBMatrix, kTrans, static_cast<int>(m), n, k, 1.0f, w.data_ptr<float>(), k,
                   reinterpret_cast<float*>(out.data_ptr()));
  return out;
}

void mkl_packed_addmm(const float* a, int64_t m, int64_t n, int64_t k, const at::Tensor& packed, float beta,
                      float* c) {
  cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                      a, static_cast<int>(k), reinterpret_cast<const float*>(packed.data_ptr()),
                      static_cast<int>(n), beta, c, static_cast<int>(n));
}

void mkl_packed_mm(const at::Tensor& a, const at::Tensor& packed, double beta, const at::Tensor& c) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && c.scalar_type() == at::kFloat && a.dim() == 2 && c.dim() == 2 &&
                  a.is_contiguous() && c.is_contiguous() && a.size(0) == c.size(0),
              "mkl_packed_mm: a (M, K), c (M, N) contiguous fp32");
  TORCH_CHECK(packed.scalar_type() == at::kByte, "mkl_packed_mm: a weight packed by mkl_pack");
  mkl_packed_addmm(a.data_ptr<float>(), a.size(0), c.size(1), a.size(1), packed, static_cast<float>(beta),
                   c.data_ptr<float>());
}

}  // namespace zlm
