// The element-wise step of the zoneout LSTM cell on the CPU, forward and backward.
//
// Built on first use by zlm/model/cells/cpu_ext.py (torch.utils.cpp_extension.load) with
// explicit instruction-set flags (-mavx2 -mfma, or -mavx512f ...), never -march=native.
// The recurrent matrix multiplies stay in torch (oneDNN/MKL); these two functions do
// everything else of one timestep in one pass over memory, vectorised over the hidden
// units and split over the batch rows with at::parallel_for.
//
// Shapes (B batch rows, H units; gate blocks i, f, g, o as in torch.nn.LSTM):
//   xp   (B, 4H) S   input projection of this step, bias included
//   rec  (B, 4H) S or bf16, optional   h_prev W_hh^T (added to xp here)
//   acts (B, 4H) S   out: i, f, g, o after their activations (g = tanh); may alias xp
//   c_prev, h_prev (B, H) S; kc, kh (B, H) S keep masks, or absent: the floats zc, zh
//   c_out (B, H) S zoned c;  tc_out (B, H) S tanh(c~), optional;  y_out (B, H) S zoned h
//   y_lp (B, H) bf16, optional: a bf16 copy of y for the next bf16 matrix multiply
// Equations (SPEC.md section 4):
//   c~ = f c_prev + i g;  h~ = o tanh(c~);  c = kc c_prev + (1-kc) c~;  h = kh h_prev + (1-kh) h~
// S is float or double. Strides: every tensor is contiguous (checked in Python).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

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

// Rows per parallel chunk: at least ~32K elements each, so small steps stay on one thread
// (waking a second thread costs more than the work, worse still on a busy machine).
inline int64_t grain_rows(int64_t H) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1)); }

template <typename T> T* opt_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? reinterpret_cast<T*>(t->data_ptr()) : nullptr;
}

template <typename S, typename R>
void forward_rows(int64_t r0, int64_t r1, int64_t H, const S* xp, const R* rec, S* acts, const S* c_prev,
                  const S* h_prev, const S* kc, S zc, const S* kh, S zh, S* c_out, S* tc_out, S* y_out,
                  uint16_t* y_lp) {
  for (int64_t b = r0; b < r1; ++b) {
    const int64_t g0 = b * 4 * H, s0 = b * H;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      S pi = xp[g0 + j], pf = xp[g0 + H + j], pg = xp[g0 + 2 * H + j], po = xp[g0 + 3 * H + j];
      if (rec) {
        pi += load<S>(rec, g0 + j);
        pf += load<S>(rec, g0 + H + j);
        pg += load<S>(rec, g0 + 2 * H + j);
        po += load<S>(rec, g0 + 3 * H + j);
      }
      const S i = sigm(pi), f = sigm(pf), g = tanh_(pg), o = sigm(po);
      const S cp = c_prev[s0 + j], hp = h_prev[s0 + j];
      const S ct = f * cp + i * g;
      const S tc = tanh_(ct);
      const S ht = o * tc;
      const S dc = kc ? kc[s0 + j] : zc, dh = kh ? kh[s0 + j] : zh;
      const S h = ht + dh * (hp - ht);
      acts[g0 + j] = i;
      acts[g0 + H + j] = f;
      acts[g0 + 2 * H + j] = g;
      acts[g0 + 3 * H + j] = o;
      c_out[s0 + j] = ct + dc * (cp - ct);
      if (tc_out) tc_out[s0 + j] = tc;
      y_out[s0 + j] = h;
      if (y_lp) y_lp[s0 + j] = f_to_bf16(static_cast<float>(h));
    }
  }
}

// Backward of one step (see zlm/model/cells/compiled.py for the derivation):
//   dh = carry + dy + rec                      gradient of the zoned h_t
//   dc~ = (1-kc) dc + (1-kh) dh o (1 - tc^2)
//   dpre = [dc~ g i(1-i), dc~ c_prev f(1-f), dc~ i (1-g^2), (1-kh) dh tc o(1-o)]
//   dc <- kc dc + dc~ f   (gradient of c_{t-1}),  carry <- kh dh
template <typename S, typename R, typename D>
void backward_rows(int64_t r0, int64_t r1, int64_t H, const S* acts, const S* tc, const S* c_prev,
                   const S* kc, S zc, const S* kh, S zh, const S* dy, S* carry, const R* rec, S* dc,
                   D* dpre) {
  for (int64_t b = r0; b < r1; ++b) {
    const int64_t g0 = b * 4 * H, s0 = b * H;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      S dh = carry[s0 + j];
      if (dy) dh += dy[s0 + j];
      if (rec) dh += load<S>(rec, s0 + j);
      const S i = acts[g0 + j], f = acts[g0 + H + j], g = acts[g0 + 2 * H + j], o = acts[g0 + 3 * H + j];
      const S t = tc[s0 + j];
      const S kcj = kc ? kc[s0 + j] : zc, khj = kh ? kh[s0 + j] : zh;
      const S dht = (S(1) - khj) * dh;
      const S dct = (S(1) - kcj) * dc[s0 + j] + dht * o * (S(1) - t * t);
      const S di = dct * g * i * (S(1) - i);
      const S df = dct * c_prev[s0 + j] * f * (S(1) - f);
      const S dg = dct * i * (S(1) - g * g);
      const S dO = dht * t * o * (S(1) - o);
      dc[s0 + j] = kcj * dc[s0 + j] + dct * f;
      carry[s0 + j] = khj * dh;
      if constexpr (sizeof(D) == 2) {
        dpre[g0 + j] = f_to_bf16(static_cast<float>(di));
        dpre[g0 + H + j] = f_to_bf16(static_cast<float>(df));
        dpre[g0 + 2 * H + j] = f_to_bf16(static_cast<float>(dg));
        dpre[g0 + 3 * H + j] = f_to_bf16(static_cast<float>(dO));
      } else {
        dpre[g0 + j] = di;
        dpre[g0 + H + j] = df;
        dpre[g0 + 2 * H + j] = dg;
        dpre[g0 + 3 * H + j] = dO;
      }
    }
  }
}

template <typename S>
void forward_typed(const at::Tensor& xp, const c10::optional<at::Tensor>& rec, const at::Tensor& acts,
                   const at::Tensor& c_prev, const at::Tensor& h_prev, const c10::optional<at::Tensor>& kc,
                   double zc, const c10::optional<at::Tensor>& kh, double zh, const at::Tensor& c_out,
                   const c10::optional<at::Tensor>& tc_out, const at::Tensor& y_out,
                   const c10::optional<at::Tensor>& y_lp) {
  const int64_t B = c_prev.size(0), H = c_prev.size(1);
  const S* xp_p = xp.data_ptr<S>();
  S* acts_p = acts.data_ptr<S>();
  const bool rec_bf16 = rec.has_value() && rec->defined() && rec->scalar_type() == at::kBFloat16;
  at::parallel_for(0, B, grain_rows(H), [&](int64_t r0, int64_t r1) {
    auto run = [&](auto* rec_p) {
      forward_rows<S>(r0, r1, H, xp_p, rec_p, acts_p, c_prev.data_ptr<S>(), h_prev.data_ptr<S>(),
                      opt_ptr<const S>(kc), static_cast<S>(zc), opt_ptr<const S>(kh), static_cast<S>(zh),
                      c_out.data_ptr<S>(), opt_ptr<S>(tc_out), y_out.data_ptr<S>(), opt_ptr<uint16_t>(y_lp));
    };
    if (rec_bf16) run(opt_ptr<const uint16_t>(rec));
    else run(opt_ptr<const S>(rec));
  });
}

template <typename S>
void backward_typed(const at::Tensor& acts, const at::Tensor& tc, const at::Tensor& c_prev,
                    const c10::optional<at::Tensor>& kc, double zc, const c10::optional<at::Tensor>& kh,
                    double zh, const c10::optional<at::Tensor>& dy, const at::Tensor& carry,
                    const c10::optional<at::Tensor>& rec, const at::Tensor& dc, const at::Tensor& dpre) {
  const int64_t B = c_prev.size(0), H = c_prev.size(1);
  const bool rec_bf16 = rec.has_value() && rec->defined() && rec->scalar_type() == at::kBFloat16;
  const bool out_bf16 = dpre.scalar_type() == at::kBFloat16;
  at::parallel_for(0, B, grain_rows(H), [&](int64_t r0, int64_t r1) {
    auto run = [&](auto* rec_p, auto* dpre_p) {
      backward_rows<S>(r0, r1, H, acts.data_ptr<S>(), tc.data_ptr<S>(), c_prev.data_ptr<S>(),
                       opt_ptr<const S>(kc), static_cast<S>(zc), opt_ptr<const S>(kh), static_cast<S>(zh),
                       opt_ptr<const S>(dy), carry.data_ptr<S>(), rec_p, dc.data_ptr<S>(), dpre_p);
    };
    uint16_t* d16 = reinterpret_cast<uint16_t*>(dpre.data_ptr());
    S* ds = reinterpret_cast<S*>(dpre.data_ptr());
    if (rec_bf16 && out_bf16) run(opt_ptr<const uint16_t>(rec), d16);
    else if (rec_bf16) run(opt_ptr<const uint16_t>(rec), ds);
    else if (out_bf16) run(opt_ptr<const S>(rec), d16);
    else run(opt_ptr<const S>(rec), ds);
  });
}

void forward_step(const at::Tensor& xp, const c10::optional<at::Tensor>& rec, const at::Tensor& acts,
                  const at::Tensor& c_prev, const at::Tensor& h_prev, const c10::optional<at::Tensor>& kc,
                  double zc, const c10::optional<at::Tensor>& kh, double zh, const at::Tensor& c_out,
                  const c10::optional<at::Tensor>& tc_out, const at::Tensor& y_out,
                  const c10::optional<at::Tensor>& y_lp) {
  TORCH_CHECK(xp.dtype() == c_prev.dtype(), "forward_step: xp and state dtypes differ");
  if (xp.scalar_type() == at::kDouble) {
    TORCH_CHECK(!(y_lp.has_value() && y_lp->defined()), "forward_step: no bf16 copy in fp64");
    forward_typed<double>(xp, rec, acts, c_prev, h_prev, kc, zc, kh, zh, c_out, tc_out, y_out, y_lp);
  } else {
    TORCH_CHECK(xp.scalar_type() == at::kFloat, "forward_step: fp32 or fp64 state");
    forward_typed<float>(xp, rec, acts, c_prev, h_prev, kc, zc, kh, zh, c_out, tc_out, y_out, y_lp);
  }
}

void backward_step(const at::Tensor& acts, const at::Tensor& tc, const at::Tensor& c_prev,
                   const c10::optional<at::Tensor>& kc, double zc, const c10::optional<at::Tensor>& kh,
                   double zh, const c10::optional<at::Tensor>& dy, const at::Tensor& carry,
                   const c10::optional<at::Tensor>& rec, const at::Tensor& dc, const at::Tensor& dpre) {
  if (acts.scalar_type() == at::kDouble) {
    backward_typed<double>(acts, tc, c_prev, kc, zc, kh, zh, dy, carry, rec, dc, dpre);
  } else {
    TORCH_CHECK(acts.scalar_type() == at::kFloat, "backward_step: fp32 or fp64 state");
    backward_typed<float>(acts, tc, c_prev, kc, zc, kh, zh, dy, carry, rec, dc, dpre);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zlm: the element-wise step of the zoneout LSTM cell (CPU)";
  m.def("forward_step", &forward_step, "one timestep forward, in place into the given buffers");
  m.def("backward_step", &backward_step, "one timestep backward, in place into the given buffers");
}
