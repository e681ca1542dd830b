"""The host CPU as LLVM sees it, with features that can be masked for testing.

Kernels are chosen by CPU features, as Myelin's are: AVX-512 (16 float lanes),
AVX2/FMA (8 lanes) or a portable scalar/SSE variant (4 lanes). A feature mask such
as "-avx512f" (Myelin's `--cpu=-avx512`) compiles for a lesser CPU on this one, so
every variant can be tested here.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
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
# AMX's bf16 GEMM packs its tiles with AVX512-BF16's conversions: masking those masks it too
# (--cpu=-avx512bf16 leaves a Sapphire Rapids, as a Zen 4, its float32 products).
_MASK_GROUPS["avx512bf16"] = ["avx512bf16", "amx-bf16"]
_MASK_GROUPS["avx2"] += _MASK_GROUPS["avx512"]
_MASK_GROUPS["avx"] += _MASK_GROUPS["avx2"]
# CPUs gain extensions faster than a list: a family also masks every feature of the host
# whose name starts so (Zen 5's avx512vp2intersect, AVX2's VEX-coded avxvnni, avxifma...).
_FAMILY_PREFIXES: dict[str, tuple[str, ...]] = {"avx512": ("avx512", "avx10", "amx-")}
_FAMILY_PREFIXES["avx2"] = (*_FAMILY_PREFIXES["avx512"], "avxvnni", "avxifma", "avxneconvert")
_FAMILY_PREFIXES["avx"] = _FAMILY_PREFIXES["avx2"]
# Myelin's names (its --cpu flag) for what LLVM calls otherwise.
_MYELIN_NAMES = {"fma3": "fma"}
# What Myelin's "only these" form (a mask without a leading sign) switches off first;
# SSE and SSE2 stay, as every x86-64 CPU and its calling convention have them.
_OPTIONAL = ["sse3", "ssse3", "sse4.1", "sse4.2", "avx", "fma"]


@functools.cache
def _initialize() -> None:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()


@dataclass(frozen=True)
class CPUTarget:
    """A CPU name plus its feature string, and the vector shape kernels use on it."""

    name: str
    features: str

    # kept once worked out: the cost models ask for lanes hundreds of thousands of times
    @functools.cached_property
    def feature_set(self) -> set[str]:
        return {f[1:] for f in self.features.split(",") if f.startswith("+")}

    @functools.cached_property
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
        """The machine code generator for this CPU (shared: see new_machine)."""
        return self.new_machine()

    def new_machine(self) -> llvm.TargetMachine:
        """A target machine of its own: an execution engine takes ownership of the one it
        is given and deletes it with itself."""
        _initialize()
        target = llvm.Target.from_default_triple()
        return target.create_target_machine(cpu=self.name, features=self.features, opt=3, reloc="default", codemodel="jitdefault")

    def key(self) -> str:
        return f"{self.name}:{self.features}"


@functools.cache
def host_target(mask: str = "") -> CPUTarget:
    """The host CPU with the features in `mask` switched off (or back on).

    Entries are comma separated, ranvier's way ("-avx512,-avx2"), or run together,
    Myelin's way ("-avx512-fma3"); an entry is a feature family (avx512, avx2, avx),
    a Myelin name (fma3, sse4.1) or any LLVM feature name. "+x" re-enables a feature
    the host has; a mask starting without a sign (Myelin's "avx2+fma3") keeps only
    the features it names. An unknown name is an error.
    """
    _initialize()
    features = dict(_parse(llvm.get_host_cpu_features().flatten()))
    host = {f for f, on in features.items() if on}
    name = llvm.get_host_cpu_name()
    entries = _mask_entries(mask, features)
    if mask.strip() and mask.strip()[0] not in "+-":
        for family in _OPTIONAL:
            for feature in _MASK_GROUPS.get(family, [family]):
                features[feature] = False
    for enable, family in entries:
        members = _MASK_GROUPS.get(family, [family])
        if not enable:
            members = members + [f for f in features if f.startswith(_FAMILY_PREFIXES.get(family, ()))]
        if enable:
            if family not in host and not host & set(members):
                raise RanvierError(f"cannot enable CPU feature {family!r}: this CPU ({name}) does not have it")
            for feature in _prerequisites(family) + _own(family):
                if feature in host:
                    features[feature] = True
        else:
            for feature in members:
                if feature in features:
                    features[feature] = False
    if mask:
        # A named CPU implies its features; a generic one lets the feature string rule.
        name = "x86-64"
    # Disabled features go last: LLVM applies the string in order, and a later "+avxvnni"
    # would switch AVX2 back on after "-avx2".
    ordered = sorted(features.items(), key=lambda item: (not item[1], item[0]))
    return CPUTarget(name, ",".join(f"{'+' if on else '-'}{f}" for f, on in ordered))


def _mask_entries(mask: str, features: dict[str, bool]) -> list[tuple[bool, str]]:
    """(enable, family or LLVM feature) for each entry of a mask, in order."""

    def known(name: str) -> str | None:
        name = _MYELIN_NAMES.get(name, name)
        return name if name in _MASK_GROUPS or name in features else None

    entries = []
    for part in filter(None, (p.strip() for p in mask.split(","))):
        sign = part[0] if part[0] in "+-" else "+"
        whole = known(part.lstrip("+-"))
        # A whole LLVM name may itself contain '-' ("amx-tile"); otherwise split Myelin-style.
        pieces = [(sign, part.lstrip("+-"))] if whole else re.findall(r"([+-]?)([^+-]+)", part)
        for piece_sign, piece in pieces:
            feature = known(piece)
            if feature is None:
                raise RanvierError(
                    f"unknown CPU feature {piece!r} in mask {mask!r}; use a family ({', '.join(_MASK_GROUPS)}), "
                    f"a Myelin name (fma3, sse4.1, ...) or an LLVM feature of this CPU"
                )
            entries.append(((piece_sign or sign) == "+", feature))
    return entries


def _own(family: str) -> list[str]:
    """A family's features without those of the families it contains (avx2 without avx512's)."""
    inner = {"avx": "avx2", "avx2": "avx512"}.get(family)
    members = _MASK_GROUPS.get(family, [family])
    return [f for f in members if inner is None or f not in _MASK_GROUPS[inner]]


def _prerequisites(family: str) -> list[str]:
    """The features a family needs switched on with it (AVX2 needs AVX)."""
    chain = ["avx", "avx2", "avx512"]
    return [f for needed in chain[: chain.index(family)] for f in _own(needed)] if family in chain else []


def _parse(flat: str) -> Iterator[tuple[str, bool]]:
    for item in flat.split(","):
        if item:
            yield item[1:], item[0] == "+"
