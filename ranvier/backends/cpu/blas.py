"""The vendor BLAS that generated code calls: SciPy's OpenBLAS, its GEMM and GEMV
entry points and its thread-count setter, found once per process."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def blas_pointers() -> tuple[int, int, int, int]:
    """Addresses of SciPy's BLAS sgemm, dgemm, sgemv and dgemv (OpenBLAS), for generated code to call."""
    import scipy.linalg.cython_blas as blas

    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    capsules = blas.__pyx_capi__
    return tuple(get_pointer(capsules[n], get_name(capsules[n])) for n in ("sgemm", "dgemm", "sgemv", "dgemv"))


_NO_THREAD_CONTROL = ctypes.CFUNCTYPE(None, ctypes.c_int)(lambda count: None)


@functools.cache
def blas_thread_setter() -> int:
    """Address of the thread-count setter of the OpenBLAS behind SciPy's BLAS (a no-op
    where that library is not found), so generated code can keep BLAS on one thread."""
    from threadpoolctl import ThreadpoolController

    blas_pointers()  # loads SciPy's BLAS, so the controller can see it
    for library in ThreadpoolController().select(internal_api="openblas").lib_controllers:
        if "scipy_openblas" in library.filepath and "numpy" not in library.filepath:
            handle = ctypes.CDLL(library.filepath)
            for symbol in ("scipy_openblas_set_num_threads", "openblas_set_num_threads", "scipy_openblas_set_num_threads64_"):
                if hasattr(handle, symbol):
                    return _address(getattr(handle, symbol))
    return _address(_NO_THREAD_CONTROL)


def _address(function: ctypes._CData) -> int:
    """Where a C function is (a found symbol's address, never null)."""
    return ctypes.cast(function, ctypes.c_void_p).value or 0
