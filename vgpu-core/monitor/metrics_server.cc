// vgpu-monitor's /metrics over HTTP: docs/metrics.md, "The HTTP side".
#include "vgpu/base/clock.h"
#include "vgpu/monitor/metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace vgpu::monitor {
namespace {

constexpr std::size_t kMaxRequestHeadBytes = 8 * 1024;
constexpr int kReadLimitMs = 2'000;
constexpr int kWriteLimitMs = 5'000;
constexpr int kStopCheckMs = 200;  // how often the idle thread looks whether it should end

std::int64_t NowMs() { return static_cast<std::int64_t>(base::MonotonicNs() / 1'000'000); }

// Waits until `fd` is ready for `events` or `deadline_ms` passes; false on the deadline or an error.
bool WaitFor(int fd, short events, std::int64_t deadline_ms) {
  while (true) {
    const std::int64_t left = deadline_ms - NowMs();
    if (left <= 0) return false;
    pollfd entry{fd, events, 0};
    const int ready = ::poll(&entry, 1, static_cast<int>(left));
    if (ready < 0 && errno == EINTR) continue;
    return ready > 0 && (entry.revents & events) != 0;
  }
}

// The request head (up to the blank line), read within kReadLimitMs and kMaxRequestHeadBytes; false past either.
bool ReadHead(int fd, std::string& head) {
  const std::int64_t deadline = NowMs() + kReadLimitMs;
  char buffer[1024];
  while (head.find("\r\n\r\n") == std::string::npos && head.find("\n\n") == std::string::npos) {
    if (head.size() >= kMaxRequestHeadBytes || !WaitFor(fd, POLLIN, deadline)) return false;
    const ssize_t got = ::recv(fd, buffer, sizeof buffer, 0);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got <= 0) return false;
    head.append(buffer, static_cast<std::size_t>(got));
  }
  return true;
}

void WriteAll(int fd, const std::string& text) {
  const std::int64_t deadline = NowMs() + kWriteLimitMs;
  std::size_t done = 0;
  while (done < text.size()) {
    if (!WaitFor(fd, POLLOUT, deadline)) return;
    // MSG_NOSIGNAL: a scraper that hung up must not end the monitor with SIGPIPE.
    const ssize_t sent = ::send(fd, text.data() + done, text.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (sent <= 0) return;
    done += static_cast<std::size_t>(sent);
  }
}

std::string Response(std::string_view status, std::string_view type, const std::string& body, bool with_body) {
  return "HTTP/1.1 " + std::string(status) + "\r\nContent-Type: " + std::string(type) +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" +
         (with_body ? body : std::string());
}

}  // namespace

std::string HttpResponse(std::string_view request_head, const std::string* metrics) {
  // The request line: METHOD SP TARGET SP HTTP/x.y
  const std::string_view line = request_head.substr(0, request_head.find_first_of("\r\n"));
  const std::size_t first = line.find(' ');
  const std::size_t second = first == std::string_view::npos ? first : line.find(' ', first + 1);
  constexpr std::string_view kText = "text/plain; charset=utf-8";
  if (second == std::string_view::npos || line.substr(second + 1, 5) != "HTTP/") {
    return Response("400 Bad Request", kText, "not an HTTP request\n", true);
  }
  const std::string_view method = line.substr(0, first);
  std::string_view target = line.substr(first + 1, second - first - 1);
  target = target.substr(0, target.find('?'));
  if (target != "/metrics") return Response("404 Not Found", kText, "only /metrics is served here\n", true);
  if (method != "GET" && method != "HEAD") {
    return Response("405 Method Not Allowed", kText, "only GET and HEAD\n", true);
  }
  if (metrics == nullptr) return Response("503 Service Unavailable", kText, "no period judged yet\n", true);
  return Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", *metrics, method == "GET");
}

bool MetricsServer::Start(const std::string& address, std::uint16_t port, std::string& error) {
  const std::string where = address + ":" + std::to_string(port);
  sockaddr_in socket_address{};
  socket_address.sin_family = AF_INET;
  socket_address.sin_port = htons(port);
  if (::inet_pton(AF_INET, address.c_str(), &socket_address.sin_addr) != 1) {
    error = "'" + address + "' is not an IPv4 address; e.g. 0.0.0.0 or 127.0.0.1";
    return false;
  }
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int on = 1;
  if (listen_fd_ < 0 || ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0 ||
      ::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&socket_address), sizeof socket_address) != 0 ||
      ::listen(listen_fd_, 16) != 0) {
    error = "cannot serve metrics on " + where + ": " + std::strerror(errno);
    if (listen_fd_ >= 0) ::close(listen_fd_);
    listen_fd_ = -1;
    return false;
  }
  socklen_t length = sizeof socket_address;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&socket_address), &length);
  port_ = ntohs(socket_address.sin_port);
  // The thread takes no SIGTERM or SIGINT: they must reach the judging loop's sleep.
  sigset_t blocked, previous;
  sigemptyset(&blocked);
  sigaddset(&blocked, SIGTERM);
  sigaddset(&blocked, SIGINT);
  pthread_sigmask(SIG_BLOCK, &blocked, &previous);
  thread_ = std::thread([this] { Serve(); });
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  return true;
}

MetricsServer::~MetricsServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void MetricsServer::Publish(std::string text) {
  auto shared = std::make_shared<const std::string>(std::move(text));
  const std::lock_guard<std::mutex> lock(mutex_);
  text_ = std::move(shared);
}

void MetricsServer::Serve() {
  while (!stop_) {
    pollfd entry{listen_fd_, POLLIN, 0};
    if (::poll(&entry, 1, kStopCheckMs) <= 0) continue;
    const int connection = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (connection < 0) continue;
    Answer(connection);
    ::close(connection);
  }
}

void MetricsServer::Answer(int connection) {
  std::string head;
  if (!ReadHead(connection, head)) return;
  std::shared_ptr<const std::string> text;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    text = text_;
  }
  WriteAll(connection, HttpResponse(head, text.get()));
}

}  // namespace vgpu::monitor
