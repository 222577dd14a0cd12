// Single-token decoding for `zlm sample` and `zlm serve`: the whole-model `Decoder` and the
// token `draw`. `Decoder::run` steps a window of tokens without the decoder: the features of
// scoring's few streams (zlm/model/cells/decoder_tiles.py).
//
// `Decoder` steps a whole model (all layers, then the decoder) for one token per stream in
// ONE call: what `zlm sample` runs per character, and what `zlm serve` runs for all its
// streams at once. Weights are packed once (by zlm/model/cells/decoder_tiles.py) into "tiles": a
// right operand W (K, N) of y = x W becomes ceil(N/kTile) tiles of (K, kTile), each
// contiguous, so a tile's product streams memory in order. The 4H gate columns are
// interleaved: tile t holds the pre-activations i, f, g, o of units kUnits t .. kUnits (t+1) - 1
// (kUnits columns each), so the thread that finishes a tile's product does the element-wise
// step of its units at once (no second pass, no barrier). kTile = 32 and kUnits = 8 come
// from zlm/model/cells/kernel_constants.py (-D defines, see kernels.h), which the Python
// packing reads too.
//
// Streams are taken kRows at a time: the weights of a tile are loaded (and widened) once for
// up to kRows rows, so a batch of streams costs the multiply-adds, not kRows weight reads,
// per row. Every row is summed in the same order whatever the batch and the thread count,
// so a stream's result does not depend on what else is stepped with it (`zlm serve` relies on
// this: a request's text equals `zlm sample --seed`'s).
//
// The products, by what the build has (`decoder_kernel()` names it):
// - "avx512-bf16dot" (AVX512-BF16, bf16 weights): x is rounded to bf16 once per row and the
//   tiles are re-laid as pairs of k ((K/2, kTile, 2), at construction), so one vdpbf16ps adds
//   two products per column; accumulators fp32. This is what bf16 training computes too
//   (autocast rounds the matmul's input to bf16).
// - "avx512" (fp32 weights, or bf16 widened exactly to fp32): kRows = 4 rows, two
//   accumulators per row and column half (even and odd k).
// - "avx2": kRows = 4 rows, two accumulators per row and 8-column chunk (even and odd k), as
//   many chunks per pass over k as the registers hold. "portable": plain loops, one row.
// h, c, the gates and the decoder's logits are fp32 in every case.

#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>

namespace zlm {
namespace {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kPairs = true;  // bf16 weights use the pair layout and vdpbf16ps
#else
constexpr bool kPairs = false;
#endif

#if defined(__AVX512F__)
constexpr int kRows = 4;
static_assert(kTile == 32, "the AVX-512 tile product holds a row's tile in two 16-float registers");

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> 16 fp32 (exact: the bits shifted up)
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// The four accumulators of each of R rows: two column halves x (even k, odd k); the even
// ones start from acc's rows (kTile floats each), the odd ones from zero.
template <int R>
inline void open_rows(const float* acc, __m512 (&a)[R][4]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    a[r][0] = _mm512_loadu_ps(acc + r * kTile);
    a[r][1] = _mm512_loadu_ps(acc + r * kTile + 16);
    a[r][2] = _mm512_setzero_ps();
    a[r][3] = _mm512_setzero_ps();
  }
}

// acc's rows = the even accumulators + the odd ones.
template <int R>
inline void close_rows(__m512 (&a)[R][4], float* acc) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * kTile, _mm512_add_ps(a[r][0], a[r][2]));
    _mm512_storeu_ps(acc + r * kTile + 16, _mm512_add_ps(a[r][1], a[r][3]));
  }
}

// acc[r][0..32) += x_r[0..K) . w (K, 32) for R rows, x_r = x + r xs (`open_rows`).
template <typename W, int R>
inline void rows_product(const float* x, int64_t xs, const W* w, int64_t K, float* acc) {
  __m512 a[R][4];
  open_rows<R>(acc, a);
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    const W* w0 = w + k * kTile;
    const __m512 v0 = load16(w0), v1 = load16(w0 + 16), v2 = load16(w0 + 32), v3 = load16(w0 + 48);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_set1_ps(x[r * xs + k]), x1 = _mm512_set1_ps(x[r * xs + k + 1]);
      a[r][0] = _mm512_fmadd_ps(x0, v0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(x0, v1, a[r][1]);
      a[r][2] = _mm512_fmadd_ps(x1, v2, a[r][2]);
      a[r][3] = _mm512_fmadd_ps(x1, v3, a[r][3]);
    }
  }
  if (k < K) {
    const W* w0 = w + k * kTile;
    const __m512 v0 = load16(w0), v1 = load16(w0 + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_set1_ps(x[r * xs + k]);
      a[r][0] = _mm512_fmadd_ps(x0, v0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(x0, v1, a[r][1]);
    }
  }
  close_rows<R>(a, acc);
}

#if defined(__AVX512BF16__)
// The pair layout: acc[r][0..32) += x_r . w for R rows, x_r = xp + r xs: P pairs of bf16
// (x[2p] low, x[2p+1] high) as uint32; w (P, 32, 2) bf16: for pair p and column j,
// w[2p][j] then w[2p+1][j]. The accumulators of `open_rows`, even and odd p.
template <int R>
inline void rows_dot(const uint32_t* xp, int64_t xs, const uint16_t* w, int64_t P, float* acc) {
  __m512 a[R][4];
  open_rows<R>(acc, a);
  auto bh = [](__m512i v) { return reinterpret_cast<__m512bh&>(v); };
  int64_t p = 0;
  for (; p + 1 < P; p += 2) {
    const uint16_t* w0 = w + p * 2 * kTile;
    const __m512bh v0 = bh(_mm512_loadu_si512(w0)), v1 = bh(_mm512_loadu_si512(w0 + 32));
    const __m512bh v2 = bh(_mm512_loadu_si512(w0 + 64)), v3 = bh(_mm512_loadu_si512(w0 + 96));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh x0 = bh(_mm512_set1_epi32(static_cast<int>(xp[r * xs + p])));
      const __m512bh x1 = bh(_mm512_set1_epi32(static_cast<int>(xp[r * xs + p + 1])));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], x0, v0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], x0, v1);
      a[r][2] = _mm512_dpbf16_ps(a[r][2], x1, v2);
      a[r][3] = _mm512_dpbf16_ps(a[r][3], x1, v3);
    }
  }
  if (p < P) {
    const uint16_t* w0 = w + p * 2 * kTile;
    const __m512bh v0 = bh(_mm512_loadu_si512(w0)), v1 = bh(_mm512_loadu_si512(w0 + 32));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh x0 = bh(_mm512_set1_epi32(static_cast<int>(xp[r * xs + p])));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], x0, v0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], x0, v1);
    }
  }
  close_rows<R>(a, acc);
}

// n floats -> n bf16 (round to nearest even); the tail of a 16 is masked.
inline void to_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = n - k >= 16 ? static_cast<__mmask16>(0xFFFF)
                                    : static_cast<__mmask16>((1u << (n - k)) - 1u);
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + k));
    _mm256_mask_storeu_epi16(out + k, m, reinterpret_cast<const __m256i&>(v));
  }
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 4;
static_assert(kTile == 32, "the AVX2 tile product takes a tile as four 8-float column chunks");

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> 8 fp32 (exact: the bits shifted up)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// acc[r][8q .. 8q + 8C) += x_r . w[:, 8q .. 8q + 8C) for R rows (x_r = x + r xs), C column
// chunks of 8 at once: per row and chunk two accumulators, even k and odd k (for ILP), added
// at the end. Each column's sums run in the same order whatever R and C, so a row's result
// does not depend on the rows stepped with it.
template <typename W, int R, int C>
inline void chunk_product(const float* x, int64_t xs, const W* w, int64_t K, float* acc, int q) {
  __m256 a[R][C], b[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      a[r][j] = _mm256_loadu_ps(acc + r * kTile + 8 * (q + j));
      b[r][j] = _mm256_setzero_ps();
    }
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    const W* w0 = w + k * kTile + 8 * q;
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      const __m256 v0 = load8(w0 + 8 * j), v1 = load8(w0 + kTile + 8 * j);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        a[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * xs + k), v0, a[r][j]);
        b[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * xs + k + 1), v1, b[r][j]);
      }
    }
  }
  if (k < K) {
    const W* w0 = w + k * kTile + 8 * q;
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      const __m256 v0 = load8(w0 + 8 * j);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * xs + k), v0, a[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) _mm256_storeu_ps(acc + r * kTile + 8 * (q + j), _mm256_add_ps(a[r][j], b[r][j]));
}

// acc[r][0..32) += x_r[0..K) . w (K, 32) for R rows: one row takes the tile's four chunks in
// one pass over k (8 accumulators); several rows take fewer chunks per pass (at most 16
// accumulators in the 16 registers with the weights and broadcasts), so each pass reads its
// columns' weights once for all R rows.
template <typename W, int R>
inline void rows_product(const float* x, int64_t xs, const W* w, int64_t K, float* acc) {
  constexpr int C = R == 1 ? 4 : (R == 2 ? 2 : 1);
#pragma GCC unroll 4
  for (int q = 0; q < 4; q += C) chunk_product<W, R, C>(x, xs, w, K, acc, q);
}
#else  // portable: the compiler vectorises the 32-wide inner loops
constexpr int kRows = 1;

template <typename W, int R>
inline void rows_product(const float* x, int64_t, const W* w, int64_t K, float* acc) {
  static_assert(R == 1, "the portable product takes one row at a time");
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

// f(std::integral_constant<int, r>) for r in 1 .. kRows: the row count as a template argument.
template <typename F>
inline void with_rows(int r, F&& f) {
  switch (r) {
    case 1: f(std::integral_constant<int, 1>{}); break;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
#endif
    default: TORCH_CHECK(false, "Decoder: ", r, " rows at once");
  }
}
static_assert(kRows <= 4, "with_rows covers up to 4 rows");

inline int64_t split_grain(int64_t tiles, int64_t threads) {
  return threads <= 1 ? std::max<int64_t>(tiles, 1) : std::max<int64_t>(1, (tiles + threads - 1) / threads);
}

// (tiles, K, kTile) bf16 -> (tiles, ceil(K/2), kTile, 2): k 2p and 2p+1 of a column side by side
// (a zero for the k past an odd K).
at::Tensor pair_tiles(const at::Tensor& w) {
  const int64_t tiles = w.size(0), K = w.size(1), P = (K + 1) / 2;
  at::Tensor out = at::zeros({tiles, P, kTile, 2}, w.options());
  const uint16_t* src = ptr<uint16_t>(w);
  uint16_t* dst = ptr<uint16_t>(out);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < kTile; ++j)
        dst[((t * P + k / 2) * kTile + j) * 2 + (k & 1)] = src[(t * K + k) * kTile + j];
  return out;
}

}  // namespace

const char* decoder_kernel() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return "avx512-bf16dot";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

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
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.scalar_type() == at::kFloat && L > 0 &&
              w[0].dim() == 3, "Decoder: table (V, Np) or embedding (V, E) fp32");
  embed = w[0].size(1) != H;
  TORCH_CHECK(embed ? w[0].size(1) == table.size(1) + H : table.size(1) == tiles * kTile,
              "Decoder: layer 0 takes the table (V, Np) with weight tiles of depth H, or the embedding (V, E) "
              "with depth E + H");
  int64_t widest = 0;
  for (int64_t l = 0; l < L; ++l) {
    const auto wt = w[l].scalar_type();
    TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16, "Decoder: fp32 or bf16 weights");
    TORCH_CHECK(w[l].is_contiguous() && w[l].dim() == 3 && w[l].size(0) == tiles &&
                w[l].size(1) == (l == 0 ? w[0].size(1) : 2 * H) && w[l].size(2) == kTile, "Decoder: weight tiles");
    TORCH_CHECK((l == 0 && !embed) || (bias[l].is_contiguous() && bias[l].numel() == tiles * kTile &&
                                       bias[l].scalar_type() == at::kFloat), "Decoder: bias (Np,) fp32");
    depth.push_back(w[l].size(1));
    widest = std::max(widest, depth.back());
    if (kPairs && wt == at::kBFloat16) w[l] = pair_tiles(w[l]);
  }
  const int64_t V = dec_b.numel();
  TORCH_CHECK(dec_w.is_contiguous() && dec_w.scalar_type() == at::kFloat && dec_w.dim() == 3 &&
              dec_w.size(0) == (V + kTile - 1) / kTile && dec_w.size(1) == H && dec_w.size(2) == kTile,
              "Decoder: decoder tiles (ceil(V/32), H, 32) fp32");
  TORCH_CHECK(dec_b.is_contiguous() && dec_b.scalar_type() == at::kFloat, "Decoder: decoder bias fp32");
  xcat = at::zeros({B, widest}, h.options());
  hnew = at::empty({B, H}, h.options());
  xbf = at::zeros({B, widest + 2}, h.options().dtype(at::kBFloat16));  // x as bf16 pairs (pair layout)
}

// One layer: pre = init + x W over every tile, then the element-wise step of its units.
template <typename W>
void Decoder::layer(int64_t l, const int64_t* tok) {
  const int64_t B = h.size(1), H = h.size(2), tiles = w[l].size(0), K = depth[l];
  const int64_t Np = tiles * kTile;
  const W* wp = reinterpret_cast<const W*>(w[l].data_ptr());
  const bool looked_up = l == 0 && !embed;  // layer 0's input projection is a row of the table
  const float* x = looked_up ? h[0].data_ptr<float>() : xcat.data_ptr<float>();
  const int64_t xs = looked_up ? H : K;  // row stride of x
  const float* init = looked_up ? table.data_ptr<float>() : bias[l].data_ptr<float>();
  float* hp = h[l].data_ptr<float>();
  float* cp = c[l].data_ptr<float>();
  float* hn = hnew.data_ptr<float>();
  const float zc = static_cast<float>(keep_c[l]), zh = static_cast<float>(keep_h[l]);
  const bool pairs = kPairs && std::is_same<W, uint16_t>::value;
  const int64_t P = (K + 1) / 2, ps = xbf.size(1) / 2;  // pairs per row of x, row stride in pairs
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xbf.data_ptr());
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (pairs) {  // x rounded to bf16 once per row (a zero after an odd K)
    uint16_t* xb = ptr<uint16_t>(xbf);
    for (int64_t b = 0; b < B; ++b) {
      to_bf16(x + b * xs, K, xb + b * 2 * ps);
      if (K & 1) xb[b * 2 * ps + K] = 0;
    }
  }
#endif
  at::parallel_for(0, tiles, split_grain(tiles, threads), [&](int64_t t0, int64_t t1) {
    float acc[kRows * kTile];
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t b0 = 0; b0 < B; b0 += kRows) {
        const int r = static_cast<int>(std::min<int64_t>(kRows, B - b0));
        for (int i = 0; i < r; ++i) {
          // layer 0: the token's table row, or the stream's row of the given projection (run)
          const float* row = !looked_up ? init : (xp_rows != nullptr ? xp_rows + (b0 + i) * Np : init + tok[b0 + i] * Np);
          const float* src = row + t * kTile;
          std::memcpy(acc + i * kTile, src, sizeof(float) * kTile);
        }
        with_rows(r, [&](auto R) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
          if (pairs) {
            rows_dot<decltype(R)::value>(xp + b0 * ps, ps, reinterpret_cast<const uint16_t*>(wp) + t * P * 2 * kTile,
                                         P, acc);
            return;
          }
#endif
          rows_product<W, decltype(R)::value>(x + b0 * xs, xs, wp + t * K * kTile, K, acc);
        });
        const int64_t u0 = t * kUnits, n = std::min<int64_t>(kUnits, H - u0);
        for (int i = 0; i < r; ++i) {
          const float* a = acc + i * kTile;
          const int64_t b = b0 + i;
          for (int64_t u = 0; u < n; ++u) {
            const float ig = sigm(a[u]), f = sigm(a[kUnits + u]);
            const float g = tanh_(a[2 * kUnits + u]), o = sigm(a[3 * kUnits + u]);
            const int64_t s = b * H + u0 + u;
            const float cprev = cp[s];
            const float ct = f * cprev + ig * g;
            const float ht = o * tanh_(ct);
            cp[s] = ct + zc * (cprev - ct);
            hn[s] = ht + zh * (hp[s] - ht);
          }
        }
      }
    }
  });
  (void)xp;
  (void)P;
  std::memcpy(hp, hn, sizeof(float) * B * H);
}

void Decoder::check_tokens(const int64_t* tp, int64_t n) const {
  const int64_t Vin = table.size(0);
  for (int64_t b = 0; b < n; ++b)
    TORCH_CHECK(tp[b] >= 0 && tp[b] < Vin, "Decoder: token id ", tp[b], " out of range");
}

void Decoder::layers(const int64_t* tp) {
  const int64_t L = h.size(0), B = h.size(1), H = h.size(2);
  float* xc = xcat.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    if (l > 0 || embed) {  // x = [layer l's input: the h of layer l-1 (new) or the token's embedding, h of layer l]
      const int64_t I = depth[l] - H, K = depth[l];
      const float* mine = h[l].data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {
        const float* in = l > 0 ? h[l - 1].data_ptr<float>() + b * H : table.data_ptr<float>() + tp[b] * I;
        std::memcpy(xc + b * K, in, sizeof(float) * I);
        std::memcpy(xc + b * K + I, mine + b * H, sizeof(float) * H);
      }
    }
    if (w[l].scalar_type() == at::kBFloat16) layer<uint16_t>(l, tp);
    else layer<float>(l, tp);
  }
}

void Decoder::run(const at::Tensor& in, const at::Tensor& out) {
  const int64_t L = h.size(0), B = h.size(1), H = h.size(2), Np = w[0].size(0) * kTile;
  const bool tokens = in.scalar_type() == at::kLong;
  TORCH_CHECK(tokens || !embed, "Decoder.run: this Decoder takes tokens (its layer 0 reads the embedding)");
  TORCH_CHECK(in.is_contiguous() && in.size(1) == B &&
              (tokens ? in.dim() == 2 : in.scalar_type() == at::kFloat && in.dim() == 3 && in.size(2) == Np),
              "Decoder.run: tokens (T, B) int64, or layer 0's interleaved pre-activations (T, B, Np) fp32");
  const int64_t T = in.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == T * B * H,
              "Decoder.run: out (T, B, H) fp32");
  const int64_t* tp = tokens ? in.data_ptr<int64_t>() : nullptr;
  if (tokens) check_tokens(tp, T * B);
  const float* xpp = tokens ? nullptr : in.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* top = h[L - 1].data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    xp_rows = tokens ? nullptr : xpp + t * B * Np;
    layers(tokens ? tp + t * B : nullptr);
    std::memcpy(op + t * B * H, top, sizeof(float) * B * H);
  }
  xp_rows = nullptr;
}

void Decoder::step(const at::Tensor& tok, const at::Tensor& logits) {
  const int64_t L = h.size(0), B = h.size(1), H = h.size(2), V = dec_b.numel();
  TORCH_CHECK(tok.scalar_type() == at::kLong && tok.is_contiguous() && tok.numel() == B,
              "Decoder.step: tok (B,) int64");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.numel() == B * V,
              "Decoder.step: logits (B, V) fp32");
  const int64_t* tp = tok.data_ptr<int64_t>();
  check_tokens(tp, B);
  layers(tp);
  const int64_t vt = dec_w.size(0);
  const float* top = h[L - 1].data_ptr<float>();
  const float* dw = dec_w.data_ptr<float>();
  const float* db = dec_b.data_ptr<float>();
  float* out = logits.data_ptr<float>();
  const int64_t work = H * vt * kTile * B;  // below 64K multiply-adds one thread: waking a second costs more
  at::parallel_for(0, vt, work < 65536 ? vt : split_grain(vt, threads), [&](int64_t t0, int64_t t1) {
    float acc[kRows * kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j0 = t * kTile, n = std::min<int64_t>(kTile, V - j0);
      for (int64_t b0 = 0; b0 < B; b0 += kRows) {
        const int r = static_cast<int>(std::min<int64_t>(kRows, B - b0));
        for (int i = 0; i < r; ++i)
          for (int64_t j = 0; j < kTile; ++j) acc[i * kTile + j] = j < n ? db[j0 + j] : 0.0f;
        with_rows(r, [&](auto R) {
          rows_product<float, decltype(R)::value>(top + b0 * H, H, dw + t * H * kTile, H, acc);
        });
        for (int i = 0; i < r; ++i) std::memcpy(out + (b0 + i) * V + j0, acc + i * kTile, sizeof(float) * n);
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
