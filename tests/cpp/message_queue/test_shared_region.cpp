// The shared region's memfd (message_queue/region/shared_region.hpp) on kernels that
// treat MFD_NOEXEC_SEAL differently, each imitated in a forked child by a
// seccomp filter on memfd_create: before Linux 6.3 the flag is refused
// (EINVAL); on 6.3 to 6.7 with vm.memfd_noexec=2 a memfd without it is
// refused (EACCES). Either way a region is created, mapped by a peer, and
// says whether it is sealed.
#include <gtest/gtest.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/error.hpp"
#include "message_queue/region/shared_region.hpp"

#if defined(__x86_64__)
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#endif

namespace tpcomm::mq {
namespace {

constexpr unsigned kNoExecSeal = 0x0008U;  // MFD_NOEXEC_SEAL

#if defined(__x86_64__)
// memfd_create fails with `error` when its flags hold MFD_NOEXEC_SEAL
// (refuseSeal) or when they do not (!refuseSeal); other calls pass.
bool refuseMemfd(bool refuseSeal, int error) {
  const unsigned char ifSet = refuseSeal ? 0 : 1;
  const unsigned char ifClear = refuseSeal ? 1 : 0;
  struct sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 0, 4),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_memfd_create, 0, 3),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[1])),
      BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, kNoExecSeal, ifSet, ifClear),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (error & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])),
                            filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}
#endif

// In a child: installs the filter (unless `filtered` is false), creates a
// region, writes it, maps it again through /proc as a peer would, and exits
// 0 when the region's sealing is `wantSealed`.
int createInChild(bool filtered, bool refuseSeal, int error, bool wantSealed) {
  const pid_t child = ::fork();
  if (child == 0) {
    int status = 0;
    try {
#if defined(__x86_64__)
      if (filtered && !refuseMemfd(refuseSeal, error)) ::_exit(80);
#endif
      auto region = SharedRegion::create(8192);
      std::memcpy(region->base(), "tpcomm", 7);
      auto peer = SharedRegion::attach(::getpid(), region->fd(), 8192, region->nonce());
      if (std::strcmp(peer->base(), "tpcomm") != 0) status = 81;
      if (region->execSealed() != wantSealed || peer->execSealed() != wantSealed) status = 82;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
      status = 83;
    }
    ::_exit(status);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

bool kernelAtLeast(int major, int minor) {
  struct utsname u;
  int a = 0, b = 0;
  return ::uname(&u) == 0 && std::sscanf(u.release, "%d.%d", &a, &b) == 2 &&
         (a > major || (a == major && b >= minor));
}

#if defined(__x86_64__)
TEST(SharedRegion, AKernelThatRefusesTheNoExecSealGetsAPlainMemfd) {
  EXPECT_EQ(createInChild(true, true, EINVAL, false), 0);
}

TEST(SharedRegion, AKernelThatRefusesAnUnsealedMemfdGetsASealedOne) {
  // What vm.memfd_noexec=2 does on Linux 6.3 to 6.7; the region needs the
  // flag there (before it was passed the path fell back to Gloo).
  ASSERT_TRUE(kernelAtLeast(6, 3)) << "the seal needs Linux 6.3 or later";
  EXPECT_EQ(createInChild(true, false, EACCES, true), 0);
}
#endif

TEST(SharedRegion, IsSealedWhereTheKernelCanSealIt) {
  EXPECT_EQ(createInChild(false, false, 0, kernelAtLeast(6, 3)), 0);
}

// Every region has its own random nonce; attaching with any other nonce (a
// reused descriptor number, a pid of another namespace) is refused and maps
// nothing, while the announced one attaches.
TEST(SharedRegion, AttachChecksTheCreatorsNonce) {
  auto region = SharedRegion::create(4096);
  auto other = SharedRegion::create(4096);
  EXPECT_FALSE(region->nonce() == other->nonce());
  EXPECT_FALSE(region->nonce() == RegionNonce{});
  EXPECT_EQ(RegionNonce::parse(region->nonce().hex()), region->nonce());
  std::memcpy(region->base(), "mine", 5);
  try {
    SharedRegion::attach(::getpid(), region->fd(), 4096, other->nonce());
    FAIL() << "attached with another region's nonce";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kSystem);
    EXPECT_NE(std::string(e.what()).find("another shared region than the one announced"),
              std::string::npos)
        << e.what();
  }
  auto peer = SharedRegion::attach(::getpid(), region->fd(), 4096, region->nonce());
  EXPECT_STREQ(peer->base(), "mine");
  EXPECT_THROW(RegionNonce::parse("0123"), Error);
  EXPECT_THROW(RegionNonce::parse(std::string(31, '0') + "g"), Error);
}

}  // namespace
}  // namespace tpcomm::mq
