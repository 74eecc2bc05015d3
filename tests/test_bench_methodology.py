"""The benchmarks' references do the work zo does and no more: no allocation zo skips (bench/ read as code)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import test_bench_cpu_adam as cpu_bench  # noqa: E402  (bench/test_bench_cpu_adam.py)
from common import peak_extra_bytes  # noqa: E402  (bench/common.py)


def test_torch_chain_allocates_no_gradient_per_step():
    """The bf16 case's torch chain upcasts into an fp32 gradient allocated once, as a training loop keeps one; before,
    `grad.float()` allocated (and page-faulted) 4 bytes per param every step, work zo never does, which flattered
    zo's ratio (10M params, one thread, under load: the chain 33 ms allocating, 26 ms not). The fused AdamW: the
    foreach one allocates its own temporaries (its algorithm, not the chain's)."""
    n = 1 << 22
    run = cpu_bench.make_step("torch_fused", cpu_bench.buffers(n, "bf16"), 1)
    run()
    extra = peak_extra_bytes(run)
    if extra is None:
        pytest.skip("no /proc/self/clear_refs here")
    assert extra < n, f"one step of the chain grew the resident set by {extra / n:.2f} bytes/param"


def test_torch_chain_still_upcasts_and_downcasts():
    """The chain keeps its copies: after a step torch's fp32 gradient holds the bf16 gradient's values and the bf16
    output holds the fp32 params, rounded."""
    n = 4096
    b = cpu_bench.buffers(n, "bf16")
    run = cpu_bench.make_step("torch_fused", b, 1)
    b["g"].copy_(torch.arange(n, dtype=torch.bfloat16))
    run()
    assert torch.equal(b["out"], b["p"].to(torch.bfloat16))
    b["g"].fill_(3.0)
    before = b["p"].clone()
    run()
    assert torch.all(b["p"] < before)  # a positive gradient everywhere: every param went down


def test_dashboard_and_summary_take_the_same_baseline_and_ceiling(tmp_path):
    """The transport suite's copy groups (pageable, torch_pinned, zo_pinned): the run's own table and summary.py give
    ratios against pageable and torch_pinned; before, the dashboard knew neither name and showed no ratio there."""
    import json

    import summary  # bench/summary.py

    from zo_kernels import dashboard

    assert (dashboard.BASELINES, dashboard.CEILINGS) == (summary.BASELINES, summary.CEILINGS)
    benches = [{"group": "cuda copy H2D 64 MiB", "name": f"test[{p}]", "stats": {"min": t},
                "extra_info": {"provider": p, "bytes": 64 << 20}}
               for p, t in (("zo_pinned", 2e-3), ("torch_pinned", 2e-3), ("pageable", 8e-3))]  # fmt: skip
    path = tmp_path / "copy.json"
    path.write_text(json.dumps({"datetime": "2026-11-23T10:00:00", "machine_info": {}, "benchmarks": benches}))
    page = dashboard.render([path])
    assert "0.25x time of pageable" in page and "100% of ceiling" in page


def test_pack_groups_show_the_event_times_of_every_provider(tmp_path):
    """The pack suite times zo, torch_ref and copy with CUDA events inside one benchmark whose own rounds time only
    the host's launch on a GPU: the ratio table, summary.py and the dashboard take the event times (providers_ms).
    Before, they showed the launch as the pack (the H200's 100M pack at 11.8 TB/s, no torch_ref or copy row)."""
    import json

    import summary  # bench/summary.py

    from zo_kernels import dashboard

    info = {"provider": "zo", "numel": 10**8, "bytes": 6 * 10**8,
            "providers_ms": {"zo": 0.18, "torch_ref": 0.84, "copy": 0.145}}  # fmt: skip
    bench = {"group": "pack n=1e+08 64 tensors, align 1", "name": "test_pack[x]",
             "stats": {"min": 5e-5, "rounds": 10}, "extra_info": info}  # fmt: skip
    lines = "\n".join(summary.group_lines(bench["group"], {"zo": bench}))
    assert "0.180 ms" in lines and "0.840 ms" in lines and "81% of copy" in lines, lines
    assert "0.050 ms" not in lines, lines
    path = tmp_path / "pack.json"
    path.write_text(json.dumps({"datetime": "2026-11-27T10:00:00", "machine_info": {}, "benchmarks": [bench]}))
    recs = {r["provider"]: r for r in dashboard.records(dashboard.load_run(path))}
    assert set(recs) == {"zo", "torch_ref", "copy"}
    assert recs["zo"]["value"] == pytest.approx(6e8 / 0.18e-3 / 1e9)


@pytest.mark.parametrize("where", ["step_rows", "test_bench_step"])
def test_reference_loop_holds_its_fp32_grads(where):
    """The training-step reference (bench/step_rows.py's and bench/test_bench_step.py's ReferenceLoop) upcasts into
    fp32 gradients it keeps, with the values of the bf16 ones; before, `p.grad.float()` allocated them every step."""
    module = __import__(where)
    from zo_kernels.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    loop = module.ReferenceLoop(GPT(GPTConfig.for_params(2e5, vocab=64, context=16)))
    x = torch.randint(0, 64, (2, 17))
    loop.step(x)
    first = [m.grad.data_ptr() for m in loop.master]
    loop.step(x)
    assert [m.grad.data_ptr() for m in loop.master] == first
    for m, p in zip(loop.master, loop.work.parameters()):
        assert torch.equal(m.grad, p.grad.float())


class _FakeBenchmark:
    """What the suites use of pytest-benchmark's fixture: group, extra_info, pedantic (one call), stats.stats.min."""

    def __init__(self):
        self.group, self.extra_info = None, {}
        self.stats = type("Metadata", (), {"stats": type("Stats", (), {"min": 1.0})()})()

    def pedantic(self, fn, **kw):
        fn()


def test_group_names_give_the_size_that_ran():
    """1.5M params ran as "n=2e+06" (`:.0e`), and 1.5M and 2.4M would share one group, whose ratio tables (the run's
    own, summary.py) keep one benchmark per provider: one size silently dropped."""
    import re

    import test_bench_transport as transport_bench  # bench/test_bench_transport.py

    for n in (1_500_000, 2_400_000):
        b = _FakeBenchmark()
        cpu_bench.test_cpu_adam(b, n, "fp32", 1, "ceiling")
        assert int(float(re.search(r"n=(\S+)", b.group)[1])) == n, b.group
    b = _FakeBenchmark()
    transport_bench.test_host_writeback(b, 1_500_000, "kernel")
    assert int(float(re.search(r"n=(\S+)", b.group)[1])) == 1_500_000, b.group
    from common import size_label

    assert [size_label(n) for n in (10_000_000, 16_000_000, 1_500_000, 1_234_567)] == [
        "1e+07", "1.6e+07", "1.5e+06", "1.234567e+06"]  # fmt: skip


def test_the_chains_held_gradient_still_counts_as_extra_memory():
    """The table's "extra B/param" keeps the 4 B/param fp32 gradient the bf16 chain holds (zo needs none), now that
    it is allocated once before the measure rather than inside every step."""
    n = 1 << 20
    for provider, lo, hi in (("torch_fused", 4 * n, 5 * n), ("zo", 0, n)):
        b = _FakeBenchmark()
        cpu_bench.test_cpu_adam(b, n, "bf16", 1, provider)
        extra = b.extra_info["peak_extra_bytes"]
        if extra is None:
            pytest.skip("no /proc/self/clear_refs here")
        assert lo <= extra < hi, (provider, extra / n)


def test_the_dashboard_draws_the_pack_sizes_on_one_chart(tmp_path, monkeypatch):
    """The pack groups named the size without `n=`, so the dashboard made one section (a one-point chart "against
    size") per size; now one section holds both sizes."""
    import json

    import test_bench_buckets as buckets_bench  # bench/test_bench_buckets.py

    from zo_kernels.dashboard import render

    monkeypatch.setattr(buckets_bench, "_median_ms", lambda fn, reps: 1.0)  # the names are checked, not the times
    benches = []
    for n in (20_000, 40_000):
        b = _FakeBenchmark()
        buckets_bench.test_pack(b, n, 64, 1)
        benches.append({"group": b.group, "name": f"test_pack[{n}]", "stats": {"min": 1e-3},
                        "extra_info": b.extra_info})  # fmt: skip
    path = tmp_path / "pack.json"
    path.write_text(json.dumps({"datetime": "2026-11-23T10:00:00", "machine_info": {}, "benchmarks": benches}))
    page = render([path])
    assert page.count("<section>") == 1 and "<th>20K</th>" in page and "<th>40K</th>" in page
