"""The source tree's layering, checked: dependencies point one way,
backend -> coordinator -> {custom_allreduce, message_queue} -> common
(the error type and the settings: the floor, a top-level folder that every
layer may include and that includes no other); the bindings (python/) and the C++ interface (cpp/) may
include every layer below them (and not each other); inside
message_queue, the ring, the arena, the collectives engine and the windows
stand on region/ and not on each other. An include that runs back up fails here,
naming the file, the line and the rule. Also: no folder of more than 20
source files, no source file past 600 lines without the reason at its top."""

import os
import re

ROOT = __file__.rsplit("/tests/", 1)[0]
SOURCES = (".cpp", ".hpp", ".cu", ".cuh", ".inl", ".h")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)

# Each layer and the layers its sources may include (itself included).
LAYERS = {
    "common": {"common"},
    "message_queue": {"message_queue", "common"},
    "custom_allreduce": {"custom_allreduce", "common"},
    "coordinator": {"coordinator", "custom_allreduce", "message_queue", "common"},
    "backend": {"backend", "coordinator", "custom_allreduce", "message_queue", "common"},
    "bindings": {"bindings", "backend", "coordinator", "custom_allreduce", "message_queue",
                 "common"},
    "cpp_interface": {"cpp_interface", "backend", "coordinator", "custom_allreduce",
                      "message_queue", "common"},
}
TOP = {"common": "common", "backend": "backend", "coordinator": "coordinator", "custom_allreduce":
       "custom_allreduce", "message_queue": "message_queue", "python": "bindings", "cpp": "cpp_interface"}


# message_queue's parts and the parts each may include.
MQ_PARTS = {"region": {"region"}, "ring": {"ring", "region"}, "arena": {"arena", "region"},
            "collectives": {"collectives", "region"}, "window": {"window", "region"}}
MAX_SOURCES_PER_FOLDER = 20


def layer_of(rel):
    """The layer of a path relative to the repository root, or None: its
    top-level folder's, with no exception."""
    return TOP.get(rel.split("/", 1)[0])


def mq_part_of(rel):
    parts = rel.split("/")
    return parts[1] if parts[0] == "message_queue" and parts[1] in MQ_PARTS else None


def _sources():
    for top in TOP:
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if name.endswith(SOURCES):
                    yield os.path.join(folder, name)


def _resolve(including, target):
    """An include's path relative to the root: from the root first (the
    project's include root), else beside the including file."""
    if os.path.exists(os.path.join(ROOT, target)):
        return target
    beside = os.path.join(os.path.dirname(including), target)
    if os.path.exists(beside):
        return os.path.relpath(beside, ROOT)
    return None  # a system or torch header


def _read(path):
    with open(path, errors="replace") as f:
        return path, f.read()


def violations(files=None):
    """`files`: (path, text) pairs, the tree's sources when None."""
    out = []
    for path, text in files if files is not None else map(_read, _sources()):
        rel = os.path.relpath(path, ROOT)
        mine = layer_of(rel)
        for match in INCLUDE.finditer(text):
            target = _resolve(path, match.group(1))
            theirs = layer_of(target) if target else None
            line = text.count("\n", 0, match.start()) + 1
            if theirs is not None and theirs not in LAYERS[mine]:
                out.append(f"{rel}:{line} includes {target}: {mine} may include only "
                           f"{', '.join(sorted(LAYERS[mine]))}")
            part, their_part = mq_part_of(rel), mq_part_of(target) if target else None
            if part and their_part and their_part not in MQ_PARTS[part]:
                out.append(f"{rel}:{line} includes {target}: message_queue/{part} may include "
                           f"only {', '.join(sorted(MQ_PARTS[part]))} of message_queue")
    return out


def test_includes_point_down_the_layers():
    found = violations()
    assert not found, "\n".join(found)


def test_an_include_that_runs_back_up_is_caught():
    # The check itself, on sources placed as these layers' would be (not
    # written anywhere): each includes a layer above its own.
    probes = [
        (os.path.join(ROOT, "message_queue", "probe.hpp"),
         '#include "coordinator/group_coordinator.hpp"\n'),
        (os.path.join(ROOT, "common", "probe.hpp"),
         '// floor\n#include "message_queue/ring/ring.hpp"\n'),
        (os.path.join(ROOT, "coordinator", "probe.cpp"), '#include "backend/work.hpp"\n'),
        (os.path.join(ROOT, "custom_allreduce", "probe.cu"),
         '#include "message_queue/region/futex.hpp"\n'),
    ]
    probes.append((os.path.join(ROOT, "message_queue", "ring", "probe.cpp"),
                   '#include "message_queue/collectives/shm_group.hpp"\n'))
    probes.append((os.path.join(ROOT, "backend", "probe.cpp"),
                   '#include "cpp/src/tensor_frame.hpp"\n'))
    found = violations(probes)
    assert len(found) == 6, found
    assert found[0].startswith("message_queue/probe.hpp:1 includes coordinator/"), found
    assert found[1].startswith("common/probe.hpp:2 includes message_queue/"), found
    assert "coordinator may include only" in found[2], found
    assert "custom_allreduce may include only" in found[3], found
    assert "message_queue/ring may include only" in found[4], found
    assert found[5].startswith("backend/probe.cpp:1 includes cpp/src/tensor_frame.hpp"), found


def test_no_folder_holds_more_than_twenty_sources():
    crowded = []
    for top in ("common", "backend", "coordinator", "custom_allreduce", "message_queue", "python", "cpp",
                "tests", "examples"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            n = sum(name.endswith(SOURCES + (".py",)) for name in names)
            if n > MAX_SOURCES_PER_FOLDER:
                crowded.append(f"{os.path.relpath(folder, ROOT)} ({n})")
    assert not crowded, "group these folders' files by concern: " + ", ".join(crowded)


def test_long_sources_say_why_at_their_top():
    long_ones = []
    for top in ("common", "backend", "coordinator", "custom_allreduce", "message_queue", "python", "cpp",
                "tests"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if not name.endswith(SOURCES + (".py",)):
                    continue
                path = os.path.join(folder, name)
                with open(path, errors="replace") as f:
                    lines = f.readlines()
                head = "".join(lines[:25])
                if len(lines) > 600 and "Longer than 600 lines because" not in head:
                    long_ones.append(f"{os.path.relpath(path, ROOT)} ({len(lines)} lines)")
    assert not long_ones, ("past 600 lines without 'Longer than 600 lines because ...' in "
                           "the opening comment: " + ", ".join(long_ones))
