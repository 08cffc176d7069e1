// A method's events with any number of subscribers (ARCHITECTURE.md §11): each feature of a training step (data
// parallelism, an offload, ZeRO-3's gathers) subscribes on its own, and its subscription is an RAII token, so that
// none can overwrite another's callback or outlive the scope it was made for.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace sbp {

// Calls its callback until destroyed or reset (then the subscriber is removed). The hooks it came from outlive it.
class Subscription {
 public:
  Subscription() = default;
  explicit Subscription(std::function<void()> cancel) : cancel_(std::move(cancel)) {}
  ~Subscription() { reset(); }
  Subscription(Subscription&& other) noexcept : cancel_(std::exchange(other.cancel_, nullptr)) {}
  Subscription& operator=(Subscription&& other) noexcept {
    if (this != &other) {
      reset();
      cancel_ = std::exchange(other.cancel_, nullptr);
    }
    return *this;
  }
  Subscription(const Subscription&) = delete;
  Subscription& operator=(const Subscription&) = delete;
  void reset() {
    if (auto cancel = std::exchange(cancel_, nullptr)) cancel();
  }

 private:
  std::function<void()> cancel_;
};

// The subscribers of one event, called in the order they subscribed.
template <class Event>
class EventHooks {
 public:
  using Fn = std::function<void(const Event&)>;
  [[nodiscard]] Subscription subscribe(Fn fn) {
    const auto id = next_id_++;
    subscribers_.emplace_back(id, std::move(fn));
    return Subscription([this, id] {
      std::erase_if(subscribers_, [id](const auto& s) { return s.first == id; });
    });
  }
  bool empty() const { return subscribers_.empty(); }
  void operator()(const Event& event) const {
    for (const auto& [id, fn] : subscribers_) fn(event);
  }

 private:
  std::vector<std::pair<std::uint64_t, Fn>> subscribers_;
  std::uint64_t next_id_ = 0;
};

}  // namespace sbp
