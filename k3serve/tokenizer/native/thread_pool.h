// A small persistent fork-join pool: the caller runs items too; workers park on a condition
// variable between jobs (so their thread-local piece caches stay warm across calls).
//
// The caller waits for the items to be done, not for the workers to wake up: on a busy machine a
// parked worker may get a CPU late, and then it finds every item claimed and does nothing. Each
// job is reference-counted, so such a late worker only touches its own finished job's counters.
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace k3tok {

class ThreadPool {
 public:
  static ThreadPool& get() {
    static ThreadPool* pool = new ThreadPool();  // never destroyed: workers park until exit
    return *pool;
  }

  // Runs fn(i) for i in [0, n_items) on up to n_threads threads (the caller is one of them).
  void run(size_t n_threads, size_t n_items, const std::function<void(size_t)>& fn) {
    if (n_threads <= 1 || n_items <= 1) {
      for (size_t i = 0; i < n_items; ++i) fn(i);
      return;
    }
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n_items = n_items;
    {
      std::lock_guard<std::mutex> lk(mu_);
      size_t helpers = std::min(n_threads, n_items) - 1;
      while (workers_.size() < helpers) workers_.emplace_back([this] { loop(); });
      job_ = job;
      wanted_ = helpers;
      ++generation_;
    }
    cv_.notify_all();
    work(*job);
    {
      std::unique_lock<std::mutex> lk(job->mu);
      job->cv.wait(lk, [&] { return job->done.load() == job->n_items; });
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (job_ == job) job_.reset();
    }
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  struct Job {
    const std::function<void(size_t)>* fn = nullptr;
    size_t n_items = 0;
    std::atomic<size_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
    std::exception_ptr error;
  };

  static void work(Job& job) {
    for (size_t i; (i = job.next.fetch_add(1)) < job.n_items;) {
      try {
        (*job.fn)(i);
      } catch (...) {
        std::lock_guard<std::mutex> g(job.mu);
        if (!job.error) job.error = std::current_exception();
      }
      if (job.done.fetch_add(1) + 1 == job.n_items) {
        std::lock_guard<std::mutex> g(job.mu);
        job.cv.notify_all();
      }
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        if (wanted_ == 0 || !job_) continue;
        --wanted_;
        job = job_;
      }
      work(*job);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  std::shared_ptr<Job> job_;
  size_t wanted_ = 0;
  uint64_t generation_ = 0;
};

}  // namespace k3tok
