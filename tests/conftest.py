import os
import sys

# The Triton kernels run on CPU tensors through Triton's interpreter; it must be chosen before triton
# is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests import the shared helpers module
