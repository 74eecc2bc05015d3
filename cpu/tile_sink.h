// A C-level tile sink: what the CPU Adam loop calls after each finished tile, with no Python in between.
// Producers (zo_kernels._cpu.copy_tile_sink, zo_kernels._cuda.h2d_tile_sink) wrap one in a PyCapsule named
// kTileSinkCapsule; the capsule owns it. fn returns 0, or nonzero after writing a message into err.
// numel: the elements it may be called on ([0, numel)); a step over more is refused before any write.
#pragma once
#include <cstddef>
#include <cstdint>

namespace zo {

constexpr const char* kTileSinkCapsule = "zo_kernels.tile_sink";

struct TileSink {
  int (*fn)(void* ctx, int64_t start, int64_t end, char* err, size_t err_len);
  void* ctx;
  void (*destroy)(void* ctx);
  int64_t numel;
};

}  // namespace zo
