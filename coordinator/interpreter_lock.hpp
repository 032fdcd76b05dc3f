#pragma once
// Teardown without the Python interpreter lock.
//
// Destroying a group joins threads: torch's ProcessGroupGloo joins its
// workers, which may be freeing a tensor whose Python object needs the
// interpreter lock (GIL). A destructor reached from Python (`del backend`,
// garbage collection) runs with that lock held, so the
// join would wait forever. The coordinator therefore runs every step of its
// teardown that waits for another thread inside withoutInterpreterLock().
//
// The coordinator knows nothing of Python: the extension module installs the
// releaser once at import; until then (C++ tests) `fn` simply runs.

#include <functional>

namespace tpcomm::coord {

// Runs `fn`, with the interpreter lock released around it when the calling
// thread holds it. Installed once, before any group exists.
using InterpreterLockReleaser = void (*)(const std::function<void()>& fn);
void setInterpreterLockReleaser(InterpreterLockReleaser releaser);

// Runs `fn` without the interpreter lock (see above). Exceptions propagate.
void withoutInterpreterLock(const std::function<void()>& fn);

}  // namespace tpcomm::coord
