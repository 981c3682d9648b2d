"""The native kernels' build target (DELTASERVE_NATIVE_MARCH, ops/native.py `build_flags`) and `native_choice`, the
answer `--backend auto` takes: a build for x86-64-v3 reports AVX2+FMA and no AVX-512; the native kernels are chosen
on x86-64 built for at least AVX2+FMA, torch when the build fails, below x86-64-v3 and on other CPU kinds."""

from __future__ import annotations

import platform
from pathlib import Path
from types import SimpleNamespace

from deltaserve.ops import native
from deltaserve.ops.native_contract import ISA_AMX_BF16, ISA_AVX2, ISA_AVX512BF16, ISA_AVX512F, ISA_FMA

AVX512 = ISA_AVX512F | ISA_AVX512BF16 | ISA_AMX_BF16


def _cpu_flags() -> set[str]:
    path = Path("/proc/cpuinfo")
    text = path.read_text() if path.exists() else ""
    return {w for line in text.splitlines() if line.startswith("flags") for w in line.split()}


def _fake_library(isa: int) -> SimpleNamespace:
    return SimpleNamespace(ds_vector_isa=lambda: isa)


def test_the_target_comes_from_the_environment(monkeypatch):
    """-march=native by default, -mcpu=native on ARM, -march=<value> for DELTASERVE_NATIVE_MARCH."""
    monkeypatch.delenv("DELTASERVE_NATIVE_MARCH", raising=False)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert native.build_flags()[1] == "-march=native"
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert native.build_flags()[1] == "-mcpu=native"
    monkeypatch.setenv("DELTASERVE_NATIVE_MARCH", "armv8.2-a+bf16")
    assert native.build_flags()[1] == "-march=armv8.2-a+bf16"
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("DELTASERVE_NATIVE_MARCH", "x86-64-v3")
    assert native.build_flags()[1] == "-march=x86-64-v3"
    assert native.build_flags("native")[1] == "-march=native"


def test_an_x86_64_v3_build_reports_avx2_and_no_avx512(monkeypatch, tmp_path):
    """Built into a fresh cache folder for x86-64-v3 (AVX2 laptops): AVX2 and FMA, none of the AVX-512 forms."""
    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path))
    lib = native.build_library(native.build_flags("x86-64-v3"))
    if native.compiler() is None:
        assert lib is None
        return
    assert lib is not None, "the sources do not compile for x86-64-v3"
    assert list((tmp_path / "native").glob("kernels-*.so"))
    isa = lib.ds_vector_isa()
    assert isa & (ISA_AVX2 | ISA_FMA) == ISA_AVX2 | ISA_FMA
    assert not isa & AVX512
    assert native.isa_names(isa) == "AVX2+FMA"


def test_native_is_chosen_here_exactly_where_the_cpu_has_avx2_and_fma():
    """This machine: the kernels are chosen on an x86-64 CPU with AVX2 and FMA (the reason names what the build was
    compiled for), not elsewhere; without a compiler, torch, and the reason says so."""
    chosen, reason = native.native_choice()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if native.compiler() is None:
        assert not chosen
        assert "no C compiler" in reason or not x86
        return
    assert chosen == (x86 and {"avx2", "fma"} <= _cpu_flags()), reason
    if chosen:
        assert "AVX2+FMA" in reason and native.FLAGS[1] in reason


def test_a_failed_build_chooses_torch(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native, "native_library", lambda: None)
    chosen, reason = native.native_choice()
    assert not chosen and "did not build" in reason
    assert ("no C compiler" if native.compiler() is None else "build failed") in reason
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert native.native_choice() == (False, "the native kernels did not build (there is no C compiler), so torch "
                                             "runs")


def test_other_cpu_kinds_choose_torch(monkeypatch):
    """On ARM the kernels are not measured against torch: torch, whatever the library says it was built for."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(native, "native_library", lambda: _fake_library(ISA_AVX2 | ISA_FMA))
    chosen, reason = native.native_choice()
    assert not chosen and reason.startswith("aarch64: ") and "not measured" in reason


def test_the_build_target_decides_on_x86_64(monkeypatch):
    """Below x86-64-v3 torch; AVX2+FMA the portable forms; AVX-512 BF16 (and AMX) the forms the kernels are
    written for."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for isa, chosen, named in ((0, False, "no AVX2"), (ISA_AVX2, False, "AVX2"),
                               (ISA_AVX2 | ISA_FMA, True, "portable forms"),
                               (ISA_AVX2 | ISA_FMA | AVX512, True, "AVX2+FMA+AVX-512F+AVX-512 BF16+AMX-BF16")):
        monkeypatch.setattr(native, "native_library", lambda isa=isa: _fake_library(isa))
        answer, reason = native.native_choice()
        assert answer == chosen and named in reason, (isa, reason)
        assert ("x86-64-v3" in reason) == (not chosen)
