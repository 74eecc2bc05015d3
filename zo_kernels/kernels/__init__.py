"""Triton kernels. Importing this package imports triton; zo_kernels imports it only on first use."""
