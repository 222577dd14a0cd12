// The element-wise step of the zoneout LSTM cell on the CPU, forward and backward.
//
// Built on first use by zlm/model/cells/cpu_ext.py (torch.utils.cpp_extension.load) with
// explicit instruction-set flags (-mavx2 -mfma, or -mavx512f ...), never -march=native.
// Training and windows: the recurrent matrix multiplies stay in torch (oneDNN/MKL);
// forward_step and backward_step do everything else of one timestep in one pass over
// memory, vectorised over the hidden units and split over the batch rows with
// at::parallel_for; in fp32 their time loops (forward_window, backward_window) run here too.
//
// Shapes (B batch rows, H units; gate blocks i, f, g, o as in torch.nn.LSTM):
//   xp   (B, 4H) S   input projection of this step, bias included
//   rec  (B, 4H) S or bf16, optional   h_prev W_hh^T (added to xp here)
//   acts (B, 4H) S   out: i, f, g, o after their activations (g = tanh); may alias xp
//   c_prev, h_prev (B, H) S; kc, kh (B, H) S keep masks, or absent: the floats zc, zh
//   c_out (B, H) S zoned c;  tc_out (B, H) S tanh(c~) (scratch when not saved);  y_out (B, H) S zoned h
//   y_lp (B, H) bf16, optional: a bf16 copy of y for the next bf16 matrix multiply
// Equations (SPEC.md section 4):
//   c~ = f c_prev + i g;  h~ = o tanh(c~);  c = kc c_prev + (1-kc) c~;  h = kh h_prev + (1-kh) h~
// S is float or double. Strides: every tensor is contiguous (checked in Python).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

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

template <typename S> inline S load(const S* p, int64_t k) { return p[k]; }
template <typename S> inline S load(const uint16_t* p, int64_t k) { return static_cast<S>(bf16_to_f(p[k])); }

// Rows per parallel chunk: at least ~8K elements each, so tiny steps stay on one thread
// (waking a second thread costs more than the work). Measured on 2 idle cores: B 32 x H 512
// (16K elements, ~90 us on one thread) runs faster split in two.
inline int64_t grain_rows(int64_t H) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(H, 1)); }

inline bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// A (B, n) row-major operand, or one constant row broadcast to every row (row stride 0):
// the inner loops stay free of branches, so the compiler vectorises them.
template <typename T>
struct Rows {
  const T* p;
  int64_t stride;
  std::vector<T> fill;
  Rows(const c10::optional<at::Tensor>& t, int64_t n, T value) {
    if (given(t)) {
      p = reinterpret_cast<const T*>(t->data_ptr());
      stride = n;
    } else {
      fill.assign(n, value);
      p = fill.data();
      stride = 0;
    }
  }
  const T* row(int64_t b) const { return p + b * stride; }
};

// R: type of the recurrent part (S, or uint16_t = bf16); with bf16 a bf16 copy of y is written.
// Store = false (inference windows): the activations and tanh(c~), kept only for a
// backward, are not written.
template <typename S, typename R, bool Store = true>
void forward_rows(int64_t r0, int64_t r1, int64_t H, const S* xp, const Rows<R>& rec, S* acts,
                  const S* c_prev, const S* h_prev, const Rows<S>& kc, const Rows<S>& kh, S* c_out,
                  S* tc_out, S* y_out, uint16_t* y_lp) {
  for (int64_t b = r0; b < r1; ++b) {
    const int64_t g0 = b * 4 * H, s0 = b * H;
    const S* x = xp + g0;
    const R* r = rec.row(b);
    const S *kcr = kc.row(b), *khr = kh.row(b);
    S* a = acts + g0;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      const S pi = x[j] + load<S>(r, j), pf = x[H + j] + load<S>(r, H + j);
      const S pg = x[2 * H + j] + load<S>(r, 2 * H + j), po = x[3 * H + j] + load<S>(r, 3 * H + j);
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
      if constexpr (sizeof(R) == 2) y_lp[s0 + j] = f_to_bf16(static_cast<float>(h));
    }
  }
}

// Backward of one step (see zlm/model/cells/compiled.py for the derivation):
//   dh = carry + dy + rec                      gradient of the zoned h_t
//   dc~ = (1-kc) dc + (1-kh) dh o (1 - tc^2)
//   dpre = [dc~ g i(1-i), dc~ c_prev f(1-f), dc~ i (1-g^2), (1-kh) dh tc o(1-o)]
//   dc <- kc dc + dc~ f   (gradient of c_{t-1}),  carry <- kh dh
// R: type of rec and of dpre (S, or uint16_t = bf16).
template <typename S, typename R>
void backward_rows(int64_t r0, int64_t r1, int64_t H, const S* acts, const S* tc, const S* c_prev,
                   const Rows<S>& kc, const Rows<S>& kh, const Rows<S>& dy, S* carry, const Rows<R>& rec,
                   S* dc, R* dpre) {
  for (int64_t b = r0; b < r1; ++b) {
    const int64_t g0 = b * 4 * H, s0 = b * H;
    const S* a = acts + g0;
    const S *kcr = kc.row(b), *khr = kh.row(b), *dyr = dy.row(b);
    const R* rr = rec.row(b);
    R* d = dpre + g0;
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
      if constexpr (sizeof(R) == 2) {
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

template <typename S, typename R, bool Store = true>
void forward_typed(const at::Tensor& xp, const c10::optional<at::Tensor>& rec, const at::Tensor& acts,
                   const at::Tensor& c_prev, const at::Tensor& h_prev, const c10::optional<at::Tensor>& kc,
                   double zc, const c10::optional<at::Tensor>& kh, double zh, const at::Tensor& c_out,
                   const at::Tensor& tc_out, const at::Tensor& y_out, const c10::optional<at::Tensor>& y_lp) {
  const int64_t B = c_prev.size(0), H = c_prev.size(1);
  const Rows<R> rec_rows(rec, 4 * H, R(0));
  const Rows<S> kc_rows(kc, H, static_cast<S>(zc)), kh_rows(kh, H, static_cast<S>(zh));
  uint16_t* lp = given(y_lp) ? reinterpret_cast<uint16_t*>(y_lp->data_ptr()) : nullptr;
  at::parallel_for(0, B, grain_rows(H), [&](int64_t r0, int64_t r1) {
    forward_rows<S, R, Store>(r0, r1, H, xp.data_ptr<S>(), rec_rows, acts.data_ptr<S>(), c_prev.data_ptr<S>(),
                       h_prev.data_ptr<S>(), kc_rows, kh_rows, c_out.data_ptr<S>(), tc_out.data_ptr<S>(),
                       y_out.data_ptr<S>(), lp);
  });
}

template <typename S, typename R>
void backward_typed(const at::Tensor& acts, const at::Tensor& tc, const at::Tensor& c_prev,
                    const c10::optional<at::Tensor>& kc, double zc, const c10::optional<at::Tensor>& kh,
                    double zh, const c10::optional<at::Tensor>& dy, const at::Tensor& carry,
                    const c10::optional<at::Tensor>& rec, const at::Tensor& dc, const at::Tensor& dpre) {
  const int64_t B = c_prev.size(0), H = c_prev.size(1);
  const Rows<R> rec_rows(rec, H, R(0));
  const Rows<S> kc_rows(kc, H, static_cast<S>(zc)), kh_rows(kh, H, static_cast<S>(zh)), dy_rows(dy, H, S(0));
  R* d = reinterpret_cast<R*>(dpre.data_ptr());
  at::parallel_for(0, B, grain_rows(H), [&](int64_t r0, int64_t r1) {
    backward_rows<S, R>(r0, r1, H, acts.data_ptr<S>(), tc.data_ptr<S>(), c_prev.data_ptr<S>(), kc_rows,
                        kh_rows, dy_rows, carry.data_ptr<S>(), rec_rows, dc.data_ptr<S>(), d);
  });
}

// Every tensor contiguous; S = the state dtype (fp32 or fp64); bf16 (rec, y_lp, dpre) only
// with fp32 state, and then all of them bf16 together (checked here).
void forward_step(const at::Tensor& xp, const c10::optional<at::Tensor>& rec, const at::Tensor& acts,
                  const at::Tensor& c_prev, const at::Tensor& h_prev, const c10::optional<at::Tensor>& kc,
                  double zc, const c10::optional<at::Tensor>& kh, double zh, const at::Tensor& c_out,
                  const at::Tensor& tc_out, const at::Tensor& y_out, const c10::optional<at::Tensor>& y_lp) {
  TORCH_CHECK(xp.dtype() == c_prev.dtype(), "forward_step: xp and state dtypes differ");
  const bool lp = given(y_lp);
  TORCH_CHECK(!given(rec) || (rec->scalar_type() == at::kBFloat16) == lp, "forward_step: bf16 rec <=> y_lp");
  if (xp.scalar_type() == at::kDouble) {
    TORCH_CHECK(!lp, "forward_step: no bf16 with fp64 state");
    forward_typed<double, double>(xp, rec, acts, c_prev, h_prev, kc, zc, kh, zh, c_out, tc_out, y_out, y_lp);
  } else {
    TORCH_CHECK(xp.scalar_type() == at::kFloat, "forward_step: fp32 or fp64 state");
    if (lp) forward_typed<float, uint16_t>(xp, rec, acts, c_prev, h_prev, kc, zc, kh, zh, c_out, tc_out, y_out, y_lp);
    else forward_typed<float, float>(xp, rec, acts, c_prev, h_prev, kc, zc, kh, zh, c_out, tc_out, y_out, y_lp);
  }
}

void backward_step(const at::Tensor& acts, const at::Tensor& tc, const at::Tensor& c_prev,
                   const c10::optional<at::Tensor>& kc, double zc, const c10::optional<at::Tensor>& kh,
                   double zh, const c10::optional<at::Tensor>& dy, const at::Tensor& carry,
                   const c10::optional<at::Tensor>& rec, const at::Tensor& dc, const at::Tensor& dpre) {
  const bool lp = dpre.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!given(rec) || (rec->scalar_type() == at::kBFloat16) == lp, "backward_step: bf16 rec <=> dpre");
  if (acts.scalar_type() == at::kDouble) {
    TORCH_CHECK(!lp, "backward_step: no bf16 with fp64 state");
    backward_typed<double, double>(acts, tc, c_prev, kc, zc, kh, zh, dy, carry, rec, dc, dpre);
  } else {
    TORCH_CHECK(acts.scalar_type() == at::kFloat, "backward_step: fp32 or fp64 state");
    if (lp) backward_typed<float, uint16_t>(acts, tc, c_prev, kc, zc, kh, zh, dy, carry, rec, dc, dpre);
    else backward_typed<float, float>(acts, tc, c_prev, kc, zc, kh, zh, dy, carry, rec, dc, dpre);
  }
}


// The time loop of a window's forward for fp32 with the recurrent weight packed by oneDNN
// (zlm/model/cells/packed_gemm.py): per step pre = gates[t] + y[t] W_hh^T in one oneDNN
// call (the same operator the Python loop calls), then forward_step's element-wise work.
// Moving the loop here saves the interpreter's per-step cost (two calls, six views).
//   gates (T, B, 4H): in, x W_ih^T + b; out, the activations.  y (T+1, B, H): y[0] = h0.
//   c (T+1, B, H): c[0] = c0.  tc (T, B, H).  kc, kh (T, B, H) masks, or the floats zc, zh.
//   save = false (no backward follows): the activations and tc are not written.
void forward_window(const at::Tensor& gates, const at::Tensor& w_packed, const at::Tensor& y, const at::Tensor& c,
                    const at::Tensor& tc, const c10::optional<at::Tensor>& kc, double zc,
                    const c10::optional<at::Tensor>& kh, double zh, bool save) {
  static auto linear_add = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const c10::optional<at::Tensor>&, c10::string_view)>();
  TORCH_CHECK(gates.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "forward_window: fp32");
  const int64_t T = gates.size(0);
  const c10::optional<at::Tensor> none;
  for (int64_t t = 0; t < T; ++t) {
    const at::Tensor g = gates[t], yt = y[t];
    const at::Tensor pre = linear_add.call(yt, g, w_packed, none, "add");
    const c10::optional<at::Tensor> kct = given(kc) ? c10::optional<at::Tensor>((*kc)[t]) : none;
    const c10::optional<at::Tensor> kht = given(kh) ? c10::optional<at::Tensor>((*kh)[t]) : none;
    if (save) forward_typed<float, float, true>(pre, none, g, c[t], yt, kct, zc, kht, zh, c[t + 1], tc[t], y[t + 1], none);
    else forward_typed<float, float, false>(pre, none, g, c[t], yt, kct, zc, kht, zh, c[t + 1], tc[t], y[t + 1], none);
  }
}

// The backward time loop for fp32 with W_hh^T packed by oneDNN: per step (from T-1 down)
// backward_step's element-wise work, then rec = dpre W_hh in one oneDNN call. Returns the
// last rec (B, H), the gradient reaching h0 through W_hh (the caller adds carry).
at::Tensor backward_window(const at::Tensor& acts, const at::Tensor& tc, const at::Tensor& c,
                           const c10::optional<at::Tensor>& kc, double zc, const c10::optional<at::Tensor>& kh,
                           double zh, const c10::optional<at::Tensor>& dy, const at::Tensor& carry,
                           const at::Tensor& dc, const at::Tensor& dgates, const at::Tensor& w_packed) {
  static auto linear = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                             c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                             c10::optional<c10::string_view>)>();
  TORCH_CHECK(acts.scalar_type() == at::kFloat && dgates.scalar_type() == at::kFloat, "backward_window: fp32");
  const int64_t T = acts.size(0);
  const c10::optional<at::Tensor> none;
  c10::optional<at::Tensor> rec;
  at::Tensor last;
  for (int64_t t = T - 1; t >= 0; --t) {
    const c10::optional<at::Tensor> kct = given(kc) ? c10::optional<at::Tensor>((*kc)[t]) : none;
    const c10::optional<at::Tensor> kht = given(kh) ? c10::optional<at::Tensor>((*kh)[t]) : none;
    const c10::optional<at::Tensor> dyt = given(dy) ? c10::optional<at::Tensor>((*dy)[t]) : none;
    const at::Tensor d = dgates[t];
    backward_typed<float, float>(acts[t], tc[t], c[t], kct, zc, kht, zh, dyt, carry, rec, dc, d);
    last = linear.call(d, w_packed, none, "none", c10::List<c10::optional<at::Scalar>>(), c10::nullopt);
    rec = last;
  }
  return last;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zlm: the element-wise step of the zoneout LSTM cell (CPU)";
  m.def("forward_step", &forward_step, "one timestep forward, in place into the given buffers");
  m.def("backward_step", &backward_step, "one timestep backward, in place into the given buffers");
  m.def("forward_window", &forward_window, "a window's forward time loop (fp32, packed oneDNN weight)");
  m.def("backward_window", &backward_window, "a window's backward time loop (fp32, packed oneDNN weight)");
}
