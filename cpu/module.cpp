// pybind11 bindings of the CPU kernels. Tensors arrive as integer addresses (checked in Python
// first, then again in C++); every entry point releases the GIL while it runs.
#include <pybind11/pybind11.h>

#include "adam.h"

namespace py = pybind11;

namespace {

zo::Buffers buffers(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
                    uintptr_t param_out, int out_dtype, int64_t n) {
  zo::Buffers b;
  b.param = reinterpret_cast<float*>(param);
  b.grad = reinterpret_cast<const void*>(grad);
  b.grad_dtype = grad_dtype;
  b.exp_avg = reinterpret_cast<float*>(exp_avg);
  b.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sq);
  b.param_out = reinterpret_cast<void*>(param_out);
  b.out_dtype = out_dtype;
  b.n = n;
  return b;
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "zo_kernels CPU kernels (stateless; addresses in, nothing kept)";
  m.def("isa_supported", &zo::isa_supported, py::arg("isa"), "Whether this CPU runs ISA code 0/1/2.");
  m.def(
      "adam_step",
      [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
         uintptr_t param_out, int out_dtype, int64_t n, int64_t step, double lr, double beta1, double beta2,
         double eps, double weight_decay, double grad_scale, bool adamw, bool bias_correction, int isa,
         int threads) {
        zo::AdamParams a;
        a.step = step; a.lr = lr; a.beta1 = beta1; a.beta2 = beta2; a.eps = eps;
        a.weight_decay = weight_decay; a.grad_scale = grad_scale; a.adamw = adamw;
        a.bias_correction = bias_correction;
        zo::adam_step(buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq, param_out, out_dtype, n), a, isa,
                      threads);
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("param_out"), py::arg("out_dtype"), py::arg("n"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale"), py::arg("adamw"),
      py::arg("bias_correction"), py::arg("isa"), py::arg("threads"), py::call_guard<py::gil_scoped_release>(),
      "Adam/AdamW over n elements at raw addresses.");
  m.def(
      "sum_squares",
      [](uintptr_t x, uintptr_t y, int dtype, int64_t n, int isa, int threads) {
        zo::SumSquares r;
        {
          py::gil_scoped_release release;
          r = zo::sum_squares(reinterpret_cast<const void*>(x), reinterpret_cast<void*>(y), dtype, n, isa, threads);
        }
        return py::make_tuple(r.sum, r.nonfinite);
      },
      py::arg("x"), py::arg("y"), py::arg("dtype"), py::arg("n"), py::arg("isa"), py::arg("threads"),
      "(sum of squares, any inf/NaN) of n values at x, copying them to y (if not 0) in the same pass.");
  m.def(
      "stream_pass",
      [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
         uintptr_t param_out, int out_dtype, int64_t n, int isa, int threads) {
        zo::stream_pass(buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq, param_out, out_dtype, n), isa,
                        threads);
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("param_out"), py::arg("out_dtype"), py::arg("n"), py::arg("isa"), py::arg("threads"),
      py::call_guard<py::gil_scoped_release>(), "The streaming ceiling: Adam's loads and stores, no math.");
}
