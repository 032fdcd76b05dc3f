#pragma once
// Declarations only (see ../README.md): torch's ProcessGroupGloo.hpp includes
// this header but uses nothing of it in what tpcomm compiles.
