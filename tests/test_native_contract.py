"""The Python/C contract (deltaserve/ops/native_contract.py): the committed native_src/contract.h is the one the
module writes now; a probe built with the library's compiler and flags sees each struct's size and field offsets,
and each constant, as ctypes does; the loaded library's entry points carry the contract's signatures."""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import pytest

from deltaserve.ops import native
from deltaserve.ops import native_contract as contract


def test_committed_header_is_the_generated_one():
    assert contract.HEADER.read_text() == contract.header(), \
        "native_src/contract.h is stale: run ops/native_contract.py's write_header()"


def _probe_source() -> str:
    """A C program printing each constant, each struct's size and each field's offset, one `name value` a line."""
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "contract.h"', "", "int main(void) {"]
    lines += [f'    printf("{name} %lld\\n", (long long){name});' for name in contract.CONSTANTS]
    for struct in contract.STRUCTS:
        name = struct.c_name
        lines.append(f'    printf("{name} %zu\\n", sizeof({name}));')
        lines += [f'    printf("{name}.{field} %zu\\n", offsetof({name}, {field}));' for field, _, _ in struct.fields]
    return "\n".join([*lines, "    return 0;", "}", ""])


def _c_layout(header_dir: Path, tmp_path: Path) -> dict[str, int]:
    """What the probe prints, compiled against contract.h in `header_dir` (common.h from the library's sources)."""
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    probe, program = tmp_path / "probe.c", tmp_path / "probe"
    probe.write_text(_probe_source())
    flags = [f for f in native.FLAGS if f != "-shared"]  # the library's flags, for an executable
    subprocess.run([cc, *flags, "-I", str(header_dir), "-I", str(native.SOURCES), str(probe), "-o", str(program),
                    "-lm"], check=True, capture_output=True, text=True)
    output = subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout
    return {name: int(value) for name, value in (line.split() for line in output.splitlines())}


def _ctypes_layout() -> dict[str, int]:
    layout = dict(contract.CONSTANTS)
    for struct in contract.STRUCTS:
        layout[struct.c_name] = ctypes.sizeof(struct)
        layout.update({f"{struct.c_name}.{field}": getattr(struct, field).offset for field, _, _ in struct.fields})
    return layout


def test_c_and_ctypes_agree_on_the_layouts_and_constants(tmp_path):
    assert _c_layout(native.SOURCES, tmp_path) == _ctypes_layout()


def test_the_probe_catches_a_reordered_field(tmp_path):
    """Swapping the first two fields of the first struct in the header moves both: the probe must see it."""
    lines = contract.HEADER.read_text().splitlines(keepends=True)
    first = lines.index("typedef struct {\n") + 1
    lines[first], lines[first + 1] = lines[first + 1], lines[first]
    (tmp_path / "contract.h").write_text("".join(lines))
    c_side, ctypes_side = _c_layout(tmp_path, tmp_path), _ctypes_layout()
    struct = contract.STRUCTS[0]
    moved = {f"{struct.c_name}.{field}" for field, _, _ in struct.fields[:2]}
    assert {name for name in ctypes_side if c_side[name] != ctypes_side[name]} == moved


def test_every_entry_point_has_the_contract_signature():
    """Each exported ds_* function of the sources is in the contract, and the loaded library carries its types."""
    defined = set()
    for source in native.SOURCES.glob("*.c"):
        defined |= set(re.findall(r"^(?:int|int64_t|void) (ds_\w+)\(", source.read_text(), re.MULTILINE))
    signatures = contract.entry_signatures()
    assert defined == set(signatures)
    lib = native.native_library()
    if lib is None:
        pytest.skip("the native kernels did not build")
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        assert (list(function.argtypes), function.restype) == (argtypes, restype), name


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    return set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())


def test_a_build_reports_the_instruction_sets_it_was_compiled_for():
    """The library built for this CPU takes the AVX-512 (BF16, AMX) forms exactly where the CPU has them; a build for
    plain x86-64-v3 (AVX2, as most laptops) compiles the kernels' portable forms and says so."""
    lib = native.native_library()
    assert lib is not None, "the kernels did not build"
    flags, isa = _cpu_flags(), lib.ds_vector_isa()
    assert bool(isa & contract.ISA_AVX512F) == ("avx512f" in flags)
    assert bool(isa & contract.ISA_AVX512BF16) == ("avx512_bf16" in flags)
    assert bool(isa & contract.ISA_AMX_BF16) == ("amx_bf16" in flags and "amx_tile" in flags)
    v3 = native.build_library([f if f != "-march=native" else "-march=x86-64-v3" for f in native.FLAGS])
    assert v3 is not None, "the sources do not compile without AVX-512"
    assert v3.ds_vector_isa() == contract.ISA_AVX2 | contract.ISA_FMA
