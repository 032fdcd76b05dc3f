#include "backend/flight_record.hpp"

#include "backend/flight_dump.hpp"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <c10/util/ApproximateClock.h>
#include <c10/util/thread_name.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string_view>
#include <thread>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/route_stats.hpp"

namespace tpcomm::backend {

namespace {

using Recorder = c10d::FlightRecorder<c10::Event>;

// FlightRecord::record writes every field of an entry by name, over the
// entry a slot held before. A field torch adds would keep the older entry's
// value there: torch 2.11-2.15's entry has 25 fields, 512 bytes on x86-64,
// and a torch whose entry differs stops the build here until record() sets
// the new field.
#if defined(__x86_64__)
static_assert(sizeof(Recorder::Entry) == 512,
              "torch's FlightRecorder::Entry changed: set its new fields in FlightRecord::record");
#endif

constexpr const char* kInstanceSymbol = "_ZZN4c10d14FlightRecorderIN3c105EventEE3getEvE8instance";

// The address of the local (unexported) data symbol `name` in the loaded
// shared object that holds `anchor`, from the object's file's symbol table;
// nullptr with `why` set when there is none.
void* findLocalSymbol(const void* anchor, const char* name, std::string& why) {
  Dl_info info{};
  if (::dladdr(anchor, &info) == 0 || info.dli_fname == nullptr) {
    why = "dladdr found no library for torch's dump function";
    return nullptr;
  }
  void* handle = ::dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  link_map* map = nullptr;
  if (handle == nullptr || ::dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || map == nullptr) {
    if (handle != nullptr) ::dlclose(handle);
    why = detail::concat("no link map for ", info.dli_fname);
    return nullptr;
  }
  const ElfW(Addr) bias = map->l_addr;
  ::dlclose(handle);  // RTLD_NOLOAD: only a reference count
  const int fd = ::open(info.dli_fname, O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    if (fd >= 0) ::close(fd);
    why = detail::concat("cannot read ", info.dli_fname);
    return nullptr;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* file = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (file == MAP_FAILED) {
    why = detail::concat("cannot map ", info.dli_fname);
    return nullptr;
  }
  const char* base = static_cast<const char*>(file);
  void* found = nullptr;
  why = detail::concat(info.dli_fname, " has no symbol table (a stripped build)");
  const auto* eh = reinterpret_cast<const ElfW(Ehdr)*>(base);
  // [offset, offset + count * each) lies in the file (no sum that can wrap).
  const auto inFile = [size](uint64_t offset, uint64_t count, uint64_t each) {
    return offset <= size && count <= (size - offset) / each;
  };
  const bool elf = size >= sizeof(ElfW(Ehdr)) && std::memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0 &&
                   eh->e_ident[EI_CLASS] == (sizeof(void*) == 8 ? ELFCLASS64 : ELFCLASS32) &&
                   eh->e_shoff > 0 && eh->e_shentsize == sizeof(ElfW(Shdr)) &&
                   inFile(eh->e_shoff, eh->e_shnum, sizeof(ElfW(Shdr)));
  const size_t nameLength = std::strlen(name);
  for (unsigned i = 0; elf && i < eh->e_shnum && found == nullptr; ++i) {
    const auto* sections = reinterpret_cast<const ElfW(Shdr)*>(base + eh->e_shoff);
    const ElfW(Shdr)& symtab = sections[i];
    if (symtab.sh_type != SHT_SYMTAB || symtab.sh_link >= eh->e_shnum ||
        symtab.sh_entsize != sizeof(ElfW(Sym)) || !inFile(symtab.sh_offset, symtab.sh_size, 1)) {
      continue;
    }
    const ElfW(Shdr)& strtab = sections[symtab.sh_link];
    if (strtab.sh_type != SHT_STRTAB || !inFile(strtab.sh_offset, strtab.sh_size, 1)) continue;
    const auto* symbols = reinterpret_cast<const ElfW(Sym)*>(base + symtab.sh_offset);
    const char* strings = base + strtab.sh_offset;
    const size_t count = symtab.sh_size / sizeof(ElfW(Sym));
    why = detail::concat(info.dli_fname, " has no symbol ", name);
    for (size_t s = 0; s < count; ++s) {
      const ElfW(Sym)& sym = symbols[s];
      // An 8-byte data object: the pointer; its name checked only then.
      // The low 4 bits of st_info: the symbol type in ELF32 and ELF64 alike.
      if ((sym.st_info & 0xf) != STT_OBJECT || sym.st_size != sizeof(void*) || sym.st_value == 0 ||
          sym.st_shndx == SHN_UNDEF || sym.st_shndx >= eh->e_shnum ||
          sym.st_name >= strtab.sh_size || nameLength >= strtab.sh_size - sym.st_name) {
        continue;
      }
      if (std::memcmp(strings + sym.st_name, name, nameLength + 1) == 0) {
        found = reinterpret_cast<void*>(bias + sym.st_value);
        break;
      }
    }
  }
  ::munmap(file, size);
  return found;
}

Recorder& recorder(void* p) { return *static_cast<Recorder*>(p); }

// Finds torch's recorder; nullptr with `why`.
void* findRecorder(std::string& why) {
  // Constructs the singleton (dump() calls get()), so that the pointer is set.
  (void)c10d::dump_fr_trace(false, false, true);
  void* slot =
      findLocalSymbol(reinterpret_cast<const void*>(&c10d::dump_fr_trace), kInstanceSymbol, why);
  if (slot == nullptr) return nullptr;
  auto* instance = *static_cast<Recorder**>(slot);
  if (instance == nullptr) {
    why = "torch's flight recorder is not constructed";
    return nullptr;
  }
  why = recorderLayoutProblem(instance);
  return why.empty() ? instance : nullptr;
}

}  // namespace

std::string recorderLayoutProblem(void* instance) {
  // What its constructor set: a recorder laid out as torch's header says.
  Recorder& r = recorder(instance);
  std::lock_guard<std::mutex> lock(r.mutex_);
  if (r.enabled_ != (r.max_entries_ > 0) || r.reset_epoch_start_idx_.count(r.reset_epoch_) == 0 ||
      r.entries_.size() > r.max_entries_) {
    return "torch's flight recorder does not look as its header says";
  }
  return {};
}

const char* flightOpName(const char* op) {
  // Compared as C strings: a lookup per call that allocates nothing.
  static constexpr std::pair<const char*, const char*> kNames[] = {
      {"allreduce", "all_reduce"},
      {"allreduce_sparse", "all_reduce"},
      {"all_reduce_add_rms_norm", "all_reduce"},
      {"allgather", "all_gather"},
      {"allgather_into_tensor", "_all_gather_base"},
      {"allgather_coalesced", "ALLGATHER_coalesced"},
      {"reduce_scatter_tensor", "_reduce_scatter_base"},
      {"all_to_all_single", "all_to_all"},
      {"barrier", "all_reduce_barrier"},
  };
  for (const auto& [from, to] : kNames) {
    if (std::strcmp(op, from) == 0) return to;
  }
  return op;
}

void FlightName::writeTo(std::string& out) const {
  out.assign(name);
  if (route != nullptr) out.append(" tpcomm/").append(route);
}

FlightName FlightCall::routed() const {
  const auto& route = coord::RouteStats::lastRoute();
  if (!id.id || p2p || !route) return {};
  return FlightName{name, coord::statsRouteName(*route)};
}

FlightRecord& FlightRecord::get() {
  static FlightRecord* record = new FlightRecord();  // outlives every group
  return *record;
}

FlightRecord::FlightRecord() {
  stacks_ = settings().frStacks;
  std::string why;
  void* found = nullptr;
  try {
    found = findRecorder(why);
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (found == nullptr) {
    status_ = "off: " + why;
    return;
  }
  if (!recorder(found).enabled_) {
    status_ = "off: TORCH_FR_BUFFER_SIZE=0";
    return;
  }
  recorder_ = found;
  {
    // The ring's whole size at once (torch's default of 2,000 entries is
    // about 1 MB): filling it then moves no entry, where torch grows it an
    // entry at a time, moving every entry as it doubles. A larger
    // TORCH_FR_BUFFER_SIZE is left to grow as torch grows it.
    constexpr size_t kReservedEntries = 4096;
    Recorder& r = recorder(found);
    std::lock_guard<std::mutex> lock(r.mutex_);
    r.entries_.reserve(std::min(r.max_entries_, kReservedEntries));
  }
  const auto set = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0';
  };
  const auto on = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && (std::strcmp(v, "1") == 0 || std::strcmp(v, "true") == 0);
  };
  dumps_ = set("TORCH_FR_DUMP_TEMP_FILE") || set("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") ||
           on("TORCH_FR_DUMP_ON_TIMEOUT") || on("TORCH_NCCL_DUMP_ON_TIMEOUT");
  status_ = detail::concat("on (torch's recorder, ", recorder(found).max_entries_, " entries",
                           stacks_ ? ", with Python stacks" : "",
                           dumps_ ? ", dumped after a failure" : "", ")");
}

void FlightRecord::setRank(int rank) {
  rank_ = rank;
  setMergingDumpRank(rank);
}

std::string FlightRecord::status() const {
  if (!dumps_) return status_;
  return status_.substr(0, status_.size() - 1) + ": " + mergingDumpStatus() + ")";
}

void FlightRecord::recordGroup(const std::string& name, const std::string& desc,
                               const std::vector<uint64_t>& ranks) {
  if (recorder_ == nullptr) return;
  Recorder& r = recorder(recorder_);
  std::lock_guard<std::mutex> lock(r.mutex_);
  r.pg_name_to_ranks_[{name, desc}] = ranks;
}

namespace {

// A call's tensors as its entry keeps them, read before the recorder's mutex
// is taken (reading a tensor's sizes may throw); one per thread, so that
// reading them allocates nothing once warm.
struct CallTensorsRecord {
  c10::SmallVector<int64_t, 4> inputDims;
  std::vector<c10::ScalarType> inputDtypes;
  c10::SmallVector<int64_t, 4> outputDims;
  std::vector<c10::ScalarType> outputDtypes;
  c10::SmallVector<int64_t, 8> sizes;

  void read(c10::ArrayRef<at::Tensor> inputs, c10::ArrayRef<at::Tensor> outputs) {
    inputDims.clear();
    inputDtypes.clear();
    outputDims.clear();
    outputDtypes.clear();
    sizes.clear();
    for (const auto& t : inputs) {
      if (!t.defined()) continue;  // refused by the call's checks, after this
      inputDtypes.push_back(t.scalar_type());
      inputDims.push_back(t.dim());
      sizes.append(t.sizes().begin(), t.sizes().end());
    }
    for (const auto& t : outputs) {
      if (!t.defined()) continue;
      outputDtypes.push_back(t.scalar_type());
      outputDims.push_back(t.dim());
      sizes.append(t.sizes().begin(), t.sizes().end());
    }
  }
};

}  // namespace

FlightId FlightRecord::record(size_t pgId, const std::string& name, const std::string& desc,
                              size_t collectiveSeq, size_t p2pSeq, std::string_view profilingName,
                              c10::ArrayRef<at::Tensor> inputs, c10::ArrayRef<at::Tensor> outputs,
                              std::chrono::milliseconds timeout, bool isP2P) {
  if (recorder_ == nullptr) return {};
  Recorder& r = recorder(recorder_);
  // Without stacks every entry shares one empty traceback (no allocation).
  static const auto empty = torch::CapturedTraceback::gather(false, false, false);
  std::shared_ptr<torch::CapturedTraceback> traceback;
  if (stacks_) traceback = torch::CapturedTraceback::gather(true, true, false);
  // The thread's name, read once per thread (a system call each time).
  static thread_local const std::string threadName = c10::getThreadName();
  static thread_local CallTensorsRecord tensors;
  tensors.read(inputs, outputs);
  const c10::time_t now = c10::getTime();
  const std::thread::id thread = std::this_thread::get_id();
  std::lock_guard<std::mutex> lock(r.mutex_);
  // Once the ring is full, the slot's strings and vectors are reused as
  // they are (assigned over): a call allocates only where its entry needs
  // more room than the slot's last one had. The slot, the ring's next index
  // and the id are claimed together first, as torch's record() does, so
  // that an assignment failing below (out of memory) leaves the ring in
  // step. Every field is set (the static_assert above guards the list).
  Recorder::Entry& e =
      r.entries_.size() < r.max_entries_ ? r.entries_.emplace_back() : r.entries_[r.next_];
  if (++r.next_ == r.max_entries_) r.next_ = 0;
  const FlightId id{r.id_++, r.reset_epoch_};
  e.id_ = *id.id;
  e.reset_epoch_ = *id.epoch;
  e.retired_ = false;
  e.pg_id_ = pgId;
  std::get<0>(e.pg_name_).assign(name);
  std::get<1>(e.pg_name_).assign(desc);
  e.collective_seq_id_ = collectiveSeq;
  e.p2p_seq_id_ = p2pSeq;
  e.op_id_ = isP2P ? p2pSeq : collectiveSeq;
  e.profiling_name_.assign(profilingName.data(), profilingName.size());
  if (stacks_) {
    e.traceback_ = std::move(traceback);
  } else if (e.traceback_ != empty) {
    e.traceback_ = empty;  // a slot that held another entry's (no counting when it is the same)
  }
  e.start_ = nullptr;
  e.end_ = nullptr;
  e.time_created_ = now;
  e.timeout_ms_ = timeout.count();
  e.isP2P_ = isP2P;
  e.duration_ = std::nullopt;
  e.time_discovered_started_ = now;
  e.time_discovered_completed_ = std::nullopt;
  e.input_dims_.assign(tensors.inputDims.begin(), tensors.inputDims.end());
  e.input_dtypes_.assign(tensors.inputDtypes.begin(), tensors.inputDtypes.end());
  e.output_dims_.assign(tensors.outputDims.begin(), tensors.outputDims.end());
  e.output_dtypes_.assign(tensors.outputDtypes.begin(), tensors.outputDtypes.end());
  e.sizes_.assign(tensors.sizes.begin(), tensors.sizes.end());
  e.thread_id_ = thread;
  e.thread_name_.assign(threadName);
  return id;
}

namespace {

// The entry `id` names, under the recorder's mutex, or nullptr once it was
// overwritten (the buffer is a ring).
Recorder::Entry* entryOf(Recorder& r, const FlightId& id) {
  if (!id.id || !id.epoch || r.entries_.empty()) return nullptr;
  auto epoch = r.reset_epoch_start_idx_.find(*id.epoch);
  if (epoch == r.reset_epoch_start_idx_.end()) return nullptr;
  const size_t index = (epoch->second + *id.id) % r.max_entries_;
  if (index >= r.entries_.size()) return nullptr;
  Recorder::Entry& e = r.entries_[index];
  return e.id_ == *id.id && e.reset_epoch_ == *id.epoch ? &e : nullptr;
}

}  // namespace

void FlightRecord::rename(const FlightId& id, const FlightName& profilingName) {
  if (recorder_ == nullptr || !id.id || profilingName.empty()) return;
  Recorder& r = recorder(recorder_);
  std::lock_guard<std::mutex> lock(r.mutex_);
  if (Recorder::Entry* e = entryOf(r, id)) profilingName.writeTo(e->profiling_name_);
}

void FlightRecord::retire(const FlightId& id, const FlightName& profilingName) {
  if (recorder_ == nullptr || !id.id) return;
  const c10::time_t now = c10::getTime();
  Recorder& r = recorder(recorder_);
  std::lock_guard<std::mutex> lock(r.mutex_);
  Recorder::Entry* e = entryOf(r, id);
  if (e == nullptr) return;
  if (!profilingName.empty()) profilingName.writeTo(e->profiling_name_);
  e->time_discovered_completed_ = now;
  e->retired_ = true;
}

namespace {

// torchfrtrace (torch 2.11) reads "nccl:<op>" and "xccl:<op>" entries only,
// and stops at any other. The entries ProcessGroupGloo records for tpcomm's
// own Gloo groups ("gloo:all_gather" of a set-up exchange) become
// "nccl:<torch's op name> tpcomm/internal" (point to point, whose peer
// Gloo does not record: "nccl:coalesced tpcomm/internal").
void renameInternalEntries(Recorder& r) {
  static const std::map<std::string, std::string> names = {
      {"gloo:all_gather", "all_gather"},
      {"gloo:all_reduce", "all_reduce"},
      {"gloo:all_to_all", "all_to_all"},
      {"gloo:barrier", "all_reduce_barrier"},
      {"gloo:broadcast", "broadcast"},
      {"gloo:gather", "gather"},
      {"gloo:reduce", "reduce"},
      {"gloo:scatter", "scatter"},
      {"gloo:sparse_all_reduce", "all_reduce"}};
  static const std::string kInternal = ":tpcomm-internal";
  std::lock_guard<std::mutex> lock(r.mutex_);
  for (auto& e : r.entries_) {
    const std::string& group = std::get<0>(e.pg_name_);
    if (group.size() < kInternal.size() ||
        group.compare(group.size() - kInternal.size(), kInternal.size(), kInternal) != 0 ||
        e.profiling_name_.rfind("gloo:", 0) != 0) {
      continue;
    }
    auto it = names.find(e.profiling_name_);
    e.profiling_name_ =
        "nccl:" + (it != names.end() ? it->second : std::string("coalesced")) + " tpcomm/internal";
  }
}

}  // namespace

void FlightRecord::renameInternal() {
  if (recorder_ != nullptr) renameInternalEntries(recorder(recorder_));
}

std::string FlightRecord::dumpAfterFailure() {
  if (recorder_ == nullptr || !dumps_) return "";
  static std::mutex dumping;
  std::lock_guard<std::mutex> lock(dumping);
  try {
    renameInternalEntries(recorder(recorder_));
    auto& writer = c10d::DebugInfoWriter::getWriter(rank_);
    // Without stack traces: symbolizing them may need the GIL, which the
    // failing caller's thread may not be able to take.
    writer.write(c10d::dump_fr_trace(true, false, false));
    return " (flight recorder dumped to " + writer.getWriterTarget() + ")";
  } catch (const std::exception& e) {
    return std::string(" (flight recorder dump failed: ") + e.what() + ")";
  }
}

}  // namespace tpcomm::backend
