// The zoneout keep masks of the mix16 draw (zlm/model/cells/masks.py), written in one pass.
//
// n elements into out (fp32 or fp64, contiguous): word i (i = 0, 1, ...) is splitmix64's
// output for the state seed + (i + 1) * GAMMA; element k is kept (1) when the signed 16-bit
// lane k % 4 of word k / 4 (lane 0 = the low bits) lies below `below` (= level - 2^15), else
// 0. The same bits as the torch expression in masks.py, which runs where this does not.
// GAMMA, the multipliers and shifts of splitmix64 and the bits per element come from
// zlm/model/cells/kernel_constants.py (-D defines, checked in kernels.h).

#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace zlm {
namespace {

constexpr int kBits = ZLM_MASK_BITS;  // bits of a word per element
constexpr int64_t kLanes = 64 / kBits;  // elements per 64-bit word
static_assert(kBits == 16, "a lane is read as int16_t");
constexpr uint64_t kGamma = ZLM_SPLITMIX_GAMMA;

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> ZLM_SPLITMIX_SHIFT1)) * uint64_t{ZLM_SPLITMIX_MIX1};
  z = (z ^ (z >> ZLM_SPLITMIX_SHIFT2)) * uint64_t{ZLM_SPLITMIX_MIX2};
  return z ^ (z >> ZLM_SPLITMIX_SHIFT3);
}

// Words w0 .. w1 - 1 of the mask: their kLanes elements each (fewer for the last word).
template <typename S>
void mask_words(uint64_t seed, int64_t below, int64_t w0, int64_t w1, int64_t n, S* out) {
  const int64_t full = std::min(w1, n / kLanes);  // words whose lanes are all inside
#pragma omp simd
  for (int64_t w = w0; w < full; ++w) {
    const uint64_t z = splitmix64(seed + static_cast<uint64_t>(w + 1) * kGamma);
    for (int l = 0; l < kLanes; ++l) {
      const int16_t r = static_cast<int16_t>(static_cast<uint16_t>(z >> (kBits * l)));
      out[kLanes * w + l] = r < below ? S(1) : S(0);
    }
  }
  for (int64_t w = std::max(w0, full); w < w1; ++w) {  // the last, partial word
    const uint64_t z = splitmix64(seed + static_cast<uint64_t>(w + 1) * kGamma);
    for (int64_t k = kLanes * w; k < std::min(n, kLanes * w + kLanes); ++k) {
      const int16_t r = static_cast<int16_t>(static_cast<uint16_t>(z >> (kBits * (k - kLanes * w))));
      out[k] = r < below ? S(1) : S(0);
    }
  }
}

}  // namespace

void draw_mask(const at::Tensor& seed, int64_t below, const at::Tensor& out) {
  TORCH_CHECK(out.is_contiguous() && (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble),
              "draw_mask: out contiguous fp32 or fp64");
  TORCH_CHECK(seed.device().is_cpu() && seed.scalar_type() == at::kLong && seed.numel() == 1,
              "draw_mask: seed one int64 on the CPU");
  const int64_t n = out.numel(), words = (n + kLanes - 1) / kLanes;
  const uint64_t s = static_cast<uint64_t>(*seed.data_ptr<int64_t>());  // read here, not by Python
  at::parallel_for(0, words, 16384, [&](int64_t w0, int64_t w1) {
    if (out.scalar_type() == at::kFloat) mask_words<float>(s, below, w0, w1, n, ptr<float>(out));
    else mask_words<double>(s, below, w0, w1, n, ptr<double>(out));
  });
}

}  // namespace zlm
