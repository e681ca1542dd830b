"""The host CPU as LLVM sees it, with features that can be masked for testing.

Kernels are chosen by CPU features, as Myelin's are: AVX-512 (16 float lanes),
AVX2/FMA (8 lanes) or a portable scalar/SSE variant (4 lanes). A feature mask such
as "-avx512f" (Myelin's `--cpu=-avx512`) compiles for a lesser CPU on this one, so
every variant can be tested here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import llvmlite.binding as llvm

from ...errors import RanvierError

_MASK_GROUPS = {
    # Masking a family also masks what depends on it, so LLVM never sees an impossible CPU.
    "avx512": ["avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512bf16", "avx512fp16",
               "avx512vnni", "avx512ifma", "avx512vbmi", "avx512vbmi2", "avx512bitalg", "avx512vpopcntdq",
               "avx10.1", "avx10.1-256", "avx10.1-512", "amx-tile", "amx-bf16", "amx-int8", "amx-fp16"],
    "avx2": ["avx2", "fma", "f16c", "vaes", "vpclmulqdq", "gfni"],
    "avx": ["avx", "xsave", "xsaveopt"],
}
_MASK_GROUPS["avx2"] += _MASK_GROUPS["avx512"]
_MASK_GROUPS["avx"] += _MASK_GROUPS["avx2"]


@functools.cache
def _initialize() -> None:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()


@dataclass(frozen=True)
class CPUTarget:
    """A CPU name plus its feature string, and the vector shape kernels use on it."""

    name: str
    features: str

    @property
    def feature_set(self) -> set[str]:
        return {f[1:] for f in self.features.split(",") if f.startswith("+")}

    @property
    def variant(self) -> str:
        flags = self.feature_set
        if "avx512f" in flags:
            return "avx512"
        if "avx2" in flags and "fma" in flags:
            return "avx2"
        return "sse"

    @property
    def vector_bytes(self) -> int:
        return {"avx512": 64, "avx2": 32, "sse": 16}[self.variant]

    def lanes(self, itemsize: int) -> int:
        return max(1, self.vector_bytes // itemsize)

    @functools.cached_property
    def machine(self) -> llvm.TargetMachine:
        _initialize()
        target = llvm.Target.from_default_triple()
        return target.create_target_machine(cpu=self.name, features=self.features, opt=3, reloc="default", codemodel="jitdefault")

    def key(self) -> str:
        return f"{self.name}:{self.features}"


def host_target(mask: str = "") -> CPUTarget:
    """The host CPU with the features named in `mask` removed, e.g. "-avx512" or "-avx512,-avx2".

    A mask entry is a feature family (avx512, avx2, avx) or any single LLVM feature name.
    """
    _initialize()
    features = dict(_parse(llvm.get_host_cpu_features().flatten()))
    name = llvm.get_host_cpu_name()
    for item in filter(None, (part.strip() for part in mask.split(","))):
        if not item.startswith("-"):
            raise RanvierError(f"CPU feature mask entries start with '-' (got {item!r}), e.g. '-avx512'")
        family = item[1:]
        for feature in _MASK_GROUPS.get(family, [family]):
            if feature in features:
                features[feature] = False
    if mask:
        # A named CPU implies its features; a generic one lets the feature string rule.
        name = "x86-64"
    # Disabled features go last: LLVM applies the string in order, and a later "+avxvnni"
    # would switch AVX2 back on after "-avx2".
    ordered = sorted(features.items(), key=lambda item: (not item[1], item[0]))
    return CPUTarget(name, ",".join(f"{'+' if on else '-'}{f}" for f, on in ordered))


def _parse(flat: str):
    for item in flat.split(","):
        if item:
            yield item[1:], item[0] == "+"
