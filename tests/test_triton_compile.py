"""Every Triton kernel compiled to cubin for sm_80 and sm_90 without a GPU, with the specialisations that real
launches produce (tests/triton_compile.py drives the launchers through Triton's own launch path)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "triton_compile.py"), str(out)], capture_output=True,
                       text=True, timeout=900, env=env)  # fmt: skip
    if not out.exists():
        pytest.fail(f"the compile script wrote no report (exit {r.returncode}):\n{r.stdout[-3000:]}\n"
                    f"{r.stderr[-3000:]}")  # fmt: skip
    return json.loads(out.read_text())


def test_every_case_compiles(report):
    bad = [f"{c['target']} {c['case']}: {c['error'][:400]}" for c in report["cases"] if c["error"]]
    assert not bad, f"{len(bad)} of {len(report['cases'])} launches failed to compile:\n" + "\n".join(bad[:8])


def test_every_kernel_compiled_for_both_targets(report):
    assert report["kernels"], "no @triton.jit kernel found"
    for kernel in report["kernels"]:
        for target in ("sm_80", "sm_90"):
            got = [c for c in report["compiled"] if c["kernel"] == kernel and c["target"] == target]
            assert got, f"{kernel} was never compiled for {target}"
            assert all(c["cubin_bytes"] > 0 for c in got)


@pytest.mark.parametrize("kernel", ["pack._pack_kernel", "pack._unpack_kernel"])
def test_one_tensor_specialisation_is_compiled(report, kernel):
    """A bucket of one tensor: Triton turns n_seg == 1 into a compile-time constant (finding 1)."""
    sigs = [c["signature"] for c in report["compiled"] if c["kernel"] == kernel]
    assert any("('constexpr', 1)" in s.split("('*i64', 'D'), ('*i64', 'D'), ")[1][:20] for s in sigs), sigs


@pytest.mark.parametrize("kernel", ["pack._pack_kernel", "pack._unpack_kernel"])
def test_aligned_pack_and_unpack_use_vector_loads_and_stores(report, kernel):
    """Finding 8: with 16-byte aligned buffers and segments the PTX moves 16 bytes per access."""
    for target in ("sm_80", "sm_90"):
        aligned = [c for c in report["compiled"] if c["kernel"] == kernel and c["target"] == target
                   and "align 8" in c["case"] and "unaligned" not in c["case"]]  # fmt: skip
        assert aligned, f"no aligned {kernel} variant for {target}"
        for c in aligned:
            ops = c["vector_ops"]
            loads = sum(v for k, v in ops.items() if k.startswith("ld."))
            stores = sum(v for k, v in ops.items() if k.startswith("st."))
            assert loads and stores, f"{target} {c['case']}: no vector loads/stores in the PTX ({ops})"


def test_no_float_atomics(report):
    """Finding 11: the sum of squares is reduced in a fixed order (per-block partials, then one program), so
    a GPU run with clipping is bitwise reproducible; a float atomic in any kernel would break that."""
    bad = {(c["kernel"], c["target"]) for c in report["compiled"] if c["float_atomics"]}
    assert not bad, f"float atomics in {sorted(bad)}"
