// Optional CPython trampoline for the hottest native entry points.
//
// Why: a ctypes call converts its arguments through generic type objects and
// releases and re-takes the GIL around the foreign call; for a batch-1 sparse
// resolve (~8 us of C) that was ~0.5 us a call.  A METH_FASTCALL function
// taking plain ints costs ~0.05 us.  It calls a C function pointer handed in
// by the caller (an address ctypes looked up in the C-ABI library), so this
// module knows nothing about the residency table and the C library itself
// stays free of Python headers (one build for every interpreter).  Built per
// interpreter ABI as the extension module ascend_offload/_native/_ao_fastcall
// when the package is built (setup.py); without it the callers keep using ctypes.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>

namespace {

typedef int64_t (*Fn3)(void*, void*, void*);

// call3(fn, a, b, c, release_gil) -> fn(a, b, c) as an int.  The pointers are
// ints (0 = NULL).  release_gil lets other Python threads run during long
// calls (large batches); short ones keep it, which is cheaper.
PyObject* call3(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "call3(fn, a, b, c, release_gil): %zd arguments given", nargs);
    return nullptr;
  }
  void* f = PyLong_AsVoidPtr(args[0]);
  void* a = PyLong_AsVoidPtr(args[1]);
  void* b = PyLong_AsVoidPtr(args[2]);
  void* c = PyLong_AsVoidPtr(args[3]);
  const int release = PyObject_IsTrue(args[4]);
  if (PyErr_Occurred()) return nullptr;
  if (f == nullptr) {
    PyErr_SetString(PyExc_ValueError, "call3: fn is NULL");
    return nullptr;
  }
  const Fn3 fn = reinterpret_cast<Fn3>(f);
  int64_t r;
  if (release) {
    Py_BEGIN_ALLOW_THREADS
    r = fn(a, b, c);
    Py_END_ALLOW_THREADS
  } else {
    r = fn(a, b, c);
  }
  return PyLong_FromLongLong(r);
}

PyMethodDef kMethods[] = {
    {"call3", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(call3)),
     METH_FASTCALL, "call3(fn, a, b, c, release_gil) -> int64: fn(a, b, c) for a C "
                    "function pointer fn taking three pointers"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_ao_fastcall", nullptr, -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__ao_fastcall() { return PyModule_Create(&kModule); }
