// Asynchronous file I/O for optimizer state on NVMe: aligned host buffers, files opened with O_DIRECT,
// reads and writes submitted without blocking and waited on by handle. Two backends behind one engine:
// a pool of threads calling pread/pwrite, and io_uring through raw system calls (no liburing).
// Everything a request touches is checked before it is queued; nothing here holds the GIL.
#pragma once
#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace zo::aio {

// Every buffer address, file offset and length is a multiple of this (the page size; O_DIRECT needs the
// device's logical block size, 512 or 4096, and 4096 satisfies both), with or without O_DIRECT.
constexpr size_t kAlign = 4096;
constexpr size_t kMaxChunk = size_t(1) << 30;  // a piece's bytes: read/write move at most 0x7ffff000 a call

// An OS error: errno, a message naming the operation and the file, and the file.
struct IoError : std::runtime_error {
  IoError(int err, const std::string& what, std::string path)
      : std::runtime_error(what), err(err), path(std::move(path)) {}
  int err;
  std::string path;
};

// Host memory aligned to kAlign, zero-filled. Owned through shared_ptr: a request in flight keeps it alive.
class Buffer {
 public:
  explicit Buffer(size_t nbytes);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  bool busy() const { return busy_; }
  static size_t live_bytes();  // all Buffers alive in the process
  static size_t peak_bytes();  // high-water mark of live_bytes since the last reset_peak()
  static void reset_peak();

 private:
  friend class Engine;
  char* data_ = nullptr;
  size_t nbytes_ = 0;
  bool busy_ = false;  // a request on it is in flight (guarded by the engine's mutex)
};

// A file of a fixed size (a multiple of kAlign), opened read-write, created if missing, its blocks reserved.
class File {
 public:
  File(const std::string& path, int64_t nbytes, bool direct);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  void close();
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  int64_t nbytes() const { return nbytes_; }
  bool direct() const { return direct_; }

 private:
  friend class Engine;
  std::atomic<int> users_{0};  // requests on this file not yet waited on
  std::mutex mu_;              // close() against a submit taking fd_ and counting a user
  std::atomic<int> fd_{-1};
  std::string path_;
  int64_t nbytes_ = 0;
  bool direct_ = false;
};

enum class Op { kRead, kWrite };

struct Ring;  // io_uring's mapped queues (aio.cpp)

class Engine {
 public:
  // backend "threads" (`depth` threads) or "uring" (a ring of `depth` entries); requests are split into
  // pieces of at most `chunk_bytes` that run concurrently.
  Engine(const std::string& backend, int depth, size_t chunk_bytes);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  // Queue a read of file[file_off, +nbytes) into buf[buf_off, +nbytes) (or a write of it to the file) and
  // return its handle. Throws std::invalid_argument, with nothing queued, on a misaligned or out-of-bounds
  // range, a closed file or a buffer another request still uses.
  int64_t submit(Op op, const std::shared_ptr<File>& file, const std::shared_ptr<Buffer>& buf, size_t buf_off,
                 size_t nbytes, int64_t file_off);
  // Block until request h is complete; throws IoError if any of its pieces failed.
  void wait(int64_t h);
  // Block until every request is complete, discarding their errors (for close and error paths).
  void drain();
  size_t pending();
  void check_owner() const;  // a forked child's call raises (the workers are the parent's)
  const std::string& backend() const { return backend_; }

 private:
  pid_t owner_ = 0;  // the process that made it: a forked child inherits it without its threads
  struct Request {
    Op op;
    std::shared_ptr<File> file;
    std::shared_ptr<Buffer> buf;
    size_t nbytes;
    int64_t file_off;
    int remaining;  // pieces not finished
    int err = 0;    // first error of a piece
    std::string err_what;
  };
  struct Piece {
    int64_t req;
    Op op;
    int fd;
    char* ptr;
    size_t len;
    int64_t off;
  };
  void finish_locked(const Piece& p, int err, const std::string& what);  // a piece ended (err 0: success)
  void worker();
  void uring_pump_locked();                    // queued pieces -> submission queue -> kernel
  void uring_reap_locked();                    // completion queue -> finish_locked
  void uring_wait_locked(std::unique_lock<std::mutex>& lk);  // one round of waiting for completions

  std::string backend_;
  size_t chunk_;
  std::mutex mu_;
  // on the heap: a forked child must not destroy it (glibc's destroy waits for the waiters, the parent's workers,
  // which the child does not have: its exit hung); the owner deletes it after joining them
  std::condition_variable& cv_ = *new std::condition_variable;
  std::unordered_map<int64_t, Request> reqs_;
  std::deque<Piece> queue_;  // pieces not yet started (threads) or not yet in the ring (uring)
  int64_t next_ = 1;
  bool stop_ = false;
  std::vector<std::thread> threads_;
  std::unique_ptr<Ring> ring_;
  std::vector<Piece> slots_;      // uring: the piece of each ring slot in flight (user_data = slot index)
  std::vector<int> free_slots_;
};

std::string describe(Op op, size_t nbytes, int64_t off, const std::string& path);

}  // namespace zo::aio
