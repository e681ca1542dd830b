"""LLVM IR shared by the native backends: element types and loops (irutil), conversions
between how a dtype is stored and how it computes (convert), the vectorized math library
(mathlib), and IR values with operators that kernels are written in (values)."""
