"""Independent references and comparison helpers shared by the tests."""

from __future__ import annotations

import hashlib
import math

import torch

FP32_EPS = torch.finfo(torch.float32).eps


def ref_adam(p, grads, m=None, v=None, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True,
             bias_correction=True, grad_scale=1.0, first_step=1, dtype=torch.float64):  # fmt: skip
    """torch.optim.Adam/AdamW's formulas written out with plain tensor ops in `dtype`; returns (p, m, v)."""
    p = p.to(dtype).clone()
    m = torch.zeros_like(p) if m is None else m.to(dtype).clone()
    v = torch.zeros_like(p) if v is None else v.to(dtype).clone()
    b1, b2 = betas
    for i, g in enumerate(grads):
        step = first_step + i
        g = g.to(dtype) * grad_scale
        if not adamw:
            g = g + weight_decay * p
        else:
            p = p * (1 - lr * weight_decay)
        m = m + (1 - b1) * (g - m)
        v = v * b2 + (1 - b2) * g * g
        bc1 = 1 - b1**step if bias_correction else 1.0
        bc2 = 1 - b2**step if bias_correction else 1.0
        p = p - (lr / bc1) * m / (v.sqrt() / bc2**0.5 + eps)
    return p, m, v


def adam_bound(step: int, b1: float, b2: float, bias_correction: bool = True) -> float:
    """The largest |m_hat| / sqrt(v_hat) exact Adam can reach at `step` (the 8-bit format's guard), from its
    definition: m_hat and v_hat weigh the gradient of k steps ago by w_k = (1 - b1) b1^k / (1 - b1^step) and
    u_k = (1 - b2) b2^k / (1 - b2^step) (without bias correction, unnormalized), so by Cauchy-Schwarz
    |m_hat| <= sqrt(sum_k w_k^2 / u_k) sqrt(v_hat), with equality for g_k proportional to w_k / u_k. Each term in
    logarithms (b2^k underflows long before the term does); inf where a term is (b2 = 0 past step 1)."""
    total = 0.0
    for k in range(step):
        if k and b1 == 0.0:
            break  # (w_k = 0 from here on)
        if k and b2 == 0.0:
            return math.inf
        log_term = 2 * math.log1p(-b1) - math.log1p(-b2) + (k * (2 * math.log(b1) - math.log(b2)) if k else 0.0)
        if log_term > 700:
            return math.inf
        total += math.exp(log_term)
    norm = (1 - b2**step) / (1 - b1**step) ** 2 if bias_correction else 1.0
    return math.sqrt(total * norm)


def assert_close_verbose(actual: torch.Tensor, expected: torch.Tensor, bound: float, what: str) -> None:
    """Element-wise |actual - expected| <= bound; on failure print the first bad indices."""
    err = (actual.double() - expected.double()).abs()
    bad = (err > bound) | (actual.isnan() != expected.isnan())
    if bad.any():
        idx = bad.nonzero().flatten()[:8].tolist()
        rows = ", ".join(f"[{i}] {actual.flatten()[i].item()!r} vs {expected.flatten()[i].item()!r}" for i in idx)
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements off by more than {bound:.3g}; "
                             f"max err {err.max().item():.3g}; first: {rows}")  # fmt: skip


def assert_within_2x_of(actual, ref64, other, what: str) -> None:
    """actual's error against the float64 reference is at most ~2x that of `other` (torch in fp32)."""
    err_other = (other.double() - ref64).abs().max().item()
    bound = 2 * err_other + 2 * FP32_EPS * max(1.0, ref64.abs().max().item())
    assert_close_verbose(actual, ref64, bound, what)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit-for-bit equality, except that NaN only has to be NaN (its payload may differ)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ"
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[actual.dtype]
    a, e = actual[~nan_a].view(ints), expected[~nan_e].view(ints)
    if not torch.equal(a, e):
        idx = (a != e).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"{what}: bits differ at {idx}: {a[idx].tolist()} vs {e[idx].tolist()}")


def digest(*tensors: torch.Tensor) -> str:
    """A hash of the bytes of every tensor (to prove that a failed call touched nothing)."""
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`zo-kernels ARGV` in this process: (exit code, stdout, stderr)."""
    from zo_kernels.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


class WhereBlocked:
    """Samples, every `every_s` on a thread of its own, the innermost zo_kernels line the calling thread is in while
    the `with` block runs: where a call that should return at once spends its time (a host wait found by its line).
    `top(k)` gives the k lines seen most often with their sample counts."""

    def __init__(self, every_s: float = 0.002) -> None:
        import threading
        from collections import Counter

        self.every_s, self.seen = every_s, Counter()
        self._target = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import sys

        while not self._stop.wait(self.every_s):
            frame = sys._current_frames().get(self._target)
            lines = []
            while frame is not None and len(lines) < 3:
                name = frame.f_code.co_filename
                if "zo_kernels" in name:
                    lines.append(f"{name.rsplit('zo_kernels', 1)[1].lstrip('/')}:{frame.f_lineno} "
                                 f"{frame.f_code.co_name}")  # fmt: skip
                frame = frame.f_back
            self.seen[" < ".join(lines) or "(outside zo_kernels)"] += 1

    def __enter__(self) -> WhereBlocked:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def top(self, k: int = 2) -> list[tuple[str, int]]:
        return self.seen.most_common(k)
