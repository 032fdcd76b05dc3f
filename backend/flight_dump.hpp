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

// Registers the merging writer as torch's dump writer, once per process,
// when TORCH_FR_DUMP_TEMP_FILE (or TORCH_NCCL_DEBUG_INFO_TEMP_FILE) names a
// prefix. torch's registration replaces whatever writer was there, so this
// runs when tpcomm's module loads, before anything can be writing through
// one; a writer the program registered before is kept (its dumps stay as
// they are). Never throws.
void registerMergingDumpWriter();

// This process's global rank, for the file's name (<prefix><rank>); until
// set, the RANK environment variable, else 0.
void setMergingDumpRank(int rank);

// "merged into <file>", or why dumps are not merged.
std::string mergingDumpStatus();

}  // namespace tpcomm::backend
