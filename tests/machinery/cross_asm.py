"""A Numba kernel's machine code for another CPU: its LLVM IR (what Numba optimised for this
machine) compiled by llvmlite for a target triple, e.g. aarch64 with NEON. Lessons 06 and 10 read
the instructions there too, so their SIMD checks are tested for both ISAs on any machine."""

from __future__ import annotations

import re

import numba
import pytest

TARGETS = {  # name: (triple, cpu, features)
    "aarch64": ("aarch64-unknown-linux-gnu", "neoverse-n1", "+neon"),
    "x86_64": ("x86_64-unknown-linux-gnu", "skylake", "+avx2,+fma"),
}


def _strip_host_only(ir: str) -> str:
    """Functions whose optimised body uses x86 intrinsics (Numba's reference-count helpers, after
    LLVM's x86 passes) become declarations: the kernel's own loop is target-neutral IR."""
    out = []
    for block in re.split(r"(?m)^(?=define )", ir):
        body_end = block.find("\n}\n")
        if block.startswith("define ") and "@llvm.x86." in block[:body_end]:
            head = block.split("{", 1)[0]
            head = re.sub(r"^define (?:(?:linkonce_odr|internal|private|weak_odr|weak|dso_local|hidden) )*",
                          "declare ", head)
            head = re.sub(r"\s(?:local_unnamed_addr|unnamed_addr|#\d+)\b", "", head)
            out.append(head.strip() + "\n" + block[body_end + 3:])
        else:
            out.append(block)
    return re.sub(r"(?m)^declare .*@llvm\.x86\..*$", "", "".join(out))


def cross_asm(fn, args, target: str) -> str:
    """Assembly of Numba function `fn` (compiled for the types of `args`) for `target`."""
    import llvmlite.binding as llvm

    triple, cpu, features = TARGETS[target]
    sig = tuple(numba.typeof(a) for a in args)
    if sig not in fn.signatures:
        fn.compile(sig)
    ir = _strip_host_only(fn.inspect_llvm(sig))
    ir = re.sub(r'"target-(?:cpu|features)"="[^"]*"', "", ir)
    ir = re.sub(r"(?m)^target (?:triple|datalayout) = .*$", "", ir)
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    try:
        tm = llvm.Target.from_triple(triple).create_target_machine(cpu=cpu, features=features, opt=3)
    except RuntimeError as exc:
        pytest.skip(f"this llvmlite has no {target} backend ({exc})")
    mod = llvm.parse_assembly(ir)
    mod.triple, mod.data_layout = triple, str(tm.target_data)
    mod.verify()
    return tm.emit_assembly(mod)
