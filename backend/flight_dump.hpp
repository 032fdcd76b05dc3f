#pragma once
// One dump file per rank that holds every recorder's entries.
//
// torch writes each flight-recorder dump through one process-wide writer
// (c10d::DebugInfoWriter) to <TORCH_FR_DUMP_TEMP_FILE><rank>: ProcessGroupNCCL
// its own recorder's (CUDA events), torch's hooks and tpcomm the recorder
// Gloo and tpcomm record into. Written as they are, the last dump of a rank
// replaces the one before, and torchfrtrace reads one file per rank (a
// second file of the same rank replaces the first in its table), so one
// recorder's entries were lost. tpcomm registers a writer that merges
// every dump it is handed with what it wrote before, so the file of a rank
// always holds both recorders' entries, and torchfrtrace reads them
// together.

#include <string>

namespace tpcomm::backend {

// Two pickled dumps in torch's format merged: the entries of both (an entry
// in both, known by its group id, record id and creation time, as `newer`
// has it), ordered by creation time; the group tables ("pg_config",
// "pg_status") of both, `newer`'s where both name a group; every other key
// as `newer` has it (as `older` where `newer` lacks it). Throws
// std::runtime_error when either is not such a dump.
std::string mergeFlightDumps(const std::string& older, const std::string& newer);

// Registers, once per process, the merging writer for this process's global
// `rank`, writing to <TORCH_FR_DUMP_TEMP_FILE><rank> (or
// TORCH_NCCL_DEBUG_INFO_TEMP_FILE's prefix). Returns the file, or "" with
// `why` set where it did not: no prefix set, or the program or torch
// registered a writer first (dumps then go through that one, as they are).
std::string registerMergingDumpWriter(int rank, std::string& why);

}  // namespace tpcomm::backend
