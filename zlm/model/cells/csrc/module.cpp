// The Python module of zlm's C++ kernels: the bindings only (the kernels live in
// cell_steps.cpp, mask_draw.cpp and decoder.cpp; kernels.h declares them). It includes
// torch's pybind11 header with the tensor type casters, not torch/extension.h, which would
// pull in the whole C++ frontend and more than double this file's compile time.

#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zlm: the CPU zoneout cell's steps and windows, the zoneout mask draw, the sampling Decoder";
  m.def("forward_step", &zlm::forward_step, "one timestep forward, in place into the given buffers");
  m.def("backward_step", &zlm::backward_step, "one timestep backward, in place into the given buffers");
  m.def("forward_window", &zlm::forward_window,
        "a window's forward time loop (fp32 or bf16 multiplies, a weight packed by oneDNN, MKL or for AMX)");
  m.def("backward_window", &zlm::backward_window,
        "a window's backward time loop (fp32 or bf16 multiplies, a weight packed by oneDNN, MKL or for AMX)");
  m.def("mkl_packed_ready", &zlm::mkl_packed_ready, "whether torch carries MKL's packed GEMM (mkl_gemm.cpp)");
  m.def("mkl_pack", &zlm::mkl_pack, "W (N, K) fp32 -> MKL's packed W^T for products with M rows, a byte tensor");
  m.def("mkl_packed_mm", &zlm::mkl_packed_mm, "c = a W^T + beta c with W packed by mkl_pack, into c");
  m.def("amx_ready", &zlm::amx_ready, "whether this CPU and torch run oneDNN's AMX bf16 micro-kernel (amx_gemm.cpp)");
  m.def("amx_pack", &zlm::amx_pack,
        "B (K, N) bf16, K even -> its columns padded to Np (a multiple of 16) in blocks of AMX's VNNI layout, "
        "(Np / nb, K, nb)");
  m.def("amx_mm", &zlm::amx_mm, "a (M, K) bf16 x B packed by amx_pack -> (M, Np) fp32 (columns past N are 0)");
  m.def("bf16_pair", &zlm::bf16_pair, "fp32 (N, K) -> bf16 (N, K) and its transpose (K, N), in one pass");
  m.def("draw_mask", &zlm::draw_mask, "a zoneout keep mask of the mix16 draw (masks.py)");
  m.def("draw", &zlm::draw, "one token per row by inverse CDF (sampling)");
  m.def("decoder_kernel", &zlm::decoder_kernel, "the Decoder's product as built (decoder.cpp)");
  pybind11::dict constants;  // as compiled: kernel_constants.CONSTANTS, read back by the tests
  constants["DECODER_TILE"] = ZLM_DECODER_TILE;
  constants["DECODER_UNITS"] = ZLM_DECODER_UNITS;
  constants["MASK_BITS"] = ZLM_MASK_BITS;
  constants["SPLITMIX_GAMMA"] = ZLM_SPLITMIX_GAMMA;
  constants["SPLITMIX_MIX1"] = ZLM_SPLITMIX_MIX1;
  constants["SPLITMIX_MIX2"] = ZLM_SPLITMIX_MIX2;
  constants["SPLITMIX_SHIFT1"] = ZLM_SPLITMIX_SHIFT1;
  constants["SPLITMIX_SHIFT2"] = ZLM_SPLITMIX_SHIFT2;
  constants["SPLITMIX_SHIFT3"] = ZLM_SPLITMIX_SHIFT3;
  m.attr("constants") = constants;
  pybind11::class_<zlm::Decoder>(m, "Decoder")
      .def(pybind11::init<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor, at::Tensor,
                          at::Tensor, at::Tensor, std::vector<double>, std::vector<double>, int64_t>())
      .def("step", &zlm::Decoder::step, "one token per stream through every layer and the decoder")
      .def("run", &zlm::Decoder::run, "T tokens (or layer 0's pre-activations) per stream: the top layer's h after each")
      .def_readonly("table", &zlm::Decoder::table, "layer 0's table (V, Np), or the embedding (V, E) it reads instead");
}
