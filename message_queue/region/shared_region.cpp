#include "message_queue/region/shared_region.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/error.hpp"

namespace tpcomm::mq {

namespace {

constexpr const char* kMemfdName = "tpcomm-shm";
constexpr const char* kMemfdTarget = "/memfd:tpcomm-shm";  // what /proc/<pid>/fd/<fd> links to

// Linux 6.3 on: the memfd can never be made executable. Kernels before 6.3
// refuse the flag (EINVAL); with vm.memfd_noexec=2, kernels 6.3 to 6.7
// refuse a memfd without it (EACCES).
#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif
#ifndef F_SEAL_EXEC
#define F_SEAL_EXEC 0x0020
#endif

constexpr int kMapFlags = MAP_SHARED;
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

bool sealedAgainstExec(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  return seals >= 0 && (seals & F_SEAL_EXEC) != 0;
}

RegionNonce randomNonce() {
  RegionNonce nonce;
  TPCOMM_CHECK(
      ::getrandom(nonce.words, sizeof(nonce.words), 0) == static_cast<ssize_t>(sizeof(nonce.words)),
      kSystem, "getrandom: ", std::strerror(errno));
  return nonce;
}

}  // namespace

std::string RegionNonce::hex() const {
  char text[33];
  std::snprintf(text, sizeof(text), "%016llx%016llx", static_cast<unsigned long long>(words[0]),
                static_cast<unsigned long long>(words[1]));
  return text;
}

RegionNonce RegionNonce::parse(const std::string& text) {
  RegionNonce nonce;
  const bool hex =
      text.size() == 32 && text.find_first_not_of("0123456789abcdef") == std::string::npos;
  TPCOMM_CHECK(hex, kInvalidUsage, "'", text, "' is not a shared region's nonce (32 hex digits)");
  nonce.words[0] = std::stoull(text.substr(0, 16), nullptr, 16);
  nonce.words[1] = std::stoull(text.substr(16), nullptr, 16);
  return nonce;
}

std::unique_ptr<SharedRegion> SharedRegion::create(size_t userBytes) {
  TPCOMM_CHECK(userBytes > 0, kInvalidUsage, "shared region of 0 bytes");
  const RegionNonce nonce = randomNonce();
  const size_t bytes = userBytes + kPreambleBytes;
  int fd = ::memfd_create(kMemfdName, MFD_CLOEXEC | MFD_NOEXEC_SEAL);
  if (fd < 0 && errno == EINVAL) fd = ::memfd_create(kMemfdName, MFD_CLOEXEC);
  TPCOMM_CHECK(fd >= 0, kSystem, "memfd_create: ", std::strerror(errno));
  const auto fail = [fd](const char* what) {
    const int err = errno;
    ::close(fd);
    TPCOMM_THROW(kSystem, what, ": ", std::strerror(err));
  };
  if (::fchmod(fd, 0600) != 0) fail("fchmod(memfd, 0600)");
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) fail("ftruncate(memfd)");
  // Where sealing is allowed (MFD_NOEXEC_SEAL allows it): no process holding
  // the memfd may resize it (a shrink would fault every mapper) or add seals.
  ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, kMapFlags, fd, 0);
  if (base == MAP_FAILED) fail("mmap(memfd)");
  std::memcpy(base, nonce.words, sizeof(nonce.words));
  return std::unique_ptr<SharedRegion>(
      new SharedRegion(base, userBytes, fd, sealedAgainstExec(fd), nonce));
}

std::unique_ptr<SharedRegion> SharedRegion::attach(int32_t pid, int32_t fd, size_t userBytes,
                                                   const RegionNonce& nonce) {
  const size_t bytes = userBytes + kPreambleBytes;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/fd/%d", static_cast<int>(pid), static_cast<int>(fd));
  // Only a region this code created: the descriptor may have been closed and
  // its number reused for any other file (a device, a socket) meanwhile.
  char target[128] = {};
  const ssize_t n = ::readlink(path, target, sizeof(target) - 1);
  TPCOMM_CHECK(n >= 0, kSystem, "readlink(", path, "): ", std::strerror(errno));
  TPCOMM_CHECK(std::strncmp(target, kMemfdTarget, std::strlen(kMemfdTarget)) == 0, kSystem, path,
               " is not a tpcomm shared region (it is '", target, "')");
  const int own = ::open(path, O_RDWR | O_CLOEXEC);
  TPCOMM_CHECK(own >= 0, kSystem, "open(", path, "): ", std::strerror(errno));
  struct stat st;
  if (::fstat(own, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    ::close(own);
    TPCOMM_THROW(kSystem, path, " is not the expected shared region of ", userBytes, " bytes");
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, kMapFlags, own, 0);
  const int err = errno;
  const bool sealed = sealedAgainstExec(own);
  ::close(own);
  TPCOMM_CHECK(base != MAP_FAILED, kSystem, "mmap(", path, "): ", std::strerror(err));
  RegionNonce found;
  std::memcpy(found.words, base, sizeof(found.words));
  if (!(found == nonce)) {
    ::munmap(base, bytes);
    TPCOMM_THROW(kSystem, path, " is another shared region than the one announced (nonce ",
                 found.hex(), ", expected ", nonce.hex(), ")");
  }
  return std::unique_ptr<SharedRegion>(new SharedRegion(base, userBytes, -1, sealed, nonce));
}

SharedRegion::~SharedRegion() {
  closeDescriptor();
  ::munmap(base_, bytes_ + kPreambleBytes);
}

void SharedRegion::prefault(size_t offset, size_t length, bool write) {
  if (length == 0) return;
  char* start = base() + offset;
  if (::madvise(start, length, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0) return;
  // Before Linux 5.14: touch a byte per page (a write of the zero it holds:
  // the caller's pages are fresh).
  constexpr size_t kPage = 4096;
  for (size_t at = 0; at < length; at += kPage) {
    volatile char* p = start + at;
    if (write) {
      *p = *p;
    } else {
      (void)*p;
    }
  }
}

int SharedRegion::bindToNode(size_t offset, size_t length, int node) {
  constexpr int kMpolPreferred = 1;             // <linux/mempolicy.h>, without libnuma's headers
  if (node < 0 || node >= 1023) return EINVAL;  // mbind reads maxnode - 1 bits
  const long pageSize = ::sysconf(_SC_PAGESIZE);
  const uintptr_t page = pageSize > 0 ? static_cast<uintptr_t>(pageSize) : 4096;
  const auto start = reinterpret_cast<uintptr_t>(base() + offset);
  const uintptr_t first = (start + page - 1) / page * page;
  const uintptr_t end = (start + length) / page * page;
  if (end <= first) return -1;
  unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] = 1UL << (node % (8 * sizeof(unsigned long)));
  const long done = ::syscall(SYS_mbind, first, end - first, kMpolPreferred, mask,
                              static_cast<unsigned long>(1024), 0u);
  return done == 0 ? 0 : errno;
}

void SharedRegion::closeDescriptor() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string SharedRegion::name() const {
  return detail::concat("memfd:", ::getpid(), ":", fd_, ":", bytes_, ":", nonce_.hex());
}

bool RegionName::parse(const std::string& text, RegionName* out) {
  int pid = 0, fd = 0;
  unsigned long long bytes = 0;
  char nonceText[33] = {};
  int used = 0;
  const bool parsed = std::sscanf(text.c_str(), "memfd:%d:%d:%llu:%32[0-9a-f]%n", &pid, &fd, &bytes,
                                  nonceText, &used) == 4 &&
                      used == static_cast<int>(text.size()) && pid > 0 && fd >= 0 &&
                      std::strlen(nonceText) == 32;
  if (!parsed) return false;
  out->pid = pid;
  out->fd = fd;
  out->bytes = bytes;
  out->nonce = RegionNonce::parse(nonceText);
  return true;
}

}  // namespace tpcomm::mq
