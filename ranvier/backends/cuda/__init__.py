"""The CUDA backend's code generation: kernels for NVIDIA GPUs as LLVM IR, from the same
formulas and IR values as the CPU backend's (`ranvier.backends.llvm`), written as PTX by
LLVM's NVPTX back end and checked by NVIDIA's assembler (`ptx.py`); elementwise maps and
fused Calculate programs (`maps.py`) with their launch shapes (`launch.py`); finding a GPU
through the driver (`driver.py`). Running cells on a device is not built yet: that needs a
GPU to be checked on (see the README's CUDA section)."""
