"""Pure-torch CPU versions of the CUDA-only ops on sglang 0.5.23's DeepSeek-V4 prefill and decode path.

Each public function is a drop-in for the sglang function named in its docstring (same arguments, same
output layout and bytes); `README.md` maps each to its sglang file:line and its test. Importing this package
does not import sglang; the patch layer that installs these functions lives elsewhere.
"""
