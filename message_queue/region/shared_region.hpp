#pragma once
// An anonymous shared-memory region for processes of one host: created with
// memfd_create (mode 0600, no name in /dev/shm or anywhere else), mapped by
// peers through /proc/<creator pid>/fd/<fd> while the creator keeps the
// descriptor open. The kernel frees the memory when the last process that
// mapped it unmaps it or dies, so no exit (SIGKILL at any moment included)
// can leave anything behind. Internal to message_queue/.
//
// Every region starts with a preamble holding a random 128-bit nonce that the
// creator announces beside its pid and descriptor; attach checks it, so a
// reused descriptor number, a pid of another pid namespace or any other
// region never passes for the announced one. base() and bytes() are the
// caller's part after the preamble.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace tpcomm::mq {

// A region's nonce; hex() is how it travels (32 lowercase hex digits).
struct RegionNonce {
  uint64_t words[2] = {0, 0};
  std::string hex() const;
  // InvalidUsage unless `text` is 32 hex digits.
  static RegionNonce parse(const std::string& text);
  bool operator==(const RegionNonce& other) const {
    return words[0] == other.words[0] && words[1] == other.words[1];
  }
};

// Where another process of this host finds a region:
// "memfd:<creator pid>:<fd>:<bytes>:<nonce hex>".
struct RegionName {
  int32_t pid = 0;
  int32_t fd = -1;
  uint64_t bytes = 0;
  RegionNonce nonce;
  // Parses `text`; false when it is not such a name.
  static bool parse(const std::string& text, RegionName* out);
};

class SharedRegion {
 public:
  // Creates and maps `bytes` of zeroed shared memory, sealed against ever
  // being executable (and against resizing) where the kernel can (Linux 6.3
  // on; older kernels refuse the flag and get a plain memfd). Throws System.
  static std::unique_ptr<SharedRegion> create(size_t bytes);
  // Maps the region another process of this host created and still holds
  // open as descriptor `fd`, whose nonce is `nonce`. Throws System naming the
  // path when it cannot (the creator exited, another user's process, a
  // different /proc, another region behind that path).
  static std::unique_ptr<SharedRegion> attach(int32_t pid, int32_t fd, size_t bytes,
                                              const RegionNonce& nonce);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  char* base() const { return static_cast<char*>(base_) + kPreambleBytes; }
  size_t bytes() const { return bytes_; }
  // The creator's descriptor that peers attach through (-1 once closed).
  int32_t fd() const { return fd_; }
  // Closes the descriptor once every peer attached; the mapping stays.
  void closeDescriptor();
  // Faults in [offset, offset + length) of this mapping now rather than on
  // first use: `write` allocates the pages (first touch: on this process's
  // NUMA node), else maps pages someone allocated. Best effort.
  void prefault(size_t offset, size_t length, bool write);
  // Asks the kernel to allocate the pages of [offset, offset + length) that
  // are not allocated yet on NUMA node `node` (mbind, MPOL_PREFERRED: another
  // node when that one is full), whoever touches them first; the policy
  // belongs to the memfd, so every process that maps it follows it. Only
  // whole pages inside the range are bound. Returns 0, -1 when the range
  // holds no whole page, or the errno of a refusal (EPERM where a seccomp
  // filter forbids mbind, ENOSYS without NUMA): the pages then go where
  // they are first touched.
  int bindToNode(size_t offset, size_t length, int node);
  // Whether the memfd is sealed against execution (MFD_NOEXEC_SEAL).
  bool execSealed() const { return execSealed_; }
  const RegionNonce& nonce() const { return nonce_; }
  // This region's name, for peers to attach through (the creator's).
  std::string name() const;
  // Bytes before base(): the nonce, padded to a page, so that base() stays
  // page-aligned (callers lay pages out from it; madvise needs them).
  static constexpr size_t kPreambleBytes = 4096;

 private:
  SharedRegion(void* base, size_t bytes, int fd, bool execSealed, RegionNonce nonce)
      : base_(base), bytes_(bytes), fd_(fd), execSealed_(execSealed), nonce_(nonce) {}
  void* base_;  // the mapping, preamble included
  size_t bytes_;
  int fd_;
  bool execSealed_;
  RegionNonce nonce_;
};

}  // namespace tpcomm::mq
