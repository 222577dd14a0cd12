// Single-token decoding for `zlm sample`: the whole-model `Decoder` and the token `draw`.
//
// `Decoder` steps a whole model (all layers, then the decoder) for one token per stream in
// ONE call: what `zlm sample` runs per character. Weights are packed once (by
// zlm/inference/stepper.py) into "tiles": a right operand W (K, N) of y = x W becomes
// ceil(N/kTile) tiles of (K, kTile), each contiguous, so a tile's product streams memory in
// order. The 4H gate columns are interleaved: tile t holds the pre-activations i, f, g, o of
// units kUnits t .. kUnits (t+1) - 1 (kUnits columns each), so the thread that finishes a
// tile's product does the element-wise step of its units at once (no second pass, no
// barrier). W is fp32, or bf16 (read as uint16, widened exactly to fp32); x, the
// accumulators, h, c and gates are fp32. Each output column is summed by one thread in one
// order, so the result does not depend on the thread count. kTile = 32 and kUnits = 8 come
// from zlm/model/cells/kernel_constants.py (-D defines, see kernels.h), which the Python
// packing reads too.

#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>

namespace zlm {
namespace {

// acc[0..32) += x[0..K) . w (K, 32): two accumulator sets (even and odd k) for ILP.
#if defined(__AVX2__) && defined(__FMA__)
static_assert(kTile == 32, "the AVX2 tile product holds a tile in four 8-float registers");

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> 8 fp32 (exact: the bits shifted up)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

template <typename W>
inline void tile_gemv(const float* x, const W* w, int64_t K, float* acc) {
  __m256 a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8);
  __m256 a2 = _mm256_loadu_ps(acc + 16), a3 = _mm256_loadu_ps(acc + 24);
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    const W* w0 = w + k * kTile;
    const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + k + 1);
    a0 = _mm256_fmadd_ps(x0, load8(w0), a0);
    a1 = _mm256_fmadd_ps(x0, load8(w0 + 8), a1);
    a2 = _mm256_fmadd_ps(x0, load8(w0 + 16), a2);
    a3 = _mm256_fmadd_ps(x0, load8(w0 + 24), a3);
    b0 = _mm256_fmadd_ps(x1, load8(w0 + 32), b0);
    b1 = _mm256_fmadd_ps(x1, load8(w0 + 40), b1);
    b2 = _mm256_fmadd_ps(x1, load8(w0 + 48), b2);
    b3 = _mm256_fmadd_ps(x1, load8(w0 + 56), b3);
  }
  if (k < K) {
    const W* w0 = w + k * kTile;
    const __m256 x0 = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(x0, load8(w0), a0);
    a1 = _mm256_fmadd_ps(x0, load8(w0 + 8), a1);
    a2 = _mm256_fmadd_ps(x0, load8(w0 + 16), a2);
    a3 = _mm256_fmadd_ps(x0, load8(w0 + 24), a3);
  }
  _mm256_storeu_ps(acc, _mm256_add_ps(a0, b0));
  _mm256_storeu_ps(acc + 8, _mm256_add_ps(a1, b1));
  _mm256_storeu_ps(acc + 16, _mm256_add_ps(a2, b2));
  _mm256_storeu_ps(acc + 24, _mm256_add_ps(a3, b3));
}
#else  // portable: the compiler vectorises the 32-wide inner loops
template <typename W>
inline void tile_gemv(const float* x, const W* w, int64_t K, float* acc) {
  float a0[kTile], a1[kTile];
  for (int64_t j = 0; j < kTile; ++j) { a0[j] = acc[j]; a1[j] = 0.0f; }
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    const float x0 = x[k], x1 = x[k + 1];
    const W* w0 = w + k * kTile;
    const W* w1 = w0 + kTile;
#pragma omp simd
    for (int64_t j = 0; j < kTile; ++j) {
      a0[j] += x0 * load<float>(w0, j);
      a1[j] += x1 * load<float>(w1, j);
    }
  }
  if (k < K) {
    const float x0 = x[k];
    const W* w0 = w + k * kTile;
#pragma omp simd
    for (int64_t j = 0; j < kTile; ++j) a0[j] += x0 * load<float>(w0, j);
  }
  for (int64_t j = 0; j < kTile; ++j) acc[j] = a0[j] + a1[j];
}
#endif

inline int64_t split_grain(int64_t tiles, int64_t threads) {
  return threads <= 1 ? std::max<int64_t>(tiles, 1) : std::max<int64_t>(1, (tiles + threads - 1) / threads);
}

}  // namespace

Decoder::Decoder(at::Tensor table_, std::vector<at::Tensor> w_, std::vector<at::Tensor> bias_, at::Tensor dec_w_,
                 at::Tensor dec_b_, at::Tensor h_, at::Tensor c_, std::vector<double> kc, std::vector<double> kh,
                 int64_t threads_)
    : table(table_), w(w_), bias(bias_), dec_w(dec_w_), dec_b(dec_b_), h(h_), c(c_), keep_c(kc),
      keep_h(kh), threads(std::max<int64_t>(threads_, 1)) {
  const int64_t L = h.size(0), B = h.size(1), H = h.size(2);
  TORCH_CHECK(h.scalar_type() == at::kFloat && c.scalar_type() == at::kFloat, "Decoder: fp32 state");
  TORCH_CHECK(h.is_contiguous() && c.is_contiguous() && c.sizes() == h.sizes(), "Decoder: h, c (L, B, H)");
  TORCH_CHECK(static_cast<int64_t>(w.size()) == L && static_cast<int64_t>(bias.size()) == L &&
              static_cast<int64_t>(keep_c.size()) == L && static_cast<int64_t>(keep_h.size()) == L,
              "Decoder: one weight, bias and keep per layer");
  const int64_t tiles = (H + kUnits - 1) / kUnits;
  TORCH_CHECK(table.dim() == 2 && table.size(1) == tiles * kTile && table.is_contiguous() &&
              table.scalar_type() == at::kFloat, "Decoder: table (V, Np) fp32");
  for (int64_t l = 0; l < L; ++l) {
    const auto wt = w[l].scalar_type();
    TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16, "Decoder: fp32 or bf16 weights");
    TORCH_CHECK(w[l].is_contiguous() && w[l].dim() == 3 && w[l].size(0) == tiles &&
                w[l].size(1) == (l == 0 ? H : 2 * H) && w[l].size(2) == kTile, "Decoder: weight tiles");
    TORCH_CHECK(l == 0 || (bias[l].is_contiguous() && bias[l].numel() == tiles * kTile &&
                           bias[l].scalar_type() == at::kFloat), "Decoder: bias (Np,) fp32");
  }
  const int64_t V = dec_b.numel();
  TORCH_CHECK(dec_w.is_contiguous() && dec_w.scalar_type() == at::kFloat && dec_w.dim() == 3 &&
              dec_w.size(0) == (V + kTile - 1) / kTile && dec_w.size(1) == H && dec_w.size(2) == kTile,
              "Decoder: decoder tiles (ceil(V/32), H, 32) fp32");
  TORCH_CHECK(dec_b.is_contiguous() && dec_b.scalar_type() == at::kFloat, "Decoder: decoder bias fp32");
  xcat = at::zeros({B, 2 * H}, h.options());
  hnew = at::empty({B, H}, h.options());
}

// One layer: pre = init + x W over every tile, then the element-wise step of its units.
template <typename W>
void Decoder::layer(int64_t l, const int64_t* tok) {
  const int64_t B = h.size(1), H = h.size(2), tiles = w[l].size(0), K = w[l].size(1);
  const int64_t Np = tiles * kTile;
  const W* wp = reinterpret_cast<const W*>(w[l].data_ptr());
  const float* x = l == 0 ? h[0].data_ptr<float>() : xcat.data_ptr<float>();
  const int64_t xs = l == 0 ? H : 2 * H;  // row stride of x
  const float* init = l == 0 ? table.data_ptr<float>() : bias[l].data_ptr<float>();
  float* hp = h[l].data_ptr<float>();
  float* cp = c[l].data_ptr<float>();
  float* hn = hnew.data_ptr<float>();
  const float zc = static_cast<float>(keep_c[l]), zh = static_cast<float>(keep_h[l]);
  at::parallel_for(0, tiles, split_grain(tiles, threads), [&](int64_t t0, int64_t t1) {
    float acc[kTile];
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t b = 0; b < B; ++b) {
        const float* src = init + (l == 0 ? tok[b] * Np : 0) + t * kTile;
        for (int64_t j = 0; j < kTile; ++j) acc[j] = src[j];
        tile_gemv<W>(x + b * xs, wp + t * K * kTile, K, acc);
        const int64_t u0 = t * kUnits, n = std::min<int64_t>(kUnits, H - u0);
        for (int64_t u = 0; u < n; ++u) {
          const float i = sigm(acc[u]), f = sigm(acc[kUnits + u]);
          const float g = tanh_(acc[2 * kUnits + u]), o = sigm(acc[3 * kUnits + u]);
          const int64_t s = b * H + u0 + u;
          const float cprev = cp[s];
          const float ct = f * cprev + i * g;
          const float ht = o * tanh_(ct);
          cp[s] = ct + zc * (cprev - ct);
          hn[s] = ht + zh * (hp[s] - ht);
        }
      }
    }
  });
  std::memcpy(hp, hn, sizeof(float) * B * H);
}

void Decoder::step(const at::Tensor& tok, const at::Tensor& logits) {
  const int64_t L = h.size(0), B = h.size(1), H = h.size(2), V = dec_b.numel();
  TORCH_CHECK(tok.scalar_type() == at::kLong && tok.is_contiguous() && tok.numel() == B,
              "Decoder.step: tok (B,) int64");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.numel() == B * V,
              "Decoder.step: logits (B, V) fp32");
  const int64_t* tp = tok.data_ptr<int64_t>();
  const int64_t Vin = table.size(0);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(tp[b] >= 0 && tp[b] < Vin, "Decoder.step: token id ", tp[b], " out of range");
  float* xc = xcat.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    if (l > 0) {  // x = [h of layer l-1 (new), h of layer l (previous)]
      const float* below = h[l - 1].data_ptr<float>();
      const float* mine = h[l].data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {
        std::memcpy(xc + b * 2 * H, below + b * H, sizeof(float) * H);
        std::memcpy(xc + b * 2 * H + H, mine + b * H, sizeof(float) * H);
      }
    }
    if (w[l].scalar_type() == at::kBFloat16) layer<uint16_t>(l, tp);
    else layer<float>(l, tp);
  }
  const int64_t vt = dec_w.size(0);
  const float* top = h[L - 1].data_ptr<float>();
  const float* dw = dec_w.data_ptr<float>();
  const float* db = dec_b.data_ptr<float>();
  float* out = logits.data_ptr<float>();
  const int64_t work = H * vt * kTile;  // below 64K weights one thread: waking a second costs more
  at::parallel_for(0, vt, work < 65536 ? vt : split_grain(vt, threads), [&](int64_t t0, int64_t t1) {
    float acc[kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j0 = t * kTile, n = std::min<int64_t>(kTile, V - j0);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t j = 0; j < kTile; ++j) acc[j] = j < n ? db[j0 + j] : 0.0f;
        tile_gemv<float>(top + b * H, dw + t * H * kTile, H, acc);
        std::memcpy(out + b * V + j0, acc, sizeof(float) * n);
      }
    }
  });
}

// One token per row by inverse CDF, for sampling. x (B, V) fp32: logits (log = true: the
// weights are exp((x - max) * inv_t), a softmax at temperature 1/inv_t) or probabilities
// (log = false: the weights are x; zeros are never drawn). u (B,) fp64 uniforms in [0, 1).
// out: B int64 (contiguous). Token j is drawn when cum_{j-1} <= u * total < cum_j, the
// cumulative sums taken in fp64 in token order.
void draw(const at::Tensor& x, const at::Tensor& u, double inv_t, bool log, const at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "draw: x (B, V) fp32");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == B, "draw: u (B,) fp64");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == B, "draw: out (B,) int64");
  TORCH_CHECK(V > 0, "draw: empty vocabulary");
  static thread_local std::vector<double> w;
  w.resize(V);
  const float* xp = x.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const float* r = xp + b * V;
    double total = 0.0;
    if (log) {
      float m = r[0];
      for (int64_t j = 1; j < V; ++j) m = r[j] > m ? r[j] : m;
      for (int64_t j = 0; j < V; ++j) total += (w[j] = std::exp((static_cast<double>(r[j]) - m) * inv_t));
    } else {
      for (int64_t j = 0; j < V; ++j) total += (w[j] = r[j] > 0.0f ? static_cast<double>(r[j]) : 0.0);
    }
    const double target = up[b] * total;
    int64_t pick = -1;
    double cum = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      cum += w[j];
      if (w[j] > 0.0) {
        pick = j;  // the last token with weight, should rounding leave target >= total
        if (cum > target) break;
      }
    }
    TORCH_CHECK(pick >= 0, "draw: no token has probability > 0");
    op[b] = pick;
  }
}

}  // namespace zlm
