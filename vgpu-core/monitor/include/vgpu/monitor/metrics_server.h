// vgpu-monitor's /metrics over HTTP (docs/metrics.md, "The HTTP side"): one small thread serving, one connection at a
// time with bounded reads and writes, the text the judging loop last handed over. The loop never waits on a scraper.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

namespace vgpu::monitor {

// The whole HTTP response to a request head (pure): 200 with `metrics` for GET or HEAD /metrics (no body for HEAD),
// 503 while `metrics` is null (no period judged yet), 404 for another path, 405 for another method, 400 for a head
// that is not HTTP.
std::string HttpResponse(std::string_view request_head, const std::string* metrics);

class MetricsServer {
 public:
  MetricsServer() = default;
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  ~MetricsServer();

  // Listens on `address` (IPv4 dotted) : `port` (0: one the kernel picks) and starts the serving thread. False with
  // `error` naming the address, the port and the reason (a port in use, say).
  bool Start(const std::string& address, std::uint16_t port, std::string& error);
  std::uint16_t port() const { return port_; }

  // The text the next scrapes get (the last period's).
  void Publish(std::string text);

 private:
  void Serve();
  void Answer(int connection);

  int listen_fd_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::shared_ptr<const std::string> text_;  // under mutex_; null until the first Publish
  std::thread thread_;
};

}  // namespace vgpu::monitor
