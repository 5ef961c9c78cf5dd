// IoQueue (io_queue.h): transfers split into pieces of request_bytes, kept
// depth() deep over one backend, short transfers resubmitted, failures named.
#include "csrc/core/disk/io_queue.h"

#include <algorithm>
#include <cerrno>
#include <limits>
#include <system_error>

namespace hipferry::disk {
namespace {

constexpr int kSlotShift = 32;
constexpr std::uint64_t kPieceMask = (std::uint64_t{1} << kSlotShift) - 1;

const char* op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

std::string describe(IoOp op, const std::string& path, std::uint64_t offset, std::size_t bytes) {
  return std::string(op_name(op)) + " of " + path + " at offset " + std::to_string(offset) + " (" +
         std::to_string(bytes) + " bytes)";
}

}  // namespace

IoQueue::IoQueue(IoBackend& backend, std::size_t request_bytes)
    : backend_(backend), request_bytes_(request_bytes), depth_(backend.depth()) {
  if (request_bytes == 0) throw std::invalid_argument("IoQueue: request_bytes must be > 0, got 0");
  if (depth_ == 0) {
    throw std::invalid_argument(std::string("IoQueue: the backend '") + backend.name() +
                                "' has depth 0; expected at least 1");
  }
  completions_.resize(depth_);
}

IoQueue::~IoQueue() {
  // Never leave the kernel a buffer the caller is about to free. A broken
  // backend (reap throws) leaves nothing better to do than stop.
  ready_.clear();
  std::vector<std::uint64_t> ignored;
  try {
    wait_in_flight(&ignored);
  } catch (...) {
  }
}

void IoQueue::read(const FileRef& file, std::uint64_t offset, void* buffer, std::size_t bytes, std::uint64_t token) {
  enqueue(IoOp::kRead, file, offset, buffer, bytes, token);
}

void IoQueue::write(const FileRef& file, std::uint64_t offset, const void* buffer, std::size_t bytes,
                    std::uint64_t token) {
  // The backend only reads a write's buffer; the request type is shared.
  enqueue(IoOp::kWrite, file, offset, const_cast<void*>(buffer), bytes, token);
}

void IoQueue::enqueue(IoOp op, const FileRef& file, std::uint64_t offset, void* buffer, std::size_t bytes,
                      std::uint64_t token) {
  if (failed_) throw_failure();
  const std::string what = std::string("IoQueue::") + op_name(op) + " of " + file.path + ": ";
  if (file.fd < 0)
    throw std::invalid_argument(what + "file.fd must be an open descriptor, got " + std::to_string(file.fd));
  if (buffer == nullptr && bytes > 0) throw std::invalid_argument(what + "buffer is null");
  if (bytes > std::numeric_limits<std::uint64_t>::max() - offset) {
    throw std::invalid_argument(what + "offset + bytes overflows");
  }
  const std::size_t pieces = bytes / request_bytes_ + (bytes % request_bytes_ != 0);
  if (pieces > kPieceMask) throw std::invalid_argument(what + "too many pieces; raise request_bytes");
  if (pieces == 0) {  // nothing to move: done at the next poll
    empty_done_.push_back(token);
    return;
  }
  const std::uint32_t slot = take_slot();
  Transfer& t = transfers_[slot];
  t.op = op;
  t.file = &file;
  t.offset = offset;
  t.buffer = static_cast<unsigned char*>(buffer);
  t.bytes = bytes;
  t.token = token;
  t.moved.assign(pieces, 0);
  t.pieces_left = pieces;
  t.live = true;
  ++live_;
  for (std::size_t i = 0; i < pieces; ++i) ready_.push_back(Piece{slot, static_cast<std::uint32_t>(i)});
}

std::uint32_t IoQueue::take_slot() {
  if (!free_slots_.empty()) {
    const std::uint32_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }
  transfers_.emplace_back();
  return static_cast<std::uint32_t>(transfers_.size() - 1);
}

void IoQueue::finish(std::uint32_t slot, std::vector<std::uint64_t>* done) {
  Transfer& t = transfers_[slot];
  t.live = false;
  --live_;
  free_slots_.push_back(slot);
  done->push_back(t.token);
}

void IoQueue::poll(bool wait, std::vector<std::uint64_t>* done) {
  if (done == nullptr) throw std::invalid_argument("IoQueue::poll: done must not be null");
  if (failed_) throw_failure();
  done->insert(done->end(), empty_done_.begin(), empty_done_.end());
  empty_done_.clear();
  submit_ready();
  if (in_flight_ > 0) reap(wait ? 1 : 0, done);
  submit_ready();  // refill what the completions freed, and resubmit short ones
  if (failed_) {
    // Note [no I/O after a failure returns]
    wait_in_flight(done);
    drop_queued();
    throw_failure();
  }
}

void IoQueue::cancel(std::vector<std::uint64_t>* done) {
  if (done == nullptr) throw std::invalid_argument("IoQueue::cancel: done must not be null");
  if (failed_) return;  // already drained
  done->insert(done->end(), empty_done_.begin(), empty_done_.end());
  empty_done_.clear();
  ready_.clear();
  cancelling_ = true;
  try {
    wait_in_flight(done);
  } catch (...) {
    cancelling_ = false;
    throw;
  }
  cancelling_ = false;
  drop_queued();
}

std::size_t IoQueue::pending() const { return live_ + empty_done_.size(); }

void IoQueue::submit_ready() {
  while (!failed_ && !ready_.empty() && in_flight_ < depth_) {
    const Piece p = ready_.front();
    const Transfer& t = transfers_[p.slot];
    const std::size_t piece_start = std::size_t{p.index} * request_bytes_;
    const std::size_t start = piece_start + t.moved[p.index];
    IoRequest r;
    r.op = t.op;
    r.fd = t.file->fd;
    r.offset = t.offset + start;
    r.buffer = t.buffer + start;
    r.bytes = std::min(request_bytes_, t.bytes - piece_start) - t.moved[p.index];
    r.tag = (std::uint64_t{p.slot} << kSlotShift) | p.index;
    try {
      backend_.submit(r);
    } catch (const std::exception& e) {  // the backend itself is broken
      fail(t, r.offset, r.bytes, EIO, std::string(backend_.name()) + " backend: " + e.what());
      return;
    }
    ready_.pop_front();
    ++in_flight_;
    ++counters_.requests;
    counters_.max_in_flight = std::max(counters_.max_in_flight, in_flight_);
  }
}

void IoQueue::reap(std::size_t min_complete, std::vector<std::uint64_t>* done) {
  const std::size_t n = backend_.reap(completions_.data(), completions_.size(), min_complete);
  for (std::size_t i = 0; i < n; ++i) complete(completions_[i], done);
}

void IoQueue::complete(const IoCompletion& c, std::vector<std::uint64_t>* done) {
  const auto slot = static_cast<std::uint32_t>(c.tag >> kSlotShift);
  const auto index = static_cast<std::uint32_t>(c.tag & kPieceMask);
  if (slot >= transfers_.size() || !transfers_[slot].live || index >= transfers_[slot].moved.size()) {
    throw std::logic_error(std::string(backend_.name()) + " backend: a completion with unknown tag " +
                           std::to_string(c.tag));
  }
  Transfer& t = transfers_[slot];
  --in_flight_;
  const std::size_t piece_start = std::size_t{index} * request_bytes_;
  const std::size_t asked = std::min(request_bytes_, t.bytes - piece_start) - t.moved[index];
  const std::uint64_t offset = t.offset + piece_start + t.moved[index];
  if (c.result < 0) {
    const int error = static_cast<int>(-c.result);
    fail(t, offset, asked, error, std::error_code(error, std::generic_category()).message());
    return;
  }
  const auto moved = static_cast<std::uint64_t>(c.result);
  if (moved > asked) {
    fail(t, offset, asked, EIO, "the backend reports " + std::to_string(moved) + " bytes moved");
    return;
  }
  if (moved < asked) ++counters_.short_transfers;
  if (moved == 0) {
    // A read at the end of the file; a write that moves nothing would loop.
    if (t.op == IoOp::kRead)
      fail(t, offset, asked, 0, "the file ends early (truncated?)");
    else
      fail(t, offset, asked, EIO, "short write (no bytes written)");
    return;
  }
  (t.op == IoOp::kRead ? counters_.bytes_read : counters_.bytes_written) += moved;
  t.moved[index] += moved;
  if (moved < asked) {
    ready_.push_front(Piece{slot, index});  // the rest, next
  } else if (--t.pieces_left == 0) {
    finish(slot, done);
  }
}

void IoQueue::fail(const Transfer& t, std::uint64_t offset, std::size_t bytes, int error, const std::string& cause) {
  // While cancelling, the transfer is abandoned anyway; only the first failure is kept.
  if (cancelling_ || failed_) return;
  failed_ = true;
  failure_message_ = describe(t.op, t.file->path, offset, bytes) + ": " + cause;
  failure_path_ = t.file->path;
  failure_offset_ = offset;
  failure_error_ = error;
}

void IoQueue::wait_in_flight(std::vector<std::uint64_t>* done) {
  while (in_flight_ > 0) reap(in_flight_, done);
}

void IoQueue::drop_queued() {
  ready_.clear();
  transfers_.clear();
  free_slots_.clear();
  live_ = 0;
  empty_done_.clear();
}

void IoQueue::throw_failure() const {
  throw IoFailure(failure_message_, failure_path_, failure_offset_, failure_error_);
}

}  // namespace hipferry::disk
