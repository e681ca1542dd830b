"""The CUDA backend's code generation: kernels for NVIDIA GPUs as LLVM IR, from the same
formulas and IR values as the CPU backend's (`ranvier.backends.llvm`), written as PTX by
LLVM's NVPTX back end and checked by NVIDIA's assembler (`ptx.py`). Kernels run one thread
per output element (`kernels.py`): elementwise maps and fused Calculate programs
(`maps.py`), reductions (`reductions.py`); `launch.py` picks their launch shapes and
`driver.py` finds the GPU. Running cells on a device is not built yet: it needs a GPU to
be checked on."""
