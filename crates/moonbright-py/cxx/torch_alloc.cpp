// The allocation entry point of PyTorch's global allocator (moonbright.torch.enable()).
//
// PyTorch's CUDAPluggableAllocator::malloc does not check what the alloc function returns
// (torch/csrc/cuda/CUDAPluggableAllocator.cpp: `void* r = alloc_fn_(size, device, stream);` is
// stored and handed out as the tensor's data pointer), so a null return would give a tensor at
// address 0 and a crash at its first use. PyTorch's own allocators report failure by throwing a
// C++ exception, which the Python binding layer translates. So this function calls
// moonbright_alloc and, when it fails, throws:
//
// - on out of memory, once moonbright.torch.enable() has registered torch.OutOfMemoryError and
//   checked the installed PyTorch headers: an exception derived from `torch::PyTorchError`.
//   torch/csrc/Exceptions.h catches `torch::PyTorchError&` and raises
//   `PyErr_SetString(e.python_type(), e.what())`; both are virtual calls into this file, and
//   the catch matches by the base class's type name, as exceptions crossing shared libraries do
//   with libstdc++. So Python sees torch.OutOfMemoryError with MoonBright's message.
// - otherwise std::runtime_error, which PyTorch raises as RuntimeError with the message.
//
// The declaration of torch::PyTorchError below repeats PyTorch's (a std::exception, then one
// pure virtual `python_type`, then the message): unchanged since 2018, and checked at enable().

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

extern "C" {
void* moonbright_alloc(ssize_t size, int device, void* stream);
size_t moonbright_last_error_copy(char* buf, size_t len);
int moonbright_last_error_is_oom(void);
}

namespace torch {
// Layout and virtual functions as in torch/csrc/Exceptions.h.
struct PyTorchError : public std::exception {
  PyTorchError() = default;
  explicit PyTorchError(std::string msg_) : msg(std::move(msg_)) {}
  virtual void* python_type() = 0;
  const char* what() const noexcept override { return msg.c_str(); }
  std::string msg;
};
}  // namespace torch

namespace moonbright_cxx {
std::atomic<void*> oom_type{nullptr};

struct TorchOutOfMemory final : public torch::PyTorchError {
  explicit TorchOutOfMemory(std::string m) : torch::PyTorchError(std::move(m)) {}
  void* python_type() override { return oom_type.load(); }
};

std::string last_error() {
  size_t n = moonbright_last_error_copy(nullptr, 0);
  std::vector<char> buf(n + 1, '\0');
  moonbright_last_error_copy(buf.data(), buf.size());
  return std::string(buf.data(), n);
}
}  // namespace moonbright_cxx

extern "C" void moonbright_cxx_set_oom_type(void* type) { moonbright_cxx::oom_type.store(type); }

extern "C" void* moonbright_cxx_torch_alloc(ssize_t size, int device, void* stream) {
  void* p = moonbright_alloc(size, device, stream);
  if (p != nullptr || size == 0) {
    return p;
  }
  std::string msg = "MoonBright: " + moonbright_cxx::last_error();
  if (moonbright_cxx::oom_type.load() != nullptr && moonbright_last_error_is_oom()) {
    throw moonbright_cxx::TorchOutOfMemory(std::move(msg));
  }
  throw std::runtime_error(msg);
}
