import os
import sys

import torch

# Without a CUDA device the Triton kernels run on CPU tensors through Triton's interpreter; it must be chosen
# before triton is first imported. With one, the tests compile and launch them for real (no interpreter).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests import the shared helpers module
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_compat

    interpreter_compat.patch()  # Triton 3.6's interpreter under numpy 2.4 (the GPU machine's Triton)

# On a CPU without native bf16, the test GPTs' 16-bit matmuls as fp32 products rounded once (tests/matmul16.py:
# torch emulates them ~50x slower there); ZO_TEST_TORCH_MATMUL16=1 keeps torch's own kernels.
from zo_kernels.demo import native_bf16  # noqa: E402

MATMUL16 = "torch's own (this CPU computes bf16 natively)"
if native_bf16(torch.device("cpu")):
    pass
elif os.environ.get("ZO_TEST_TORCH_MATMUL16") == "1":
    MATMUL16 = "torch's own, emulated (ZO_TEST_TORCH_MATMUL16=1)"
else:
    import matmul16

    matmul16.install()
    MATMUL16 = "fp32 products rounded once (tests/matmul16.py; this CPU has no native bf16)"


def pytest_report_header(config):
    return f"16-bit CPU matmuls: {MATMUL16}"
