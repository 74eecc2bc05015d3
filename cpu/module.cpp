// pybind11 bindings of the CPU kernels. Tensors arrive as integer addresses (checked in Python
// first, then again in C++); every entry point releases the GIL while it runs.
#include <pybind11/pybind11.h>

#include <cstring>

#include "adam.h"
#include "aio.h"

namespace py = pybind11;

namespace {

// `state`: the moments' format, () for fp32, else (code, exp_avg scales, exp_avg_sq scales, block, index0, seed).
zo::Buffers buffers(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
                    uintptr_t param_out, int out_dtype, int64_t n, const py::tuple& state = py::tuple()) {
  zo::Buffers b;
  b.param = reinterpret_cast<float*>(param);
  b.grad = reinterpret_cast<const void*>(grad);
  b.grad_dtype = grad_dtype;
  b.exp_avg = reinterpret_cast<void*>(exp_avg);
  b.exp_avg_sq = reinterpret_cast<void*>(exp_avg_sq);
  b.param_out = reinterpret_cast<void*>(param_out);
  b.out_dtype = out_dtype;
  b.n = n;
  if (state.size() == 0) return b;
  if (state.size() != 6) throw std::invalid_argument("state must be (code, m_scale, v_scale, block, index0, seed)");
  b.state = state[0].cast<int>();
  b.exp_avg_scale = reinterpret_cast<float*>(state[1].cast<uintptr_t>());
  b.exp_avg_sq_scale = reinterpret_cast<float*>(state[2].cast<uintptr_t>());
  b.block = state[3].cast<int64_t>();
  b.index0 = state[4].cast<int64_t>();
  b.seed = state[5].cast<uint64_t>();
  return b;
}

zo::AdamParams params(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                      double grad_scale, bool adamw, bool bias_correction) {
  zo::AdamParams a;
  a.step = step; a.lr = lr; a.beta1 = beta1; a.beta2 = beta2; a.eps = eps;
  a.weight_decay = weight_decay; a.grad_scale = grad_scale; a.adamw = adamw;
  a.bias_correction = bias_correction;
  return a;
}

// The host tile sink: memcpy of each finished tile from src to dst (the device = CPU writeback, and the test
// double of the CUDA sink).
struct CopySink {
  char* dst;
  const char* src;
  size_t elem;
};

int copy_tile(void* ctx, int64_t start, int64_t end, char*, size_t) {
  const auto* c = static_cast<const CopySink*>(ctx);
  std::memcpy(c->dst + start * c->elem, c->src + start * c->elem, size_t(end - start) * c->elem);
  return 0;
}

py::capsule make_sink(zo::TileSink* sink) {
  return py::capsule(sink, zo::kTileSinkCapsule, [](PyObject* cap) {
    auto* s = static_cast<zo::TileSink*>(PyCapsule_GetPointer(cap, zo::kTileSinkCapsule));
    if (s && s->destroy) s->destroy(s->ctx);
    delete s;
  });
}

void bind_aio(py::module_& m) {
  namespace aio = zo::aio;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const aio::IoError& e) {  // OSError(errno, message naming the operation and file, file)
      py::object err = e.path.empty() ? py::handle(PyExc_OSError)(e.err, e.what())
                                      : py::handle(PyExc_OSError)(e.err, e.what(), e.path);
      PyErr_SetObject(PyExc_OSError, err.ptr());
    }
  });
  m.attr("AIO_ALIGN") = aio::kAlign;
  py::class_<aio::Buffer, std::shared_ptr<aio::Buffer>>(m, "AlignedBuffer", py::buffer_protocol(),
                                                        "Zero-filled host memory aligned to AIO_ALIGN bytes.")
      .def(py::init<size_t>(), py::arg("nbytes"))
      .def_buffer([](aio::Buffer& b) { return py::buffer_info(b.data(), b.nbytes()); })
      .def_property_readonly("nbytes", &aio::Buffer::nbytes)
      .def_property_readonly("address", [](const aio::Buffer& b) { return uintptr_t(b.data()); })
      .def_property_readonly("busy", &aio::Buffer::busy)
      .def_static("live_bytes", &aio::Buffer::live_bytes, "Bytes of all AlignedBuffers alive in the process.")
      .def_static("peak_bytes", &aio::Buffer::peak_bytes, "High-water mark of live_bytes since reset_peak().")
      .def_static("reset_peak", &aio::Buffer::reset_peak);
  py::class_<aio::File, std::shared_ptr<aio::File>>(m, "AioFile", "A file of fixed size, O_DIRECT if asked.")
      .def(py::init<const std::string&, int64_t, bool>(), py::arg("path"), py::arg("nbytes"), py::arg("direct"),
           py::call_guard<py::gil_scoped_release>())
      .def("close", &aio::File::close, "Close it (refused while requests on it are not waited on).")
      .def_property_readonly("path", &aio::File::path)
      .def_property_readonly("nbytes", &aio::File::nbytes)
      .def_property_readonly("direct", &aio::File::direct)
      .def_property_readonly("closed", [](const aio::File& f) { return f.fd() < 0; });
  auto submit = [](aio::Op op) {
    return [op](aio::Engine& e, const std::shared_ptr<aio::File>& f, const std::shared_ptr<aio::Buffer>& b,
                size_t buf_off, size_t nbytes, int64_t file_off) { return e.submit(op, f, b, buf_off, nbytes, file_off); };
  };
  py::class_<aio::Engine>(m, "AioEngine", "Asynchronous reads and writes of AlignedBuffers, waited on by handle.")
      .def(py::init<const std::string&, int, size_t>(), py::arg("backend"), py::arg("depth"), py::arg("chunk_bytes"))
      .def("read", submit(aio::Op::kRead), py::arg("file"), py::arg("buffer"), py::arg("buf_offset"),
           py::arg("nbytes"), py::arg("file_offset"), py::call_guard<py::gil_scoped_release>(),
           "Queue file[file_offset, +nbytes) -> buffer[buf_offset, +nbytes); returns a handle.")
      .def("write", submit(aio::Op::kWrite), py::arg("file"), py::arg("buffer"), py::arg("buf_offset"),
           py::arg("nbytes"), py::arg("file_offset"), py::call_guard<py::gil_scoped_release>(),
           "Queue buffer[buf_offset, +nbytes) -> file[file_offset, +nbytes); returns a handle.")
      .def("wait", &aio::Engine::wait, py::arg("handle"), py::call_guard<py::gil_scoped_release>(),
           "Block until the request completes; OSError naming the operation and file if it failed.")
      .def("drain", &aio::Engine::drain, py::call_guard<py::gil_scoped_release>(),
           "Block until every request completes, discarding their errors.")
      .def("pending", &aio::Engine::pending, "Requests not yet waited on.")
      .def_property_readonly("backend", &aio::Engine::backend);
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "zo_kernels CPU kernels (stateless; addresses in, nothing kept)";
  m.def("isa_supported", &zo::isa_supported, py::arg("isa"), "Whether this CPU runs ISA code 0/1/2.");
  // The calling thread's floating-point mode (MXCSR's control bits: flush-to-zero, denormals-are-zero, rounding,
  // exception masks), which torch.set_flush_denormal sets per thread: a background thread takes its caller's.
  m.def("fp_mode", &zo::fp_mode, "This thread's MXCSR control bits.");
  m.def("set_fp_mode", &zo::set_fp_mode, py::arg("bits"),
        "Set this thread's MXCSR control bits; returns the ones it had.");
  m.def(
      "update_cap",
      [](int64_t step, double beta1, double beta2, bool bias_correction) {
        return zo::update_cap(params(step, 0.0, beta1, beta2, 1e-8, 0.0, 1.0, true, bias_correction));
      },
      py::arg("step"), py::arg("beta1"), py::arg("beta2"), py::arg("bias_correction") = true,
      "The 8-bit update's guard (cpu/adam.cpp, update_cap): its denominator is at least |exp_avg| times this; 0: none.");
  m.def(
      "adam_step",
      [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
         uintptr_t param_out, int out_dtype, int64_t n, int64_t step, double lr, double beta1, double beta2,
         double eps, double weight_decay, double grad_scale, bool adamw, bool bias_correction, int isa,
         int threads, uintptr_t progress, const py::tuple& state) {
        const zo::Buffers b = buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq, param_out, out_dtype, n, state);
        py::gil_scoped_release release;
        zo::adam_step(b, params(step, lr, beta1, beta2, eps, weight_decay, grad_scale, adamw, bias_correction), isa,
                      threads);
        if (progress) *reinterpret_cast<int64_t*>(progress) += n;  // after the update: exact under Ctrl-C
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("param_out"), py::arg("out_dtype"), py::arg("n"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale"), py::arg("adamw"),
      py::arg("bias_correction"), py::arg("isa"), py::arg("threads"), py::arg("progress") = 0,
      py::arg("state") = py::tuple(),
      "Adam/AdamW over n elements at raw addresses; adds n to the int64 at `progress` (if not 0) when done. "
      "`state`: () for fp32 moments, else (format code 0/1/2, exp_avg scales, exp_avg_sq scales, block, index0, "
      "seed).");
  m.def(
      "adam_step_tiled",
      [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
         uintptr_t param_out, int out_dtype, int64_t n, int64_t step, double lr, double beta1, double beta2,
         double eps, double weight_decay, double grad_scale, bool adamw, bool bias_correction, int isa,
         int threads, int64_t tile, const py::capsule& sink, uintptr_t progress, const py::tuple& state) {
        if (!sink.name() || std::strcmp(sink.name(), zo::kTileSinkCapsule) != 0)
          throw py::type_error("sink must be a zo_kernels tile sink capsule");
        const auto* s = sink.get_pointer<zo::TileSink>();
        const zo::Buffers b = buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq, param_out, out_dtype, n, state);
        py::gil_scoped_release release;  // the whole tile loop, sink calls included, runs without Python
        zo::adam_step_tiled(b,
                            params(step, lr, beta1, beta2, eps, weight_decay, grad_scale, adamw, bias_correction),
                            isa, threads, tile, *s, reinterpret_cast<int64_t*>(progress));
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("param_out"), py::arg("out_dtype"), py::arg("n"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale"), py::arg("adamw"),
      py::arg("bias_correction"), py::arg("isa"), py::arg("threads"), py::arg("tile"), py::arg("sink"),
      py::arg("progress") = 0, py::arg("state") = py::tuple(),
      "adam_step in tiles, calling a C tile sink after each one (no Python between tiles); the int64 at "
      "`progress` (if not 0) is set to the end of each tile once it is updated.");
  m.def(
      "copy_tile_sink",
      [](uintptr_t dst, uintptr_t src, size_t elem, int64_t numel) {
        if (!dst) throw std::invalid_argument("copy_tile_sink: dst address is null");
        if (!src) throw std::invalid_argument("copy_tile_sink: src address is null");
        if (!elem) throw std::invalid_argument("copy_tile_sink: elem_size must be > 0");
        if (numel < 0) throw std::invalid_argument("copy_tile_sink: numel must be >= 0");
        auto* ctx = new CopySink{reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src), elem};
        return make_sink(new zo::TileSink{copy_tile, ctx, [](void* c) { delete static_cast<CopySink*>(c); }, numel});
      },
      py::arg("dst"), py::arg("src"), py::arg("elem_size"), py::arg("numel"),
      "A C tile sink copying tile [start, end) of src to dst (element size elem_size, numel elements each).");
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
      "accumulate",
      [](uintptr_t acc, uintptr_t x, int dtype, double alpha, int64_t n, int isa, int threads) {
        py::gil_scoped_release release;
        zo::accumulate(reinterpret_cast<float*>(acc), reinterpret_cast<const void*>(x), dtype, alpha, n, isa, threads);
      },
      py::arg("acc"), py::arg("x"), py::arg("dtype"), py::arg("alpha"), py::arg("n"), py::arg("isa"),
      py::arg("threads"), "acc[i] = fma(alpha, x[i], acc[i]): n fp32 at acc, n values of dtype at x.");
  m.def(
      "stream_pass",
      [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
         uintptr_t param_out, int out_dtype, int64_t n, int isa, int threads, const py::tuple& state) {
        const zo::Buffers b = buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq, param_out, out_dtype, n, state);
        py::gil_scoped_release release;
        zo::stream_pass(b, isa, threads);
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("param_out"), py::arg("out_dtype"), py::arg("n"), py::arg("isa"), py::arg("threads"),
      py::arg("state") = py::tuple(), "The streaming ceiling: Adam's loads and stores (of the state format), no math.");
  bind_aio(m);
}
