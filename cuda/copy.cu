// Copy streams for the offload step, against the CUDA runtime only (no torch headers, no device code):
// page-locked host memory, async host<->device copies on a caller's stream, and events for ordering.
// PyTorch interoperates through raw pointers and `torch.cuda.Stream.cuda_stream` handles.
// Every runtime call is checked; a failure raises RuntimeError naming the call and CUDA's message.
//
// NEVER RUN ON A GPU: this file is compiled (sm_80, sm_90) and its no-device paths are tested on a
// machine without one; the copies themselves have not been executed.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "../cpu/tile_sink.h"

namespace py = pybind11;

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state so the next call starts clean
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(err));
  }
}

// The calling thread's current device, set to `device` for the lifetime of the guard. This module links its
// own (static) CUDA runtime, whose current device is not torch's: every call that creates or uses a resource
// names its device explicitly.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != prev_) cudaSetDevice(prev_);
    cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
cudaEvent_t as_event(uintptr_t e) { return reinterpret_cast<cudaEvent_t>(e); }

int device_count() {
  int n = 0;
  // No driver or no device is an answer (0), not an error.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

uintptr_t host_alloc(size_t nbytes, int device) {
  if (nbytes == 0) throw std::invalid_argument("host_alloc: nbytes must be > 0");
  DeviceGuard guard(device);
  void* p = nullptr;
  check(cudaHostAlloc(&p, nbytes, cudaHostAllocPortable), "cudaHostAlloc");
  return reinterpret_cast<uintptr_t>(p);
}

void host_free(uintptr_t p) { check(cudaFreeHost(reinterpret_cast<void*>(p)), "cudaFreeHost"); }

void host_register(uintptr_t p, size_t nbytes, int device) {
  if (!p || nbytes == 0) throw std::invalid_argument("host_register: null pointer or zero size");
  DeviceGuard guard(device);
  check(cudaHostRegister(reinterpret_cast<void*>(p), nbytes, cudaHostRegisterPortable), "cudaHostRegister");
}

void host_unregister(uintptr_t p) { check(cudaHostUnregister(reinterpret_cast<void*>(p)), "cudaHostUnregister"); }

// Where a pointer lives: 0 unregistered host, 1 page-locked host, 2 device, 3 managed.
int pointer_kind(uintptr_t p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, reinterpret_cast<void*>(p)) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  switch (a.type) {
    case cudaMemoryTypeHost: return 1;
    case cudaMemoryTypeDevice: return 2;
    case cudaMemoryTypeManaged: return 3;
    default: return 0;
  }
}

void copy_async(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, int device, cudaMemcpyKind kind,
                const char* what) {
  if (nbytes == 0) return;
  if (!dst || !src) throw std::invalid_argument(std::string(what) + ": null pointer");
  DeviceGuard guard(device);
  check(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes, kind,
                        as_stream(stream)),
        what);
}

// Blocking-sync events: a host waiting for a copy sleeps instead of spinning on a core the CPU update needs.
uintptr_t event_create(int device) {
  DeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync), "cudaEventCreateWithFlags");
  return reinterpret_cast<uintptr_t>(e);
}

// Destroying an event can run from a finalizer during interpreter or driver shutdown: those errors are not
// the caller's to handle.
void event_destroy(uintptr_t e) {
  const cudaError_t r = cudaEventDestroy(as_event(e));
  if (r == cudaErrorCudartUnloading || r == cudaErrorContextIsDestroyed) {
    cudaGetLastError();
    return;
  }
  check(r, "cudaEventDestroy");
}

// The CUDA tile sink: queue the H2D copy of each finished tile of a pinned staging buffer on a stream,
// called from the CPU Adam loop in C++ (zo_kernels._cpu.adam_step_tiled), no Python between tiles.
struct H2DSink {
  char* dst;
  const char* src;
  size_t elem;
  cudaStream_t stream;
  int device;
};

int h2d_tile(void* ctx, int64_t start, int64_t end, char* err, size_t err_len) {
  const auto* s = static_cast<const H2DSink*>(ctx);
  int prev = -1;
  if (cudaGetDevice(&prev) == cudaSuccess && prev != s->device) cudaSetDevice(s->device);
  const cudaError_t r = cudaMemcpyAsync(s->dst + start * s->elem, s->src + start * s->elem,
                                        size_t(end - start) * s->elem, cudaMemcpyHostToDevice, s->stream);
  if (prev >= 0 && prev != s->device) cudaSetDevice(prev);
  if (r == cudaSuccess) return 0;
  cudaGetLastError();
  std::snprintf(err, err_len, "cudaMemcpyAsync(H2D) failed: %s", cudaGetErrorString(r));
  return 1;
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "zo_kernels copy streams: pinned host memory, async copies, events (CUDA runtime, raw handles)";
  m.def("device_count", &device_count, "Number of CUDA devices (0 without a driver or device).");
  m.def("runtime_version", [] {
    int v = 0;
    check(cudaRuntimeGetVersion(&v), "cudaRuntimeGetVersion");
    return v;
  });
  m.def("host_alloc", &host_alloc, py::arg("nbytes"), py::arg("device"),
        "Page-locked host memory (cudaHostAlloc, portable) allocated with `device` current; returns its address.");
  m.def("host_free", &host_free, py::arg("ptr"));
  m.def("host_register", &host_register, py::arg("ptr"), py::arg("nbytes"), py::arg("device"),
        "Page-lock an existing host buffer.");
  m.def("host_unregister", &host_unregister, py::arg("ptr"));
  m.def("pointer_kind", &pointer_kind, py::arg("ptr"), "0 pageable host, 1 pinned host, 2 device, 3 managed.");
  // The copies and waits release the GIL: a copy issued per tile never stalls the Python thread that
  // drives the CPU update (the update itself runs with the GIL released too).
  m.def(
      "h2d_async",
      [](uintptr_t dst, uintptr_t src, size_t n, uintptr_t s, int device) {
        copy_async(dst, src, n, s, device, cudaMemcpyHostToDevice, "cudaMemcpyAsync(H2D)");
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"), py::arg("device"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "d2h_async",
      [](uintptr_t dst, uintptr_t src, size_t n, uintptr_t s, int device) {
        copy_async(dst, src, n, s, device, cudaMemcpyDeviceToHost, "cudaMemcpyAsync(D2H)");
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"), py::arg("device"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "h2d_tile_sink",
      [](uintptr_t dst, uintptr_t src, size_t elem, int64_t numel, uintptr_t stream, int device) {
        if (!dst) throw std::invalid_argument("h2d_tile_sink: dst address is null");
        if (!src) throw std::invalid_argument("h2d_tile_sink: src address is null");
        if (!elem) throw std::invalid_argument("h2d_tile_sink: elem_size must be > 0");
        if (numel < 0) throw std::invalid_argument("h2d_tile_sink: numel must be >= 0");
        auto* ctx = new H2DSink{reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src), elem, as_stream(stream),
                                device};
        auto* sink = new zo::TileSink{h2d_tile, ctx, [](void* p) { delete static_cast<H2DSink*>(p); }, numel};
        return py::capsule(sink, zo::kTileSinkCapsule, [](PyObject* cap) {
          auto* s = static_cast<zo::TileSink*>(PyCapsule_GetPointer(cap, zo::kTileSinkCapsule));
          if (s && s->destroy) s->destroy(s->ctx);
          delete s;
        });
      },
      py::arg("dst"), py::arg("src"), py::arg("elem_size"), py::arg("numel"), py::arg("stream"), py::arg("device"),
      "A C tile sink queueing the H2D copy of tile [start, end) of pinned src to device dst on `stream` (numel each).");
  m.def("event_create", &event_create, py::arg("device"), "A blocking-sync, timing-free event on `device`.");
  m.def("event_destroy", &event_destroy, py::arg("event"));
  m.def(
      "event_record",
      [](uintptr_t e, uintptr_t s, int device) {
        DeviceGuard guard(device);
        check(cudaEventRecord(as_event(e), as_stream(s)), "cudaEventRecord");
      },
      py::arg("event"), py::arg("stream"), py::arg("device"),
      py::call_guard<py::gil_scoped_release>());  // (a full queue of pending work can block it, as a copy)
  m.def(
      "stream_wait_event",
      [](uintptr_t s, uintptr_t e, int device) {
        DeviceGuard guard(device);
        check(cudaStreamWaitEvent(as_stream(s), as_event(e), 0), "cudaStreamWaitEvent");
      },
      py::arg("stream"), py::arg("event"), py::arg("device"), py::call_guard<py::gil_scoped_release>());
  m.def("event_synchronize", [](uintptr_t e) { check(cudaEventSynchronize(as_event(e)), "cudaEventSynchronize"); },
        py::arg("event"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "event_query",
      [](uintptr_t e) {
        const cudaError_t r = cudaEventQuery(as_event(e));
        if (r == cudaErrorNotReady) {
          cudaGetLastError();
          return false;
        }
        check(r, "cudaEventQuery");
        return true;
      },
      py::arg("event"));
}
