"""The CPU backend: LLVM code generation through llvmlite, one native function per cell."""
