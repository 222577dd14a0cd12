// What the C++ kernels of zlm share: the constants Python passes in, the arithmetic the
// cell step and the Decoder both use, and the entry points module.cpp binds.
//
// Built by zlm/model/cells/cpu_ext.py (torch.utils.cpp_extension.load) from
//   cell_steps.cpp  the training cell: element-wise steps, time windows, bf16 conversion
//   mkl_gemm.cpp    the fp32 windows' recurrent product through MKL's packed GEMM
//   amx_gemm.cpp    the bf16 windows' recurrent product through oneDNN's AMX micro-kernel
//   mask_draw.cpp   the zoneout keep masks (the mix16 draw)
//   decoder.cpp     sampling and scoring a few streams: the whole-model Decoder, the inverse-CDF token draw
//   module.cpp      the Python bindings (the only file that includes pybind11)
// with explicit instruction-set flags (-mavx2 -mfma, or -mavx512f ...), never -march=native.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// The constants both languages use are defined once, in zlm/model/cells/kernel_constants.py,
// and reach the compiler as -D defines (`kernel_constants.compiler_defines`).
#ifndef ZLM_DECODER_TILE
#error "ZLM_DECODER_TILE is not defined: build through zlm/model/cells/cpu_ext.py"
#endif
#ifndef ZLM_DECODER_UNITS
#error "ZLM_DECODER_UNITS is not defined: build through zlm/model/cells/cpu_ext.py"
#endif
#ifndef ZLM_MASK_BITS
#error "ZLM_MASK_BITS is not defined: build through zlm/model/cells/cpu_ext.py"
#endif
#ifndef ZLM_SPLITMIX_GAMMA
#error "ZLM_SPLITMIX_GAMMA is not defined: build through zlm/model/cells/cpu_ext.py"
#endif
#ifndef ZLM_SPLITMIX_MIX1
#error "ZLM_SPLITMIX_MIX1 is not defined: build through zlm/model/cells/cpu_ext.py"
#endif
#ifndef ZLM_SPLITMIX_MIX2
#error "ZLM_SPLITMIX_MIX2 is not defined: build through zlm/model/cells/cpu_ext.py"
#endif
#if !defined(ZLM_SPLITMIX_SHIFT1) || !defined(ZLM_SPLITMIX_SHIFT2) || !defined(ZLM_SPLITMIX_SHIFT3)
#error "ZLM_SPLITMIX_SHIFT1..3 are not defined: build through zlm/model/cells/cpu_ext.py"
#endif

namespace zlm {

// exp for float, vectorisable (Cephes expf: range reduction by ln 2, degree-6 polynomial;
// ~1 ulp on [-87, 88]). Rounding by the 1.5 * 2^23 trick: needs no -ffast-math.
inline float exp_f(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float big = 12582912.0f;  // 1.5 * 2^23
  float t = x * 1.44269504088896341f + big;
  float n = t - big;
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = static_cast<int32_t>(n) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float sigm(float x) { return 1.0f / (1.0f + exp_f(-x)); }
inline float tanh_(float x) { return 2.0f / (1.0f + exp_f(-2.0f * x)) - 1.0f; }
inline double sigm(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double tanh_(double x) { return std::tanh(x); }

// bf16 is handled as its bits (uint16_t): widening is exact, narrowing rounds to nearest even.
inline float bf16_to_f(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f_to_bf16(float f) {  // round to nearest even (finite values)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Element k of an S array, or of a bf16 array widened to S.
template <typename S> inline S load(const S* p, int64_t k) { return p[k]; }
template <typename S> inline S load(const uint16_t* p, int64_t k) { return static_cast<S>(bf16_to_f(p[k])); }

inline bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The data of a contiguous tensor as T* (nullptr for an absent optional one).
template <typename T> T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }
template <typename T> T* ptr(const c10::optional<at::Tensor>& t) { return given(t) ? ptr<T>(*t) : nullptr; }

// ---------------------------------------------------------------- cell_steps.cpp
void forward_step(const at::Tensor& xp, const c10::optional<at::Tensor>& rec, const at::Tensor& acts,
                  const at::Tensor& c_prev, const at::Tensor& h_prev, const c10::optional<at::Tensor>& kc,
                  double zc, const c10::optional<at::Tensor>& kh, double zh, const at::Tensor& c_out,
                  const at::Tensor& tc_out, const at::Tensor& y_out, const c10::optional<at::Tensor>& y_lp);
void backward_step(const at::Tensor& acts, const at::Tensor& tc, const at::Tensor& c_prev,
                   const c10::optional<at::Tensor>& kc, double zc, const c10::optional<at::Tensor>& kh,
                   double zh, const c10::optional<at::Tensor>& dy, const at::Tensor& carry,
                   const c10::optional<at::Tensor>& rec, const at::Tensor& dc, const at::Tensor& dpre);
void forward_window(const at::Tensor& gates, const at::Tensor& w_packed, const at::Tensor& y, const at::Tensor& c,
                    const at::Tensor& tc, const c10::optional<at::Tensor>& kc, double zc,
                    const c10::optional<at::Tensor>& kh, double zh, bool save,
                    const c10::optional<at::Tensor>& y_lp, const c10::optional<at::Tensor>& xp_lp);
at::Tensor backward_window(const at::Tensor& acts, const at::Tensor& tc, const at::Tensor& c,
                           const c10::optional<at::Tensor>& kc, double zc, const c10::optional<at::Tensor>& kh,
                           double zh, const c10::optional<at::Tensor>& dy, const at::Tensor& carry,
                           const at::Tensor& dc, const at::Tensor& dgates, const at::Tensor& w_packed,
                           const c10::optional<at::Tensor>& dgates_t, const c10::optional<at::Tensor>& y,
                           const c10::optional<at::Tensor>& y_t, const c10::optional<at::Tensor>& db);
void bf16_pair(const at::Tensor& w, const at::Tensor& out, const at::Tensor& out_t);

// ---------------------------------------------------------------- mkl_gemm.cpp
bool mkl_packed_ready();
at::Tensor mkl_pack(const at::Tensor& w, int64_t m);
void mkl_packed_addmm(const float* a, int64_t m, int64_t n, int64_t k, const at::Tensor& packed, float beta,
                      float* c);
void mkl_packed_mm(const at::Tensor& a, const at::Tensor& packed, double beta, const at::Tensor& c);

// ---------------------------------------------------------------- amx_gemm.cpp
bool amx_ready();
at::Tensor amx_pack(const at::Tensor& b);
bool is_amx_packed(const at::Tensor& w);
int64_t amx_columns(const at::Tensor& packed);  // Np: the padded width of the product's rows
void amx_mm_into(const uint16_t* a, int64_t m, const at::Tensor& packed, float* c);  // c = a B
at::Tensor amx_mm(const at::Tensor& a, const at::Tensor& packed);

// ---------------------------------------------------------------- mask_draw.cpp
void draw_mask(const at::Tensor& seed, int64_t below, const at::Tensor& out);

// ---------------------------------------------------------------- decoder.cpp
// Tile layout of the Decoder's packed weights (see decoder.cpp).
constexpr int64_t kTile = ZLM_DECODER_TILE, kUnits = ZLM_DECODER_UNITS;
static_assert(kTile == 4 * kUnits, "a tile holds the four gates of its units");

void draw(const at::Tensor& x, const at::Tensor& u, double inv_t, bool log, const at::Tensor& out);

// The Decoder's product as built: "avx512-bf16dot", "avx512", "avx2" or "portable" (decoder.cpp).
const char* decoder_kernel();

// One token per stream through every layer and the decoder, in one call (decoder.cpp).
struct Decoder {
  // Layer 0's input projection, one of two ways (chosen by the depth of w[0]):
  // looked up: table (V_in, Np) fp32, E W_ih^T + b per token, interleaved columns; K_0 = H;
  // embed: table is the embedding (V_in, E) fp32, and w[0] holds [W_ih; W_hh] (K_0 = E + H)
  //   with bias[0]: one row of products more per step, no (V, Np) table for a large vocabulary.
  at::Tensor table;
  std::vector<at::Tensor> w;     // per layer (tiles, K_l, kTile) fp32 or bf16: K_l = H + H for l > 0
  std::vector<at::Tensor> bias;  // per layer (Np,) fp32, interleaved (looked up: layer 0's is in the table)
  at::Tensor dec_w;              // (ceil(V/kTile), H, kTile) fp32
  at::Tensor dec_b;              // (V,) fp32
  at::Tensor h, c;               // (L, B, H) fp32, the state, updated in place
  std::vector<double> keep_c, keep_h;
  int64_t threads;
  std::vector<int64_t> depth;    // per layer K_l (the tiles of bf16 weights may be re-laid in pairs of k)
  bool embed = false;            // layer 0 reads the embedding (above)
  at::Tensor xcat, hnew;         // scratch: (B, max K_l) [input, h_prev], (B, H) the new h
  at::Tensor xbf;                // scratch: (B, max K_l + 2) bf16, x rounded for the pair layout
  const float* xp_rows = nullptr;  // during run: layer 0's rows for this step, (B, Np)

  Decoder(at::Tensor table_, std::vector<at::Tensor> w_, std::vector<at::Tensor> bias_, at::Tensor dec_w_,
          at::Tensor dec_b_, at::Tensor h_, at::Tensor c_, std::vector<double> kc, std::vector<double> kh,
          int64_t threads_);
  void step(const at::Tensor& tok, const at::Tensor& logits);
  // T tokens per stream, one after another, without the decoder: in, the tokens (T, B) int64
  // (layer 0 reads the table's rows) or layer 0's pre-activations (T, B, Np) fp32 (x W_ih^T +
  // b, interleaved columns) -> out (T, B, H) fp32, the top layer's h after each (what the
  // decoder reads); h, c carried.
  void run(const at::Tensor& in, const at::Tensor& out);

 private:
  template <typename W>
  void layer(int64_t l, const int64_t* tok);
  void layers(const int64_t* tok);  // every layer for one token per stream (checked ids, or xp_rows)
  void check_tokens(const int64_t* tok, int64_t n) const;
};

}  // namespace zlm
