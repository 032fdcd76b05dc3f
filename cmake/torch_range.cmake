# The torch releases this source is tested against: 2.11 through 2.15.
# pyproject.toml's dependency line and python/run.sh's list say the same
# (tests/python/test_torch_range.py checks that all three agree).
#
# Included by CMakeLists.txt, which calls tpcomm_check_torch_range() with the
# torch found beside the building interpreter before anything compiles. Also
# runs as a script, for the tests:
#   cmake -DTPCOMM_TORCH_VERSION=2.16.0 [-DTPCOMM_TORCH_UNTESTED=ON] -P cmake/torch_range.cmake
set(TPCOMM_TORCH_MIN "2.11")
set(TPCOMM_TORCH_BELOW "2.16")
set(TPCOMM_TORCH_RANGE ">=${TPCOMM_TORCH_MIN},<${TPCOMM_TORCH_BELOW}")

# Stops the configure with a message naming the torch found, where it is, the
# range, and what to do, unless TPCOMM_TORCH_UNTESTED is on (then a warning).
# Sets TPCOMM_TORCH_MINOR ("2.14") for the caller.
function(tpcomm_check_torch_range version where)
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" minor "${version}")
  set(TPCOMM_TORCH_MINOR "${minor}" PARENT_SCOPE)
  if(minor AND minor VERSION_GREATER_EQUAL TPCOMM_TORCH_MIN AND minor VERSION_LESS TPCOMM_TORCH_BELOW)
    return()
  endif()
  set(text
      "tpcomm supports torch ${TPCOMM_TORCH_RANGE} (2.11 through 2.15), but ${where} has torch "
      "${version}. Install a torch of that range there (e.g. pip install torch==2.15.0), or "
      "build against this one untested with -C cmake.define.TPCOMM_TORCH_UNTESTED=ON")
  string(JOIN "" text ${text})
  if(TPCOMM_TORCH_UNTESTED)
    message(WARNING "${text}")
  else()
    message(FATAL_ERROR "${text}")
  endif()
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  tpcomm_check_torch_range("${TPCOMM_TORCH_VERSION}" "the environment given")
  message(STATUS "torch ${TPCOMM_TORCH_VERSION}: accepted")
endif()
