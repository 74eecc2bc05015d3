// Asynchronous file I/O (see aio.h). io_uring is driven through its three system calls and the shared
// rings it maps; the rings are touched only under the engine's mutex, which a waiter keeps while it
// blocks in io_uring_enter (completions arrive without it; one Python thread drives an engine).
#include "aio.h"

#include <fcntl.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace zo::aio {

namespace {

std::atomic<size_t> g_live{0}, g_peak{0};

std::string errstr(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

}  // namespace

std::string describe(Op op, size_t nbytes, int64_t off, const std::string& path) {
  return std::string(op == Op::kRead ? "pread" : "pwrite") + " of " + std::to_string(nbytes) + " bytes at offset " +
         std::to_string(off) + (op == Op::kRead ? " of " : " to ") + path;
}

// ---------------------------------------------------------------------------------------------- Buffer

Buffer::Buffer(size_t nbytes) : nbytes_(nbytes) {
  if (nbytes == 0 || nbytes % kAlign)
    throw std::invalid_argument("nbytes must be a positive multiple of " + std::to_string(kAlign) + ", got " +
                                std::to_string(nbytes));
  void* p = nullptr;
  if (posix_memalign(&p, kAlign, nbytes)) throw std::bad_alloc();
  std::memset(p, 0, nbytes);  // resident from the start: the pool's memory is what it costs, counted up front
  data_ = static_cast<char*>(p);
  size_t live = g_live += nbytes, peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
}

Buffer::~Buffer() {
  std::free(data_);
  g_live -= nbytes_;
}

size_t Buffer::live_bytes() { return g_live.load(); }
size_t Buffer::peak_bytes() { return g_peak.load(); }
void Buffer::reset_peak() { g_peak.store(g_live.load()); }

// ------------------------------------------------------------------------------------------------ File

File::File(const std::string& path, int64_t nbytes, bool direct) : path_(path), nbytes_(nbytes), direct_(direct) {
  if (nbytes <= 0 || nbytes % int64_t(kAlign))
    throw std::invalid_argument("nbytes must be a positive multiple of " + std::to_string(kAlign) + ", got " +
                                std::to_string(nbytes));
  const int flags = O_RDWR | O_CLOEXEC | (direct ? O_DIRECT : 0);
  bool created = true;  // (a failed reservation removes a file this call made, not one that was there)
  fd_ = ::open(path.c_str(), flags | O_CREAT | O_EXCL, 0600);
  std::string made = path;  // the file a failed reservation removes, if this call made it
  if (fd_ < 0 && errno == EEXIST) {  // (there, or a symbolic link: O_CREAT follows it, O_EXCL does not)
    struct stat st;
    created = ::stat(path.c_str(), &st) != 0 && errno == ENOENT;  // a link to nothing: its target is made here
    fd_ = ::open(path.c_str(), flags | O_CREAT, 0600);
    if (fd_ < 0) created = false;  // (the link's own path is no file this call made: it stays)
    if (created) {
      char* real = ::realpath(path.c_str(), nullptr);
      if (real != nullptr) {
        made = real;
        std::free(real);
      } else {
        created = false;
      }
    }
  }
  if (fd_ < 0) {
    int err = errno;
    struct stat st;  // O_DIRECT refused (EINVAL) after the O_EXCL create made the file: it goes
    if (created && direct && err == EINVAL && ::stat(made.c_str(), &st) == 0) ::unlink(made.c_str());
    throw IoError(err, std::string("open") + (direct ? " (O_DIRECT)" : "") + " of " + path + " failed: " +
                           errstr(err), path);
  }
  // Reserve the blocks now, so a full disk shows here and not in the middle of an update.
  int err = ::fallocate(fd_, 0, 0, nbytes) ? errno : 0;
  if (err == EOPNOTSUPP || err == ENOSYS) err = 0;
  if (!err && ::ftruncate(fd_, nbytes)) err = errno;
  if (err) {
    ::close(fd_);
    fd_ = -1;
    if (created) ::unlink(made.c_str());
    throw IoError(err, "reserving " + std::to_string(nbytes) + " bytes for " + path + " failed: " + errstr(err),
                  path);
  }
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

void File::close() {
  std::lock_guard<std::mutex> fl(mu_);
  if (users_ > 0)
    throw std::invalid_argument("cannot close " + path_ + ": " + std::to_string(users_.load()) +
                                " request(s) on it not yet waited on");
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

// ------------------------------------------------------------------------------------------------ Ring

struct Ring {
  int fd = -1;
  unsigned *sq_head = nullptr, *sq_tail = nullptr, *sq_mask = nullptr, *sq_array = nullptr;
  unsigned *cq_head = nullptr, *cq_tail = nullptr, *cq_mask = nullptr;
  io_uring_sqe* sqes = nullptr;
  io_uring_cqe* cqes = nullptr;
  void* sq_map = MAP_FAILED;
  void* cq_map = MAP_FAILED;
  void* sqe_map = MAP_FAILED;
  size_t sq_len = 0, cq_len = 0, sqe_len = 0;
  unsigned entries = 0;
  unsigned unsubmitted = 0;  // queued in the submission ring, not yet taken by the kernel

  explicit Ring(unsigned depth) {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    fd = int(syscall(__NR_io_uring_setup, depth, &p));
    if (fd < 0) {
      int err = errno;
      throw IoError(err, "io_uring_setup failed: " + errstr(err), "");
    }
    entries = p.sq_entries;
    sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_len = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    bool single = p.features & IORING_FEAT_SINGLE_MMAP;
    if (single) sq_len = cq_len = std::max(sq_len, cq_len);
    sq_map = mmap(nullptr, sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    cq_map = single ? sq_map
                    : mmap(nullptr, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
    sqe_len = p.sq_entries * sizeof(io_uring_sqe);
    sqe_map = mmap(nullptr, sqe_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (sq_map == MAP_FAILED || cq_map == MAP_FAILED || sqe_map == MAP_FAILED) {
      int err = errno;
      unmap();
      throw IoError(err, "mapping the io_uring queues failed: " + errstr(err), "");
    }
    auto* sq = static_cast<char*>(sq_map);
    auto* cq = static_cast<char*>(cq_map);
    sq_head = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
    sq_tail = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask = reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    cq_head = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask = reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    sqes = static_cast<io_uring_sqe*>(sqe_map);
  }
  ~Ring() { unmap(); }

  void unmap() {
    if (sqe_map != MAP_FAILED) munmap(sqe_map, sqe_len);
    if (cq_map != MAP_FAILED && cq_map != sq_map) munmap(cq_map, cq_len);
    if (sq_map != MAP_FAILED) munmap(sq_map, sq_len);
    sq_map = cq_map = sqe_map = MAP_FAILED;
    if (fd >= 0) ::close(fd);
    fd = -1;
  }

  // Hands the queued entries to the kernel and, with min_complete > 0, waits for that many completions.
  int enter(unsigned min_complete) {
    for (;;) {
      long r = syscall(__NR_io_uring_enter, fd, unsubmitted, min_complete, min_complete ? IORING_ENTER_GETEVENTS : 0,
                       nullptr, 0);
      if (r >= 0) {
        unsubmitted -= unsigned(r);
        return 0;
      }
      if (errno != EINTR) return errno;
    }
  }
};

// ---------------------------------------------------------------------------------------------- Engine

Engine::Engine(const std::string& backend, int depth, size_t chunk_bytes)
    : owner_(getpid()), backend_(backend), chunk_(chunk_bytes) {
  if (depth < 1 || depth > 4096) throw std::invalid_argument("depth must be in [1, 4096], got " + std::to_string(depth));
  if (chunk_bytes == 0 || chunk_bytes % kAlign || chunk_bytes > kMaxChunk)
    throw std::invalid_argument("chunk_bytes must be a positive multiple of " + std::to_string(kAlign) + " up to " +
                                std::to_string(kMaxChunk) + " (one read or write call's most), got " +
                                std::to_string(chunk_bytes));
  if (backend == "threads") {
    for (int i = 0; i < depth; ++i) threads_.emplace_back([this] { worker(); });
  } else if (backend == "uring") {
    ring_ = std::make_unique<Ring>(unsigned(depth));
    slots_.resize(ring_->entries);
    for (unsigned i = 0; i < ring_->entries; ++i) free_slots_.push_back(int(i));
  } else {
    throw std::invalid_argument("backend must be 'threads' or 'uring', got '" + backend + "'");
  }
}

Engine::~Engine() {
  if (getpid() != owner_) {  // a forked child: the workers (and their requests) are the parent's; joining a thread
    // this process does not have crashed it at exit. Their handles and the condition they wait on are let go, never
    // destroyed (the child exits).
    new std::vector<std::thread>(std::move(threads_));
    return;
  }
  try {
    drain();
  } catch (...) {  // the ring failed: nothing more can be waited for
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  delete &cv_;
}

int64_t Engine::submit(Op op, const std::shared_ptr<File>& file, const std::shared_ptr<Buffer>& buf, size_t buf_off,
                       size_t nbytes, int64_t file_off) {
  check_owner();
  if (!file) throw std::invalid_argument("file must not be None");
  if (!buf) throw std::invalid_argument("buffer must not be None");
  const std::string what = describe(op, nbytes, file_off, file->path());
  auto refuse = [&](const std::string& why) { throw std::invalid_argument(what + " refused: " + why); };
  if (nbytes == 0 || nbytes % kAlign) refuse("nbytes must be a positive multiple of " + std::to_string(kAlign));
  if (file_off < 0 || file_off % int64_t(kAlign))
    refuse("the file offset must be a non-negative multiple of " + std::to_string(kAlign));
  if (buf_off % kAlign) refuse("the buffer offset " + std::to_string(buf_off) + " is not a multiple of 4096");
  if (buf_off > buf->nbytes() || nbytes > buf->nbytes() - buf_off)
    refuse("buffer range [" + std::to_string(buf_off) + ", " + std::to_string(buf_off + nbytes) +
           ") exceeds the buffer's " + std::to_string(buf->nbytes()) + " bytes");
  if (nbytes > uint64_t(file->nbytes()) || file_off > file->nbytes() - int64_t(nbytes))
    refuse("file range exceeds the file's " + std::to_string(file->nbytes()) + " bytes");
  std::unique_lock<std::mutex> lk(mu_);
  if (buf->busy_) refuse("the buffer is used by a request not yet waited on");
  int fd;
  {  // the file's descriptor taken with a user counted, or refused: File::close (under the same lock) cannot slip
    std::lock_guard<std::mutex> fl(file->mu_);  // in between (it closed a descriptor the pieces were to use)
    fd = file->fd_;
    if (fd < 0) refuse("the file is closed");
    ++file->users_;
  }
  const int64_t h = next_++;
  int pieces = int((nbytes + chunk_ - 1) / chunk_);
  reqs_.emplace(h, Request{op, file, buf, nbytes, file_off, pieces, 0, {}});
  buf->busy_ = true;
  for (size_t done = 0; done < nbytes; done += chunk_)
    queue_.push_back(Piece{h, op, fd, buf->data() + buf_off + done, std::min(chunk_, nbytes - done),
                           file_off + int64_t(done)});
  if (ring_) {
    uring_pump_locked();
  } else {
    lk.unlock();
    cv_.notify_all();
  }
  return h;
}

void Engine::finish_locked(const Piece& p, int err, const std::string& why) {
  Request& r = reqs_.at(p.req);
  if (err && !r.err) {
    r.err = err;
    r.err_what = describe(p.op, p.len, p.off, r.file->path()) + " failed: " + (why.empty() ? errstr(err) : why);
  }
  --r.remaining;
  cv_.notify_all();
}

void Engine::worker() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;
    Piece p = queue_.front();
    queue_.pop_front();
    lk.unlock();
    int err = 0;
    std::string why;
    for (size_t done = 0; done < p.len;) {
      ssize_t r = p.op == Op::kRead ? ::pread(p.fd, p.ptr + done, p.len - done, p.off + int64_t(done))
                                    : ::pwrite(p.fd, p.ptr + done, p.len - done, p.off + int64_t(done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) {
        err = errno;
        break;
      }
      if (r == 0) {
        err = EIO;
        why = "unexpected end of file after " + std::to_string(done) + " bytes";
        break;
      }
      done += size_t(r);
    }
    lk.lock();
    finish_locked(p, err, why);
  }
}

void Engine::uring_pump_locked() {
  Ring& q = *ring_;
  unsigned tail = *q.sq_tail;  // only this side writes the tail
  bool added = false;
  while (!queue_.empty() && !free_slots_.empty()) {
    Piece p = queue_.front();
    queue_.pop_front();
    int slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[slot] = p;
    unsigned idx = tail & *q.sq_mask;
    io_uring_sqe* e = &q.sqes[idx];
    std::memset(e, 0, sizeof(*e));
    e->opcode = p.op == Op::kRead ? IORING_OP_READ : IORING_OP_WRITE;
    e->fd = p.fd;
    e->addr = reinterpret_cast<uint64_t>(p.ptr);
    e->len = unsigned(p.len);
    e->off = uint64_t(p.off);
    e->user_data = uint64_t(slot);
    q.sq_array[idx] = idx;
    ++tail;
    ++q.unsubmitted;
    added = true;
  }
  if (added) __atomic_store_n(q.sq_tail, tail, __ATOMIC_RELEASE);
  if (q.unsubmitted) {
    int err = q.enter(0);
    if (err) throw IoError(err, "io_uring_enter (submit) failed: " + errstr(err), "");
  }
}

void Engine::uring_reap_locked() {
  Ring& q = *ring_;
  unsigned head = *q.cq_head;
  const unsigned tail = __atomic_load_n(q.cq_tail, __ATOMIC_ACQUIRE);
  for (; head != tail; ++head) {
    const io_uring_cqe& c = q.cqes[head & *q.cq_mask];
    const int slot = int(c.user_data);
    Piece p = slots_[slot];
    free_slots_.push_back(slot);
    if (c.res < 0) {
      finish_locked(p, -c.res, "");
    } else if (c.res == 0) {  // (a write of 0 bytes would be queued again for ever)
      finish_locked(p, EIO, p.op == Op::kRead ? "unexpected end of file" : "the write stored 0 bytes");
    } else if (size_t(c.res) < p.len) {  // a short transfer: the rest goes back to the front of the queue
      size_t n = size_t(c.res);
      queue_.push_front(Piece{p.req, p.op, p.fd, p.ptr + n, p.len - n, p.off + int64_t(n)});
    } else {
      finish_locked(p, 0, "");
    }
  }
  __atomic_store_n(q.cq_head, head, __ATOMIC_RELEASE);
}

void Engine::uring_wait_locked(std::unique_lock<std::mutex>&) {
  uring_pump_locked();
  int err = ring_->enter(1);
  if (err) throw IoError(err, "io_uring_enter (wait) failed: " + errstr(err), "");
  uring_reap_locked();
  uring_pump_locked();
}

void Engine::check_owner() const {
  if (getpid() != owner_)
    throw std::runtime_error("this I/O engine was made by process " + std::to_string(owner_) +
                             ": a forked child has none of its threads to serve a request (make one in the child)");
}

void Engine::wait(int64_t h) {
  check_owner();
  std::unique_lock<std::mutex> lk(mu_);
  auto it = reqs_.find(h);
  if (it == reqs_.end())
    throw std::invalid_argument("unknown request handle " + std::to_string(h) +
                                " (never submitted, or already waited on)");
  while (it->second.remaining > 0) {
    if (ring_)
      uring_wait_locked(lk);
    else
      cv_.wait(lk);
    it = reqs_.find(h);
  }
  Request r = std::move(it->second);
  reqs_.erase(it);
  r.buf->busy_ = false;
  --r.file->users_;
  if (r.err) throw IoError(r.err, r.err_what, r.file->path());
}

void Engine::drain() {
  check_owner();
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    bool busy = false;
    for (auto& kv : reqs_) busy = busy || kv.second.remaining > 0;
    if (!busy) break;
    if (ring_)
      uring_wait_locked(lk);
    else
      cv_.wait(lk);
  }
  for (auto& kv : reqs_) {
    kv.second.buf->busy_ = false;
    --kv.second.file->users_;
  }
  reqs_.clear();
}

size_t Engine::pending() {
  check_owner();
  std::lock_guard<std::mutex> lk(mu_);
  return reqs_.size();
}

}  // namespace zo::aio
