// An ordered host copy queue: one worker thread runs row-copy jobs strictly in
// submission order (FIFO), with no Python and no GIL anywhere on it.
//
// Why: the layerwise pipeline moves each layer's KV between the store and a
// shared slot while the model thread computes. Done by Python I/O threads, every
// job took the GIL for ~25-50 us and woke a thread, and the model thread ran
// ~7 % slower beside them than beside plain native copies (bench layerwise,
// docs/bench-layerwise.md). Here the model thread only submits descriptors and
// waits with the GIL released (ctypes drops it for the call). FIFO order is also
// what makes slot reuse cheap: a load queued after the save of the slot's
// previous contents cannot start before that save's copy ended (the reuse gate's
// "queued consumers").
//
// Tickets are 1, 2, 3, ... in submission order; status[0] is the highest finished
// ticket (jobs finish in order), status[1] the number of failed jobs, both
// readable by the caller without a call (ao_cq_status). A job's result is 0, or
// the negative result of ao_copy_rows (a bad index: nothing of that job was
// copied); non-zero results are kept until ao_cq_take reads them.
//
// Every entry point takes three pointer-sized arguments so that the CPython
// fast-call trampoline (fastcall.cpp) can call it for ~0.1 us; ctypes works too.
//
// Waking a sleeping worker costs the submitter ~40 us on the 2-vCPU VM we
// measure on (a futex wake that exits to the hypervisor), against ~1 us when the
// worker is awake. So the worker polls for `spin_us` after its queue ran empty
// before it sleeps, and a submit only signals a worker that sleeps; a waiter
// likewise polls its ticket for wait_spin_us before it sleeps on the condition.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define AO_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define AO_PAUSE() asm volatile("yield")
#else
#define AO_PAUSE() ((void)0)
#endif

extern "C" int64_t ao_copy_rows(const uint8_t* src, int64_t src_rows, const int32_t* sidx,
                                uint8_t* dst, int64_t dst_rows, const int32_t* didx, int64_t n,
                                int64_t row_bytes, int32_t nthreads);

namespace {

using Clock = std::chrono::steady_clock;

struct Job {
  int64_t ticket;
  const uint8_t* src;
  int64_t src_rows;
  uint8_t* dst;
  int64_t dst_rows;
  int64_t row_bytes;
  int64_t delay_us;
  std::vector<int32_t> sidx, didx;
};

struct Queue {
  std::atomic<int64_t> status[2] = {{0}, {0}};  // done ticket, failed jobs
  std::atomic<int64_t> submitted{0};
  int64_t spin_us;
  int64_t wait_spin_us = 0;
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  std::deque<Job> jobs;
  std::unordered_map<int64_t, int64_t> results;  // non-zero results not yet taken
  bool sleeping = false;
  bool stop = false;
  std::thread worker;

  explicit Queue(int64_t spin) : spin_us(spin) {}

  // Polls (no lock, no syscall) until a job was submitted after `taken` or spin_us passed.
  void spin_for_work(int64_t taken) {
    if (spin_us <= 0) return;
    const auto until = Clock::now() + std::chrono::microseconds(spin_us);
    while (submitted.load(std::memory_order_acquire) == taken) {
      for (int i = 0; i < 64; ++i) AO_PAUSE();
      if (Clock::now() >= until) return;
    }
  }

  void run() {
    int64_t taken = 0;
    for (;;) {
      std::unique_lock<std::mutex> lk(mu);
      if (jobs.empty() && !stop) {
        lk.unlock();
        spin_for_work(taken);
        lk.lock();
        sleeping = true;
        work_cv.wait(lk, [this] { return stop || !jobs.empty(); });
        sleeping = false;
      }
      if (jobs.empty()) return;  // stop requested and everything queued ran
      Job job = std::move(jobs.front());
      jobs.pop_front();
      lk.unlock();
      taken = job.ticket;
      if (job.delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(job.delay_us));
      const int64_t rc = ao_copy_rows(job.src, job.src_rows, job.sidx.data(), job.dst,
                                      job.dst_rows, job.didx.data(),
                                      static_cast<int64_t>(job.sidx.size()), job.row_bytes, 1);
      lk.lock();
      if (rc != 0) {
        results[job.ticket] = rc;
        status[1].fetch_add(1, std::memory_order_release);
      }
      status[0].store(job.ticket, std::memory_order_release);
      done_cv.notify_all();
    }
  }
};

inline int64_t as_int(void* p) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(p)); }

}  // namespace

extern "C" {

// spin_us: microseconds the worker polls for new work before it sleeps;
// wait_spin_us: how long a waiter polls for its ticket before it sleeps.
void* ao_cq_create(void* spin_us, void* wait_spin_us, void*) {
  Queue* q = new Queue(as_int(spin_us));
  q->wait_spin_us = as_int(wait_spin_us);
  q->worker = std::thread([q] { q->run(); });
  return q;
}

// Runs what is queued, then stops the worker and frees the queue.
int64_t ao_cq_destroy(void* h, void*, void*) {
  Queue* q = static_cast<Queue*>(h);
  {
    std::lock_guard<std::mutex> lk(q->mu);
    q->stop = true;
  }
  q->work_cv.notify_all();
  q->worker.join();
  delete q;
  return 0;
}

// The address of the two status words (done ticket, failed jobs), valid until destroy.
int64_t ao_cq_status(void* h, void*, void*) {
  return as_int(static_cast<Queue*>(h)->status);
}

// args = {src, src_rows, sidx, dst, dst_rows, didx, n, row_bytes, delay_us}:
// dst[didx[i]] = src[sidx[i]] for i < n (rows of row_bytes), after sleeping delay_us
// (a fault-injection hook: a slow save). The index arrays are copied: the caller's
// buffers may go away on return. Returns the job's ticket, or -1 (out of memory).
int64_t ao_cq_submit(void* h, void* argp, void*) {
  Queue* q = static_cast<Queue*>(h);
  const int64_t* a = static_cast<const int64_t*>(argp);
  const int64_t n = a[6];
  const int32_t* sidx = reinterpret_cast<const int32_t*>(a[2]);
  const int32_t* didx = reinterpret_cast<const int32_t*>(a[5]);
  Job job{0, reinterpret_cast<const uint8_t*>(a[0]), a[1], reinterpret_cast<uint8_t*>(a[3]),
          a[4], a[7], a[8], {}, {}};
  int64_t ticket;
  bool wake;
  try {
    if (n > 0) {
      job.sidx.assign(sidx, sidx + n);
      job.didx.assign(didx, didx + n);
    }
    std::lock_guard<std::mutex> lk(q->mu);
    ticket = job.ticket = q->submitted.load(std::memory_order_relaxed) + 1;
    q->jobs.push_back(std::move(job));
    q->submitted.store(ticket, std::memory_order_release);
    wake = q->sleeping;
  } catch (...) {  // out of memory: nothing queued; no C++ exception crosses the C ABI
    return -1;
  }
  if (wake) q->work_cv.notify_one();
  return ticket;
}

// 1 once `ticket` finished, 0 if it did not within timeout_us.
int64_t ao_cq_wait(void* h, void* ticketp, void* timeout_usp) {
  Queue* q = static_cast<Queue*>(h);
  const int64_t ticket = as_int(ticketp);
  if (q->status[0].load(std::memory_order_acquire) >= ticket) return 1;
  if (q->wait_spin_us > 0) {  // the job is often about to end: poll before sleeping
    const auto until = Clock::now() + std::chrono::microseconds(
        std::min<int64_t>(q->wait_spin_us, as_int(timeout_usp)));
    while (q->status[0].load(std::memory_order_acquire) < ticket) {
      for (int i = 0; i < 64; ++i) AO_PAUSE();
      if (Clock::now() >= until) break;
    }
    if (q->status[0].load(std::memory_order_acquire) >= ticket) return 1;
  }
  std::unique_lock<std::mutex> lk(q->mu);
  const bool ok = q->done_cv.wait_for(lk, std::chrono::microseconds(as_int(timeout_usp)), [q, ticket] {
    return q->status[0].load(std::memory_order_relaxed) >= ticket;
  });
  return ok ? 1 : 0;
}

// The result of a finished job (0 = copied), forgotten once read.
int64_t ao_cq_take(void* h, void* ticketp, void*) {
  Queue* q = static_cast<Queue*>(h);
  std::lock_guard<std::mutex> lk(q->mu);
  auto it = q->results.find(as_int(ticketp));
  if (it == q->results.end()) return 0;
  const int64_t rc = it->second;
  q->results.erase(it);
  return rc;
}

}  // extern "C"
