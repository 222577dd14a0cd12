// The training cell's C++ work on the CPU (zlm/model/cells/compiled.py calls it): the
// element-wise step of the zoneout LSTM forward and backward, the time loops of a window
// with packed weights, and the bf16 conversion of the recurrent weight.
//
// The recurrent matrix multiplies stay in torch (oneDNN/MKL/AMX micro-kernels); forward_step and
// backward_step do everything else of one timestep in one pass over memory, vectorised over
// the hidden units and split over the batch rows with at::parallel_for. With packed weights
// (fp32: MKL's packed GEMM, mkl_gemm.cpp, or oneDNN's; bf16 on CPUs with native bf16:
// oneDNN's, or its AMX micro-kernel, amx_gemm.cpp) the time loops (forward_window, backward_window) run here too, calling the same
// product the Python loop calls.
//
// Shapes (B batch rows, H units; gate blocks i, f, g, o as in torch.nn.LSTM):
//   xp   (B, 4H) S, or bf16 with a bf16 rec   input projection of this step, bias included
//   rec  (B, 4H) S or bf16 (fp32 with a bf16 xp: AMX), optional   h_prev W_hh^T (added to xp here)
//   acts (B, 4H) S   out: i, f, g, o after their activations (g = tanh); may alias an S xp
//   c_prev, h_prev (B, H) S; kc, kh (B, H) S keep masks, or absent: the floats zc, zh
//   c_out (B, H) S zoned c;  tc_out (B, H) S tanh(c~) (scratch when not saved);  y_out (B, H) S zoned h
//   y_lp (B, H) bf16, optional: a bf16 copy of y for the next bf16 matrix multiply
// Equations (zoneout: keep the previous value with probability k, per unit):
//   c~ = f c_prev + i g;  h~ = o tanh(c~);  c = kc c_prev + (1-kc) c~;  h = kh h_prev + (1-kh) h~
// S is float or double. Strides: every tensor is contiguous (checked in Python).

#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>

namespace zlm {
namespace {


// Rows per parallel chunk: at least ~8K elements each, so tiny steps stay on one thread
// (waking a second thread costs more than the work) and B 32 x H 512 (16K elements) splits
// in two (docs/kernels.md).
inline int64_t grain_rows(int64_t H) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(H, 1)); }

// A (B, n) row-major operand, or one constant row broadcast to every row (row stride 0):
// the inner loops stay free of branches, so the compiler vectorises them.
template <typename T>
struct RowPtr {
  const T* p;
  int64_t stride;
  const T* row(int64_t b) const { return p + b * stride; }
};

// The RowPtr of an optional tensor (its rows of n elements), or of `value` broadcast (the
// filled row lives here). at(k): the same starting k elements further on, for step t of a
// (T, B, n) tensor (k = t * B * n); a broadcast row stays put.
template <typename T>
struct Rows {
  std::vector<T> fill;
  RowPtr<T> base;
  Rows(const c10::optional<at::Tensor>& t, int64_t n, T value) {
    if (given(t)) {
      base = {reinterpret_cast<const T*>(t->data_ptr()), n};
    } else {
      fill.assign(n, value);
      base = {fill.data(), 0};
    }
  }
  Rows(const Rows&) = delete;
  RowPtr<T> at(int64_t k) const { return {base.p + (base.stride ? k : 0), base.stride}; }
};

// X, R: types of the input projection and of the recurrent part (S, or uint16_t = bf16);
// with a bf16 X or R (bf16 multiplies) a bf16 copy of y is written.
// Store = false (inference windows): the activations and tanh(c~), kept only for a
// backward, are not written.
template <typename S, typename X, typename R, bool Store = true>
void forward_rows(int64_t r0, int64_t r1, int64_t H, const X* xp, RowPtr<R> rec, S* acts,
                  const S* c_prev, const S* h_prev, RowPtr<S> kc, RowPtr<S> kh, S* c_out,
                  S* tc_out, S* y_out, uint16_t* y_lp) {
  for (int64_t b = r0; b < r1; ++b) {
    const int64_t g0 = b * 4 * H, s0 = b * H;
    const X* x = xp + g0;
    const R* r = rec.row(b);
    const S *kcr = kc.row(b), *khr = kh.row(b);
    S* a = acts + g0;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      const S pi = load<S>(x, j) + load<S>(r, j), pf = load<S>(x, H + j) + load<S>(r, H + j);
      const S pg = load<S>(x, 2 * H + j) + load<S>(r, 2 * H + j);
      const S po = load<S>(x, 3 * H + j) + load<S>(r, 3 * H + j);
      const S i = sigm(pi), f = sigm(pf), g = tanh_(pg), o = sigm(po);
      const S cp = c_prev[s0 + j], hp = h_prev[s0 + j];
      const S ct = f * cp + i * g;
      const S tc = tanh_(ct);
      const S ht = o * tc;
      const S h = ht + khr[j] * (hp - ht);
      if constexpr (Store) {
        a[j] = i;
        a[H + j] = f;
        a[2 * H + j] = g;
        a[3 * H + j] = o;
        tc_out[s0 + j] = tc;
      }
      c_out[s0 + j] = ct + kcr[j] * (cp - ct);
      y_out[s0 + j] = h;
      if constexpr (sizeof(R) == 2 || sizeof(X) == 2) y_lp[s0 + j] = f_to_bf16(static_cast<float>(h));
    }
  }
}

// Backward of one step (see zlm/model/cells/compiled.py for the derivation):
//   dh = carry + dy + rec                      gradient of the zoned h_t
//   dc~ = (1-kc) dc + (1-kh) dh o (1 - tc^2)
//   dpre = [dc~ g i(1-i), dc~ c_prev f(1-f), dc~ i (1-g^2), (1-kh) dh tc o(1-o)]
//   dc <- kc dc + dc~ f   (gradient of c_{t-1}),  carry <- kh dh
// R: type of rec, D: of dpre (S, or uint16_t = bf16).
template <typename S, typename R, typename D = R>
void backward_rows(int64_t r0, int64_t r1, int64_t H, const S* acts, const S* tc, const S* c_prev,
                   RowPtr<S> kc, RowPtr<S> kh, RowPtr<S> dy, S* carry, RowPtr<R> rec,
                   S* dc, D* dpre) {
  for (int64_t b = r0; b < r1; ++b) {
    const int64_t g0 = b * 4 * H, s0 = b * H;
    const S* a = acts + g0;
    const S *kcr = kc.row(b), *khr = kh.row(b), *dyr = dy.row(b);
    const R* rr = rec.row(b);
    D* d = dpre + g0;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      const S dh = carry[s0 + j] + dyr[j] + load<S>(rr, j);
      const S i = a[j], f = a[H + j], g = a[2 * H + j], o = a[3 * H + j];
      const S t = tc[s0 + j];
      const S kcj = kcr[j], khj = khr[j];
      const S dht = (S(1) - khj) * dh;
      const S dct = (S(1) - kcj) * dc[s0 + j] + dht * o * (S(1) - t * t);
      const S di = dct * g * i * (S(1) - i);
      const S df = dct * c_prev[s0 + j] * f * (S(1) - f);
      const S dg = dct * i * (S(1) - g * g);
      const S dO = dht * t * o * (S(1) - o);
      dc[s0 + j] = kcj * dc[s0 + j] + dct * f;
      carry[s0 + j] = khj * dh;
      if constexpr (sizeof(D) == 2) {
        d[j] = f_to_bf16(static_cast<float>(di));
        d[H + j] = f_to_bf16(static_cast<float>(df));
        d[2 * H + j] = f_to_bf16(static_cast<float>(dg));
        d[3 * H + j] = f_to_bf16(static_cast<float>(dO));
      } else {
        d[j] = di;
        d[H + j] = df;
        d[2 * H + j] = dg;
        d[3 * H + j] = dO;
      }
    }
  }
}

// One step over all B rows, split over the rows (pointers into contiguous buffers).
template <typename S, typename X, typename R, bool Store = true>
void forward_ptrs(int64_t B, int64_t H, const X* xp, RowPtr<R> rec, S* acts, const S* c_prev, const S* h_prev,
                  RowPtr<S> kc, RowPtr<S> kh, S* c_out, S* tc_out, S* y_out, uint16_t* y_lp) {
  at::parallel_for(0, B, grain_rows(H), [&](int64_t r0, int64_t r1) {
    forward_rows<S, X, R, Store>(r0, r1, H, xp, rec, acts, c_prev, h_prev, kc, kh, c_out, tc_out, y_out, y_lp);
  });
}

template <typename S, typename R, typename D = R>
void backward_ptrs(int64_t B, int64_t H, const S* acts, const S* tc, const S* c_prev, RowPtr<S> kc,
                   RowPtr<S> kh, RowPtr<S> dy, S* carry, RowPtr<R> rec, S* dc, D* dpre) {
  at::parallel_for(0, B, grain_rows(H), [&](int64_t r0, int64_t r1) {
    backward_rows<S, R, D>(r0, r1, H, acts, tc, c_prev, kc, kh, dy, carry, rec, dc, dpre);
  });
}

template <typename S, typename X, typename R, bool Store = true>
void forward_typed(const at::Tensor& xp, const c10::optional<at::Tensor>& rec, const at::Tensor& acts,
                   const at::Tensor& c_prev, const at::Tensor& h_prev, const c10::optional<at::Tensor>& kc,
                   double zc, const c10::optional<at::Tensor>& kh, double zh, const at::Tensor& c_out,
                   const at::Tensor& tc_out, const at::Tensor& y_out, const c10::optional<at::Tensor>& y_lp) {
  const int64_t B = c_prev.size(0), H = c_prev.size(1);
  const Rows<R> rec_rows(rec, 4 * H, R(0));
  const Rows<S> kc_rows(kc, H, static_cast<S>(zc)), kh_rows(kh, H, static_cast<S>(zh));
  forward_ptrs<S, X, R, Store>(B, H, ptr<const X>(xp), rec_rows.at(0), ptr<S>(acts), ptr<const S>(c_prev),
                               ptr<const S>(h_prev), kc_rows.at(0), kh_rows.at(0), ptr<S>(c_out), ptr<S>(tc_out),
                               ptr<S>(y_out), ptr<uint16_t>(y_lp));
}

template <typename S, typename R, typename D = R>
void backward_typed(const at::Tensor& acts, const at::Tensor& tc, const at::Tensor& c_prev,
                    const c10::optional<at::Tensor>& kc, double zc, const c10::optional<at::Tensor>& kh,
                    double zh, const c10::optional<at::Tensor>& dy, const at::Tensor& carry,
                    const c10::optional<at::Tensor>& rec, const at::Tensor& dc, const at::Tensor& dpre) {
  const int64_t B = c_prev.size(0), H = c_prev.size(1);
  const Rows<R> rec_rows(rec, H, R(0));
  const Rows<S> kc_rows(kc, H, static_cast<S>(zc)), kh_rows(kh, H, static_cast<S>(zh)), dy_rows(dy, H, S(0));
  backward_ptrs<S, R, D>(B, H, ptr<const S>(acts), ptr<const S>(tc), ptr<const S>(c_prev), kc_rows.at(0),
                         kh_rows.at(0), dy_rows.at(0), ptr<S>(carry), rec_rows.at(0), ptr<S>(dc), ptr<D>(dpre));
}

// fn(j0, j1) for the blocks of `width` columns of a (rows, cols) operand, split over the
// threads in chunks of about 4K elements.
template <typename F>
void over_column_blocks(int64_t rows, int64_t cols, int64_t width, const F& fn) {
  at::parallel_for(0, (cols + width - 1) / width, std::max<int64_t>(1, 4096 / std::max<int64_t>(rows * width, 1)),
                   [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) fn(q * width, std::min(cols, q * width + width));
  });
}

// dst[j * ld + col0 + b] = src[b * cols + j] for a row-major (rows, cols) src: one step's
// block written transposed into the (cols, ld) matrix of the window. Each thread walks 16
// columns at a time so it fills 16 destination lines in step.
void transpose_into(const float* src, int64_t rows, int64_t cols, float* dst, int64_t ld, int64_t col0) {
  over_column_blocks(rows, cols, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t b = 0; b < rows; ++b) {
      const float* s = src + b * cols;
      float* d = dst + col0 + b;
      for (int64_t j = j0; j < j1; ++j) d[j * ld] = s[j];
    }
  });
}

// fp32 -> bf16 as torch's .to(torch.bfloat16) rounds: to nearest even, NaN -> the quiet NaN 0x7FC0.
inline uint16_t bf16_of(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t r = f_to_bf16(f);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : r;  // a select, not a branch
}

// a @ W^T for a oneDNN-packed W (zlm/model/cells/packed_gemm.py): the operator the Python
// loops call (RecurrentGemm.mm), looked up once.
at::Tensor packed_mm(const at::Tensor& a, const at::Tensor& w_packed) {
  static auto linear = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                             c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                             c10::optional<c10::string_view>)>();
  return linear.call(a, w_packed, c10::nullopt, "none", c10::List<c10::optional<at::Scalar>>(), c10::nullopt);
}

// db[j] += sum over the B rows of d[b, j], d (B, N) fp32 or bf16: the bias gradient summed
// step by step while d is in cache. Split over columns, each summed in row order (the
// result does not depend on the thread count).
template <typename R>
void add_column_sums(const R* d, int64_t B, int64_t N, float* db) {
  over_column_blocks(B, N, 64, [&](int64_t j0, int64_t j1) {
    for (int64_t b = 0; b < B; ++b) {
      const R* row = d + b * N;
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) db[j] += load<float>(row, j);
    }
  });
}

}  // namespace

// Every tensor contiguous; S = the state dtype (fp32 or fp64); bf16 (rec, y_lp, dpre) only
// with fp32 state, and then all of them bf16 together (checked here), except that a bf16
// step may take an fp32 rec (the AMX product's result, amx_gemm.cpp).
void forward_step(const at::Tensor& xp, const c10::optional<at::Tensor>& rec, const at::Tensor& acts,
                  const at::Tensor& c_prev, const at::Tensor& h_prev, const c10::optional<at::Tensor>& kc,
                  double zc, const c10::optional<at::Tensor>& kh, double zh, const at::Tensor& c_out,
                  const at::Tensor& tc_out, const at::Tensor& y_out, const c10::optional<at::Tensor>& y_lp) {
  const bool lp = given(y_lp);
  const bool xp_lp = xp.scalar_type() == at::kBFloat16;
  const bool rec_lp = given(rec) && rec->scalar_type() == at::kBFloat16;
  const bool rec_f32 = given(rec) && rec->scalar_type() == at::kFloat;  // with a bf16 xp: the AMX product
  TORCH_CHECK(!given(rec) || rec_lp == lp || (xp_lp && rec_f32), "forward_step: bf16 rec <=> y_lp");
  TORCH_CHECK(xp_lp ? lp : xp.dtype() == c_prev.dtype(),
              "forward_step: xp bf16 (only with y_lp) or the state dtype");
  if (c_prev.scalar_type() == at::kDouble) {
    TORCH_CHECK(!lp, "forward_step: no bf16 with fp64 state");
    forward_typed<double, double, double>(xp, rec, acts, c_prev, h_prev, kc, zc, kh, zh, c_out, tc_out, y_out, y_lp);
  } else {
    TORCH_CHECK(c_prev.scalar_type() == at::kFloat, "forward_step: fp32 or fp64 state");
    if (xp_lp && rec_f32) forward_typed<float, uint16_t, float>(xp, rec, acts, c_prev, h_prev, kc, zc, kh, zh, c_out, tc_out, y_out, y_lp);
    else if (xp_lp) forward_typed<float, uint16_t, uint16_t>(xp, rec, acts, c_prev, h_prev, kc, zc, kh, zh, c_out, tc_out, y_out, y_lp);
    else if (lp) forward_typed<float, float, uint16_t>(xp, rec, acts, c_prev, h_prev, kc, zc, kh, zh, c_out, tc_out, y_out, y_lp);
    else forward_typed<float, float, float>(xp, rec, acts, c_prev, h_prev, kc, zc, kh, zh, c_out, tc_out, y_out, y_lp);
  }
}

void backward_step(const at::Tensor& acts, const at::Tensor& tc, const at::Tensor& c_prev,
                   const c10::optional<at::Tensor>& kc, double zc, const c10::optional<at::Tensor>& kh,
                   double zh, const c10::optional<at::Tensor>& dy, const at::Tensor& carry,
                   const c10::optional<at::Tensor>& rec, const at::Tensor& dc, const at::Tensor& dpre) {
  const bool lp = dpre.scalar_type() == at::kBFloat16;
  const bool rec_f32 = given(rec) && rec->scalar_type() == at::kFloat;  // with a bf16 dpre: the AMX product
  TORCH_CHECK(!given(rec) || (rec->scalar_type() == at::kBFloat16) == lp || (lp && rec_f32),
              "backward_step: bf16 rec <=> dpre");
  if (acts.scalar_type() == at::kDouble) {
    TORCH_CHECK(!lp, "backward_step: no bf16 with fp64 state");
    backward_typed<double, double>(acts, tc, c_prev, kc, zc, kh, zh, dy, carry, rec, dc, dpre);
  } else {
    TORCH_CHECK(acts.scalar_type() == at::kFloat, "backward_step: fp32 or fp64 state");
    if (lp && rec_f32) backward_typed<float, float, uint16_t>(acts, tc, c_prev, kc, zc, kh, zh, dy, carry, rec, dc, dpre);
    else if (lp) backward_typed<float, uint16_t>(acts, tc, c_prev, kc, zc, kh, zh, dy, carry, rec, dc, dpre);
    else backward_typed<float, float>(acts, tc, c_prev, kc, zc, kh, zh, dy, carry, rec, dc, dpre);
  }
}

// fp32 (N, K) -> bf16 copies out (N, K) and out_t (K, N), as bf16_of rounds: the recurrent
// weight of a bf16 window for the forward and, transposed, for the backward product, in one
// pass over 32 x 32 tiles (one conversion and one transposing copy in torch take longer:
// docs/kernels.md).
void bf16_pair(const at::Tensor& w, const at::Tensor& out, const at::Tensor& out_t) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous(), "bf16_pair: w (N, K) fp32");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.size(0) == N && out.size(1) == K,
              "bf16_pair: out (N, K) bf16");
  TORCH_CHECK(out_t.scalar_type() == at::kBFloat16 && out_t.is_contiguous() && out_t.size(0) == K &&
              out_t.size(1) == N, "bf16_pair: out_t (K, N) bf16");
  const float* src = ptr<const float>(w);
  uint16_t *dst = ptr<uint16_t>(out), *dst_t = ptr<uint16_t>(out_t);
  constexpr int64_t kT = 32;
  at::parallel_for(0, (N + kT - 1) / kT, 1, [&](int64_t q0, int64_t q1) {
    uint16_t tile[kT][kT];
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t n0 = q * kT, nn = std::min(N, n0 + kT) - n0;
      for (int64_t k0 = 0; k0 < K; k0 += kT) {
        const int64_t kk = std::min(K, k0 + kT) - k0;
        for (int64_t i = 0; i < nn; ++i) {  // rows of the tile: contiguous reads and writes
          const float* r = src + (n0 + i) * K + k0;
          uint16_t* d = dst + (n0 + i) * K + k0;
#pragma omp simd
          for (int64_t j = 0; j < kk; ++j) d[j] = tile[i][j] = bf16_of(r[j]);
        }
        for (int64_t j = 0; j < kk; ++j) {  // columns of the tile: contiguous rows of out_t
          uint16_t* d = dst_t + (k0 + j) * N + n0;
          for (int64_t i = 0; i < nn; ++i) d[i] = tile[i][j];
        }
      }
    }
  });
}

// The time loop of a window's forward with the recurrent weight packed by oneDNN, in fp32 by
// MKL (a byte tensor from mkl_pack) or in bf16 for AMX (a 3-d tensor from amx_pack: then
// each step's rec comes back fp32; zlm/model/cells/packed_gemm.py); moving the loop here
// saves the interpreter's per-step cost (two calls, six views). fp32 (y_lp absent): per step
// pre = gates[t] + y[t] W_hh^T in one call (MKL: into gates[t] itself; the same product the
// Python loop calls), then forward_step's element-wise work. bf16 (y_lp and xp_lp given,
// W_hh packed in bf16): per step rec = y_lp[t] W_hh^T in bf16 (fp32 accumulation), then the
// element-wise step adds xp_lp[t] and rec in fp32, writes the activations to gates[t], y[t+1]
// and its bf16 copy y_lp[t+1].
//   gates (T, B, 4H): fp32: in, x W_ih^T + b; out, the activations (bf16: out only).
//   xp_lp (T, B, 4H) bf16: x W_ih^T + b (bf16 only).  y (T+1, B, H): y[0] = h0.
//   y_lp (T+1, B, H) bf16, y_lp[0] = h0: bf16 copies of y.
//   c (T+1, B, H): c[0] = c0.  tc (T, B, H).  kc, kh (T, B, H) masks, or the floats zc, zh.
//   save = false (no backward follows): the activations and tc are not written.
void forward_window(const at::Tensor& gates, const at::Tensor& w_packed, const at::Tensor& y, const at::Tensor& c,
                    const at::Tensor& tc, const c10::optional<at::Tensor>& kc, double zc,
                    const c10::optional<at::Tensor>& kh, double zh, bool save,
                    const c10::optional<at::Tensor>& y_lp, const c10::optional<at::Tensor>& xp_lp) {
  static auto linear_add = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const c10::optional<at::Tensor>&, c10::string_view)>();
  TORCH_CHECK(gates.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "forward_window: fp32 state");
  const bool lp = given(y_lp);
  TORCH_CHECK(!lp || (y_lp->scalar_type() == at::kBFloat16 && given(xp_lp) && xp_lp->scalar_type() == at::kBFloat16),
              "forward_window: y_lp and xp_lp bf16 together");
  const int64_t T = gates.size(0), B = gates.size(1), H = y.size(2);
  const bool mkl = w_packed.scalar_type() == at::kByte;  // packed by mkl_pack (fp32 only)
  TORCH_CHECK(!mkl || !lp, "forward_window: an MKL-packed weight is fp32 only");
  const bool amx = is_amx_packed(w_packed);  // packed by amx_pack (bf16 only)
  TORCH_CHECK(!amx || lp, "forward_window: an AMX-packed weight is bf16 only");
  // AMX writes every step's rec, fp32, into one buffer the element-wise step then reads
  // (rows of Np >= 4H columns: the product's padded width).
  const int64_t Np = amx ? amx_columns(w_packed) : 4 * H;
  const at::Tensor rec_buf = amx ? at::empty({B, Np}, gates.options()) : at::Tensor();
  const c10::optional<at::Tensor> none;
  const Rows<float> kc_rows(kc, H, static_cast<float>(zc)), kh_rows(kh, H, static_cast<float>(zh));
  const Rows<float> no_rec(none, 4 * H, 0.0f);  // fp32: the recurrent part is already in pre
  float *g = ptr<float>(gates), *yp = ptr<float>(y), *cp = ptr<float>(c), *tcp = ptr<float>(tc);
  const int64_t G = B * 4 * H, S = B * H;  // elements per step: gates, state
  for (int64_t t = 0; t < T; ++t, g += G, yp += S, cp += S, tcp += S) {
    const RowPtr<float> kct = kc_rows.at(t * S), kht = kh_rows.at(t * S);
    if (lp) {
      const uint16_t* xp = ptr<const uint16_t>(xp_lp) + t * G;
      uint16_t* out_lp = ptr<uint16_t>(y_lp) + (t + 1) * S;
      const auto step = [&]<typename R>(RowPtr<R> r) {  // rec fp32 (AMX) or bf16 (oneDNN)
        if (save) forward_ptrs<float, uint16_t, R, true>(B, H, xp, r, g, cp, yp, kct, kht, cp + S, tcp, yp + S, out_lp);
        else forward_ptrs<float, uint16_t, R, false>(B, H, xp, r, g, cp, yp, kct, kht, cp + S, tcp, yp + S, out_lp);
      };
      if (amx) {
        amx_mm_into(ptr<const uint16_t>(*y_lp) + t * S, B, w_packed, ptr<float>(rec_buf));  // (B, 4H) fp32
        step(RowPtr<float>{ptr<const float>(rec_buf), Np});
      } else {
        const at::Tensor rec = packed_mm((*y_lp)[t], w_packed);  // (B, 4H) bf16
        step(RowPtr<uint16_t>{ptr<const uint16_t>(rec), 4 * H});
      }
      continue;
    }
    at::Tensor pre;
    const float* xp = g;  // MKL: gates[t] += y[t] W_hh^T in place, the activations overwrite it
    if (mkl) {
      mkl_packed_addmm(yp, B, 4 * H, H, w_packed, 1.0f, g);
    } else {
      pre = linear_add.call(y[t], gates[t], w_packed, none, "add");  // (B, 4H)
      xp = ptr<const float>(pre);
    }
    if (save) forward_ptrs<float, float, float, true>(B, H, xp, no_rec.at(0), g, cp, yp, kct, kht, cp + S, tcp, yp + S, nullptr);
    else forward_ptrs<float, float, float, false>(B, H, xp, no_rec.at(0), g, cp, yp, kct, kht, cp + S, tcp, yp + S, nullptr);
  }
}

// The backward time loop with W_hh^T packed by oneDNN (or in fp32 by MKL, in bf16 for AMX:
// rec fp32): per step (from T-1 down) backward_step's element-wise work, then rec = dpre W_hh
// in one call. fp32, or bf16 when dgates is bf16 (W_hh^T packed in bf16; dpre bf16, rec bf16
// or, with AMX, fp32; the state gradients carry and dc fp32). Returns the last rec (B, H), the gradient reaching h0 through W_hh
// (the caller adds carry).
// fp32 only, optional: dgates_t (4H, T*B) and, from y (T+1, B, H), y_t (H, T*B) receive
// each step's dpre and h_prev transposed while they are in cache, so the weight gradients
// run as oneDNN products on contiguous operands (zlm/model/cells/compiled.py).
// Optional db (4H,) fp32: receives the bias gradient, the column sums of every step's dpre.
at::Tensor backward_window(const at::Tensor& acts, const at::Tensor& tc, const at::Tensor& c,
                           const c10::optional<at::Tensor>& kc, double zc, const c10::optional<at::Tensor>& kh,
                           double zh, const c10::optional<at::Tensor>& dy, const at::Tensor& carry,
                           const at::Tensor& dc, const at::Tensor& dgates, const at::Tensor& w_packed,
                           const c10::optional<at::Tensor>& dgates_t, const c10::optional<at::Tensor>& y,
                           const c10::optional<at::Tensor>& y_t, const c10::optional<at::Tensor>& db) {
  const bool lp = dgates.scalar_type() == at::kBFloat16;
  TORCH_CHECK(acts.scalar_type() == at::kFloat && (lp || dgates.scalar_type() == at::kFloat),
              "backward_window: fp32 state, fp32 or bf16 dgates");
  const int64_t T = acts.size(0), B = acts.size(1), H = tc.size(2);
  TORCH_CHECK(!lp || (!given(dgates_t) && !given(y)), "backward_window: transposed copies are fp32 only");
  TORCH_CHECK(given(y) == given(y_t), "backward_window: y and y_t together");
  TORCH_CHECK(!given(db) || (db->scalar_type() == at::kFloat && db->numel() == 4 * H), "backward_window: db (4H,) fp32");
  const Rows<float> kc_rows(kc, H, static_cast<float>(zc)), kh_rows(kh, H, static_cast<float>(zh));
  const Rows<float> dy_rows(dy, H, 0.0f);
  const int64_t G = B * 4 * H, S = B * H;  // elements per step: gates, state
  if (given(db)) db->zero_();
  const c10::optional<at::Tensor> none;
  const Rows<uint16_t> zero_lp(none, H, 0);  // rec of the last step: nothing came back yet
  const Rows<float> zero_f(none, H, 0.0f);
  const bool mkl = w_packed.scalar_type() == at::kByte;  // packed by mkl_pack (fp32 only)
  TORCH_CHECK(!mkl || !lp, "backward_window: an MKL-packed weight is fp32 only");
  const bool amx = is_amx_packed(w_packed);  // packed by amx_pack (bf16 only; rec comes back fp32)
  TORCH_CHECK(!amx || lp, "backward_window: an AMX-packed weight is bf16 only");
  // MKL and AMX write every step's rec into one buffer: a step reads it before its own product
  // (AMX: rows of Np >= H columns, the product's padded width).
  const int64_t Np = amx ? amx_columns(w_packed) : H;
  at::Tensor last, rec_buf = mkl || amx ? at::empty({B, Np}, acts.options()) : at::Tensor();
  for (int64_t t = T - 1; t >= 0; --t) {
    const float *a = ptr<const float>(acts) + t * G, *tct = ptr<const float>(tc) + t * S;
    const float* ct = ptr<const float>(c) + t * S;
    const RowPtr<float> kct = kc_rows.at(t * S), kht = kh_rows.at(t * S), dyt = dy_rows.at(t * S);
    const at::Tensor d = dgates[t];
    if (lp) {
      const auto step = [&]<typename R>(RowPtr<R> r) {  // rec fp32 (AMX) or bf16 (oneDNN); dpre bf16
        backward_ptrs<float, R, uint16_t>(B, H, a, tct, ct, kct, kht, dyt, ptr<float>(carry), r, ptr<float>(dc),
                                          ptr<uint16_t>(d));
      };
      if (amx) step(last.defined() ? RowPtr<float>{ptr<const float>(last), Np} : zero_f.at(0));
      else step(last.defined() ? RowPtr<uint16_t>{ptr<const uint16_t>(last), H} : zero_lp.at(0));
      if (given(db)) add_column_sums(ptr<const uint16_t>(d), B, 4 * H, ptr<float>(db));
    } else {
      const RowPtr<float> r = last.defined() ? RowPtr<float>{ptr<const float>(last), H} : zero_f.at(0);
      backward_ptrs<float, float>(B, H, a, tct, ct, kct, kht, dyt, ptr<float>(carry), r, ptr<float>(dc), ptr<float>(d));
      if (given(db)) add_column_sums(ptr<const float>(d), B, 4 * H, ptr<float>(db));
    }
    if (given(dgates_t)) transpose_into(ptr<const float>(d), B, 4 * H, ptr<float>(dgates_t), T * B, t * B);
    if (given(y)) transpose_into(ptr<const float>(y) + t * S, B, H, ptr<float>(y_t), T * B, t * B);
    if (mkl) {
      mkl_packed_addmm(ptr<const float>(d), B, H, 4 * H, w_packed, 0.0f, ptr<float>(rec_buf));
      last = rec_buf;
    } else if (amx) {
      amx_mm_into(ptr<const uint16_t>(d), B, w_packed, ptr<float>(rec_buf));
      last = rec_buf;
    } else {
      last = packed_mm(d, w_packed);
    }
  }
  return amx ? last.narrow(1, 0, H) : last;  // AMX: the columns past H are padding
}

}  // namespace zlm
