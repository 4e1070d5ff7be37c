"""The C++ side of global-mode OOM, without PyTorch: a library that declares torch::PyTorchError
as torch/csrc/Exceptions.h does and catches it as PyTorch's binding layer does must catch what
moonbright_torch_alloc throws, and get MoonBright's message and the registered Python type
through the virtual calls. Needs g++ (skipped without it)."""

import ctypes
import shutil
import subprocess
import textwrap
import types

import pytest

import moonbright
import moonbright.torch as mt

CATCHER = r"""
#include <sys/types.h>
#include <cstring>
#include <exception>
#include <string>
typedef struct _object PyObject;
namespace torch {
struct PyTorchError : public std::exception {
  PyTorchError() = default;
  PyTorchError(std::string msg_) : msg(std::move(msg_)) {}
  virtual PyObject* python_type() = 0;
  const char* what() const noexcept override { return msg.c_str(); }
  std::string msg;
};
}
typedef void* (*alloc_fn)(ssize_t, int, void*);
// 0: no exception, 1: torch::PyTorchError, 2: std::exception, 3: other
extern "C" int try_alloc(alloc_fn f, ssize_t size, void** ptr, void** type, char* msg, size_t len) {
  try {
    *ptr = f(size, 0, nullptr);
    return 0;
  } catch (torch::PyTorchError& e) {
    *type = e.python_type();
    strncpy(msg, e.what(), len - 1);
    return 1;
  } catch (const std::exception& e) {
    strncpy(msg, e.what(), len - 1);
    return 2;
  } catch (...) {
    return 3;
  }
}
"""


@pytest.fixture(scope="module")
def catcher(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++")
    d = tmp_path_factory.mktemp("catcher")
    (d / "catcher.cpp").write_text(CATCHER)
    so = d / "libcatcher.so"
    subprocess.run([gxx, "-shared", "-fPIC", "-O1", "-o", str(so), str(d / "catcher.cpp")], check=True)
    lib = ctypes.CDLL(str(so))
    lib.try_alloc.restype = ctypes.c_int
    lib.try_alloc.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.POINTER(ctypes.c_void_p),
                              ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
    mb = ctypes.CDLL(moonbright.library_path())
    fn = ctypes.cast(mb.moonbright_torch_alloc, ctypes.c_void_p).value
    free = mb.moonbright_free
    free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

    def call(size):
        ptr, ty = ctypes.c_void_p(), ctypes.c_void_p()
        buf = ctypes.create_string_buffer(4096)
        kind = lib.try_alloc(fn, size, ctypes.byref(ptr), ctypes.byref(ty), buf, 4096)
        return kind, ptr.value, ty.value, buf.value.decode()

    yield call, free
    moonbright._moonbright._set_torch_oom_type(None)


class FakeOutOfMemoryError(RuntimeError):
    pass


def test_success_returns_the_pointer(catcher):
    call, free = catcher
    kind, ptr, _, _ = call(1000)
    assert kind == 0 and ptr
    free(ptr, 1000, 0, None)
    assert call(0)[:2] == (0, None)


def test_oom_throws_the_registered_type(catcher):
    call, _ = catcher
    moonbright._moonbright._set_torch_oom_type(FakeOutOfMemoryError)
    kind, ptr, ty, msg = call(1 << 40)
    assert kind == 1, msg
    assert ty == id(FakeOutOfMemoryError)
    assert msg.startswith("MoonBright: ") and "cap" in msg


def test_without_a_registered_type_it_is_a_runtime_error(catcher):
    call, _ = catcher
    moonbright._moonbright._set_torch_oom_type(None)
    kind, _, _, msg = call(1 << 40)
    assert kind == 2 and "MoonBright" in msg


HEADER = textwrap.dedent("""
    namespace torch {
    // Abstract base class for exceptions which translate to specific Python types
    struct TORCH_PYTHON_API PyTorchError : public std::exception {
      PyTorchError() = default;
      PyTorchError(std::string msg_) : msg(std::move(msg_)) {}
      virtual PyObject* python_type() = 0;
      const char* what() const noexcept override {
        return msg.c_str();
      }
      std::string msg;
    };
    }
    #define X catch (torch::PyTorchError & e) { PyErr_SetString(e.python_type(), msg.c_str()); }
""")


def fake_torch(tmp_path, header):
    inc = tmp_path / "include" / "torch" / "csrc"
    inc.mkdir(parents=True)
    (inc / "Exceptions.h").write_text(header)
    return types.SimpleNamespace(__file__=str(tmp_path / "__init__.py"))


def test_header_check_accepts_pytorch_declaration(tmp_path):
    assert mt._pytorch_error_layout_ok(fake_torch(tmp_path, HEADER))


def test_header_check_refuses_a_changed_layout(tmp_path):
    changed = HEADER.replace("std::string msg;", "std::string msg;\n  int code;")
    assert not mt._pytorch_error_layout_ok(fake_torch(tmp_path / "a", changed))
    more = HEADER.replace("virtual PyObject*", "virtual void hook() {}\n  virtual PyObject*")
    assert not mt._pytorch_error_layout_ok(fake_torch(tmp_path / "b", more))
    assert not mt._pytorch_error_layout_ok(fake_torch(tmp_path / "c", "nothing"))
