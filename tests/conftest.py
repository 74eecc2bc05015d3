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
