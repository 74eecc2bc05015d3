"""Every Triton kernel compiled to cubin for sm_80 and sm_90 without a GPU, with the specialisations that real
launches produce (tests/triton_compile.py drives the launchers through Triton's own launch path)."""

import json
import os
import subprocess
import sys

import pytest

from zo_kernels.versions import triton_too_old

triton = pytest.importorskip("triton")
TOO_OLD = triton_too_old(triton.__version__)
if TOO_OLD:
    pytest.skip(f"{TOO_OLD}: nothing of it is compiled", allow_module_level=True)
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


def test_one_program_specialisation_is_compiled(report):
    """A bucket of one small tensor is one program: Triton turns n_work == 1 into a compile-time constant."""
    sigs = [c["signature"] for c in report["compiled"] if c["kernel"] == "pack._pack_kernel"]
    assert any(s.split("('*i64', 'D'), ('*i64', 'D'), ")[1].startswith("('constexpr', 1)") for s in sigs), sigs


def test_pack_into_running_totals_is_compiled_for_both_targets(report):
    """plan.pack(..., into=(sum_sq, found_inf)), the offload step's call: the ACCUMULATE variant (last constexpr True)
    compiles for sm_80 and sm_90 beside the plain one (it failed to compile where the interpreter ran it)."""
    for target in ("sm_80", "sm_90"):
        sigs = [c["signature"] for c in report["compiled"] if c["kernel"] == "pack._pack_kernel"
                and c["target"] == target]  # fmt: skip
        assert {s.endswith("('constexpr', True)]") for s in sigs} == {True, False}, (target, sigs)


@pytest.mark.parametrize("kernel", ["pack._pack_kernel", "pack._unpack_kernel"])
def test_pack_and_unpack_use_vector_loads_and_stores(report, kernel):
    """Every variant, align 1 and unaligned buffers included, holds 16-byte loads and 16-byte stores (v4 of 32-bit
    words: 4 fp32 or 8 16-bit values): the tensor side of a chunk is always aligned, the flat side where its
    address allows (plan: a runtime branch per program)."""
    for target in ("sm_80", "sm_90"):
        got = [c for c in report["compiled"] if c["kernel"] == kernel and c["target"] == target]
        assert any("align 1" in c["case"] for c in got), f"no align-1 {kernel} variant for {target}"
        for c in got:
            ops = c["vector_ops"]
            assert ops.get("ld.v4") and ops.get("st.v4"), f"{target} {c['case']}: no 16-byte loads and stores ({ops})"


def test_pack_into_a_bucket_of_another_phase_uses_8_byte_stores(report):
    """Where the bucket's address at a chunk is 8-byte but not 16-byte aligned (align 1: the tensor's and the bucket's
    phases differ), the chunk's whole blocks are stored 8 bytes at a time (a runtime branch, its alignment marked),
    not element by element."""
    for target in ("sm_80", "sm_90"):
        got = [c for c in report["compiled"] if c["kernel"] == "pack._pack_kernel" and c["target"] == target]
        for c in got:
            assert c["vector_ops"].get("st.v2"), f"{target} {c['case']}: no 8-byte stores ({c['vector_ops']})"


def test_pack_finishes_its_reduction_with_an_integer_ticket(report):
    """The last program sums the partials (one launch, no stats kernel): an integer atomic, no float one."""
    for c in report["compiled"]:
        if c["kernel"] == "pack._pack_kernel":
            assert c["int_atomics"] >= 1, f"{c['target']} {c['case']}: no ticket counter"


def test_no_float_atomics(report):
    """Finding 11: the sum of squares is reduced in a fixed order (per-program partials, summed in index order
    by the last program), so a GPU run with clipping is bitwise reproducible; a float atomic would break that."""
    bad = {(c["kernel"], c["target"]) for c in report["compiled"] if c["float_atomics"]}
    assert not bad, f"float atomics in {sorted(bad)}"


def test_adam_kernel_is_ieee_arithmetic(report):
    """kernels/adam.py is CPU Adam's arithmetic bit for bit only if every fp32 operation rounds as written: no
    approximate division or square root, no mul/add/sub left for ptxas to contract (each carries .rn), and the
    explicit fmas present (4 per element: m, v, the denominator, the parameter)."""
    got = [c for c in report["compiled"] if c["kernel"] == "adam._adam_kernel"]
    assert {c["target"] for c in got} == {"sm_80", "sm_90"}
    for c in got:
        assert c["inexact_f32"] == 0, f"{c['target']} {c['case']}: {c['inexact_f32']} inexact or contractable ops"
        assert c["fma_f32"] >= 4, f"{c['target']} {c['case']}: {c['fma_f32']} fma.rn.f32"


def test_adam_kernel_whole_blocks_use_vector_access(report):
    """adam_step launches the whole blocks apart from the last, short one: their length is a multiple of 16, so the
    masked accesses of every format get 16-byte loads and stores (v4 of 32-bit words) there."""
    for fmt in ("8bit", "bf16", "fp32"):
        for target in ("sm_80", "sm_90"):
            got = [c for c in report["compiled"] if c["kernel"] == "adam._adam_kernel" and c["target"] == target
                   and c["case"].startswith(f"adam {fmt} ")]  # fmt: skip
            assert any(c["vector_ops"].get("ld.v4") and c["vector_ops"].get("st.v4") for c in got), (fmt, target)
