#pragma once
// Declarations only (see ../../README.md): ProcessGroupGloo.hpp holds these
// through smart pointers made and destroyed inside torch.
namespace gloo::transport {

class Device;
class UnboundBuffer;

}  // namespace gloo::transport
