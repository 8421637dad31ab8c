"""dmattn-bench's bundled kernels (installed as `dmattn_kernels` from the `kernels/` folder)."""
