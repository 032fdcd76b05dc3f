#pragma once
// Which of the newest c10d::Backend capabilities the torch being built
// against declares (one source for torch 2.11-2.15):
//  - TPCOMM_ABORT_HOOKS: registerAbortHook (c10d/Hooks.hpp's AbortHook),
//    where Backend.hpp says so (C10D_BACKEND_HAS_HOOKS);
//  - TPCOMM_COMPLETION_HOOKS: registerCompletionHook and
//    Work::getCompletionKey, from torch 2.15;
//  - TPCOMM_SHRINK: supportsShrinking / shrink (dist.shrink_group);
//  - TPCOMM_RECONFIGURE: supportsReconfigure / get_reconfigure_handle /
//    reconfigure (dist._reconfigure), where Backend.hpp says so
//    (C10D_BACKEND_HAS_RECONFIGURE, torch 2.15);
//  - TPCOMM_WINDOW: supportsWindow / new_window (dist._new_window), where
//    Backend.hpp says so (C10D_BACKEND_HAS_WINDOW, torch 2.15).
// `python -m tpcomm.info` lists which are on (tpcomm._C._torch_features).

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/version.h>

#if defined(C10D_BACKEND_HAS_HOOKS)
#define TPCOMM_ABORT_HOOKS 1
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 15)
#define TPCOMM_COMPLETION_HOOKS 1
#endif
#endif

// c10d::Backend::shrink and supportsShrinking: in every torch tpcomm supports
// (2.11 on); dist.shrink_group too.
#define TPCOMM_SHRINK 1

#if defined(C10D_BACKEND_HAS_RECONFIGURE)
#define TPCOMM_RECONFIGURE 1
#endif

#if defined(C10D_BACKEND_HAS_WINDOW)
#define TPCOMM_WINDOW 1
#endif
